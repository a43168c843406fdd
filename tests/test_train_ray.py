"""End to end through the real path: Ray Train TorchTrainer, 2 workers, DeepSpeed on CPU, MLflow."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from efftx import recipes
from efftx.errors import ConfigError, LaunchError
from efftx.train.launch import launch

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def debug_cfg(name: str, **overrides):
    return recipes.get("lm_debug").override({"name": name, "train.checkpoint_every": 10, **overrides})


def mlflow_client(summary):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=summary["tracking_uri"], registry_uri=summary["tracking_uri"])


def history(summary, key="loss") -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for m in mlflow_client(summary).get_metric_history(summary["mlflow_run_id"], key):
        out.setdefault(m.step, []).append(m.value)
    return out


@pytest.fixture(scope="module")
def baseline_job(ray_cluster):
    """``debug_cfg("baseline")`` through the job script at a terminal, as a user at a shell runs it: (its summary,
    the last line it prints, and everything it wrote)."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    env.pop("EFFTX_PROGRESS", None)
    cmd = [sys.executable, "jobs/train_lm.py", "--recipe", "lm_debug", "--run-name", "baseline", "--workers", "2",
           "--set", "train.checkpoint_every=10"]
    code, out = run_in_terminal(cmd, env)
    assert code == 0, out[-3000:]
    return json.loads(next(ln for ln in reversed(out.splitlines()) if ln.startswith("{"))), out


@pytest.fixture(scope="module")
def baseline(baseline_job):
    return baseline_job[0]


def test_two_worker_run_validation_loss_falls(baseline):
    assert baseline["final_step"] == 40
    val = history(baseline, "val_bpb")
    assert sorted(val) == [0, 20, 40]
    assert val[0][0] > 7.0  # untrained: close to 8 bits per byte
    assert val[40][-1] < 0.75 * val[0][0]
    assert val[40][-1] < val[20][-1] < val[0][0]
    assert baseline["val_bpb"] == pytest.approx(val[40][-1])
    assert baseline["tokens_per_s"] > 0


def test_mlflow_records_read_back(baseline):
    client = mlflow_client(baseline)
    run = client.get_run(baseline["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["model.dim"] == "64" and params["attention.kind"] == "full" and params["recipe"] == "lm_debug"
    assert len(params["data.sha256"]) == 64
    assert sorted(history(baseline)) == list(range(1, 41))  # loss at every step
    for key in ("lr", "tokens_per_s", "mfu", "val_loss"):
        assert key in run.data.metrics
    # the weights are logged once, as the registered MLflow model (whose artifacts hold the export), not again as
    # run artifacts
    assert client.list_artifacts(run.info.run_id, "export") == []
    from efftx.export import resolve_export

    registered = resolve_export(baseline["registered_model"], baseline["tracking_uri"])
    assert (registered / "model.safetensors").is_file() and (registered / "config.json").is_file()
    samples = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
    assert "samples/step_000040.txt" in samples
    versions = client.search_model_versions("name='lm_debug'")
    assert any(v.run_id == run.info.run_id for v in versions)
    assert baseline["registered_model"].startswith("models:/lm_debug/")


def test_checkpoints_hold_config_and_only_the_last_n_are_kept(baseline):
    run = Path(baseline["checkpoint"]).parent
    kept = sorted(p for p in run.glob("checkpoint_*") if p.is_dir())
    assert len(kept) == 2  # lm_debug keeps 2 (train.keep_checkpoints)
    state = json.loads(Path(baseline["checkpoint"], "efftx_state.json").read_text())
    assert state["step"] == 40 and state["mlflow_run_id"] == baseline["mlflow_run_id"]
    assert state["config"]["model"]["dim"] == 64 and state["config"]["name"] == "baseline"
    assert Path(baseline["checkpoint"], "deepspeed", "mp_rank_00_model_states.pt").is_file()


def test_export_round_trip_and_generate_cli(baseline):
    from efftx.generate import sample_text
    from efftx.export import load_export

    export = Path(baseline["export_path"])
    assert (export / "model.safetensors").is_file()
    model, cfg, meta = load_export(export)
    assert cfg.model.dim == 64 and meta["step"] == 40
    x = torch.randint(0, 256, (1, 16))
    assert torch.isfinite(model(x)).all()
    cmd = [sys.executable, "-m", "efftx.generate", "--model", str(export), "--prompt", "def ",
           "--max-new-tokens", "24", "--temperature", "0.9", "--top-k", "16", "--seed", "5"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout and first.stdout.startswith("def ")
    expected = sample_text(str(export), "def ", 24, temperature=0.9, top_k=16, seed=5)
    assert first.stdout == "def " + expected + "\n"
    bad = subprocess.run([sys.executable, "-m", "efftx.generate", "--model", "/no/such/export", "--prompt", "x"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not an efftx export" in bad.stderr and "Traceback" not in bad.stderr


def test_torn_checkpoint_is_skipped_and_the_rerun_resumes_from_the_previous_one(ray_cluster, baseline):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    cmd = [sys.executable, "jobs/train_lm.py", "--recipe", "lm_debug", "--run-name", "torn", "--workers", "2",
           "--set", "train.checkpoint_every=10", "--set", "train.fail_at_step=25", "--set", "train.max_failures=0"]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 2 and "injected failure at step 25" in first.stderr, first.stderr[-3000:]
    run = Path(os.environ["EFFTX_HOME"], "runs", "torn")
    saved = {json.loads((p / "efftx_manifest.json").read_text())["step"]: p
             for p in run.glob("checkpoint_*") if p.is_dir()}
    assert sorted(saved) == [10, 20]
    shard = saved[20] / "deepspeed" / "mp_rank_00_model_states.pt"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # a torn write: the first half of the file survived
        f.truncate(size // 2)

    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # same command
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert (f"checkpoint {saved[20].name} (step 20) is not intact: deepspeed/mp_rank_00_model_states.pt is "
            f"{size // 2} bytes, its manifest says {size} (torn or truncated)") in second.stdout
    assert f"resuming from checkpoint {saved[10]} (step 10" in second.stdout
    assert "resumed at step 10/40" in second.stdout
    assert f"checkpoint saved at step 20: {run}/checkpoint_00000020_" in second.stdout  # the log names each save
    # not at a terminal (a pipe, as in `ray job submit` logs and CI): plain step lines, each with the time left
    assert re.search(r"\[efftx\] step 30/40 loss \S+ lr \S+ tok/s \S+ mfu \S+ eta \d+s\n", second.stdout)
    assert "\x1b[2K" not in second.stdout and "built successfully" not in second.stdout + second.stderr
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 40
    ref, got = history(baseline), history(summary)
    for step in range(1, 41):  # the rerun equals the uninterrupted run, step by step and in its validation
        assert set(got[step]) == {ref[step][0]}, step
    assert summary["val_bpb"] == baseline["val_bpb"]
    assert summary["mlflow_run_id"] != baseline["mlflow_run_id"]
    client = mlflow_client(summary)
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
    versions = client.search_model_versions(f"run_id='{summary['mlflow_run_id']}'")
    assert len(versions) == 1


def test_resuming_with_another_model_is_refused(baseline):
    with pytest.raises(ConfigError, match="already exists with a different config.*model.dim"):
        launch(debug_cfg("baseline", **{"model.dim": 32}))


def test_cluster_too_small_is_a_clear_error(ray_cluster):
    import ray

    have = f"{ray.cluster_resources()['CPU']:g}"  # the session cluster's (tests/conftest.py)
    with pytest.raises(LaunchError, match=rf"needs 200 CPUs .* Ray cluster has {have};"):
        launch(debug_cfg("too-big", **{"scaling.cpus_per_worker": 100}))


def test_non_finite_loss_stops_with_clear_error(ray_cluster):
    cfg = debug_cfg("diverge", **{"train.lr": 1e30, "train.warmup_steps": 0, "train.grad_clip": 0,
                                  "train.max_failures": 0})
    with pytest.raises(LaunchError, match="non-finite training loss"):
        launch(cfg)


def run_in_terminal(cmd: list[str], env: dict, timeout: float = 600) -> tuple[int, str]:
    """Run ``cmd`` with its stdout and stderr on a pseudo-terminal, as a user at a shell runs it; -> (exit
    code, everything it wrote, line endings as \\n)."""
    import pty
    import select
    import time

    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not select.select([master], [], [], 0.5)[0]:
                if proc.poll() is not None:
                    break  # exited and nothing left to read
                continue
            try:
                data = os.read(master, 1 << 16)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    return code, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def test_job_script_at_a_terminal_draws_a_progress_bar_and_prints_json_summary_last(baseline_job):
    summary, out = baseline_job  # the baseline run, at a terminal
    assert summary["run_name"] == "baseline" and summary["final_step"] == 40
    for key in ("val_bpb", "tokens_per_s", "mlflow_run_id", "export_path"):
        assert summary[key], key
    assert Path(summary["export_path"], "model.safetensors").is_file()
    assert "sample from the exported model" in out and "mlflow ui" in out
    # at a terminal the step lines are one bar redrawn in place (with the time left), ending full at the last step
    assert re.search(r"\r\x1b\[2K\[#{12}\.{12}\] step 20/40 loss \S+ tok/s \S+ eta \d+s", out), out[-3000:]
    assert re.search(r"\r\x1b\[2K\[#{24}\] step 40/40 loss \S+ tok/s \S+ eta 0s\n", out)
    assert "[efftx] step 20/40" not in out  # not also printed as a plain line
    # and none of the lines a user cannot act on
    assert "built successfully" not in out and "PreemptionWatcher" not in out


def test_zero3_bf16_run_samples_and_exports_whole_fp32_master_weights(ray_cluster):
    summary = launch(debug_cfg("zero3-bf16", **{"engine.zero_stage": 3, "engine.precision": "bf16",
                                                "train.steps": 10, "train.eval_every": 10,
                                                "train.sample_every": 5, "tracking.register_model": False}))
    from efftx.export import load_export

    model, cfg, _ = load_export(summary["export_path"])
    assert cfg.engine.zero_stage == 3
    assert model.embed.weight.shape == (256, 64) and model.embed.weight.dtype == torch.float32
    # the optimizer's fp32 masters, not the module's bf16 copy: nearly every weight lies between two bf16 values
    # (power: exporting the module's parameters, every one is a bf16 value)
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert (weights.bfloat16().float() != weights).float().mean() > 0.9
    val = history(summary, "val_bpb")
    assert val[10][-1] < val[0][0]
    samples = [a.path for a in mlflow_client(summary).list_artifacts(summary["mlflow_run_id"], "samples")]
    assert samples == ["samples/step_000005.txt", "samples/step_000010.txt"]
    # nothing registered (tracking.register_model=false): the export is kept with the run's artifacts instead
    assert summary["registered_model"] is None
    names = {a.path for a in mlflow_client(summary).list_artifacts(summary["mlflow_run_id"], "export")}
    assert {"export/model.safetensors", "export/config.json"} <= names


def test_fp16_without_gpu_is_a_clear_error(ray_cluster):
    with pytest.raises(ConfigError, match="fp16 needs CUDA"):
        launch(debug_cfg("fp16-cpu", **{"engine.precision": "fp16"}))


@pytest.mark.parametrize("recipe, kind", [("sinkhorn_debug", "sinkhorn"), ("performer_debug", "performer")])
def test_efficient_attention_recipes_train_with_falling_validation_loss(ray_cluster, recipe, kind):
    from efftx.generate import sample_text
    from efftx.export import load_export

    summary = launch(recipes.get(recipe).override({"name": f"{recipe}-run"}))
    val = history(summary, "val_bpb")
    assert val[40][-1] < 0.8 * val[0][0], val
    _, cfg, _ = load_export(summary["export_path"])
    assert cfg.attention.kind == kind and cfg.model.reversible
    assert len(sample_text(summary["export_path"], "def ", 20, temperature=0)) > 0


def test_speculative_pair_job_logs_base_vs_speculative(ray_cluster):
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    cmd = [sys.executable, "jobs/train_speculative.py", "--size", "debug", "--run-name", "pair",
           "--set", "train.steps=20", "--set", "train.eval_every=10", "--set", "train.sample_every=10"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(both) == {"draft", "target"}
    target = both["target"]
    for key in ("spec_mean_accepted", "decode_base_ms", "decode_spec_ms", "spec_speedup"):
        assert sorted(history(target, key)) == [10, 20], key
    assert all(0 <= v <= 5 for vs in history(target, "spec_mean_accepted").values() for v in vs)
    client = mlflow_client(target)
    for recipe in ("spec_draft_debug", "spec_target_debug"):
        assert client.search_model_versions(f"name='{recipe}'"), recipe
    params = client.get_run(target["mlflow_run_id"]).data.params
    assert params["speculative.draft"] == both["draft"]["export_path"]

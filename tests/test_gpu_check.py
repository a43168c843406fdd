"""bench/gpu_check.py, the one-command GPU check, run through its CPU plumbing (this machine has no GPU).

The train section runs a real job script (TorchTrainer + DeepSpeed, bf16) and judges it from MLflow; the decode
section times base and speculative decoding and checks greedy equality; CUDA-only rows say why they skip. The
judge is shown to fail a run whose loss does not fall or that skips steps for overflow after warm-up, and a
failing correctness row makes the exit code 1.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).parents[1] / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
_spec.loader.exec_module(gpu_check)


@pytest.mark.slow
@pytest.mark.own_cluster  # its job starts a local Ray cluster of its own: before the session's exists
def test_cpu_run_trains_judges_decodes_and_writes_the_table(tmp_path):
    code, rows = gpu_check.run(["--device", "cpu", "--only", "kernels,train,decode,nsa,serve", "--families", "lm",
                                "--steps", "10", "--warmup", "2", "--new-tokens", "12", "--out", str(tmp_path)])
    by_name = {(r.section, r.name): r for r in rows}
    assert code == 0, "\n".join(r.line() for r in rows)
    train = by_name[("train", "lm-bf16")]
    assert train.status == "pass" and "skipped steps after warm-up 0" in train.detail
    assert by_name[("decode", "batch 8, greedy speculative == base")].status == "pass"
    budget = by_name[("decode", "cache budget of 5 speculative rows of the context: held to it, outputs as alone")]
    assert budget.status == "pass" and "budget 0.62 MiB" in budget.detail, budget.detail
    assert by_name[("kernels", "Triton kernel compiled")].status == "skip"
    assert by_name[("nsa", "bench/nsa.py --no-cpu")].status == "skip"
    assert by_name[("serve", "Serve app on the device")].status == "skip"
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["name"] for r in saved] == [r.name for r in rows]
    assert "| train | lm-bf16 | pass |" in (tmp_path / "gpu_check.md").read_text()


def fake_history(val: list[float], skipped: list[int]):
    def history(summary, key):
        values = val if key == "val_loss" else skipped if key == "skipped_steps" else []
        return [(10 * i, float(v)) for i, v in enumerate(values)]

    return history


@pytest.mark.parametrize("val,skipped,ok", [
    ([5.0, 4.0, 3.0], [0, 3, 3, 3], True),  # overflow skips during warm-up (step 10 <= 10) only
    ([5.0, 5.2, 5.1], [0, 0, 0, 0], False),  # the loss did not fall
    ([5.0, 4.0, 3.0], [0, 0, 1, 2], False),  # steps skipped after warm-up
    ([5.0, 4.0, 3.0], [], False),  # no skipped-step count reported at all
])
def test_judge_fails_runs_that_do_not_learn_or_skip_steps(monkeypatch, val, skipped, ok):
    monkeypatch.setattr(gpu_check, "mlflow_history", fake_history(val, skipped))
    row = gpu_check.judge_run("x", {"tokens_per_s": 1.0, "peak_memory_mb": 1.0}, warmup=10)
    assert (row.status == "pass") is ok, row.detail


def test_a_failing_correctness_row_fails_the_check(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_check, "check_decode", lambda args, summaries: [
        gpu_check.Row("decode", "batch 1, greedy speculative == base", "FAIL", "differs at token 3"),
        gpu_check.Row("decode", "tokens/s", "info", "1", correctness=False)])
    code, rows = gpu_check.run(["--device", "cpu", "--only", "decode", "--out", str(tmp_path)])
    assert code == 1 and rows[-1].status == "FAIL"
    monkeypatch.setattr(gpu_check, "check_decode", lambda args, summaries: [
        gpu_check.Row("decode", "tokens/s", "FAIL", "slow", correctness=False)])  # figures never fail the check
    assert gpu_check.run(["--device", "cpu", "--only", "decode", "--out", str(tmp_path)])[0] == 0


def test_decode_timings_wait_for_the_device(monkeypatch):
    """The decode_*_ms metrics read the clock only after the GPU's queued work is done (torch.cuda.synchronize)."""
    import torch

    from efftx.train import tasks

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    tasks._synchronized_clock(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]
    tasks._synchronized_clock(torch.device("cpu"))
    assert len(calls) == 1


def test_kernel_rows_print_the_table_choice_and_what_autotune_chose(monkeypatch, tmp_path):
    """The launch-option rows show the tuning table's tile, warps and stages; with EFFTX_TRITON_AUTOTUNE=1 they add
    what autotune chose in the kernel tests (the log those tests write), per kernel, dtype and head dim."""
    monkeypatch.delenv("EFFTX_TRITON_TUNING", raising=False)
    monkeypatch.delenv("EFFTX_TRITON_AUTOTUNE", raising=False)
    rows = {r.name: r for r in gpu_check.kernel_choices()}
    assert rows["launch options bfloat16 D=128"].detail.startswith(
        "fwd TILE 64 x 4 warps x 3 stages, bwd TILE 32 x 8 warps x 3 stages")
    assert rows["launch options float32 D=128"].detail.startswith("fwd TILE 64 x 8 warps x 3 stages")
    assert rows["autotune"].detail.startswith("off")
    monkeypatch.setenv("EFFTX_TRITON_TUNING", "fwd.tile=32")  # an experiment's overrides show, and are named
    row = {r.name: r for r in gpu_check.kernel_choices()}["launch options float16 D=64"]
    assert row.detail.startswith("fwd TILE 32 x 4 warps x 3 stages") and "EFFTX_TRITON_TUNING=fwd.tile=32" in row.detail

    monkeypatch.delenv("EFFTX_TRITON_TUNING")
    monkeypatch.setenv("EFFTX_TRITON_AUTOTUNE", "1")
    table = dict(tile=64, num_warps=4, num_stages=3)
    picks = [(64, 4, 3), (32, 4, 3), (32, 4, 3)]
    log = tmp_path / "autotune.jsonl"
    log.write_text("".join(json.dumps(dict(kernel="fwd", dtype="bfloat16", D_PAD=64, TILE=t, num_warps=w,
                                           num_stages=s, table=table)) + "\n" for t, w, s in picks))
    rows = {r.name: r for r in gpu_check.kernel_choices(log)}
    assert rows["autotune fwd bfloat16 D<=64"].detail == (
        "3 shapes tuned, table's choice kept in 1; picked TILE 32 x 4 warps x 3 stages (2), "
        "TILE 64 x 4 warps x 3 stages (1)")
    assert "nothing tuned" in {r.name: r for r in gpu_check.kernel_choices(tmp_path / "none.jsonl")}["autotune"].detail


def test_a_section_whose_packages_are_missing_is_refused_naming_them(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("ray", "mlflow") else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        gpu_check.run(["--device", "cpu", "--only", "decode,train", "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "section train needs ray, mlflow" in err and "--only kernels,decode,nsa" in err
    assert not (tmp_path / "gpu_check.md").exists()  # nothing ran
    code, rows = gpu_check.run(["--device", "cpu", "--only", "decode", "--new-tokens", "4", "--out", str(tmp_path)])
    assert code == 0 and any(r.section == "decode" and r.status == "pass" for r in rows)  # the rest still runs


def test_bench_sections_pass_through_what_ran_and_fail_what_crashed_or_hung(tmp_path):
    """The nsa / scaling / cost sections run a bench in a subprocess on CUDA (here: stand-in commands, the device
    said to be cuda): its tables kept in OUT/<section>.log; a crash is a FAIL naming its last error line, a bench
    past --timeout a FAIL keeping what it printed; without CUDA a skip."""
    args = type("Args", (), {"device": "cuda", "timeout": 5})()
    ok = gpu_check.bench_section("cost", "a bench", ["-c", "print('| T | ms |')"], args, tmp_path)
    assert [r.status for r in ok] == ["pass"] and "| T | ms |" in (tmp_path / "cost.log").read_text()
    crash = gpu_check.bench_section("nsa", "a bench", ["-c", "raise SystemExit('CUDA out of memory at T=65536')"],
                                    args, tmp_path)
    assert crash[0].status == "FAIL" and crash[0].correctness and "CUDA out of memory" in crash[0].detail
    hung = gpu_check.bench_section("scaling", "a bench", ["-c", "import time; print('T=2048 done', flush=True); "
                                                          "time.sleep(30)"], args, tmp_path)
    assert hung[0].status == "FAIL" and "within 5 s" in hung[0].detail
    assert "T=2048 done" in (tmp_path / "scaling.log").read_text()
    args.device = "cpu"
    assert gpu_check.bench_section("cost", "a bench", ["-c", "raise SystemExit(1)"], args, tmp_path)[0].status == "skip"


def test_the_serveload_section_runs_the_inprocess_load_on_cuda(monkeypatch, tmp_path):
    """``--only serveload`` needs torch alone (no Ray): on CUDA it runs bench/serve_load.py's in-process load on the
    device, two rounds (one with --quick), then with compiled passes, sampling's per-row bench, the fixed priority
    lanes, several steps a round against one (base eager and compiled, speculative eager) and pipelined base steps
    against unpipelined (eager second, compiled last), each in its own log; the load itself with base steps
    unpipelined beside; without CUDA it is skipped, saying so."""
    ran = []
    monkeypatch.setattr(gpu_check, "bench_section", lambda section, name, cmd, args, out, log=None: ran.append(
        (cmd, log)) or [gpu_check.Row(section, name, "pass")])
    args = type("Args", (), {"device": "cuda", "timeout": 5, "quick": False})()
    assert gpu_check.check_serveload(args, tmp_path)[0].section == "serveload"
    args.quick = True
    gpu_check.check_serveload(args, tmp_path)
    compiled = (["bench/serve_load.py", "--inprocess", "--device", "cuda", "--compile", "on", "--quick", "--rounds",
                 "1"], "serveload-compiled")
    fixed = (["bench/serve_load.py", "--inprocess", "--device", "cuda", "--short-slowdown", "0", "--modes", "base",
              "--quick", "--rounds", "1"], "serveload-fixed-lanes")
    sampling = (["bench/row_sampling.py", "--device", "cuda", "--steps"], "rowsampling")
    steps = [(["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "64"], "stepsperround"),
             (["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "--compile", "on"],
              "stepsperround-compiled"),
             (["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "--mode", "speculative"],
              "stepsperround-speculative"),
             (["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "--pipeline", "--steps", "1",
               "--compile", "on"], "pipeline-compiled")]
    pipeline = (["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "64", "--pipeline", "--steps",
                 "1"], "pipeline")
    assert ran == [(["bench/serve_load.py", "--inprocess", "--device", "cuda", "--rounds", "2", "--unpipelined"], None),
                   pipeline, compiled, sampling, fixed, *steps,
                   (["bench/serve_load.py", "--inprocess", "--device", "cuda", "--rounds", "1", "--unpipelined",
                     "--quick"], None), pipeline, compiled, sampling, fixed, *steps]
    monkeypatch.undo()
    code, rows = gpu_check.run(["--device", "cpu", "--only", "serveload", "--out", str(tmp_path)])
    assert code == 0 and [(r.section, r.status, r.detail) for r in rows if r.section == "serveload"] == [
        ("serveload", "skip", "no CUDA device")]


def test_the_decodeattn_section_runs_the_decode_attention_bench_on_cuda(monkeypatch, tmp_path):
    """``--only decodeattn`` runs bench/decode_attention.py on the device (fewer shapes with --quick); without CUDA
    it is skipped, saying so."""
    ran = []
    monkeypatch.setattr(gpu_check, "bench_section", lambda section, name, cmd, args, out, log=None: ran.append(
        (section, cmd)) or [gpu_check.Row(section, name, "pass")])
    args = type("Args", (), {"device": "cuda", "timeout": 5, "quick": False})()
    gpu_check.check_decodeattn(args, tmp_path)
    args.quick = True
    gpu_check.check_decodeattn(args, tmp_path)
    assert ran == [("decodeattn", ["bench/decode_attention.py", "--device", "cuda"]),
                   ("decodeattn", ["bench/decode_attention.py", "--device", "cuda", "--tokens", "1", "--repeats", "3"])]
    monkeypatch.undo()
    code, rows = gpu_check.run(["--device", "cpu", "--only", "decodeattn", "--out", str(tmp_path)])
    assert code == 0 and [(r.section, r.status, r.detail) for r in rows if r.section == "decodeattn"] == [
        ("decodeattn", "skip", "no CUDA device")]


def test_the_speculative_section_judges_a_trained_pair_and_says_how_to_make_one(monkeypatch, tmp_path):
    """``--only speculative`` (torch alone): with a pair in ``--pair`` it runs bench/speculative.py on the device,
    eager and compiled, coupled rows included, with the distilled draft when the pair has one (fewer prompts with
    --quick), its verdict as rows, then the in-process serving load on the same pair in every mode; without a pair
    it is skipped, naming the command that makes one; without CUDA, skipped."""
    ran, silent = [], []

    def bench(section, name, cmd, args, out, log=None):
        ran.append((cmd, log))
        if cmd[0] == "bench/speculative.py" and not silent:  # its verdict where --json says
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps({
                "equality": [{"draft": "plain", "gamma": "fixed", "equal": True}],
                "goals": [{"batch": 1, "goal": 2.5, "best": 2.71, "label": "speculative, plain", "met": True}]}))
        return [gpu_check.Row(section, name, "pass")]

    monkeypatch.setattr(gpu_check, "bench_section", bench)
    pair = tmp_path / "pair"
    args = type("Args", (), {"device": "cuda", "timeout": 5, "quick": False, "pair": str(pair)})()
    skipped = gpu_check.check_speculative(args, tmp_path)
    assert [r.status for r in skipped] == ["skip"] and "make gpu-pair" in skipped[0].detail and not ran
    for role in ("target", "draft"):
        (pair / role).mkdir(parents=True)
        (pair / role / "config.json").write_text("{}")
    rows = gpu_check.check_speculative(args, tmp_path)
    models = ["--target", str(pair / "target"), "--draft", str(pair / "draft")]
    spec = ["bench/speculative.py", "--device", "cuda", *models]
    verdict = ["--json", str((tmp_path / "speculative.json").resolve())]
    assert ran == [(spec + ["--compile", "off,on", "--no-adaptive", "--coupled", "--overhead", "--costs", *verdict],
                    None),
                   (["bench/serve_load.py", "--inprocess", "--device", "cuda", *models, "--modes",
                     "base,speculative,coupled", "--rounds", "2"], "serveload-trained")]
    assert [(r.name, r.status) for r in rows] == [
        ("bench/speculative.py --device cuda (trained pair)", "pass"), ("greedy speculative == base, every draft", "pass"),
        ("batch 1: at least 2.5x", "info"), ("bench/serve_load.py --inprocess --device cuda (trained pair)", "pass")]
    assert rows[2].detail == "best 2.71x (speculative, plain): MET"
    silent.append(True)  # a run that writes no verdict: the last run's is not read for it
    assert [(r.name, r.status) for r in gpu_check.check_speculative(args, tmp_path)][1:3] == [
        ("greedy speculative == base, every draft", "FAIL"), ("goals", "FAIL")]
    silent.clear()
    (pair / "distilled").mkdir()
    (pair / "distilled" / "config.json").write_text("{}")
    ran.clear()
    args.quick = True
    gpu_check.check_speculative(args, tmp_path)
    assert ran[0][0] == spec + ["--distilled-draft", str(pair / "distilled"), "--compile", "off,on", "--no-adaptive",
                                "--coupled", "--overhead", "--costs", "--repeats", "1", "--timed-prompts", "8",
                                "--acceptance-prompts", "8", *verdict]
    assert ran[1][0][-3:] == ["--rounds", "1", "--quick"]
    monkeypatch.undo()
    code, rows = gpu_check.run(["--device", "cpu", "--only", "speculative", "--pair", str(pair), "--out", str(tmp_path)])
    assert code == 0 and [(r.section, r.status, r.detail) for r in rows if r.section == "speculative"] == [
        ("speculative", "skip", "no CUDA device")]


_pair_spec = importlib.util.spec_from_file_location("gpu_pair", Path(__file__).parents[1] / "bench" / "gpu_pair.py")
gpu_pair = importlib.util.module_from_spec(_pair_spec)
_pair_spec.loader.exec_module(gpu_pair)


def test_gpu_pair_trains_the_pair_then_a_distilled_draft_and_collects_the_three_exports(monkeypatch, tmp_path):
    """bench/gpu_pair.py (make gpu-pair): the pair's job, then the distilled draft's from the pair's target export,
    the three exports copied into OUT (the jobs stand-ins here: tests/test_train_ray.py and tests/test_distill.py run
    the real ones); a failing job stops it, naming it, and OUT keeps the pair it had."""
    import subprocess

    calls = []

    def export(name):
        folder = tmp_path / "runs" / name / "export"
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"name": name}))
        (folder / "model.safetensors").write_bytes(b"w" * 10)
        return str(folder)

    def job(cmd, cwd, stdout, text):
        calls.append(cmd[1:])
        if "--distill" in cmd:
            out = {"target": None, "draft": {"export_path": export("p-distilled-draft")}, "speculative": {}}
        else:
            out = {"draft": {"export_path": export("p-draft")}, "target": {"export_path": "file://" + export("p-target")}}
        return subprocess.CompletedProcess(cmd, 0, stdout="[efftx] done\n" + json.dumps(out) + "\n")

    monkeypatch.setattr(gpu_pair.subprocess, "run", job)
    out = tmp_path / "pair"
    assert gpu_pair.main(["--out", str(out), "--size", "debug", "--run-name", "p", "--set", "train.steps=3"]) == 0
    target = str(tmp_path / "runs" / "p-target" / "export")
    assert calls == [["jobs/train_speculative.py", "--size", "debug", "--run-name", "p", "--set", "train.steps=3"],
                     ["jobs/train_speculative.py", "--size", "debug", "--distill", "--target", target, "--run-name",
                      "p-distilled", "--set", "train.steps=3"]]
    assert {role: json.loads((out / role / "config.json").read_text())["name"] for role in gpu_pair.ROLES} == {
        "target": "p-target", "draft": "p-draft", "distilled": "p-distilled-draft"}
    assert sorted(p.name for p in out.iterdir()) == ["distilled", "draft", "target"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".pair-")] == []  # no staging left behind

    monkeypatch.setattr(gpu_pair.subprocess, "run", lambda cmd, cwd, stdout, text: subprocess.CompletedProcess(
        cmd, 1, stdout=""))
    with pytest.raises(SystemExit, match=r"the pair \(draft, then target\) failed \(exit code 1\)"):
        gpu_pair.main(["--out", str(out)])
    assert json.loads((out / "target" / "config.json").read_text())["name"] == "p-target"  # the old pair kept


def test_compiled_decode_rows_hold_compiled_base_and_speculative_decoding_to_the_eager_base(monkeypatch):
    """The decode section's compiled rows (CUDA only; here their plumbing on the CPU, the passes run eagerly and the
    device waits skipped): greedy compiled base and compiled speculative decoding equal to the eager base (correctness
    rows), sampled compiled speculative decoding runs, tokens/s rows; a compiled speculative call that raises is a
    FAIL row, not a crash."""
    import torch

    from efftx import recipes
    from efftx.generation import compiled
    from efftx.generation.decode import generate
    from efftx.models import build

    monkeypatch.setattr(compiled, "compiled_function", lambda fn, device_type: fn)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    torch.manual_seed(0)
    target, draft = (build(recipes.get(f"spec_{role}_debug")).eval() for role in ("target", "draft"))
    prompts = torch.randint(0, target.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = generate(target, prompts, 6, temperature=0.0).tolist()
    rows = gpu_check.compiled_decode_rows(target, draft, prompts, 6, 2, 0.1, base, "cuda")
    assert [(r.name, r.status) for r in rows] == [
        ("batch 2, greedy compiled == base", "pass"), ("batch 2 compiled tokens/s", "info"),
        ("batch 2, greedy compiled speculative == base", "pass"), ("batch 2, sampled compiled speculative", "pass"),
        ("batch 2 compiled speculative tokens/s", "info")]
    wrong = gpu_check.compiled_decode_rows(target, draft, prompts, 6, 2, 0.1, [[0] * 6, base[1]], "cuda")
    assert [r.status for r in wrong if r.correctness] == ["FAIL", "FAIL", "pass"]
    monkeypatch.setattr(compiled.StaticDecoder, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    failed = gpu_check.compiled_decode_rows(target, draft, prompts, 6, 2, 0.1, base, "cuda")
    assert failed[-1].name == "batch 2, greedy compiled speculative == base" and failed[-1].status == "FAIL"
    assert "RuntimeError: boom" in failed[-1].detail


def test_every_train_rows_overrides_make_a_valid_config_on_cuda():
    """The train section's runs on CUDA (each family's recipe with its overrides, the CPU-only swaps left out): every
    config validates, so no GPU row fails on its config before it trains. Power: the NSA rows' Triton kernel with
    nsa_debug's selection blocks of 8 (it takes multiples of 16) was refused."""
    from efftx import recipes

    for family, (_, job_args, extra) in gpu_check.FAMILIES.items():
        names = [job_args[1]] if job_args[0] == "--recipe" else [f"spec_{r}_{job_args[1]}" for r in ("target", "draft")]
        if family == "dalle":
            names.append(job_args[1].replace("dalle", "dvae"))
        for name in names:
            recipes.get(name).override([*extra, f"name={family}", "scaling.device=cuda", "engine.precision=bf16"]
                                       ).validate()

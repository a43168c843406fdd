"""Tune searches beyond the grid (random, Optuna's TPE), space files, and a sweep that survives its driver.

Fast: space files checked key by key before anything starts (errors name the file, line and key), samplers that
never propose an invalid or repeated point, their state saved and restored as Tune does. Slow: the real CLI
with --search optuna, its driver killed with SIGKILL after a trial finished, the same command run again.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from efftx import recipes, tuning
from efftx.errors import ConfigError
from efftx.tuning import Space, load_space_file, search_plan

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_space_file_yaml_and_json_give_the_same_typed_space(tmp_path):
    """YAML's 1e-4 (a string to YAML 1.1) and JSON's "64" become the config's types, as --set converts them."""
    yml = write(tmp_path, "s.yaml", "recipe: dvae_shapes_debug\nspace:\n  train.lr: {loguniform: [1e-4, 1e-2]}\n"
                                    "  vae.num_tokens: [32, '64']\n  model.rotary: [true, false]\n")
    js = write(tmp_path, "s.json", json.dumps({"recipe": "dvae_shapes_debug", "space": {
        "train.lr": {"loguniform": [1e-4, 0.01]}, "vae.num_tokens": [32, "64"], "model.rotary": [True, False]}}))
    a, b = load_space_file(yml), load_space_file(js)
    assert a.grid == b.grid == {"vae.num_tokens": [32, 64], "model.rotary": [True, False]}
    assert a.ranges == b.ranges == {"train.lr": ("loguniform", 1e-4, 1e-2)}
    assert a.recipe == "dvae_shapes_debug" and a.lines == {"train.lr": 3, "vae.num_tokens": 4, "model.rotary": 5}
    example = load_space_file(REPO / "examples" / "space_dvae_lr.yaml")  # the README's example stays valid
    assert example.keys and example.recipe


@pytest.mark.parametrize("name, text, message", [
    ("s.yaml", "space:\n  train.lr: [1e-3]\n  attention.sinkhorn.bucket: [8]\n",
     r"s.yaml line 3: unknown config key 'attention.sinkhorn.bucket' \(did you mean 'attention.sinkhorn.bucket_size'"),
    ("s.yaml", "space:\n  vae.num_tokens: [32, many]\n",
     r"line 2: vae.num_tokens: value 2: vae.num_tokens expects an integer, got 'many'"),
    ("s.yaml", "space:\n  train.lr: [1e-3]\n  vae.num_tokens: []\n",
     r"line 3: vae.num_tokens: the list of values is empty"),
    ("s.yaml", "space:\n  train.lr: [1e-3\n  vae.num_tokens: [32]\n", r"s.yaml line 3 column \d+: not valid YAML"),
    ("s.json", '{"space": {"train.lr": [0.001],}}', r"s.json line 1 column \d+: not valid JSON"),
    ("s.yaml", "space:\n  train.lr: 0.001\n", r"line 2: train.lr: expected a list of values, or a range"),
    ("s.yaml", "space:\n  train.lr: {loguniform: [0, 1e-2]}\n", r"line 2: train.lr: loguniform needs low > 0"),
    ("s.yaml", "space:\n  vae.num_tokens: {uniform: [32, 64]}\n",
     r"line 2: vae.num_tokens is an int key: its range is randint"),
    ("s.yaml", "space:\n  train.lr: {randint: [1, 2]}\n",
     r"line 2: train.lr is a float key: its range is uniform or loguniform"),
    ("s.yaml", "space:\n  train.lr: {uniform: [0.1, 0.01]}\n", r"uniform needs low < high"),
    ("s.yaml", "space:\n  scaling.num_workers: [1, 2]\n", r"line 2: scaling.num_workers cannot be swept"),
    ("s.yaml", "recipe: nope\nspace:\n  train.lr: [0.001]\n", r"s.yaml: unknown recipe 'nope'"),
    ("s.yaml", "spaces:\n  train.lr: [0.001]\n", r"s.yaml line 1: unknown section 'spaces'"),
    ("s.yaml", "- train.lr\n", r"expected a mapping with a 'space' section"),
    ("s.toml", "", r"name it .json, .yaml or .yml"),
])
def test_bad_space_file_is_a_clear_error_naming_key_and_line(tmp_path, name, text, message):
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError, match=message):
        load_space_file(path)


def test_missing_space_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"space file .*nope.yaml: cannot read it \(No such file"):
        load_space_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text, message", [
    ("space:\n  train.lr: [1e-3]\n  vae.num_token: [32]\n",
     "line 3: unknown config key 'vae.num_token' (did you mean 'vae.num_tokens'"),
    ("space:\n  train.lr: [1e-3\n", "s.yaml line 3 column 1: not valid YAML"),
])
def test_bad_space_file_on_the_command_line_exits_2_before_ray(tmp_path, text, message):
    path = write(tmp_path, "s.yaml", text)
    proc = subprocess.run([sys.executable, "tune/sweep.py", "--space-file", str(path), "--search", "optuna"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr  # stopped before Ray started


def test_range_the_run_config_rejects_is_refused_before_ray(tmp_path, monkeypatch):
    """The ends of a range are checked with the run config's own validation up front (here: warmup longer
    than the run), and a grid search over a range is refused: neither gets as far as Ray."""
    from efftx.train import launch

    def no_ray():
        raise AssertionError("the sweep got as far as starting Ray")

    monkeypatch.setattr(launch, "ensure_ray", no_ray)
    space = load_space_file(write(tmp_path, "s.yaml", "recipe: dvae_shapes_debug\nspace:\n"
                                                      "  train.warmup_steps: {randint: [0, 500]}\n"))
    with pytest.raises(ConfigError, match=r"s.yaml line 3: train.warmup_steps: randint \[0, 500\] reaches 500, "
                                          r"which the run config rejects: train.warmup_steps=500 exceeds train.steps"):
        tuning.sweep(space, search="random", samples=2)
    with pytest.raises(ConfigError, match="train.warmup_steps is a range: a grid search enumerates lists"):
        tuning.sweep(space, search="grid")
    with pytest.raises(ConfigError, match="has no end: give the number of trials with --samples N"):
        tuning.sweep(space.__class__(space.description, space.recipe,
                                     ranges={"train.lr": ("uniform", 1e-3, 2e-3)}), search="optuna")


KV = Space("kv heads x lr", "lm_debug", grid={"model.kv_heads": [1, 2, 3, 4], "train.lr": [1e-3, 2e-3]})


@pytest.mark.parametrize("search", ["random", "optuna"])
def test_samplers_propose_every_valid_point_once_and_never_an_invalid_one(search):
    """kv_heads=3 does not divide 4 heads: the config rejects 2 of the 8 points. A sampler's trials are the 6
    valid points, each once (without the check, both samplers propose kv_heads=3 and repeats within 6 draws)."""
    base = recipes.get("lm_debug").override({"name": "t"})
    logged = []
    plan = search_plan(KV, base, search, 0, log=logged.append)
    assert plan["trials"] == 6 and "points" not in plan
    got = [plan["searcher"].suggest(f"trial{i}")["overrides"] for i in range(plan["trials"])]
    assert sorted(map(json.dumps, got)) == sorted({json.dumps({"model.kv_heads": k, "train.lr": lr})
                                                   for k in (1, 2, 4) for lr in (1e-3, 2e-3)})
    assert sum("left out" in line and "'model.kv_heads': 3" in line for line in logged) == 2
    assert plan["searcher"].suggest("one-more") == "FINISHED"  # used up: the search ends, nothing repeats


def test_sampler_over_a_range_checks_each_proposal_and_samples_are_required():
    base = recipes.get("lm_debug").override({"name": "t"})
    space = tuning.check_space(Space("lr", "lm_debug", grid={"model.kv_heads": [2, 3]},
                                     ranges={"train.lr": ("loguniform", 1e-4, 1e-2)}))
    plan = search_plan(space, base, "random", 5, log=lambda line: None)
    got = [plan["searcher"].suggest(f"t{i}")["overrides"] for i in range(5)]
    assert all(p["model.kv_heads"] == 2 and 1e-4 <= p["train.lr"] <= 1e-2 for p in got)
    with pytest.raises(ConfigError, match="--search random over ranges"):
        search_plan(space, base, "random", 0)


def test_optuna_state_saved_and_restored_goes_on_without_repeating():
    """What Tune does with a killed sweep's searcher: saved with the experiment, restored in a new searcher
    (here in a fresh plan, as the re-run command makes one), which proposes only points not yet tried."""
    base = recipes.get("lm_debug").override({"name": "t"})
    plan = search_plan(KV, base, "optuna", 0, log=lambda line: None)
    first = plan["searcher"]
    before = [first.suggest(f"t{i}")["overrides"] for i in range(3)]
    for i, value in enumerate((2.0, 1.5)):
        first.on_trial_result(f"t{i}", {"val_bpb": value + 0.5, "training_iteration": 1})
        first.on_trial_complete(f"t{i}", {"val_bpb": value})
    ckpt = Path(first.CKPT_FILE_TMPL.format("x"))
    try:
        first.save(str(ckpt))
        second = search_plan(KV, base, "optuna", 0, log=lambda line: None)["searcher"]
        second.restore(str(ckpt))
    finally:
        ckpt.unlink(missing_ok=True)
    second.on_trial_complete("t2", {"val_bpb": 1.0})  # the trial in flight when the driver died completes
    after = [second.suggest(f"u{i}")["overrides"] for i in range(3)]
    assert len({json.dumps(p, sort_keys=True) for p in before + after}) == 6
    assert all(p["model.kv_heads"] != 3 for p in after)


def test_optuna_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna -> ImportError
    with pytest.raises(ConfigError, match="--search optuna needs Optuna: pip install -c constraints.txt optuna"):
        search_plan(KV, recipes.get("lm_debug").override({"name": "t"}), "optuna", 0, log=lambda line: None)


# ------------------------------------------------------------------------------------------- the real sweep
def _saved_statuses(exp_dir: Path) -> dict[str, str]:
    """trial id -> status in the newest experiment state Tune saved (what a restore reads)."""
    files = sorted(exp_dir.glob("experiment_state-*.json"))
    if not files:
        return {}
    try:
        state = json.loads(files[-1].read_text())
    except (OSError, ValueError):
        return {}  # being written
    trials = [json.loads(trial) for trial, _ in state["trial_data"]]
    return {t["trial_id"]: t["status"] for t in trials}


@pytest.mark.slow
def test_killed_sweep_resumes_without_rerunning_finished_trials(ray_cluster, efftx_home, tmp_path):
    """The real CLI (--search optuna from a YAML space file, no ASHA) on the session's cluster, one trial at a
    time; its driver is killed with SIGKILL once Tune has saved a finished trial, and the same command is run
    again. It resumes: the finished trial is not run again (its Tune results and MLflow metrics are as they
    were), the rest is run (the one in flight continued), and the table has each of the 2 points once."""
    from mlflow import MlflowClient

    lrs = [1e-3, 3e-3]
    space = write(tmp_path, "lr.yaml", f"recipe: dvae_shapes_debug\nspace:\n  train.lr: {lrs}\n")
    name = "killed-sweep"
    cmd = [sys.executable, "tune/sweep.py", "--space-file", str(space), "--search", "optuna", "--scheduler", "none",
           "--max-concurrent", "1", "--name", name, "--set", "train.steps=10", "--set", "train.eval_every=5",
           "--set", "train.checkpoint_every=5", "--set", "train.warmup_steps=2", "--set", "train.log_every=5"]
    env = {**os.environ, "RAY_ADDRESS": ray_cluster}
    exp_dir = Path(efftx_home) / "tune" / name
    with open(tmp_path / "first.log", "w") as out:
        first = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "TERMINATED" not in _saved_statuses(exp_dir).values():
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no trial finished in time"
            time.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
    at_kill = _saved_statuses(exp_dir)
    done = [t for t, s in at_kill.items() if s == "TERMINATED"]
    assert len(done) < len(lrs), at_kill  # killed mid-way
    results = {t: next(exp_dir.glob(f"*{t}*/result.json")).read_text() for t in done}

    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"resuming its Tune experiment {exp_dir}: {len(done)} of {len(lrs)} trials finished" in proc.stdout
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["resumed"] and summary["trials"] == summary["finished"] == len(lrs)
    assert (summary["search"], summary["scheduler"]) == ("optuna", "none")
    final = _saved_statuses(exp_dir)
    assert len(final) == len(lrs) and set(final.values()) == {"TERMINATED"} and set(done) <= set(final)
    for trial_id, text in results.items():  # no report after the kill: the finished trials did not run again
        assert next(exp_dir.glob(f"*{trial_id}*/result.json")).read_text() == text

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    parent = summary["mlflow_parent_run_id"]
    table = json.loads(Path(client.download_artifacts(parent, "sweep/results.json")).read_text())
    assert sorted(r["train.lr"] for r in table) == lrs and all(r["status"] == "complete" for r in table)
    exp_id = client.get_run(parent).info.experiment_id
    children = client.search_runs([exp_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(float(c.data.params["train.lr"]) for c in children) == lrs  # one training run per trial
    assert all(c.info.status == "FINISHED" for c in children)
    for child in children:
        if child.info.run_name.removeprefix(f"{name}-") in done:  # trained once: one evaluation per step
            steps = [m.step for m in client.get_metric_history(child.info.run_id, "val_loss")]
            assert sorted(steps) == sorted(set(steps)) and max(steps) == 10, steps
    assert client.get_run(parent).info.status == "FINISHED"

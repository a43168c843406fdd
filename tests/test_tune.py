"""Tune sweeps: spaces as data, constraints, bad input, and one tiny real sweep (slow)."""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from efftx import recipes
from efftx.errors import ConfigError
from efftx.tuning import SPACES, Space, choose, points, sweep

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def another_ray_instance():
    """A second Ray cluster on this machine (as when two jobs, or two test processes, each start one): Ray code
    that looks its cluster up from inside a worker finds two and fails unless it is told its address."""
    from efftx.cluster import ray_bin, session_of, start_node
    from netutil import free_port
    from test_job_submit import kill_cluster

    temp_dir = tempfile.mkdtemp(prefix="efftx-ray-other-", dir="/tmp")
    cmd = [ray_bin(), "start", "--head", "--num-cpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
           "--port", str(free_port()), "--temp-dir", temp_dir]
    try:
        start_node(cmd, 3, session_of)  # `ray start` with token auth, started again if the raylet registers late
        yield
    finally:
        kill_cluster(temp_dir)


def created_placement_groups() -> set[str]:
    from ray.util.placement_group import placement_group_table

    return {pg_id for pg_id, pg in placement_group_table().items() if pg["state"] == "CREATED"}


def test_points_the_config_rejects_are_left_out_before_any_trial():
    """No constraint restates a rule: the run config's own validation (here GQA's, in the attention spec)
    decides, and each left-out point is logged with its reason."""
    base = recipes.get("lm_debug").override({"name": "t"})
    space = Space("kv heads", "lm_debug", grid={"model.kv_heads": [1, 2, 3, 4], "train.lr": [1e-3, 2e-3]})
    logged = []
    got = points(space, base, log=logged.append)
    assert sorted({p["model.kv_heads"] for p in got}) == [1, 2, 4]  # 3 does not divide 4 heads
    assert len(got) == 6
    assert len(logged) == 2 and all("model.kv_heads': 3" in line and "multiple of model.kv_heads=3" in line
                                    for line in logged)


def test_named_spaces_expand_against_their_recipes():
    for name, space in SPACES.items():
        pts = points(space, recipes.get(space.recipe).override({"name": name}))
        assert pts and all(set(p) == set(space.grid) for p in pts)


def test_unknown_key_in_space_is_a_clear_error():
    space = Space("bad", "lm_debug", grid={"attention.sinkhorn.bucket": [8]})
    with pytest.raises(ConfigError, match="unknown config key 'attention.sinkhorn.bucket'.*bucket_size"):
        points(space, recipes.get("lm_debug"))


def test_space_with_a_point_the_config_rejects_is_an_error_not_a_failed_trial():
    space = Space("bad", "lm_debug", grid={"model.kv_heads": [3]})
    with pytest.raises(ConfigError, match="multiple of model.kv_heads=3"):
        points(space, recipes.get("lm_debug").override({"name": "t"}))


def test_sampling_is_a_seeded_subset():
    pts = [{"a": i} for i in range(10)]
    assert choose(pts, 0, 0) == pts and choose(pts, 99, 0) == pts
    sub = choose(pts, 3, 0)
    assert len(sub) == 3 and sub == choose(pts, 3, 0) and all(p in pts for p in sub)


@pytest.mark.parametrize("args, message", [
    (["--space", "nope"], "unknown search space 'nope'"),
    (["--space", "sinkhorn_blocks", "--set", "train.bogus=1"], "unknown config key 'train.bogus'"),
    (["--space", "sinkhorn_blocks", "--max-concurrent", "0"], "--max-concurrent must be >= 1"),
])
def test_bad_sweep_input_exits_with_message(args, message):
    proc = subprocess.run([sys.executable, "tune/sweep.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_tiny_sweep_logs_parent_child_runs_and_plot_and_asha_stops_a_hopeless_trial(ray_cluster, monkeypatch,
                                                                                    another_ray_instance):
    """Two dVAE trials that differ only in learning rate, run one after the other (grid order), on the dVAE
    task's metric (validation loss: any family can be swept; the NSA sweep of test_nsa.py is an LM's). The first
    (the recipe's lr) is the first to reach ASHA's rung at step 5 and trains on to step 20; the second
    (lr 1e-7, which cannot learn anything) is worse than it at the rung, so ASHA stops it there. ASHA compares
    a trial with those already recorded at the rung, so the order is what makes this certain. The stop takes a
    few seconds to reach the trial's workers (a few steps here), but they never get to step 20."""
    from mlflow import MlflowClient

    good, hopeless = 3e-3, 1e-7
    monkeypatch.setitem(SPACES, "lr_probe", Space("learning rate, one hopeless", "dvae_shapes_debug",
                                                  grid={"train.lr": [good, hopeless]}))
    before = created_placement_groups()
    summary = sweep("lr_probe", max_concurrent=1, name="tiny-sweep",
                    overrides=["train.steps=20", "train.eval_every=5", "train.checkpoint_every=20"])
    # ASHA stops a trial by killing it, Train's controller with it; Train's cleaner then frees the workers'
    # placement group, also with another Ray instance on the machine (efftx.cluster.start_local). Before that
    # fix every stopped trial's group stayed reserved while the driver lived, and later trials starved.
    deadline = time.monotonic() + 90
    while created_placement_groups() - before and time.monotonic() < deadline:
        time.sleep(1)
    assert not created_placement_groups() - before, "a stopped trial's Train workers still hold their resources"
    assert summary["trials"] == 2 and summary["finished"] == 2  # a stopped trial has results too
    assert (summary["metric"], summary["mode"]) == ("val_loss", "min") and summary["best_val_loss"] > 0
    assert summary["best"] == {"train.lr": good}  # completed trials win over stopped ones
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    parent = summary["mlflow_parent_run_id"]
    artifacts = [a.path for a in client.list_artifacts(parent, "sweep")]
    assert {"sweep/lr_probe.png", "sweep/results.txt", "sweep/results.json"} <= set(artifacts)
    png = client.download_artifacts(parent, "sweep/lr_probe.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the results table: the hopeless trial stopped early by ASHA, at the rung, the other ran to the end
    table = json.loads(Path(client.download_artifacts(parent, "sweep/results.json")).read_text())
    rows = {r["train.lr"]: r for r in table}
    assert (rows[good]["status"], rows[good]["step"]) == ("complete", 20), rows
    assert (rows[hopeless]["status"], rows[hopeless]["step"]) == ("stopped early", 5), rows
    assert not rows[good]["error"] and not rows[hopeless]["error"]
    assert "stopped early" in Path(client.download_artifacts(parent, "sweep/results.txt")).read_text()
    run = client.get_run(parent)
    children = client.search_runs([run.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    by_lr = {float(c.data.params["train.lr"]): c for c in children}
    assert sorted(by_lr) == [hopeless, good]
    assert by_lr[good].info.status == "FINISHED" and by_lr[hopeless].info.status == "KILLED"

    def history(child, key):
        return {m.step: m.value for m in client.get_metric_history(child.info.run_id, key)}

    val_good, val_hopeless = history(by_lr[good], "val_loss"), history(by_lr[hopeless], "val_loss")
    assert sorted(val_good) == [0, 5, 10, 15, 20] and 20 not in val_hopeless
    assert val_hopeless[5] > val_good[5]  # why ASHA stopped it
    assert max(history(by_lr[hopeless], "loss")) < 20  # its training was stopped too, not only its reports
    best = json.loads(run.data.params["sweep.best"])
    assert best == summary["best"]

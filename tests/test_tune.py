"""Tune sweeps: spaces as data, constraints, bad input, and one tiny real sweep (slow)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from efftx import recipes
from efftx.errors import ConfigError
from efftx.tuning import SPACES, Space, choose, points, sweep

REPO = Path(__file__).resolve().parents[1]


def test_constraints_exclude_invalid_points_before_any_trial():
    base = recipes.get("lm_debug").override({"name": "t"})
    space = Space("kv heads", "lm_debug", grid={"model.kv_heads": [1, 2, 3, 4], "train.lr": [1e-3, 2e-3]},
                  constraints=(("divides", "model.kv_heads", "model.heads"),))
    got = points(space, base)
    assert sorted({p["model.kv_heads"] for p in got}) == [1, 2, 4]  # 3 does not divide 4 heads
    assert len(got) == 6


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
def test_tiny_sweep_logs_parent_child_runs_and_plot(ray_cluster):
    from mlflow import MlflowClient

    summary = sweep("sinkhorn_blocks", samples=2, max_concurrent=2, name="tiny-sweep",
                    overrides=["train.steps=10", "train.eval_every=5", "train.checkpoint_every=10"])
    assert summary["trials"] == 2 and summary["finished"] >= 1
    assert set(summary["best"]) == set(SPACES["sinkhorn_blocks"].grid)
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    parent = summary["mlflow_parent_run_id"]
    artifacts = [a.path for a in client.list_artifacts(parent, "sweep")]
    assert "sweep/sinkhorn_blocks.png" in artifacts and "sweep/results.txt" in artifacts
    png = client.download_artifacts(parent, "sweep/sinkhorn_blocks.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = client.get_run(parent)
    exp = run.info.experiment_id
    children = client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent}'")
    assert len(children) == 2
    assert all(c.info.status in ("FINISHED", "KILLED") for c in children)
    assert all("val_bpb" in c.data.metrics for c in children)
    best = json.loads(run.data.params["sweep.best"])
    assert best == summary["best"]

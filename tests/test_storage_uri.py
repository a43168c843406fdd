"""Runs on any filesystem Ray supports, against a real S3-compatible server (moto_server on 127.0.0.1, started by the
``s3_server`` fixture, tests/s3server.py; authentication on). Nothing is mocked in this process: efftx (pyarrow's
S3 filesystem), Ray Train and boto3 talk to the server over HTTP.

Fast: the storage keys' syntax; bad storage (unreachable endpoint, missing bucket, refused credentials) is a
LaunchError naming the URI before Ray, MLflow or any worker starts; files, checkpoint manifests (choosing, a torn
file, pruning) and exports round-trip through the bucket; an s3:// export loads and generates from a local cache
that follows the remote files. Slow: a tiny real training run with ``scaling.storage_path=s3://...`` writes its
checkpoints, run record and export into the bucket and nothing locally; the same command, re-run after a failure,
resumes from the S3 checkpoint; ``python -m efftx.generate`` loads the s3:// export.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from efftx import recipes
from efftx import storage as st
from efftx.errors import ConfigError, ExportError, LaunchError
from efftx.train import checkpoint as ck
from efftx.train.launch import launch, resolve

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The server, with the standard AWS variables pointing this process at it."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    return s3_server


@pytest.fixture(scope="module")
def bucket(s3_server):
    return s3_server.create_bucket("efftx-tests")


def debug_cfg(name: str, **overrides):
    return recipes.get("lm_debug").override({"name": name, **overrides})


# ------------------------------------------------------------------ the keys

@pytest.mark.parametrize("overrides, match", [
    ({"scaling.storage_path": "ftp://host/runs"}, r"scaling.storage_path='ftp://host/runs': unsupported URI scheme"),
    ({"scaling.storage_path": "s3://"}, r"scaling.storage_path='s3://' names no bucket"),
    ({"scaling.storage_path": "s3://b/runs?endpoint_override=x"}, r"put options in their own keys"),
    ({"scaling.storage_path": "file://relative/runs"}, r"a file:// URI needs an absolute path"),
    ({"scaling.storage_endpoint": "http://127.0.0.1:9000"}, r"scaling.storage_endpoint='http://127.0.0.1:9000' "
                                                            r"applies to s3:// storage only"),
    ({"scaling.storage_path": "s3://b/runs", "scaling.storage_endpoint": "127.0.0.1:9000"},
     r"scaling.storage_endpoint='127.0.0.1:9000' must be http\(s\)://host\[:port\]"),
])
def test_malformed_storage_keys_are_config_errors_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        resolve(debug_cfg("bad-keys", **overrides))


def test_local_paths_and_file_uris_resolve_to_the_same_local_folder(tmp_path):
    assert resolve(debug_cfg("a", **{"scaling.storage_path": f"file://{tmp_path}/runs/"})).scaling.storage_path == \
        str(tmp_path / "runs")
    assert resolve(debug_cfg("a", **{"scaling.storage_path": str(tmp_path / "x" / ".." / "runs")})
                   ).scaling.storage_path == str(tmp_path / "runs")
    assert resolve(debug_cfg("a", **{"scaling.storage_path": "s3://bkt/runs/"})).scaling.storage_path == \
        "s3://bkt/runs"


# ------------------------------------------------------------------ bad storage: errors before anything starts

def _launch_fails(cfg, tmp_path) -> str:
    import ray

    db = tmp_path / "mlflow.db"
    ray_before = ray.is_initialized()
    with pytest.raises(LaunchError) as err:
        launch(cfg.override({"tracking.uri": f"sqlite:///{db}"}))
    assert ray.is_initialized() == ray_before  # launch stopped before joining or starting Ray
    assert not db.exists()  # ... and before it opened the MLflow run
    return str(err.value)


def test_a_bucket_that_does_not_exist_is_an_error_naming_it(s3, tmp_path):
    message = _launch_fails(debug_cfg("nobucket", **{"scaling.storage_path": "s3://no-such-bucket/runs"}), tmp_path)
    assert message.startswith("scaling.storage_path=s3://no-such-bucket/runs: the bucket s3://no-such-bucket does "
                              f"not exist (endpoint {s3.endpoint}); create it"), message


def test_refused_credentials_are_an_error_naming_the_uri(s3, bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEFFTXWRONGKEY000")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    message = _launch_fails(debug_cfg("badcreds", **{"scaling.storage_path": f"s3://{bucket}/runs"}), tmp_path)
    assert message.startswith(f"scaling.storage_path=s3://{bucket}/runs is not usable (endpoint {s3.endpoint}): ")
    assert "ACCESS_DENIED" in message and "the credentials were refused: set AWS_ACCESS_KEY_ID" in message, message


def test_an_unreachable_endpoint_is_an_error_naming_the_uri_and_the_endpoint(s3, bucket, tmp_path):
    from netutil import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    cfg = debug_cfg("unreachable", **{"scaling.storage_path": f"s3://{bucket}/runs", "scaling.storage_endpoint": dead})
    message = _launch_fails(cfg, tmp_path)
    assert message.startswith(f"scaling.storage_path=s3://{bucket}/runs is not usable (endpoint {dead}): ")
    assert f"nothing answers at {dead}: check scaling.storage_endpoint" in message, message


def test_the_key_wins_over_the_environment_and_the_good_storage_passes(s3, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # wrong; the key names the right one
    storage = st.Storage.open(f"s3://{bucket}/probe-ok", s3.endpoint)
    storage.check()
    assert not [k for k in s3.keys(bucket, "probe-ok/") if st.PROBE_PREFIX in k]  # the probe file is gone


# ------------------------------------------------------------------ files, checkpoints and exports in the bucket

def test_files_round_trip_through_the_bucket(s3, bucket, tmp_path):
    storage = st.Storage.open(f"s3://{bucket}/files")
    assert storage.root == f"{bucket}/files" and storage.uri(storage.join("a")) == f"s3://{bucket}/files/a"
    storage.write(storage.join("run", "efftx_run.json"), '{"a": 1}')
    assert json.loads(storage.read_text(storage.join("run", "efftx_run.json"))) == {"a": 1}
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(os.urandom(3 << 20))
    storage.upload_dir(src, storage.join("run", "export"), last=("config.json",))
    assert storage.file_sizes(storage.join("run", "export")) == {"config.json": 2, "sub/w.bin": 3 << 20}
    assert sorted(s3.keys(bucket, "files/run/export/")) == ["files/run/export/config.json",
                                                            "files/run/export/sub/w.bin"]
    back = storage.download_dir(storage.join("run", "export"), tmp_path / "back")
    assert (back / "sub" / "w.bin").read_bytes() == (src / "sub" / "w.bin").read_bytes()
    assert [Path(p).name for p in storage.list_dirs(storage.join("run"))] == ["export"]
    storage.rmtree(storage.join("run"))
    assert s3.keys(bucket, "files/run/") == []


def fake_checkpoint(root: Path, name: str, step: int) -> Path:
    folder = root / name
    (folder / "deepspeed").mkdir(parents=True)
    (folder / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 1000 + bytes([step]))
    (folder / ck.STATE_FILE).write_text(json.dumps({"step": step}))
    ck.write_manifest(folder, ck.file_digests(folder), step, 2)
    return folder


def test_checkpoints_in_the_bucket_are_chosen_by_manifest_and_a_torn_one_is_skipped(s3, bucket, tmp_path):
    storage = st.Storage.open(f"s3://{bucket}/ckpt")
    run = storage.join("run")
    for step in (10, 20, 30):
        storage.upload_dir(fake_checkpoint(tmp_path, f"checkpoint_{step:08d}_x", step), f"{run}/checkpoint_{step:08d}_x")
    # step 30's shard torn in the bucket (same name, half the bytes); an unfinished save without a manifest
    s3.client().put_object(Bucket=bucket, Key="ckpt/run/checkpoint_00000030_x/deepspeed/mp_rank_00_model_states.pt",
                           Body=b"x" * 500)
    s3.client().put_object(Bucket=bucket, Key="ckpt/run/checkpoint_00000040_x/efftx_state.json", Body=b"{}")
    lines: list[str] = []
    found = ck.scan(run, storage=storage)
    assert [(f.path.name, f.step) for f in found] == [("checkpoint_00000030_x", 30), ("checkpoint_00000020_x", 20),
                                                      ("checkpoint_00000010_x", 10), ("checkpoint_00000040_x", -1)]
    best = ck.choose(found, lines.append, storage, tmp_path / "work")
    assert best.step == 20 and (best.local / ck.STATE_FILE).is_file()  # the verified local copy DeepSpeed loads
    assert any("checkpoint_00000030_x (step 30) is not intact: deepspeed/mp_rank_00_model_states.pt is 500 bytes"
               in line for line in lines), lines
    removed = ck.prune(found, keep=1, tracked={found[2].path}, pinned=best.path, log=lines.append, storage=storage)
    assert sorted(p.name for p in removed) == ["checkpoint_00000030_x", "checkpoint_00000040_x"]
    assert sorted({k.split("/")[2] for k in s3.keys(bucket, "ckpt/run/")}) == ["checkpoint_00000010_x",
                                                                             "checkpoint_00000020_x"]


def test_an_s3_export_loads_and_generates_from_a_cache_that_follows_the_remote_files(s3, bucket, tmp_path,
                                                                                      one_thread):
    from efftx.export import CONFIG_FILE, export, load_export, read_export_config
    from efftx.generate import sample_text
    from efftx.models import build as build_model

    cfg = recipes.get("lm_debug")
    torch.manual_seed(0)
    local = export(build_model(cfg), cfg, tmp_path / "export", {"step": 7})
    storage = st.Storage.open(f"s3://{bucket}/exports")
    storage.upload_dir(local, storage.join("m1"), last=(CONFIG_FILE,))
    uri = f"s3://{bucket}/exports/m1"
    model, got_cfg, meta = load_export(uri)
    assert meta == {"step": 7} and got_cfg.model.dim == cfg.model.dim
    want = sample_text(str(local), "ab", 8, temperature=0.9, seed=3)
    assert sample_text(uri, "ab", 8, temperature=0.9, seed=3) == want and len(want) > 0
    # re-exported at the same URI: the next load sees the new files, not the stale cache
    export(build_model(cfg), cfg, local, {"step": 8})
    storage.upload_dir(local, storage.join("m1"), last=(CONFIG_FILE,))
    s3.client().put_object(Bucket=bucket, Key="exports/m1/notes.txt", Body=b"new")
    assert read_export_config(uri)[1] == {"step": 8}
    with pytest.raises(ExportError, match=f"s3://{bucket}/exports/none is empty or does not exist"):
        load_export(f"s3://{bucket}/exports/none")


# ------------------------------------------------------------------ a real run in the bucket

@pytest.mark.slow
def test_a_run_on_s3_writes_there_resumes_from_there_and_generates_from_there(ray_cluster, s3, bucket):
    env = {**os.environ, **s3.env(), "RAY_ADDRESS": ray_cluster}
    storage_path = f"s3://{bucket}/runs"
    cmd = [sys.executable, "jobs/train_lm.py", "--recipe", "lm_debug", "--run-name", "on-s3", "--workers", "2",
           "--set", f"scaling.storage_path={storage_path}", "--set", "train.steps=20",
           "--set", "train.checkpoint_every=10", "--set", "train.eval_every=10",
           "--set", "train.fail_at_step=15", "--set", "train.max_failures=0"]
    first = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 2 and "injected failure at step 15" in first.stderr, (first.stdout + first.stderr)[-4000:]
    keys = s3.keys(bucket, "runs/on-s3/")
    assert "runs/on-s3/efftx_run.json" in keys
    saved = sorted({k.split("/")[2] for k in keys if k.split("/")[2].startswith("checkpoint_")
                    and k.endswith(ck.MANIFEST_FILE)})
    assert [name[:len("checkpoint_00000010")] for name in saved] == ["checkpoint_00000010"]

    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # same command
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert f"resuming from checkpoint {storage_path}/on-s3/{saved[0]} (step 10" in second.stdout
    assert "resumed at step 10/20" in second.stdout
    assert f"checkpoint saved at step 20: {storage_path}/on-s3/checkpoint_00000020_" in second.stdout
    summary = json.loads(second.stdout.strip().splitlines()[-1])
    assert summary["final_step"] == 20
    assert summary["export_path"] == f"{storage_path}/on-s3/export"
    assert summary["checkpoint"].startswith(f"{storage_path}/on-s3/checkpoint_00000020_")
    record = json.loads(s3.client().get_object(Bucket=bucket, Key="runs/on-s3/efftx_run.json")["Body"].read())
    assert record["mlflow_run_id"] == summary["mlflow_run_id"]  # the resumed run read its record from the bucket

    keys = s3.keys(bucket, "runs/on-s3/")
    assert {"runs/on-s3/export/model.safetensors", "runs/on-s3/export/config.json"} <= set(keys)
    checkpoints = {k.split("/")[2] for k in keys if k.split("/")[2].startswith("checkpoint_") and k.count("/") > 2}
    assert len(checkpoints) == 2 and all(f"runs/on-s3/{c}/{ck.MANIFEST_FILE}" in keys for c in checkpoints)
    assert any(k.endswith("/deepspeed/mp_rank_00_model_states.pt") for k in keys)
    assert not Path(os.environ["EFFTX_HOME"], "runs", "on-s3").exists()  # nothing in the local runs folder

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"], registry_uri=summary["tracking_uri"])
    losses: dict[int, int] = {}
    for m in client.get_metric_history(summary["mlflow_run_id"], "loss"):
        losses[m.step] = losses.get(m.step, 0) + 1
    # steps 11-14 ran twice (before the failure at 15 and after the resume), the others once: it resumed at 10
    assert losses == {s: 2 if 11 <= s <= 14 else 1 for s in range(1, 21)}
    assert summary["registered_model"].startswith("models:/lm_debug/")  # registered from the local export copy

    gen = [sys.executable, "-m", "efftx.generate", "--model", summary["export_path"], "--prompt", "def ",
           "--max-new-tokens", "16", "--seed", "1"]
    out = subprocess.run(gen, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.startswith("def ") and len(out.stdout) > len("def \n"), out.stderr
    from efftx.export import resolve_export
    from efftx.generate import sample_text

    registered = resolve_export(summary["registered_model"], summary["tracking_uri"])
    assert out.stdout == "def " + sample_text(str(registered), "def ", 16, temperature=0.8, seed=1) + "\n"

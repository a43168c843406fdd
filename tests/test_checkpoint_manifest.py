"""Checkpoint manifests, the choice of the checkpoint to resume from, orphan pruning, atomic exports and
idempotent model registration: the parts that need no Ray cluster."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from efftx import recipes
from efftx import export as ex
from efftx.train import checkpoint as ck


def fake_checkpoint(run: Path, name: str, step: int, shard: bytes = b"x" * 1000, manifest: bool = True) -> Path:
    folder = run / name
    (folder / "deepspeed").mkdir(parents=True)
    (folder / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(shard + bytes([step % 256]))
    (folder / "latest").write_text("deepspeed")
    (folder / ck.STATE_FILE).write_text(json.dumps({"step": step}))
    if manifest:
        ck.write_manifest(folder, ck.file_digests(folder), step, 2)
    return folder


def test_manifest_detects_torn_corrupt_missing_and_unfinished(tmp_path):
    folder = fake_checkpoint(tmp_path, "checkpoint_a", 20)
    manifest, problem = ck.verify(folder)
    assert problem == "" and manifest["step"] == 20 and manifest["world_size"] == 2
    assert set(manifest["files"]) == {"deepspeed/mp_rank_00_model_states.pt", "latest", ck.STATE_FILE}
    assert all(len(d["sha256"]) == 64 for d in manifest["files"].values())

    shard = folder / "deepspeed" / "mp_rank_00_model_states.pt"
    data = shard.read_bytes()
    shard.write_bytes(data[:500])
    assert ck.verify(folder) == (None, "deepspeed/mp_rank_00_model_states.pt is 500 bytes, its manifest says 1001 "
                                       "(torn or truncated)")
    shard.write_bytes(b"y" + data[1:])  # same size, other bytes
    assert ck.verify(folder)[1] == ("deepspeed/mp_rank_00_model_states.pt does not match its SHA-256 in the manifest "
                                    "(corrupt)")
    assert ck.verify(folder, hashes=False)[0] is not None  # the cheap check sees sizes only
    shard.unlink()
    assert ck.verify(folder)[1] == "deepspeed/mp_rank_00_model_states.pt is missing"
    unfinished = fake_checkpoint(tmp_path, "checkpoint_b", 30, manifest=False)
    assert ck.verify(unfinished)[1].startswith("it has no efftx_manifest.json")


def test_ranks_writing_one_file_differently_is_an_error():
    same = {"latest": {"size": 9, "sha256": "a" * 64}}
    assert ck.merge_digests([same, {**same, "b": {"size": 1, "sha256": "b" * 64}}]).keys() == {"latest", "b"}
    with pytest.raises(ck.EfftxError, match="latest was written differently"):
        ck.merge_digests([same, {"latest": {"size": 9, "sha256": "c" * 64}}])


def test_newest_intact_checkpoint_is_chosen_and_orphans_beyond_keep_are_pruned(tmp_path):
    run = tmp_path / "run"
    old = fake_checkpoint(run, "checkpoint_00000020_x", 20)
    ray_latest = fake_checkpoint(run, "checkpoint_00000040_x", 40)  # what Ray Train committed
    mid = fake_checkpoint(run, "checkpoint_00000060_x", 60)  # written, never polled by Ray
    newest = fake_checkpoint(run, "checkpoint_00000080_x", 80)  # written, then a shard was torn
    torn_shard = newest / "deepspeed" / "mp_rank_00_model_states.pt"
    torn_shard.write_bytes(torn_shard.read_bytes()[:10])
    unfinished = fake_checkpoint(run, "checkpoint_00000100_x", 100, manifest=False)  # killed mid-save
    (run / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray's, a file: never touched

    lines: list[str] = []
    found = ck.scan(run, extra=[ray_latest])
    assert [f.step for f in found] == [80, 60, 40, 20, -1]
    best = ck.choose(found, lines.append)
    assert best.path == mid.resolve() and best.step == 60
    assert any("checkpoint_00000080_x (step 80) is not intact: deepspeed/mp_rank_00_model_states.pt is 10 bytes"
               in line for line in lines), lines

    removed = ck.prune(found, keep=1, tracked={old, ray_latest}, pinned=best.path, log=lines.append)
    # the torn and the unfinished folders go; Ray's own (20, 40) stay for Ray to rotate; the resumed one stays
    assert sorted(p.name for p in removed) == ["checkpoint_00000080_x", "checkpoint_00000100_x"]
    assert {p.name for p in run.iterdir()} == {old.name, ray_latest.name, mid.name, "checkpoint_manager_snapshot.json"}
    assert not unfinished.exists()

    # an untracked intact folder older than the newest `keep` is an orphan too
    found = ck.scan(run)
    ck.prune(found, keep=1, tracked={ray_latest}, pinned=None, log=lines.append)
    assert {p.name for p in run.iterdir() if p.is_dir()} == {ray_latest.name, mid.name}
    assert any("removed orphaned checkpoint checkpoint_00000020_x (step 20" in line for line in lines), lines


def test_no_intact_checkpoint_means_none(tmp_path):
    lines: list[str] = []
    fake_checkpoint(tmp_path, "checkpoint_a", 10, manifest=False)
    assert ck.choose(ck.scan(tmp_path), lines.append) is None
    assert ck.choose(ck.scan(tmp_path / "missing"), lines.append) is None


def torn_writes(monkeypatch):
    """Every Path.write_text / write_bytes and open(..., "w"/"wb") of a .json or .tmp file writes half its data,
    then fails (a full disk, a kill)."""
    real_open = open

    class Torn:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(data[:len(data) // 2])
            self.f.flush()
            raise OSError(28, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def __getattr__(self, name):
            return getattr(self.f, name)

    def torn_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return Torn(f) if "w" in mode and str(file).endswith((".json", ".tmp")) else f

    def torn_text(self, data, *args, **kwargs):
        with torn_open(self, "w") as f:
            f.write(data)

    def torn_bytes(self, data):
        with torn_open(self, "wb") as f:
            f.write(data)

    monkeypatch.setattr("builtins.open", torn_open)
    monkeypatch.setattr(Path, "write_text", torn_text)
    monkeypatch.setattr(Path, "write_bytes", torn_bytes)


def test_export_config_json_is_replaced_atomically(tmp_path, monkeypatch, one_thread):
    import torch

    from efftx.models import build as build_model

    cfg = recipes.get("lm_debug")
    torch.manual_seed(0)
    out = ex.export(build_model(cfg), cfg, tmp_path / "export", {"step": 10}, files={"notes.json": "{}"})
    before = (out / ex.CONFIG_FILE).read_text()
    with monkeypatch.context() as m:
        torn_writes(m)
        with pytest.raises(OSError, match="No space left"):
            ex.export(build_model(cfg), cfg, out, {"step": 20}, files={"notes.json": '{"a": 1}'})
    # the old export is whole: config.json (and the task's files) were never torn in place
    assert (out / ex.CONFIG_FILE).read_text() == before
    assert ex.read_export_config(out)[1] == {"step": 10}
    assert (out / "notes.json").read_text() == "{}"
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    ex.load_export(out)


def test_registering_a_resumed_runs_export_again_makes_no_second_version(tmp_path):
    from efftx.tracking import Tracker, client_for

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = recipes.get("lm_debug").override({"name": "once", "tracking.uri": uri})
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    tracker = Tracker(cfg)
    tracker.log_artifacts(str(export), "export")
    first = tracker.register("export")
    resumed = Tracker(cfg, run_id=tracker.run_id)  # the same run, continued after a resume
    resumed.log_artifacts(str(export), "export")
    assert resumed.register("export") == first
    client = client_for(uri)
    assert [str(v.version) for v in client.search_model_versions("name='lm_debug'")] == ["1"]
    other = Tracker(cfg)  # another run of the recipe: a new version
    other.log_artifacts(str(export), "export")
    assert other.register("export") == "models:/lm_debug/2"
    assert os.path.exists(tmp_path / "mlflow.db")


def test_a_trial_rerun_after_its_driver_died_continues_its_child_run(tmp_path):
    """A sweep's trial whose first attempt created its MLflow child run and died before its run folder recorded
    it (the sweep's driver killed as the trial started): the rerun continues that run, RUNNING again, its
    parameters not logged twice; another trial of the sweep, and a run without a parent, get runs of their own."""
    from efftx.tracking import Tracker, client_for

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = recipes.get("lm_debug").override({"name": "sweep", "tracking.uri": uri})
    parent = Tracker(base)
    trial = base.override({"name": "sweep-t1"})
    first = Tracker(trial, extra_params={"data.sha256": "abc"}, parent_run_id=parent.run_id)
    first.log_metrics({"loss": 2.0}, 1)
    client = client_for(uri)
    client.set_terminated(first.run_id, status="KILLED")
    again = Tracker(trial, extra_params={"data.sha256": "abc"}, parent_run_id=parent.run_id)
    assert again.run_id == first.run_id
    run = client.get_run(first.run_id)
    assert run.info.status == "RUNNING" and run.data.params["data.sha256"] == "abc"
    assert [m.value for m in client.get_metric_history(first.run_id, "loss")] == [2.0]
    other = Tracker(base.override({"name": "sweep-t2"}), parent_run_id=parent.run_id)
    alone = Tracker(trial)  # no parent: a run of its own
    assert len({first.run_id, other.run_id, alone.run_id, parent.run_id}) == 4
    exp = run.info.experiment_id
    children = client.search_runs([exp], f"tags.mlflow.parentRunId = '{parent.run_id}'")
    assert sorted(c.info.run_name for c in children) == ["sweep-t1", "sweep-t2"]


def test_collectives_reduce_on_the_process_groups_device(monkeypatch):
    """On GPUs Ray Train's process group is nccl, which reduces CUDA tensors only: the loop's metric means
    (efftx.train.loop.all_mean, every log step and evaluation) reduce on the group's device (nccl: the worker's
    current CUDA device), as the checkpoint collectives do. Here the group is faked: two ranks, the same values."""
    import torch
    import torch.distributed as dist

    from efftx.train import checkpoint, loop

    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert checkpoint._dist_device() == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "gloo")
    assert checkpoint._dist_device() == torch.device("cpu")

    asked, reduced = [], []

    def device():
        asked.append(True)
        return torch.device("cpu")  # the only device here; asking is what is checked

    def all_reduce(t):
        reduced.append(t.device)
        t.mul_(2)  # two ranks with the same values

    monkeypatch.setattr(checkpoint, "_dist_device", device)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    assert loop.all_mean([1.0, 3.0], weight=2.0) == [1.0, 3.0] and asked and reduced == [torch.device("cpu")]


def _in_step_worker(rank: int, world: int, init: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from efftx.train.loop import in_step

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mine = [[f"r{rank}b{i}"] for i in range(3 - rank)]  # rank 0: 3 batches, rank 1: 2 (5 over 2 ranks)
        got = {"zero3": in_step(mine, 3, rank), "zero2": in_step(mine, 2, rank)}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


def test_under_zero3_every_rank_runs_as_many_validation_batches(tmp_path):
    """ZeRO-3's forward passes gather the partitioned parameters from every rank, so a rank with one validation batch
    more than another would wait for it for good: under ZeRO-3 every rank keeps as many as the rank with fewest
    (a real two-process gloo group); other stages keep all of theirs."""
    import json

    import torch.multiprocessing as mp

    from netutil import free_port

    init, out = f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "got")
    mp.start_processes(_in_step_worker, args=(2, init, out), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"got.{r}").read_text()) for r in range(2)]
    assert [len(g["zero3"]) for g in got] == [2, 2] and got[0]["zero3"] == [["r0b0"], ["r0b1"]]
    assert [len(g["zero2"]) for g in got] == [3, 2]


def test_half_precision_weights_without_a_linked_master_are_exported_as_held_and_the_log_says_so():
    """``export_state`` where DeepSpeed links no fp32 master to the parameters (its fp16 optimizer without ZeRO; here
    a plain bf16 module): trained half-precision weights go as the module holds them, the log counts them; frozen
    ones and buffers are not counted; ``keep=False`` (the ranks that do not write) returns nothing. The linked case
    (masters exported) runs through DeepSpeed in tests/test_train_ray.py and tests/test_resume_exact.py."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    model[1].requires_grad_(False)  # frozen: no master expected
    model.register_buffer("steps", torch.tensor(7))
    engine = type("Engine", (), {"module": model})()
    said = []
    state = ck.export_state(engine, log=said.append)
    assert list(state) == list(model.state_dict()) and all(torch.equal(state[k], v) for k, v in
                                                           model.state_dict().items())
    assert len(said) == 1 and said[0].startswith("export: 2 trained half-precision parameters have no fp32 master")
    said.clear()
    assert ck.export_state(engine, keep=False, log=said.append) == {} and said == []
    assert ck.export_state(type("Engine", (), {"module": model.float()})(), log=said.append) and said == []

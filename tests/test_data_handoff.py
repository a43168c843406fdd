"""Text corpora reach the workers without a driver-only path (data.handoff, efftx/data/bytes.py): through Ray's
object store a worker trains on the corpus after the driver's cache file is gone; given only the path, a worker
that cannot see it stops with an error naming the path and the key."""

from __future__ import annotations

import gzip
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from efftx import recipes
from efftx.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def gz_corpus(tmp_path) -> Path:
    """~300 KB of Python source, gzipped: prepare decompresses it into data.cache_dir (the driver's cache)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = b"".join((stdlib / name).read_bytes() for name in ("argparse.py", "dataclasses.py", "inspect.py"))
    path = tmp_path / "corpus.txt.gz"
    path.write_bytes(gzip.compress(text))
    return path


def _resolved(tmp_path, corpus: Path, **overrides):
    from efftx.train.launch import resolve

    return resolve(recipes.get("lm_debug").override({"name": "handoff", "data.corpus": str(corpus),
                                                     "data.cache_dir": str(tmp_path / "driver-cache"), **overrides}))


def _check_handoff(tmp_path, cfg) -> None:
    import ray

    from efftx.train.tasks import LMTask

    def _worker_view(cfg_dict: dict, prepared: dict):
        """What a worker's LM task draws: a training batch and the validation windows (a Ray task: defined here,
        so Ray ships it by value)."""
        import torch

        from efftx.config import Config
        from efftx.train.tasks import LMTask

        task = LMTask(Config.from_dict(cfg_dict), prepared)
        return task.train_batch(3, 1, 1), torch.cat(task.eval_batches(0, 1)), task.codec.to_json()

    prepared = LMTask.prepare(cfg)
    expected = _worker_view(cfg.to_dict(), prepared)  # the driver, reading its cache file
    shared = LMTask.share(cfg, prepared)
    assert shared["shared"] is not None and "shared" not in prepared
    by_path = LMTask.share(cfg.copy().override({"data.handoff": "path"}), prepared)
    assert "shared" not in by_path
    cached = [p for p in (tmp_path / "driver-cache").rglob("*") if p.is_file()]
    assert cached
    for p in cached:  # the driver's cache is gone: a worker on another node never had it
        p.unlink()
    remote = ray.remote(num_cpus=0.1)(_worker_view)
    got = ray.get(remote.remote(cfg.to_dict(), shared))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]
    with pytest.raises(Exception) as err:  # only the path: a clear error naming it and the key
        ray.get(remote.remote(cfg.to_dict(), by_path))
    assert "does not exist on this node" in str(err.value) and "data.handoff=object_store" in str(err.value)


@pytest.mark.slow
def test_byte_corpus_reaches_a_worker_through_the_object_store(ray_cluster, tmp_path, gz_corpus):
    _check_handoff(tmp_path, _resolved(tmp_path, gz_corpus, **{"data.handoff": "object_store"}))


@pytest.mark.slow
def test_tokenized_corpus_reaches_a_worker_through_the_object_store(ray_cluster, tmp_path, gz_corpus):
    tok = tmp_path / "bpe.json"
    text = tmp_path / "plain.txt"
    text.write_bytes(gzip.decompress(gz_corpus.read_bytes()))
    proc = subprocess.run([sys.executable, "-m", "efftx.data.train_tokenizer", str(text), "--vocab", "320",
                           "--out", str(tok)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    _check_handoff(tmp_path, _resolved(tmp_path, gz_corpus, **{"data.handoff": "object_store",
                                                                 "data.tokenizer": str(tok)}))


@pytest.mark.slow
def test_auto_keeps_the_path_on_one_node_and_a_run_trains_from_the_object_store(ray_cluster, tmp_path, gz_corpus):
    from efftx.train.launch import launch
    from efftx.train.tasks import LMTask

    cfg = _resolved(tmp_path, gz_corpus)
    assert cfg.data.handoff == "auto"
    prepared = LMTask.prepare(cfg)
    assert LMTask.share(cfg, prepared) is prepared  # one node: the workers open the path, no extra copy
    summary = launch(recipes.get("lm_debug").override({
        "name": "handoff-run", "data.corpus": str(gz_corpus), "data.cache_dir": str(tmp_path / "run-cache"),
        "data.handoff": "object_store", "train.steps": 6, "train.eval_every": 6, "train.checkpoint_every": 100}))
    assert summary["final_step"] == 6 and summary["val_bpb"] > 0


def test_handoff_key_is_validated():
    with pytest.raises(ConfigError, match=r"data\.handoff"):
        recipes.get("lm_debug").override({"name": "t", "data.handoff": "nfs"}).validate()
    from efftx.data.bytes import visible

    with pytest.raises(DataError, match=r"/nowhere/corpus\.bin does not exist on this node.*data\.handoff"):
        visible("/nowhere/corpus.bin", 10)

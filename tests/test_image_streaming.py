"""Streaming image data (efftx.data.streaming): per-rank shards, shuffle buffer, determinism, exact resume,
bad samples, the fixed validation head, the task's choice of mode, and memory that does not grow with the
data (slow: measured in fresh processes, and in real dVAE training runs)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from efftx.config import Config, DataConfig
from efftx.data.streaming import ShuffleBuffer, StreamingImageData, is_validation, use_streaming
from efftx.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]


def noise_png(rng: np.random.Generator, side: int) -> bytes:
    """An RGB PNG of random pixels: it does not compress, so its encoded size is known (~3 bytes a pixel)."""
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def write_wds(root: Path, n: int, per_shard: int, side: int = 16, seed: int = 0, bad: dict | None = None) -> Path:
    """``n`` samples (keys ``s000000`` ...; png + txt) in shards of ``per_shard``; ``bad``: key -> what is wrong."""
    import webdataset as wds

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    bad = bad or {}
    for s in range(0, n, per_shard):
        with wds.TarWriter(str(root / f"part-{s // per_shard:05d}.tar"), encoder=False) as writer:
            for i in range(s, min(n, s + per_shard)):
                key = f"s{i:06d}"
                sample = {"__key__": key, "png": noise_png(rng, side), "txt": f"sample {i}\nline two {i}".encode()}
                if bad.get(key) == "no_caption":
                    del sample["txt"]
                elif bad.get(key) == "corrupt":
                    sample["png"] = sample["png"][:30]
                elif bad.get(key) == "latin1":
                    sample["txt"] = "caf\xe9".encode("latin-1")
                writer.write(sample)
    return root


def data_cfg(source: Path, tmp_path: Path, **image) -> DataConfig:
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    cfg.image.source = str(source)
    cfg.image.streaming = "true"
    for key, value in image.items():
        setattr(cfg.image, key, value)
    return cfg


def stream_data(cfg: DataConfig, text_seq_len: int = 32, seed: int = 5, grad_accum: int = 2) -> StreamingImageData:
    return StreamingImageData(cfg, image_size=8, channels=3, text_seq_len=text_seq_len, seed=seed,
                              grad_accum=grad_accum)


def keys(raws) -> list[str]:
    return [r.key for r in raws]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """300 samples in 8 shards (the last one short)."""
    return write_wds(tmp_path_factory.mktemp("wds"), 300, 40)


# ------------------------------------------------------------------------------------------ sharding and order

def test_each_rank_reads_its_own_shards_and_every_training_sample_once_per_epoch(shards, tmp_path):
    cfg = data_cfg(shards, tmp_path, shuffle_buffer=16, val_fraction=0.1)
    data = stream_data(cfg)
    all_keys = {f"s{i:06d}" for i in range(300)}
    val = {k for k in all_keys if is_validation(k, 0.1)}
    assert 15 < len(val) < 50
    epochs = {}
    for rank in (0, 1):
        stream = data.stream(rank, 2)
        assert [str(s) for s in stream.mine] == [str(s) for s in data.shards[rank::2]]  # shard i -> rank i % 2
        it = stream.iterate(0)
        n = stream.count()
        first, second = [next(it).key for _ in range(n)], [next(it).key for _ in range(n)]
        assert len(set(first)) == n and set(first) == set(second) and first != second  # reshuffled per epoch
        epochs[rank] = set(first)
        shard_ids = {int(k[1:]) // 40 for k in first}
        assert shard_ids == {i for i in range(8) if i % 2 == rank}
    assert not epochs[0] & epochs[1] and epochs[0] | epochs[1] == all_keys - val  # no validation sample trains


def test_order_is_a_function_of_the_seed_and_the_buffer_shuffles(shards, tmp_path):
    cfg = data_cfg(shards, tmp_path, shuffle_buffer=32)
    a = keys(stream_data(cfg).raw_batch(0, 0, 64, 0, 2))
    assert a == keys(stream_data(cfg).raw_batch(0, 0, 64, 0, 2))  # same seed, same order
    assert a != keys(stream_data(cfg, seed=6).raw_batch(0, 0, 64, 0, 2))
    # the buffer mixes the interleaved shards: samples of several shards early on, not in key order
    assert len({int(k[1:]) // 40 for k in a[:16]}) >= 3 and a != sorted(a)
    unshuffled = keys(stream_data(data_cfg(shards, tmp_path, shuffle_buffer=1, interleave=1)).raw_batch(0, 0, 30, 0, 2))
    assert unshuffled == sorted(unshuffled) and len({int(k[1:]) // 40 for k in unshuffled}) == 1


def test_shuffle_buffer_never_holds_more_than_its_size_and_loses_nothing():
    import random

    buf, out = ShuffleBuffer(10, random.Random(0)), []
    for i in range(1000):
        item = buf.push(i)
        assert len(buf) <= 10
        if item is not None:
            out.append(item)
    while len(buf):
        out.append(buf.pop())
    assert sorted(out) == list(range(1000)) and out != list(range(1000))


@pytest.mark.parametrize("resume_step", [1, 6, 13, 21, 34])
def test_a_resumed_stream_draws_exactly_the_batches_of_an_uninterrupted_one(shards, tmp_path, resume_step):
    """Batches k.. of a fresh run == batches after a resume at k (a new object positioned at step k): within
    epoch 0, while the buffer drains at an epoch's end, and in later epochs."""
    cfg = data_cfg(shards, tmp_path, shuffle_buffer=16)
    full = stream_data(cfg)
    steps = range(40)  # 40 steps x 2 micro x 5 = 400 samples: rank 1 has ~134 a epoch, so three epochs
    uninterrupted = [keys(full.raw_batch(s, m, 5, 1, 2)) for s in steps for m in range(2)]
    resumed = stream_data(cfg)
    after = [keys(resumed.raw_batch(s, m, 5, 1, 2)) for s in steps[resume_step:] for m in range(2)]
    assert after == uninterrupted[2 * resume_step:]
    # the tensors too (crops and caption lines come from (seed, rank, step, micro))
    x, y = full.batch(resume_step, 1, 5, 1, 2), stream_data(cfg).batch(resume_step, 1, 5, 1, 2)
    assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_folder_streams_as_virtual_shards_with_captions_beside_the_images(tmp_path):
    root = tmp_path / "folder"
    rng = np.random.default_rng(1)
    for i in range(50):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"im{i:03d}.png").write_bytes(noise_png(rng, 12))
        if i != 7:
            (sub / f"im{i:03d}.txt").write_text(f"picture {i}")
    (root / ".hidden.png").write_bytes(noise_png(rng, 12))
    cfg = data_cfg(root, tmp_path, folder_shard_size=10, shuffle_buffer=8, val_fraction=0.1, format="folder")
    data = stream_data(cfg, grad_accum=1)
    assert len(data.shards) == 5
    seen = set()
    for rank in range(3):
        stream = data.stream(rank, 3)
        it = stream.iterate(0)
        seen |= {next(it).key for _ in range(stream.count())}
    expected = {f"d{i % 3}/im{i:03d}" for i in range(50) if i != 7} - {k for k in seen if is_validation(k, 0.1)}
    assert seen == {k for k in expected if not is_validation(k, 0.1)}
    images, text = data.batch(0, 0, 4, 0, 3)
    assert images.shape == (4, 3, 8, 8) and text.shape == (4, 32)


# ------------------------------------------------------------------------------------------ bad data

def test_bad_samples_are_skipped_or_replaced_within_their_batch_and_counted(tmp_path):
    bad = {"s000003": "no_caption", "s000010": "corrupt", "s000011": "latin1"}
    root = write_wds(tmp_path / "bad", 60, 20, bad=bad)
    (root / "part-00009.tar").write_bytes(b"this is not a tar file")
    data = stream_data(data_cfg(root, tmp_path, shuffle_buffer=4, val_fraction=0.0, interleave=1), grad_accum=1)
    stream = data.stream(0, 1)
    n = stream.count()
    assert n == 59  # the sample without a caption never enters the stream
    assert stream.stats.skipped["missing_caption"] >= 1 and stream.stats.skipped["unreadable_tar"] >= 1
    for step in range(0, 59 // 5):
        images, text = data.batch(step, 0, 5, 0, 1)  # every batch is whole: bad slots take another sample's
        assert images.shape == (5, 3, 8, 8) and (text[:, 0] != 0).all()
    assert data.stats.skipped["unreadable_image"] == 1 and data.stats.skipped["undecodable_caption"] == 1
    too_long = stream_data(data_cfg(root, tmp_path, val_fraction=0.0), text_seq_len=4)
    with pytest.raises(DataError, match=r"part-0000\d\.tar:s0000\d\d\.txt"):
        too_long.batch(0, 0, 5, 0, 1)


def test_too_few_shards_for_the_workers_and_unusable_keys_are_clear_errors(shards, tmp_path):
    data = stream_data(data_cfg(shards, tmp_path))
    with pytest.raises(DataError, match=r"8 shard\(s\), fewer than the 9 workers \(scaling.num_workers\)"):
        data.stream(0, 9)
    wrong_keys = stream_data(data_cfg(shards, tmp_path, wds_keys="jpg,txt"))
    with pytest.raises(DataError, match=r"no usable image\+caption held-out samples.*data.image.wds_keys='jpg,txt'"):
        wrong_keys.check(2, 8)


# ------------------------------------------------------------------------------------------ validation

def test_validation_is_a_fixed_head_of_held_out_samples_whatever_the_seed_and_world(shards, tmp_path):
    cfg = data_cfg(shards, tmp_path, val_fraction=0.1)
    a, b = stream_data(cfg, seed=1), stream_data(cfg, seed=2)
    head = keys(a.head(12))
    assert head == keys(b.head(12)) and head == sorted(head)  # source order, not shuffled, not seeded
    assert all(is_validation(k, 0.1) for k in head)
    whole = a.val_batches(4, 0, 1, limit=12)
    halves = a.val_batches(4, 0, 2, limit=12), a.val_batches(4, 1, 2, limit=12)
    assert sum(x[0].shape[0] for x in whole) == 12 and sum(x[0].shape[0] for h in halves for x in h) == 12
    assert torch.equal(halves[0][0][0][0], whole[0][0][0])  # rank 0 of 2 takes [0::2]: the first one
    sample, _ = a.val_batches(4, 0, 1, limit=4)[0]
    assert torch.equal(sample, whole[0][0])  # the sample images are the first validation samples
    assert torch.equal(sample, b.val_batches(4, 0, 1, limit=4)[0][0])  # no randomness in validation


# ------------------------------------------------------------------------------------------ the task's choice

def test_streaming_is_chosen_by_the_config_and_the_task_trains_from_the_stream(shards, tmp_path, capsys):
    from efftx import recipes
    from efftx.train.launch import resolve
    from efftx.train.tasks import DVAETask

    cfg = DataConfig(cache_dir=str(tmp_path / "c"))
    cfg.image.source = str(shards)
    assert not use_streaming(cfg, str(shards), "wds")  # auto: ~300 KB is below data.image.stream_above_mb
    cfg.image.stream_above_mb = 0.1
    assert use_streaming(cfg, str(shards), "wds")
    assert use_streaming(cfg, "pipe:cat x.tar", "wds") and use_streaming(cfg, "https://host/a-{0..3}.tar", "wds")
    cfg.image.streaming = "false"
    assert not use_streaming(cfg, "https://host/a.tar", "wds")

    run = resolve(recipes.get("dvae_shapes_debug").override({
        "name": "stream", "data.image.source": str(shards), "data.image.streaming": "true",
        "vae.image_size": 16, "data.cache_dir": str(tmp_path / "cache")}))
    prepared = DVAETask.prepare(run)
    assert prepared["streaming"] is True and prepared["images"]["shards"] == 8
    assert "image data: streaming 8 shard(s)" in capsys.readouterr().out
    task = DVAETask(run, prepared)
    batch = task.train_batch(2, 1, 1)
    assert batch["images"].shape == (4, 3, 16, 16)
    resumed = DVAETask(run, prepared).train_batch(2, 1, 1)  # a fresh worker (a resumed run) draws the same batch
    assert torch.equal(batch["images"], resumed["images"])
    evals = task.eval_batches(0, 2) + task.eval_batches(1, 2)
    assert sum(b["images"].shape[0] for b in evals) == run.train.eval_batches * run.train.micro_batch_size
    in_memory = DVAETask.prepare(run.override({"data.image.streaming": "false"}))
    assert "streaming" not in in_memory and in_memory["train_images"] + in_memory["val_images"] == 300


def test_streaming_config_keys_are_validated():
    cfg = Config(name="t").override(["data.image.streaming=true", "data.image.shuffle_buffer=64"])
    cfg.validate()
    assert cfg.data.image.streaming == "true" and cfg.data.image.shuffle_buffer == 64
    for key, value in (("data.image.streaming", "yes"), ("data.image.shuffle_buffer", "0"),
                       ("data.image.interleave", "0"), ("data.image.folder_shard_size", "0"),
                       ("data.image.stream_above_mb", "-1")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            Config(name="t").override([f"{key}={value}"]).validate()


# ------------------------------------------------------------------------------------------ bounded memory (slow)

# Iterates one worker's whole stream (every training sample of the data set, decoded and cropped into batches,
# as training does) in a fresh process, sampling its RSS; prints the growth over the RSS before anything is read.
_MEASURE = textwrap.dedent("""
    import json, sys, threading, time, psutil
    from efftx.config import DataConfig
    from efftx.data.streaming import StreamingImageData

    source, buffer = sys.argv[1], int(sys.argv[2])
    cfg = DataConfig(cache_dir=sys.argv[3])
    cfg.image.source, cfg.image.streaming, cfg.image.shuffle_buffer = source, "true", buffer
    data = StreamingImageData(cfg, image_size=32, channels=3, text_seq_len=0, seed=0, grad_accum=1)
    stream = data.stream(0, 1)  # the shard list; nothing read yet
    proc = psutil.Process()
    base = peak = proc.memory_info().rss  # before any sample is read (the buffer fills during the first batch)
    done = False

    def sample():
        global peak
        while not done:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.005)

    t = threading.Thread(target=sample)
    t.start()
    n = stream.count()  # one pass over the tar headers
    for step in range(n // 8):
        data.batch(step, 0, 8)
        peak = max(peak, proc.memory_info().rss)
    done = True
    t.join()
    print(json.dumps({"samples": n, "base_mb": base / 2**20, "growth_mb": (peak - base) / 2**20}))
""")


def _measure(source: Path, buffer: int, tmp_path: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _MEASURE, str(source), str(buffer), str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sized(tmp_path_factory) -> dict[int, Path]:
    """Two WebDataset data sets of 64x64 noise PNGs (~12 KB each encoded): 2,000 and 8,000 samples."""
    root = tmp_path_factory.mktemp("sized")
    return {n: write_wds(root / f"n{n}", n, 250, side=64, seed=n) for n in (2000, 8000)}


def _encoded_mb(root: Path) -> float:
    return sum(p.stat().st_size for p in root.glob("*.tar")) / 2**20


@pytest.mark.slow
def test_memory_of_a_worker_stream_does_not_grow_with_the_data_set(sized, tmp_path):
    """The whole stream of 2k and of 8k samples, buffer 256: the peak RSS growth is the same within a margin far
    below what holding the extra 6k samples costs. Control: the same measurement with a buffer larger than the
    data (the buffer then holds every sample) grows by about that cost, so this test can fail."""
    hold_cost = _encoded_mb(sized[8000]) - _encoded_mb(sized[2000])  # encoded bytes of the 6,000 extra samples
    assert hold_cost > 60
    small, large = _measure(sized[2000], 256, tmp_path), _measure(sized[8000], 256, tmp_path)
    assert small["samples"] > 1800 and large["samples"] > 7200
    print(f"\nstreaming peak RSS growth: {small['growth_mb']:.1f} MB at 2k samples, {large['growth_mb']:.1f} MB at 8k "
          f"(base {small['base_mb']:.0f} / {large['base_mb']:.0f} MB); holding the extra 6k costs {hold_cost:.0f} MB")
    margin = hold_cost / 4
    assert large["growth_mb"] <= small["growth_mb"] + margin, (small, large, hold_cost)
    unbounded = _measure(sized[8000], 10**9, tmp_path)  # the wrong variant: everything ends up in the buffer
    print(f"unbounded buffer at 8k: {unbounded['growth_mb']:.1f} MB")
    assert unbounded["growth_mb"] > small["growth_mb"] + margin, (small, unbounded, hold_cost)


@pytest.mark.slow
def test_dvae_trains_from_a_stream_larger_than_its_buffer(ray_cluster, sized):
    """A real dVAE run (dvae_shapes_debug, 2 Ray Train workers, a few steps) streaming the 8k data set through a
    256-sample buffer: it trains, and its workers' peak RSS is printed (the bound itself is measured on the same
    iterator, at two sizes, by the test above; one run here keeps the suite short)."""
    from efftx import recipes
    from efftx.train.launch import launch

    cfg = recipes.get("dvae_shapes_debug").override({
        "name": "stream-8000", "data.image.source": str(sized[8000]), "data.image.streaming": "true",
        "data.image.shuffle_buffer": 256, "train.steps": 6, "train.eval_every": 6, "train.eval_batches": 2,
        "train.log_every": 3, "train.checkpoint_every": 100})
    summary = launch(cfg)
    assert summary["final_step"] == 6 and np.isfinite(summary["val_loss"])
    hold_cost = _encoded_mb(sized[8000]) / 2  # per worker: half the shards each
    print(f"\ndVAE worker peak RSS, streaming 8k samples: {summary['peak_memory_mb']:.0f} MB (an in-memory worker "
          f"would also hold its {hold_cost:.0f} MB of encoded samples)")

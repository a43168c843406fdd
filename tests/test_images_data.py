"""Image + caption data (efftx.data.images), synthetic shapes (efftx.data.shapes), caption tokens."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from efftx.config import Config, DataConfig
from efftx.data import shapes
from efftx.data.images import ImageTextData, random_resized_crop, to_tensor
from efftx.data.text_tokens import (PAD_ID, ByteTokenizer, HFTokenizer, decode_tokens, load_tokenizer,
                                    padding_mask, tokenize, tokenize_batch)
from efftx.errors import ConfigError, DataError

LEN = shapes.MAX_CAPTION_BYTES  # text_seq_len of these tests: every shapes caption fits


def _png(colour=(200, 30, 30), size=(20, 12), fmt="PNG", mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, format=fmt)
    return buf.getvalue()


def _data_cfg(tmp_path: Path, source: str = "shapes", **image) -> DataConfig:
    cfg = DataConfig(cache_dir=str(tmp_path / "cache"))
    cfg.image.source = source
    for key, value in image.items():
        setattr(cfg.image, key, value)
    return cfg


def _data(cfg: DataConfig, text_seq_len: int = LEN, **kw) -> ImageTextData:
    return ImageTextData(cfg, image_size=kw.pop("image_size", 16), channels=kw.pop("channels", 3),
                         text_seq_len=text_seq_len, **kw).load()


def _write_shard(path: Path, samples: list[dict]) -> None:
    import webdataset as wds

    with wds.TarWriter(str(path), encoder=False) as writer:
        for s in samples:
            writer.write(s)


# ------------------------------------------------------------------------------------------ folders

@pytest.fixture
def messy_folder(tmp_path) -> Path:
    """5 usable samples in mixed extensions/case/places, and one of each kind of bad sample."""
    root = tmp_path / "imgs"
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "captions").mkdir()
    (root / "sub" / "a.PNG").write_bytes(_png((255, 0, 0)))
    (root / "sub" / "a.txt").write_text("a red box\n\nthe colour red\n  red  \n")  # 3 lines (blank dropped)
    (root / "b.JpG").write_bytes(_png((0, 255, 0), fmt="JPEG"))
    (root / "captions" / "b.txt").write_text("green, caption elsewhere")  # matched by stem anywhere
    (root / "sub" / "deeper" / "c.webp").write_bytes(_png((0, 0, 255), fmt="WEBP"))
    (root / "sub" / "deeper" / "c.TXT").write_text("blue")
    (root / "d.bmp").write_bytes(_png((9, 9, 9), fmt="BMP"))
    (root / "d.txt").write_text("dark")
    (root / "e.jpeg").write_bytes(_png((0, 200, 200), mode="RGB", fmt="JPEG"))
    (root / "e.txt").write_text("cyan")
    # bad ones
    (root / "corrupt.png").write_bytes(_png()[:40])  # truncated PNG
    (root / "corrupt.txt").write_text("never used")
    (root / "nocap.png").write_bytes(_png())
    (root / "orphan.txt").write_text("a caption with no image")
    (root / "latin1.png").write_bytes(_png())
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (root / "blank.png").write_bytes(_png())
    (root / "blank.txt").write_text("\n  \n")
    (root / ".hidden.png").write_bytes(_png())
    return root


def test_folder_reader_counts_and_skips(tmp_path, messy_folder):
    data = _data(_data_cfg(tmp_path, str(messy_folder)))
    st = data.stats
    assert data.format == "folder"
    assert sorted(Path(s.name).name for s in data.samples) == ["a.PNG", "b.JpG", "c.webp", "d.bmp", "e.jpeg"]
    assert dict(st.skipped) == {"unreadable_image": 1, "missing_caption": 1, "missing_image": 1,
                                "undecodable_caption": 1, "empty_caption": 1}
    assert st.used == 5 and st.found == 10
    assert st.examples["unreadable_image"].endswith("corrupt.png")
    assert st.examples["missing_caption"].endswith("nocap.png")
    assert st.examples["missing_image"].endswith("orphan.txt")
    assert "5 of 10 samples usable" in st.summary() and "1 unreadable_image (e.g." in st.summary()
    a = next(s for s in data.samples if s.name.endswith("a.PNG"))
    assert a.texts == ("a red box", "the colour red", "red")


def test_a_run_reports_its_image_data_once_and_warns_when_it_is_tiny(tmp_path, messy_folder, capsys, caplog):
    """The driver prints the scan's summary once (the workers' loads print nothing), and warns that 7 training
    images are too few for a run, naming the key to change; a run on enough images gets no warning."""
    from efftx import recipes
    from efftx.train.launch import resolve
    from efftx.train.tasks import DVAETask

    cfg = resolve(recipes.get("dvae_shapes_debug").override({
        "name": "tiny", "data.image.source": str(messy_folder), "data.cache_dir": str(tmp_path / "cache")}))
    with caplog.at_level(logging.DEBUG, logger="efftx.data.images"):
        prepared = DVAETask.prepare(cfg)
        out = capsys.readouterr().out
        DVAETask(cfg, prepared).train_batch(0, 0, 0)  # a worker's first batch loads the data again
    assert out.count("image data: 8 of 9 samples usable") == 1 and prepared["train_images"] == 7  # no captions
    assert "warning: the training data is tiny for this run: 7 training images" in out
    assert "give more data (data.image.source)" in out
    assert capsys.readouterr().out == ""  # the worker's load printed nothing
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    enough = resolve(recipes.get("dvae_shapes_debug").override({"name": "enough",
                                                               "data.cache_dir": str(tmp_path / "cache")}))
    DVAETask.prepare(enough)
    assert "warning" not in capsys.readouterr().out


def test_folder_caption_lines_picked_at_random_reproducibly(tmp_path, messy_folder):
    cfg = _data_cfg(tmp_path, str(messy_folder), val_fraction=0.0)
    data, again = _data(cfg), _data(cfg)
    a = next(i for i, s in enumerate(data.samples) if s.name.endswith("a.PNG"))
    seen = set()
    for step in range(40):
        ids = data.indices(step, 0, 5)
        images, text = data.batch(step, 0, 5)
        images2, text2 = again.batch(step, 0, 5)  # a fresh instance computes the same batch
        assert torch.equal(images, images2) and torch.equal(text, text2)
        for row, i in zip(text, ids):
            if i == a:
                seen.add(decode_tokens(data.tokenizer, row))
    assert seen == {"a red box", "the colour red", "red"}


def test_ambiguous_caption_and_image_only_mode(tmp_path):
    root = tmp_path / "amb"
    (root / "x").mkdir(parents=True)
    (root / "y").mkdir()
    (root / "p.png").write_bytes(_png())
    (root / "x" / "p.txt").write_text("one")
    (root / "y" / "p.txt").write_text("two")
    (root / "q.png").write_bytes(_png())  # no caption at all
    cfg = _data_cfg(tmp_path, str(root))
    with pytest.raises(DataError, match="no usable image\\+caption samples.*ambiguous_caption.*missing_caption"):
        _data(cfg)
    # text_seq_len=0 (the dVAE): captions are not read, every decodable image is used
    data = _data(cfg, text_seq_len=0)
    images, text = data.batch(0, 0, 2)
    assert len(data) == 2 and images.shape == (2, 3, 16, 16) and text.shape == (2, 0)
    with pytest.raises(DataError, match="no text vocabulary"):
        data.vocab_size


def test_folder_with_nothing_usable_is_an_error(tmp_path):
    root = tmp_path / "bad"
    root.mkdir()
    (root / "x.png").write_bytes(b"not a png")
    (root / "x.txt").write_text("hello")
    with pytest.raises(DataError, match="0 of 1 samples usable.*unreadable_image"):
        _data(_data_cfg(tmp_path, str(root)))
    with pytest.raises(DataError, match="not found"):
        _data(_data_cfg(tmp_path, str(tmp_path / "nowhere")))


# ------------------------------------------------------------------------------------------ WebDataset

@pytest.fixture
def shards(tmp_path) -> Path:
    """shard 0: 3 good + one missing its caption; shard 1: 2 good + a corrupt image + a non-UTF-8 caption."""
    folder = tmp_path / "shards"
    folder.mkdir()
    good = lambda k, c: {"__key__": k, "png": _png(c), "txt": f"sample {k}".encode()}  # noqa: E731
    _write_shard(folder / "part-000.tar", [good("s0", (1, 2, 3)), good("s1", (4, 5, 6)),
                                           {"__key__": "nocap", "png": _png()}, good("s2", (7, 8, 9))])
    _write_shard(folder / "part-001.tar", [good("s3", (10, 11, 12)), {"__key__": "bad", "png": b"garbage",
                                                                      "txt": b"x"},
                                           {"__key__": "latin", "png": _png(), "txt": "caf\xe9".encode("latin-1")},
                                           good("s4", (13, 14, 15))])
    return folder


def test_wds_reader_single_tar_folder_and_brace_pattern(tmp_path, shards):
    one = _data(_data_cfg(tmp_path, str(shards / "part-000.tar")))
    assert one.format == "wds" and len(one) == 3
    assert dict(one.stats.skipped) == {"missing_caption": 1} and one.stats.examples["missing_caption"].endswith(":nocap")
    both = []
    for source in (str(shards), str(shards / "part-{000..001}.tar")):
        data = _data(_data_cfg(tmp_path, source))
        assert [s.key for s in data.samples] == ["s0", "s1", "s2", "s3", "s4"]
        assert dict(data.stats.skipped) == {"missing_caption": 1, "unreadable_image": 1, "undecodable_caption": 1}
        assert data.captions([0]) == ["sample s0"]
        both.append(data.batch(3, 0, 4))
    assert all(torch.equal(x, y) for x, y in zip(*both))


def test_wds_keys_and_unusable_shards_are_clear_errors(tmp_path, shards):
    # keys that match nothing: every sample skipped -> an error listing the keys the shards do hold
    with pytest.raises(DataError, match="0 of 8 samples usable.*hold keys png, txt.*wds_keys='jpg,cap'"):
        _data(_data_cfg(tmp_path, str(shards), wds_keys="jpg,cap"))
    # alternatives: 'jpg;png' accepts either image key
    assert len(_data(_data_cfg(tmp_path, str(shards), wds_keys="jpg;png,txt"))) == 5
    with pytest.raises(DataError, match="shards of data.image.source.*do not exist"):
        _data(_data_cfg(tmp_path, str(shards / "part-{000..002}.tar")))
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar file at all" * 10)
    with pytest.raises(DataError, match="0 of 1 samples usable.*unreadable_tar"):
        _data(_data_cfg(tmp_path, str(junk)))


# ------------------------------------------------------------------------------------------ shapes

def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_shapes_deterministic(tmp_path):
    a = _files(shapes.write_folder(tmp_path / "a", 6, seed=3, size=24))
    b = _files(shapes.write_folder(tmp_path / "b", 6, seed=3, size=24))
    c = _files(shapes.write_folder(tmp_path / "c", 6, seed=4, size=24))
    assert len(a) == 12 and a == b and a != c
    sa = shapes.write_shards(tmp_path / "sa", 6, seed=3, size=24, shard_size=4)
    sb = shapes.write_shards(tmp_path / "sb", 6, seed=3, size=24, shard_size=4)
    assert [p.name for p in sa] == ["shapes-000000.tar", "shapes-000001.tar"]
    assert [p.read_bytes() for p in sa] == [p.read_bytes() for p in sb]
    # sample i depends on (seed, i) alone: a longer data set starts with the shorter one
    assert _files(shapes.write_folder(tmp_path / "d", 3, seed=3, size=24)).items() <= a.items()


def test_shapes_captions_attributes_and_pixels():
    for i in range(20):
        img, cap = shapes.sample(i, seed=1, size=32)
        lines = cap.lines()
        assert lines[0] == cap.text and len(lines) == 3
        assert shapes.parse_caption(lines[0]) == cap
        short = shapes.parse_caption(lines[1])
        assert (short.shape, short.colour, short.background, short.size) == (cap.shape, cap.colour, cap.background, None)
        assert not shapes.is_held_out(cap.shape, cap.colour, cap.background)  # the train split
        px = np.asarray(img)
        cx, cy = (int(v * 32) for v in shapes.POSITIONS[cap.position])
        assert tuple(px[cy, cx]) == shapes.COLOURS[cap.colour]  # the shape sits where the caption says
        corner = (31, 31) if cap.position == "upper left" else (0, 0)
        assert tuple(px[corner]) == shapes.COLOURS[cap.background]
    held, train = shapes.captions("heldout"), shapes.captions("train")
    assert held and all(shapes.is_held_out(c.shape, c.colour, c.background) for c in held)
    assert len(held) + len(train) == len(shapes.captions("all"))
    assert {c.colour for c in train} == set(shapes.COLOURS) and {c.shape for c in train} == set(shapes.SHAPES)
    assert max(len(line.encode()) for c in shapes.captions("all") for line in c.lines()) <= shapes.MAX_CAPTION_BYTES
    with pytest.raises(DataError, match="not a shapes caption"):
        shapes.parse_caption("a red banana")


def test_shapes_default_source_reads_the_same_through_both_readers(tmp_path):
    folder = _data(_data_cfg(tmp_path, shapes_n=24, shapes_size=32), text_seq_len=64, seed=5)
    wds = _data(_data_cfg(tmp_path, shapes_n=24, shapes_size=32, format="wds"), text_seq_len=64, seed=5)
    assert (folder.format, wds.format) == ("folder", "wds") and len(folder) == len(wds) == 24
    assert folder.stats.used == wds.stats.used == 24 and not folder.stats.skipped and not wds.stats.skipped
    for x, y in zip(folder.batch(2, 0, 6, rank=1, world=2), wds.batch(2, 0, 6, rank=1, world=2)):
        assert torch.equal(x, y)
    for caption in folder.captions(range(len(folder))):
        shapes.parse_caption(caption)


def test_shapes_cli(tmp_path, capsys):
    assert shapes.main(["--out", str(tmp_path / "f"), "--n", "3", "--size", "16"]) == 0
    assert len(list((tmp_path / "f").glob("*.png"))) == 3
    assert shapes.main(["--out", str(tmp_path / "w"), "--n", "5", "--format", "wds", "--shard-size", "2"]) == 0
    assert "shapes-{000000..000002}.tar" in capsys.readouterr().out
    data = _data(_data_cfg(tmp_path, str(tmp_path / "w" / "shapes-{000000..000002}.tar")), text_seq_len=64)
    assert len(data) == 5
    for argv, message in ((["--n", "0"], "--n must be >= 1"), (["--n", "2", "--size", "4"], "--size must be >= 8"),
                          (["--n", "2", "--seed", "-1"], "--seed must be >= 0")):
        assert shapes.main(["--out", str(tmp_path / "x"), *argv]) == 2
        assert message in capsys.readouterr().err
    assert shapes.main(["--out", str(tmp_path / "f"), "--n", "2"]) == 2  # not empty
    assert "exists and is not an empty folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        shapes.main(["--out", str(tmp_path / "y"), "--n", "2", "--format", "zip"])
    assert exc.value.code == 2


# ------------------------------------------------------------------------------------------ crops

def test_crop_size_and_range():
    rng = np.random.default_rng(0)
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    for _ in range(20):
        out = random_resized_crop(img, 16, 0.75, rng)
        assert out.size == (16, 16)
    t = to_tensor(out)
    assert t.dtype == torch.float32 and t.shape == (3, 16, 16) and 0 <= t.min() and t.max() <= 1
    # lower ratio 1 on a square image: the whole image, only resized
    sq = img.crop((0, 0, 30, 30))
    assert np.array_equal(np.asarray(random_resized_crop(sq, 10, 1.0, rng)), np.asarray(sq.resize((10, 10), Image.BILINEAR)))
    # lower ratio < 1 really crops: some crops differ from the whole image
    whole = np.asarray(sq.resize((10, 10), Image.BILINEAR))
    assert any(not np.array_equal(np.asarray(random_resized_crop(sq, 10, 0.3, rng)), whole) for _ in range(5))


def test_batch_shapes_channels_and_values(tmp_path):
    cfg = _data_cfg(tmp_path, shapes_n=16, shapes_size=32)
    images, text = _data(cfg, text_seq_len=64, image_size=24, channels=4).batch(0, 0, 3)
    assert images.shape == (3, 4, 24, 24) and images.dtype == torch.float32
    assert 0 <= images.min() and images.max() <= 1 and torch.all(images[:, 3] == 1.0)  # opaque alpha
    assert text.shape == (3, 64) and text.dtype == torch.int64
    mask = padding_mask(text)
    assert mask[:, 0].all() and (~mask).any()  # text first, then padding
    assert torch.all(mask[:, :-1] | ~mask[:, 1:])  # no text after padding
    gray, _ = _data(cfg, text_seq_len=64, image_size=8, channels=1).batch(0, 0, 2)
    assert gray.shape == (2, 1, 8, 8)
    with pytest.raises(DataError, match="channels"):
        ImageTextData(cfg, image_size=8, channels=2)


# ------------------------------------------------------------------------------------------ tokens

@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> Path:
    """A tiny byte-level BPE trained offline with the tokenizers library itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([c.text for c in shapes.captions("all")[:200]], trainer)
    path = tmp_path_factory.mktemp("tok") / "bpe.json"
    tok.save(str(path))
    return path


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "a red circle — ünïcode ✓"
    ids = tok.encode(text)
    assert min(ids) >= 1 and max(ids) < tok.vocab_size == 257
    row = tokenize(tok, text, 64, truncate=False)
    assert row.shape == (64,) and row[len(ids):].tolist() == [PAD_ID] * (64 - len(ids))
    assert decode_tokens(tok, row) == text
    batch = tokenize_batch(tok, ["ab", "abcdef"], 4)  # prompts truncate by default
    assert batch.tolist() == [[98, 99, 0, 0], [98, 99, 100, 101]]


def test_hf_tokenizer_round_trip_and_data(tmp_path, bpe_json):
    tok = load_tokenizer(str(bpe_json))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 301  # 300 entries + padding
    text = "a small red circle in the upper left"
    ids = tok.encode(text)
    assert min(ids) >= 1 and len(ids) < len(text)  # merges learned: fewer tokens than bytes
    assert tok.decode(ids) == text and decode_tokens(tok, tokenize(tok, text, 40, truncate=False)) == text
    assert HFTokenizer(tok.to_json()).encode(text) == ids  # an export can carry the tokenizer
    data = _data(_data_cfg(tmp_path, shapes_n=8, shapes_size=16, bpe_path=str(bpe_json)), text_seq_len=40)
    _, text_ids = data.batch(0, 0, 4)
    assert data.vocab_size == 301 and int(text_ids.max()) < 301
    with pytest.raises(DataError, match="tokenizer file not found"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(DataError, match="not a Hugging Face tokenizers JSON"):
        load_tokenizer(str(bad))


def test_truncation_on_or_error_naming_the_file(tmp_path, shards):
    root = tmp_path / "long"
    root.mkdir()
    (root / "x.png").write_bytes(_png())
    (root / "x.txt").write_text("short\n" + "a very long caption " * 5)
    cfg = _data_cfg(tmp_path, str(root))
    with pytest.raises(DataError, match=f"caption in {re.escape(str(root / 'x.txt'))} is 99 tokens long.*truncate_captions"):
        _data(cfg, text_seq_len=20)
    cfg.image.truncate_captions = True
    data = _data(cfg, text_seq_len=20)
    assert [len(t) for t in data.samples[0].tokens] == [20, 20]
    assert padding_mask(torch.from_numpy(data.samples[0].tokens[1])).all()  # cut, not padded
    with pytest.raises(DataError, match="part-000.tar:s0.txt is 9 tokens long"):  # shards name shard:key
        _data(_data_cfg(tmp_path, str(shards)), text_seq_len=5)


# ------------------------------------------------------------------------------------------ order

def test_per_worker_order_differs_and_is_reproducible(tmp_path):
    cfg = _data_cfg(tmp_path, shapes_n=41, shapes_size=16, val_fraction=0.1)
    data = _data(cfg, seed=7, grad_accum=2)
    assert len(data.val_ids) == 4 and len(data.train_ids) == 37
    assert not set(data.val_ids) & set(data.train_ids)
    r0, r1 = data.order(0, 0, 2), data.order(0, 1, 2)
    assert len(r0) == len(r1) == 18 and not set(r0) & set(r1)  # disjoint, equal epoch lengths
    assert set(r0) | set(r1) <= set(data.train_ids)
    assert not np.array_equal(data.order(1, 0, 2), r0)  # a new order every epoch
    other_seed = _data(cfg, seed=8, grad_accum=2)
    assert not np.array_equal(other_seed.order(0, 0, 2), r0)
    assert np.array_equal(other_seed.val_ids, data.val_ids)  # the val set does not depend on the seed
    # micro batches walk the rank's stream: (step 0, micro 0), (0, 1), (1, 0) ... then the next epoch
    seq = np.concatenate([data.indices(s, m, 4, 1, 2) for s in range(5) for m in range(2)])
    assert np.array_equal(seq[:18], r1) and np.array_equal(seq[18:36], data.order(1, 1, 2))
    # pure: a fresh instance (a resumed run) gives identical batches; ranks differ
    fresh = _data(cfg, seed=7, grad_accum=2)
    for step, micro in ((0, 0), (3, 1)):
        assert all(torch.equal(x, y) for x, y in zip(data.batch(step, micro, 4, 1, 2), fresh.batch(step, micro, 4, 1, 2)))
    assert not torch.equal(data.batch(0, 0, 4, 0, 2)[0], data.batch(0, 0, 4, 1, 2)[0])
    # the validation set: fixed, split over ranks, no randomness
    v0, v1 = data.val_batches(2, 0, 2), data.val_batches(2, 1, 2)
    assert [b[0].shape[0] for b in v0 + v1] == [2, 2]
    assert all(torch.equal(x, y) for x, y in zip(v0[0], fresh.val_batches(2, 0, 2)[0]))
    with pytest.raises(DataError, match="cannot be split over 40 workers"):
        data.batch(0, 0, 1, 0, 40)


def test_image_config_keys_and_validation():
    cfg = Config(name="t")
    cfg.override(["data.image.source=/data/shards-{000..009}.tar", "data.image.wds_keys=jpg,txt",
                  "data.image.truncate_captions=true", "data.image.resize_crop_lower_ratio=0.5"])
    assert cfg.get("data.image.wds_keys") == "jpg,txt" and cfg.data.image.truncate_captions is True
    assert cfg.data.corpus == "bundled" and cfg.data.seq_len == 256  # the byte LM keys are untouched
    cfg.validate()
    for key, value in (("data.image.wds_keys", "png"), ("data.image.resize_crop_lower_ratio", "0"),
                       ("data.image.val_fraction", "1"), ("data.image.format", "zip"), ("data.image.shapes_size", "4")):
        bad = Config(name="t").override([f"{key}={value}"])
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            bad.validate()

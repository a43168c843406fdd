import gzip
import zipfile

import numpy as np
import pytest

from efftx.data.bytes import ByteData, prepare, split_sizes
from efftx.errors import DataError
from efftx.train.tasks import batch_rng

SEQ = 16


@pytest.fixture
def payload() -> bytes:
    rng = np.random.default_rng(0)
    return bytes(rng.integers(32, 127, size=5000, dtype=np.uint8))


def _check(info, payload):
    data = ByteData(info)
    assert info.size == len(payload)
    n_train, n_val = split_sizes(len(payload))
    assert (info.train_bytes, info.val_bytes) == (n_train, n_val) == (4500, 250)
    assert bytes(data.train) == payload[:n_train]
    assert bytes(data.val) == payload[n_train:n_train + n_val]
    assert isinstance(data.train.base, np.memmap) or isinstance(data.train, np.memmap)
    return data


def test_raw_file(tmp_path, payload):
    src = tmp_path / "corpus.txt"
    src.write_bytes(payload)
    info = prepare(str(src), tmp_path / "cache", SEQ)
    assert info.path == str(src)  # raw files are memory-mapped in place, not copied
    _check(info, payload)


def test_gzip(tmp_path, payload):
    src = tmp_path / "enwik8.gz"
    src.write_bytes(gzip.compress(payload))
    _check(prepare(str(src), tmp_path / "cache", SEQ), payload)


def test_zip_as_distributed(tmp_path, payload):
    src = tmp_path / "enwik8.zip"
    with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("enwik8", payload)
    info = prepare(str(src), tmp_path / "cache", SEQ)
    _check(info, payload)
    # cached: a second prepare reuses the decompressed file and its checksum
    assert prepare(str(src), tmp_path / "cache", SEQ) == info


def test_folder(tmp_path, payload):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_bytes(payload[2000:])
    (folder / "a.txt").write_bytes(payload[:2000])
    (folder / ".hidden").write_bytes(b"skip me")
    info = prepare(str(folder), tmp_path / "cache", SEQ)
    data = ByteData(info)
    whole = payload[:2000] + b"\n" + payload[2000:] + b"\n"
    assert info.size == len(whole)
    assert bytes(data.train) == whole[:info.train_bytes]


def test_full_enwik8_split_matches_the_seeds():
    assert split_sizes(100_000_000) == (90_000_000, 5_000_000)


def test_windows_reproducible_and_different_per_rank(tmp_path, payload):
    src = tmp_path / "c.txt"
    src.write_bytes(payload)
    data = ByteData(prepare(str(src), tmp_path / "cache", SEQ))
    a = data.train_batch(4, SEQ, batch_rng(0, 0, 5, 0))
    b = data.train_batch(4, SEQ, batch_rng(0, 0, 5, 0))
    c = data.train_batch(4, SEQ, batch_rng(0, 1, 5, 0))
    assert a.shape == (4, SEQ + 1) and a.dtype.is_floating_point is False
    assert (a == b).all() and not (a == c).all()
    for row in a:  # each window is a contiguous slice of the train split
        text = bytes(row.tolist())
        assert text in payload[:data.info.train_bytes]
    val = data.val_windows(6, SEQ)
    assert (val == data.val_windows(6, SEQ)).all() and val.shape == (6, SEQ + 1)


def test_bundled_corpus_builds_offline_and_is_cached(tmp_path):
    info = prepare("bundled", tmp_path, 256)
    assert info.size > 1_000_000 and len(info.sha256) == 64
    again = prepare("bundled", tmp_path, 256)
    assert again.sha256 == info.sha256 and again.path == info.path
    assert b"def " in bytes(ByteData(info).train[:200_000])


def test_missing_corpus(tmp_path):
    with pytest.raises(DataError, match="corpus not found: .*nope.gz"):
        prepare(str(tmp_path / "nope.gz"), tmp_path / "cache", SEQ)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(DataError, match="is empty"):
        prepare(str(tmp_path / "empty.txt"), tmp_path / "cache", SEQ)


def test_too_short_corpus_names_sizes(tmp_path):
    (tmp_path / "short.txt").write_bytes(b"x" * 300)
    with pytest.raises(DataError, match=r"data.seq_len \+ 2 = 18"):
        prepare(str(tmp_path / "short.txt"), tmp_path / "cache", SEQ)


def test_corrupt_archives(tmp_path):
    (tmp_path / "bad.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="not a readable gzip"):
        prepare(str(tmp_path / "bad.gz"), tmp_path / "cache", SEQ)
    (tmp_path / "bad.zip").write_bytes(b"not zip at all")
    with pytest.raises(DataError, match="not a readable zip"):
        prepare(str(tmp_path / "bad.zip"), tmp_path / "cache", SEQ)
    # nothing half-written is left in the cache
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "cache").iterdir())


# ------------------------------------------------------------------------------------------------ enwik8 check

def _fake_enwik8(path, size=100_000_000, header=b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.3/"'):
    """An enwik8-shaped zip: the header, then filler, 10^8 bytes unpacked (as distributed: one member)."""
    body = header + b"x" * (size - len(header))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        zf.writestr("enwik8", body)
    return body


def test_prepare_enwik8_accepts_the_real_shape_and_prints_its_sha256(tmp_path, capsys):
    import hashlib
    import json

    from efftx.data.prepare import main

    body = _fake_enwik8(tmp_path / "enwik8.zip")
    assert main(["enwik8", str(tmp_path / "enwik8.zip"), "--cache-dir", str(tmp_path / "cache")]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["ok"] and report["bytes"] == 100_000_000
    assert report["sha256"] == hashlib.sha256(body).hexdigest() and f"sha256 {report['sha256']}" in out
    # unpacked where training looks: the corpus cache gives the same flat file, not a second copy
    assert prepare(str(tmp_path / "enwik8.zip"), tmp_path / "cache", 64).path == report["unpacked"]
    assert "--recipe sinkhorn_enwik8 --set data.corpus=" in out


@pytest.mark.parametrize("size, header, message", [
    (99_999_999, b"<mediawiki xmlns", "it has 99,999,999 bytes once unpacked; enwik8 has 100,000,000"),
    (100_000_000, b"<?xml version", "it starts with b'<?xml versi', not enwik8's b'<mediawiki ' header"),
])
def test_prepare_enwik8_refuses_another_file_saying_what_differs(tmp_path, capsys, size, header, message):
    from efftx.data.prepare import main

    _fake_enwik8(tmp_path / "enwik8.zip", size, header)
    assert main(["enwik8", str(tmp_path / "enwik8.zip"), "--cache-dir", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert message in err and "mattmahoney.net/dc/enwik8.zip" in err


def test_prepare_enwik8_missing_or_corrupt_file_is_exit_2(tmp_path, capsys):
    from efftx.data.prepare import main

    assert main(["enwik8", str(tmp_path / "nope.zip"), "--cache-dir", str(tmp_path)]) == 2
    assert "corpus not found" in capsys.readouterr().err
    (tmp_path / "bad.zip").write_bytes(b"not a zip")
    assert main(["enwik8", str(tmp_path / "bad.zip"), "--cache-dir", str(tmp_path)]) == 2
    assert "not a readable zip file" in capsys.readouterr().err


def test_a_text_run_on_a_tiny_corpus_warns_once_naming_the_key(tmp_path, capsys):
    from efftx import recipes
    from efftx.train.launch import resolve
    from efftx.train.tasks import get

    (tmp_path / "tiny.txt").write_bytes(b"hello world\n" * 170)  # 2,040 bytes: 28 training windows of 64
    cfg = resolve(recipes.get("lm_debug").override({"name": "t", "data.corpus": str(tmp_path / "tiny.txt"),
                                                    "data.cache_dir": str(tmp_path / "cache")}))
    get("lm").prepare(cfg)
    out = capsys.readouterr().out
    assert out.count("warning: the training data is tiny for this run") == 1
    assert "training windows of data.seq_len bytes" in out and "give more data (data.corpus)" in out
    get("lm").prepare(resolve(recipes.get("lm_debug").override({"name": "t", "data.cache_dir": str(tmp_path)})))
    assert "warning" not in capsys.readouterr().out  # the bundled corpus is plenty for the debug run

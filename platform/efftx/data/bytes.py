"""Byte corpora: enwik8 (.zip / .gz / raw), any text file or folder, and the bundled default.

Every source is materialised once into a flat byte file (compressed sources are decompressed
into the cache directory; raw files are used in place) and then memory-mapped, so workers share
the page cache instead of each reading the corpus into memory.

**How the workers get it** (``data.handoff``; the LM task's ``share`` hook, run by launch on the
driver once Ray has started): the flat file lives in the *driver's* ``data.cache_dir``, which a
worker on another node cannot open. With ``object_store`` the driver puts the train and validation
arrays (:meth:`ByteData.arrays`) in Ray's object store once (``ray.put``); each node receives one
copy, and its workers map it zero-copy as read-only numpy views (:func:`shared_arrays`), so memory
per node is one corpus, as with the page cache. That was chosen over writing the corpus to the
run's storage and copying it to a node-local cache: Ray already moves objects between nodes, the
object store is sized for corpora of a few hundred MB (enwik8 is 100 MB), and nothing has to be
uploaded, kept or cleaned up on S3. With ``path`` the workers memory-map the driver's file, as
before: on one machine, or with ``data.cache_dir`` on a filesystem every node shares. ``auto`` (the
default) takes ``path`` on a one-node cluster (no extra copy, unchanged speed) and
``object_store`` on more. A worker given a path it cannot see (or whose size differs) stops with a
DataError naming the path and the key (:func:`visible`).

Split (fixed, documented in the README): the first 90% of the bytes are training data, the next
5% validation, the last 5% unused. For the full enwik8 (100,000,000 bytes) this is exactly the
seeds' split: first 90M train, next 5M validation.

The bundled default corpus is the Python standard library's own source (``*.py`` under the
interpreter's stdlib, sorted by path, tests excluded, capped at ``BUNDLED_MAX_BYTES``): it exists
offline on every machine that runs efftx. It depends on the interpreter version, so its SHA-256 is
recorded with every run.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
import sysconfig
import tempfile
import zipfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from efftx.errors import DataError

TRAIN_FRACTION = 0.90
VAL_FRACTION = 0.05
BUNDLED_MAX_BYTES = 24 * 2**20
_BUNDLED_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
_CHUNK = 1 << 20


@dataclass(frozen=True)
class CorpusInfo:
    """What a worker needs to open a prepared corpus (plain data: travels in the run config)."""

    source: str  # what the user asked for ("bundled" or a path)
    path: str  # the flat byte file that is memory-mapped
    size: int
    sha256: str
    train_bytes: int
    val_bytes: int

    def to_dict(self) -> dict:
        return asdict(self)


def split_sizes(n: int) -> tuple[int, int]:
    return int(n * TRAIN_FRACTION), int(n * VAL_FRACTION)


def prepare(source: str, cache_dir: str | os.PathLike, seq_len: int) -> CorpusInfo:
    """Materialise ``source`` (once, cached) and check it is long enough for ``seq_len`` windows."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    if source == "bundled":
        flat = _bundled(cache)
    else:
        path = Path(source).expanduser()
        if not path.exists():
            raise DataError(f"corpus not found: {source} (data.corpus must be 'bundled' or an existing file or folder)")
        path = path.resolve()
        if path.is_dir():
            flat = _cached(cache, path, "folder", lambda out: _write_folder(path, out))
        elif path.suffix == ".gz":
            flat = _cached(cache, path, "gz", lambda out: _write_gzip(path, out))
        elif path.suffix == ".zip":
            flat = _cached(cache, path, "zip", lambda out: _write_zip(path, out))
        else:
            flat = path
    size = flat.stat().st_size
    if size == 0:
        raise DataError(f"corpus {source} is empty")
    n_train, n_val = split_sizes(size)
    need = seq_len + 2
    if n_val < need or n_train < need:
        raise DataError(
            f"corpus {source} has {size:,} bytes: its train split ({n_train:,}) or validation split "
            f"({n_val:,} = {VAL_FRACTION:.0%}) is shorter than data.seq_len + 2 = {need}; "
            f"use a larger corpus (at least {int(need / VAL_FRACTION) + 1:,} bytes) or a smaller data.seq_len")
    return CorpusInfo(source=source, path=str(flat), size=size, sha256=_sha256(flat, cache),
                      train_bytes=n_train, val_bytes=n_val)


class WindowData:
    """Window sampling over a ``train`` and a ``val`` array of token ids (bytes, or a tokenizer's ids)."""

    train: np.ndarray
    val: np.ndarray

    @staticmethod
    def windows(split: np.ndarray, starts: np.ndarray, seq_len: int) -> torch.Tensor:
        """(N, seq_len + 1) int64 windows starting at ``starts``."""
        rows = np.stack([np.asarray(split[s: s + seq_len + 1]) for s in starts])
        return torch.from_numpy(rows.astype(np.int64))

    def train_batch(self, batch_size: int, seq_len: int, rng: np.random.Generator) -> torch.Tensor:
        starts = rng.integers(0, len(self.train) - seq_len - 1, size=batch_size, endpoint=True)
        return self.windows(self.train, starts, seq_len)

    def val_starts(self, n: int, seq_len: int) -> np.ndarray:
        return np.linspace(0, len(self.val) - seq_len - 1, num=n).astype(np.int64)

    def val_windows(self, n: int, seq_len: int) -> torch.Tensor:
        """A fixed validation set: ``n`` windows evenly spaced over the validation split."""
        return self.windows(self.val, self.val_starts(n, seq_len), seq_len)

    def val_target_bytes(self, n: int, seq_len: int) -> int:
        """UTF-8 bytes of text that the predicted tokens (each window's last ``seq_len``) of
        ``val_windows(n, seq_len)`` cover: the denominator of bits per byte."""
        raise NotImplementedError


class ByteData(WindowData):
    """Train/validation views of a prepared corpus, and window sampling: memory-mapped from the cache file, or
    the arrays the driver shared through Ray's object store (``shared``: an ObjectRef of :meth:`arrays`)."""

    def __init__(self, info: CorpusInfo | dict, shared=None):
        self.info = info if isinstance(info, CorpusInfo) else CorpusInfo(**info)
        if shared is not None:
            arrays = shared_arrays(shared)
            self.train, self.val = arrays["train"], arrays["val"]
            return
        data = np.memmap(visible(self.info.path, self.info.size), dtype=np.uint8, mode="r")
        self.train = data[: self.info.train_bytes]
        self.val = data[self.info.train_bytes: self.info.train_bytes + self.info.val_bytes]

    def arrays(self) -> dict[str, np.ndarray]:
        """What the driver shares through the object store (the unused last 5% is not sent)."""
        return {"train": np.asarray(self.train), "val": np.asarray(self.val)}

    def val_target_bytes(self, n: int, seq_len: int) -> int:
        return n * seq_len  # one token, one byte


# ------------------------------------------------------------------------------------------ handoff

HANDOFFS = ("auto", "object_store", "path")


def use_object_store(handoff: str) -> bool:
    """``data.handoff``: object_store / path as given; auto = the object store when the (running) Ray cluster has
    more than one live node, since only then may a worker be where the driver's cache is not."""
    if handoff not in HANDOFFS:
        raise DataError(f"data.handoff must be one of {', '.join(HANDOFFS)}; got {handoff!r}")
    if handoff != "auto":
        return handoff == "object_store"
    import ray

    return sum(1 for node in ray.nodes() if node.get("Alive")) > 1


def shared_arrays(ref) -> dict:
    """On a worker: the shared arrays, read-only numpy views of the node's object store (no copy)."""
    import ray

    return ray.get(ref)


def visible(path: str, size: int | None = None) -> str:
    """``path`` when this process can open it (with the prepared size), else a DataError naming it and the key."""
    import socket

    try:
        actual = os.path.getsize(path)
    except OSError:
        actual = None
    if actual is None or (size is not None and actual != size):
        found = "does not exist" if actual is None else f"has {actual:,} bytes, not the prepared {size:,}"
        raise DataError(f"the prepared corpus {path} {found} on this node ({socket.gethostname()}): workers on "
                        f"other nodes cannot open the driver's data.cache_dir; set data.handoff=object_store "
                        f"(or auto), or put data.cache_dir on a filesystem every node shares")
    return path


# ------------------------------------------------------------------------------------------ sources

def _bundled(cache: Path) -> Path:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tag = f"py{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    out = cache / f"bundled-{tag}.bin"
    if out.exists():
        return out
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not _BUNDLED_SKIP_DIRS.intersection(p.relative_to(stdlib).parts[:-1]))
    if not files:
        raise DataError(f"no Python sources found under {stdlib} to build the bundled corpus")

    def write(fh):
        written = 0
        for p in files:
            blob = p.read_bytes()
            if written + len(blob) > BUNDLED_MAX_BYTES:
                break
            fh.write(blob)
            written += len(blob)

    _atomic_write(out, write)
    return out


def _cached(cache: Path, source: Path, kind: str, writer) -> Path:
    st = source.stat()
    key = hashlib.sha256(f"{kind}:{source}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache / f"{source.name}-{key}.bin"
    if not out.exists():
        _atomic_write(out, writer)
    return out


def _write_folder(folder: Path, fh) -> None:
    files = sorted(p for p in folder.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))
    if not files:
        raise DataError(f"corpus folder {folder} holds no files")
    for p in files:
        with open(p, "rb") as src:
            _copy(src, fh)
        fh.write(b"\n")


def _write_gzip(path: Path, fh) -> None:
    try:
        with gzip.open(path, "rb") as src:
            _copy(src, fh)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"corpus {path} is not a readable gzip file: {exc}") from None


def _write_zip(path: Path, fh) -> None:
    try:
        with zipfile.ZipFile(path) as zf:
            members = sorted(i.filename for i in zf.infolist() if not i.is_dir())
            if not members:
                raise DataError(f"zip corpus {path} holds no files")
            for name in members:  # enwik8.zip holds exactly one member, "enwik8"
                with zf.open(name) as src:
                    _copy(src, fh)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise DataError(f"corpus {path} is not a readable zip file: {exc}") from None


def _copy(src, dst) -> None:
    while chunk := src.read(_CHUNK):
        dst.write(chunk)


def _atomic_write(out: Path, writer) -> None:
    """Write through a temporary file in the same folder, so readers never see a partial file."""
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=out.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            writer(fh)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _sha256(path: Path, cache: Path) -> str:
    """SHA-256 of a file, memoised in the cache folder by (path, size, mtime)."""
    st = path.stat()
    memo = cache / "checksums.json"
    key = f"{path}:{st.st_size}:{st.st_mtime_ns}"
    try:
        known = json.loads(memo.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    known[key] = digest.hexdigest()
    _atomic_write(memo, lambda fh: fh.write(json.dumps(known, indent=1).encode()))
    return known[key]

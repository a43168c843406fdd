"""A prepared byte corpus (efftx.data.bytes) tokenized once by a ``tokenizers`` JSON (``data.tokenizer``).

:func:`prepare_tokens` runs on the driver: it reads the corpus's flat byte file, tokenizes the training and the
validation split, and writes them into a cache folder named by the corpus's SHA-256 and the tokenizer's
(``<data.cache_dir>/tokens-<corpus sha>-<tokenizer sha>/``), built in a temporary folder and renamed into place,
so a reader never sees half of it and a second run reuses it. Workers memory-map the ids (:class:`TokenData`:
``uint16`` for vocabularies up to 65,536, else ``uint32``), or, when the driver's cache is not theirs to open
(``data.handoff``, efftx/data/bytes.py), map the same arrays zero-copy from Ray's object store
(:meth:`TokenData.arrays`, shared once by the driver).

**The split is the byte models' split** (efftx.data.bytes: the first 90% of the bytes train, the next 5%
validate), so byte and token models are validated on the same text. A split boundary that falls inside a
multi-byte UTF-8 character moves forward to the character's end (at most 3 bytes; never for ASCII text).

**Bits per byte.** Each token of the validation split records the number of corpus bytes it covers: from the
start of its text (the tokenizer's character offsets) to the start of the next token's, so the tokens of a
split cover its bytes exactly once (a byte the tokenizer's offsets skip counts for the token before it). Bytes
that are not valid UTF-8 reach the tokenizer as U+FFFD but still count as the one byte each they are. A
validation window's denominator is the bytes of the tokens it predicts (:meth:`TokenData.val_target_bytes`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from efftx.data.bytes import VAL_FRACTION, CorpusInfo, WindowData, shared_arrays, split_sizes, visible
from efftx.errors import DataError

FORMAT = 1  # bump when the cache layout or the tokenization rules change
_CHUNK_CHARS = 1 << 18  # the text is encoded in pieces of about this many characters, cut at line starts
_BATCH_CHUNKS = 32  # pieces per encode_batch call (tokenizers encodes them in parallel)
_META = "meta.json"
_FILES = {"train": "train.bin", "val": "val.bin", "val_bytes": "val_bytes.bin"}
# lone surrogates from errors="surrogateescape" (one per undecodable byte) -> U+FFFD for the tokenizer
_ESCAPED = {cp: "\ufffd" for cp in range(0xDC80, 0xDD00)}


@dataclass(frozen=True)
class TokenCorpusInfo:
    """What a worker needs to open a tokenized corpus (plain data: travels in the run's prepared data)."""

    source: str  # data.corpus
    tokenizer: str  # data.tokenizer
    tokenizer_sha256: str
    corpus_sha256: str
    path: str  # the cache folder
    dtype: str  # of the ids: uint16 | uint32
    vocab_size: int
    train_tokens: int
    val_tokens: int
    train_bytes: int  # bytes of corpus text the split covers
    val_bytes: int
    val_start: int  # byte offset of the validation split in the corpus

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def bytes_per_token(self) -> float:
        return (self.train_bytes + self.val_bytes) / max(self.train_tokens + self.val_tokens, 1)


def char_boundary(data: np.ndarray, i: int) -> int:
    """``i`` moved forward past UTF-8 continuation bytes (0b10xxxxxx), at most 3 of them."""
    end = min(len(data), i + 3)
    while i < end and (int(data[i]) & 0xC0) == 0x80:
        i += 1
    return i


def split_bounds(data: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]]:
    """((train start, end), (val start, end)) byte ranges: the byte models' split, on character boundaries."""
    n_train, n_val = split_sizes(len(data))
    mid = char_boundary(data, n_train)
    end = char_boundary(data, n_train + n_val)
    return (0, mid), (mid, end)


def prepare_tokens(corpus: CorpusInfo, codec, cache_dir: str | os.PathLike, seq_len: int,
                   tokenizer_key: str = "") -> TokenCorpusInfo:
    """Tokenize ``corpus`` with ``codec`` (a TokenizerCodec) once (cached); check both splits hold a window of
    ``seq_len`` + 2 tokens."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(f"{FORMAT}:{corpus.sha256}:{codec.sha256}".encode()).hexdigest()[:12]
    folder = cache / f"tokens-{corpus.sha256[:12]}-{codec.sha256[:12]}-{key}"
    meta = _read_meta(folder)
    if meta is None:
        _build(folder, corpus, codec)
        meta = _read_meta(folder)
        if meta is None:  # pragma: no cover - the folder was just written
            raise DataError(f"the tokenized corpus cache {folder} could not be read back")
    info = TokenCorpusInfo(source=corpus.source, tokenizer=tokenizer_key, tokenizer_sha256=codec.sha256,
                           corpus_sha256=corpus.sha256, path=str(folder), **meta)
    need = seq_len + 2
    if info.train_tokens < need or info.val_tokens < need:
        raise DataError(
            f"corpus {corpus.source} tokenized by data.tokenizer={tokenizer_key} has {info.train_tokens:,} training "
            f"and {info.val_tokens:,} validation tokens ({VAL_FRACTION:.0%} of the text); each split needs "
            f"data.seq_len + 2 = {need}: use a larger corpus or a smaller data.seq_len")
    return info


def _read_meta(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError):
        return None
    if meta.get("format") != FORMAT or not all((folder / f).is_file() for f in _FILES.values()):
        return None
    return {k: meta[k] for k in ("dtype", "vocab_size", "train_tokens", "val_tokens", "train_bytes", "val_bytes",
                                 "val_start")}


def _build(folder: Path, corpus: CorpusInfo, codec) -> None:
    """Write the cache folder through a temporary sibling renamed into place (a concurrent writer's folder wins)."""
    data = np.memmap(corpus.path, dtype=np.uint8, mode="r")
    (t0, t1), (v0, v1) = split_bounds(data)
    dtype = np.uint16 if codec.vocab_size <= 2 ** 16 else np.uint32
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".", suffix=".tmp"))
    try:
        with open(tmp / _FILES["train"], "wb") as ids:
            n_train = _tokenize(bytes(data[t0:t1]), codec, dtype, ids, None)
        with open(tmp / _FILES["val"], "wb") as ids, open(tmp / _FILES["val_bytes"], "wb") as lengths:
            n_val = _tokenize(bytes(data[v0:v1]), codec, dtype, ids, lengths)
        meta = {"format": FORMAT, "dtype": np.dtype(dtype).name, "vocab_size": codec.vocab_size,
                "train_tokens": n_train, "val_tokens": n_val, "train_bytes": t1 - t0, "val_bytes": v1 - v0,
                "val_start": v0, "corpus_sha256": corpus.sha256, "tokenizer_sha256": codec.sha256}
        (tmp / _META).write_text(json.dumps(meta, indent=1))
        (tmp / "tokenizer.json").write_text(codec.to_json(), encoding="utf-8")  # what the workers decode with
        try:
            os.rename(tmp, folder)
        except OSError:
            if _read_meta(folder) is None:  # not another writer's finished folder: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _pieces(text: str) -> list[tuple[int, int]]:
    """(start, end) character ranges of about ``_CHUNK_CHARS``, cut after a newline that a non-space character
    follows (where GPT-2-style pre-tokenizers split anyway), else after any newline, else anywhere."""
    out, start, n = [], 0, len(text)
    while start < n:
        end = start + _CHUNK_CHARS
        if end >= n:
            out.append((start, n))
            break
        cut = -1
        pos = end
        limit = min(n, end + _CHUNK_CHARS // 4)
        while True:
            nl = text.find("\n", pos, limit)
            if nl < 0:
                break
            if nl + 1 < n and not text[nl + 1].isspace():
                cut = nl + 1
                break
            if cut < 0:
                cut = nl + 1
            pos = nl + 1
        out.append((start, cut if cut > start else end))
        start = out[-1][1]
    return out


def _char_bytes(text: str) -> np.ndarray:
    """Corpus bytes of each character of ``text`` (decoded with surrogateescape: an escaped byte is 1)."""
    cp = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype=np.uint32)
    n = 1 + (cp >= 0x80).astype(np.int64) + (cp >= 0x800) + (cp >= 0x10000)
    n[(cp >= 0xDC80) & (cp < 0xDD00)] = 1
    return n


def _tokenize(blob: bytes, codec, dtype, ids_out, lengths_out) -> int:
    """Tokenize ``blob`` (one split) into ``ids_out``; with ``lengths_out``, each token's byte count (uint32)."""
    text = blob.decode("utf-8", errors="surrogateescape")
    clean = text if text.isascii() else text.translate(_ESCAPED)
    pieces = _pieces(clean)
    total, carry = 0, 0
    last_len = None  # the previous token's length, held back so a later empty piece can add to it
    for b in range(0, len(pieces), _BATCH_CHUNKS):
        batch = pieces[b:b + _BATCH_CHUNKS]
        encodings = codec.encode_batch([clean[s:e] for s, e in batch])
        for (s, e), enc in zip(batch, encodings):
            tok_ids = np.asarray(enc.ids, dtype=np.int64)
            if len(tok_ids) and (tok_ids.min() < 0 or tok_ids.max() >= codec.vocab_size):
                raise DataError(f"{codec.source} produced an id outside its vocabulary of {codec.vocab_size}")
            tok_ids.astype(dtype).tofile(ids_out)
            total += len(tok_ids)
            if lengths_out is None:
                continue
            per_char = _char_bytes(text[s:e])
            cum = np.concatenate([[0], np.cumsum(per_char)])
            piece_bytes = int(cum[-1])
            if not len(tok_ids):
                carry += piece_bytes
                continue
            starts = np.array([o[0] for o in enc.offsets], dtype=np.int64).clip(0, e - s)
            starts = np.maximum.accumulate(starts)
            starts[0] = 0
            byte_starts = cum[starts]
            lengths = np.diff(np.concatenate([byte_starts, [piece_bytes]]))
            if last_len is not None:
                last_len.tofile(lengths_out)
            lengths[0] += carry
            carry = 0
            lengths[:-1].astype(np.uint32).tofile(lengths_out)
            last_len = lengths[-1:].astype(np.uint32)
    if lengths_out is not None and last_len is not None:
        last_len[0] += carry
        last_len.tofile(lengths_out)
    return total


class TokenData(WindowData):
    """Memory-mapped token ids of a :class:`TokenCorpusInfo`, and each validation token's byte count."""

    def __init__(self, info: TokenCorpusInfo | dict, shared=None):
        self.info = info if isinstance(info, TokenCorpusInfo) else TokenCorpusInfo(**info)
        if shared is not None:  # the driver's arrays, through Ray's object store (data.handoff)
            arrays = shared_arrays(shared)
            self.train, self.val, self.val_bytes = arrays["train"], arrays["val"], arrays["val_bytes"]
            self._tokenizer_json = arrays["tokenizer_json"]
            return
        folder = Path(self.info.path)
        itemsize = np.dtype(self.info.dtype).itemsize
        self.train = np.memmap(visible(str(folder / _FILES["train"]), self.info.train_tokens * itemsize),
                               dtype=self.info.dtype, mode="r")
        self.val = np.memmap(folder / _FILES["val"], dtype=self.info.dtype, mode="r")
        self.val_bytes = np.memmap(folder / _FILES["val_bytes"], dtype=np.uint32, mode="r")
        self._tokenizer_json = None

    def arrays(self) -> dict:
        """What the driver shares through Ray's object store (data.handoff): the ids, the validation byte counts, the tokenizer."""
        return {"train": np.asarray(self.train), "val": np.asarray(self.val), "val_bytes": np.asarray(self.val_bytes),
                "tokenizer_json": self.tokenizer_json()}

    def val_target_bytes(self, n: int, seq_len: int) -> int:
        return sum(int(self.val_bytes[s + 1: s + seq_len + 1].sum(dtype=np.int64)) for s in self.val_starts(n, seq_len))

    def tokenizer_json(self) -> str:
        if self._tokenizer_json is not None:
            return self._tokenizer_json
        return (Path(self.info.path) / "tokenizer.json").read_text(encoding="utf-8")

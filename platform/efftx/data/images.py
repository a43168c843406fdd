"""Image + caption data for the dVAE and DALL-E: folders, WebDataset shards, synthetic shapes.

Sources (``data.image.source``; ``data.image.format`` = auto | folder | wds):

* ``shapes`` (default): the synthetic captioned shapes of :mod:`efftx.data.shapes`, generated once
  into ``data.cache_dir`` (``data.image.shapes_n/shapes_size/shapes_seed``) as a folder, or as
  WebDataset shards with ``data.image.format=wds``.
* **A folder** of images (png/jpg/jpeg/bmp/webp, any case) and captions: the caption of ``x.png``
  is ``x.txt`` beside it, else the one ``x.txt`` anywhere under the folder. A caption file may hold
  several lines; every sample picks one at random (reproducibly).
* **WebDataset shards**, read with the ``webdataset`` library: one ``.tar``, a folder of shards, or
  a brace pattern (``shards-{000..009}.tar``); ``data.image.wds_keys`` names the image and caption
  keys (``png,txt``; ``jpg;png,txt`` accepts either image key). URLs (``http://``, ``pipe:``) are
  passed to webdataset as they are.

Skipped, counted and logged (:class:`LoadStats`), never fatal one by one: an image without a
caption (``missing_caption``), a caption or sample without an image (``missing_image``), an image
Pillow cannot decode (``unreadable_image``), a caption that is not UTF-8 (``undecodable_caption``)
or holds only blank lines (``empty_caption``), a stem with several candidate captions elsewhere and
none beside the image (``ambiguous_caption``), a tar file or member webdataset cannot read
(``unreadable_tar``). A source where nothing is usable is a :class:`~efftx.errors.DataError`
carrying those counts. A caption longer than ``text_seq_len`` is cut with
``data.image.truncate_captions``, else a DataError naming its file (see :mod:`.text_tokens`).

What a batch is (:meth:`ImageTextData.batch`):

* ``images``: float32 ``(B, C, H, W)`` in ``[0, 1]`` (the model normalises), ``C`` = the model's
  channels (1 = L, 3 = RGB, 4 = RGBA; Pillow converts). Training images get a random resized crop:
  a square covering a fraction ``U(data.image.resize_crop_lower_ratio, 1)`` of the image's area
  (capped at the shorter side for non-square images), resized to ``image_size`` (bilinear with
  Pillow's antialiasing on reduction). Validation images get the central square, resized.
* ``text``: int64 ``(B, text_seq_len)``, padded with ``PAD_ID = 0`` (mask: ``text != 0``); with
  ``text_seq_len = 0`` (the dVAE) captions are not read at all and ``text`` is ``(B, 0)``.

Order: the training samples are permuted per epoch by ``(seed, epoch)``; rank ``r`` of ``world``
takes ``perm[r::world]``, cut to ``n // world`` so every rank has the same epoch length. Micro
batch ``(step, micro)`` of a rank covers positions ``(step * grad_accum + micro) * B ...`` of that
rank's stream of epochs, and its crops and caption choices come from ``(seed, rank, step, micro)``:
a batch is a pure function of its arguments, so a resumed run sees exactly the data an
uninterrupted run would have seen. The validation set is fixed by the samples' names alone
(the ``val_fraction`` with the smallest SHA-1 of their key), independent of seed and world size.

Scaling limits (by design, for the data sets this project trains on in CI and in examples): every
worker scans the whole source once when first used (a folder's images are kept as paths, a
shard's as their encoded bytes, captions as token rows), and images are decoded and cropped in the
training process, no DataLoader worker pool. That fits up to roughly 10^5 small images per worker
(the encoded bytes must fit in memory for shards). Larger sets, and URLs, stream instead
(:mod:`efftx.data.streaming`, ``data.image.streaming``): shards split between workers, a shuffle
buffer, memory bounded whatever the data size.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from PIL import Image

from efftx.data import shapes
from efftx.data.text_tokens import Tokenizer, load_tokenizer, tokenize
from efftx.errors import DataError

logger = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
FORMATS = ("auto", "folder", "wds")
IMAGE_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


# ------------------------------------------------------------------------------------------ samples

@dataclass(frozen=True)
class Sample:
    """One image with its caption lines (already tokenized)."""

    name: str  # for messages: a file path, or shard:key
    key: str  # stable id (folder: relative path without extension; shard: the sample key): picks the val split
    image: bytes | str  # encoded bytes (shards) or a file path (folders)
    texts: tuple[str, ...] = ()  # caption lines (empty when captions are not read)
    tokens: tuple[np.ndarray, ...] = ()  # one (text_seq_len,) int64 row per line


@dataclass
class LoadStats:
    """What a scan found: samples used, and skipped samples counted by reason (with one example each)."""

    source: str
    used: int = 0
    skipped: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)
    keys_seen: Counter = field(default_factory=Counter)  # WebDataset: keys present in the samples read

    def skip(self, reason: str, example: str) -> None:
        self.skipped[reason] += 1
        self.examples.setdefault(reason, example)

    @property
    def found(self) -> int:
        return self.used + sum(self.skipped.values())

    def summary(self) -> str:
        line = f"{self.used} of {self.found} samples usable in {self.source}"
        if self.skipped:
            parts = [f"{n} {reason} (e.g. {self.examples[reason]})" for reason, n in sorted(self.skipped.items())]
            line += "; skipped: " + ", ".join(parts)
        return line

    def to_dict(self) -> dict:
        return {"source": self.source, "used": self.used, "found": self.found, "skipped": dict(self.skipped)}


class _Skip(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CaptionSpec:
    """How caption files become token rows."""

    tokenizer: Tokenizer
    text_seq_len: int
    truncate: bool

    def parse(self, raw: bytes, name: str) -> tuple[tuple[str, ...], tuple[np.ndarray, ...]]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Skip("undecodable_caption") from None
        lines = tuple(line.strip() for line in text.splitlines() if line.strip())
        if not lines:
            raise _Skip("empty_caption")
        return lines, tuple(tokenize(self.tokenizer, line, self.text_seq_len, truncate=self.truncate, source=name)
                            for line in lines)


def _check_image(image: bytes | str) -> None:
    """Decode the whole image once (Pillow's lazy open would accept a truncated file)."""
    try:
        with Image.open(io.BytesIO(image) if isinstance(image, bytes) else image) as img:
            img.load()
    except _DECODE_ERRORS:
        raise _Skip("unreadable_image") from None


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def read_folder(root: str | os.PathLike, captions: CaptionSpec | None) -> tuple[list[Sample], LoadStats]:
    """Samples of an image + caption folder, sorted by relative path. ``captions=None``: images only."""
    root = Path(root)
    stats = LoadStats(str(root))
    files = sorted(p for p in root.rglob("*") if p.is_file() and not _hidden(p, root))
    images = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS]
    texts = [p for p in files if p.suffix.lower() == ".txt"]
    beside = {p.with_suffix(""): p for p in texts}
    by_stem: dict[str, list[Path]] = defaultdict(list)
    for p in texts:
        by_stem[p.stem].append(p)
    out, used_texts = [], set()
    for img in images:
        key = str(img.relative_to(root).with_suffix(""))
        try:
            lines, tokens = (), ()
            if captions is not None:
                cap = beside.get(img.with_suffix(""))
                if cap is None:
                    candidates = by_stem.get(img.stem, [])
                    if len(candidates) > 1:
                        raise _Skip("ambiguous_caption")
                    if not candidates:
                        raise _Skip("missing_caption")
                    cap = candidates[0]
                used_texts.add(cap)
                lines, tokens = captions.parse(cap.read_bytes(), str(cap))
            _check_image(str(img))
        except _Skip as skip:
            stats.skip(skip.reason, str(img))
            continue
        out.append(Sample(str(img), key, str(img), lines, tokens))
    if captions is not None:
        for orphan in (p for p in texts if p not in used_texts):
            stats.skip("missing_image", str(orphan))
    stats.used = len(out)
    return out, stats


def read_shards(urls: list[str], image_keys: tuple[str, ...], caption_key: str,
                captions: CaptionSpec | None) -> tuple[list[Sample], LoadStats]:
    """Samples of WebDataset shards, in shard order, read once with the ``webdataset`` library.

    webdataset opens each shard (``gopen``: files, ``pipe:``, ``http(s)://``), iterates its tar
    members and groups them into samples by key, with our error handler counting what it skips.
    The pipeline is webdataset's own stages without ``WebDataset``'s node/worker splitting and
    shuffling (every worker reads the same sequence and :class:`ImageTextData` splits it by rank)
    and with each shard closed as soon as it has been read.
    """
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    stats = LoadStats(urls[0] if len(urls) == 1 else f"{len(urls)} shards ({urls[0]} ...)")

    def on_error(exc: Exception) -> bool:
        stats.skip("unreadable_tar", " ".join(str(a) for a in exc.args if isinstance(a, str))[:200] or repr(exc))
        return True  # skip and go on

    def opened(shards: list[str]):
        for url in shards:
            try:
                stream = wds.gopen(url)
            except Exception as exc:  # noqa: BLE001 - whatever the scheme raises, the shard is skipped and counted
                on_error(exc)
                continue
            with stream:  # closed when the expander moves on to the next shard
                yield {"url": url, "stream": stream}

    out = []
    for raw in group_by_keys(tar_file_expander(opened(urls), handler=on_error), handler=on_error):
        key = raw["__key__"]
        name = f"{raw.get('__url__', '?')}:{key}"
        stats.keys_seen.update(k for k in raw if not k.startswith("__"))
        try:
            image = next((raw[k] for k in image_keys if k in raw), None)
            if image is None:
                raise _Skip("missing_image")
            lines, tokens = (), ()
            if captions is not None:
                if caption_key not in raw:
                    raise _Skip("missing_caption")
                lines, tokens = captions.parse(raw[caption_key], f"{name}.{caption_key}")
            _check_image(image)
        except _Skip as skip:
            stats.skip(skip.reason, name)
            continue
        out.append(Sample(name, key, bytes(image), lines, tokens))
    stats.used = len(out)
    return out, stats


# ------------------------------------------------------------------------------------------ sources

def _is_url(source: str) -> bool:
    return "://" in source or source.startswith("pipe:")


def _is_shard(path: str) -> bool:
    return path.lower().endswith(SHARD_SUFFIXES)


def resolve_source(data_cfg) -> tuple[str, str]:
    """``(location, format)`` of ``data.image``: generates the shapes data set if asked for it, and
    detects the format of ``format=auto`` (a .tar, brace pattern, URL or folder holding only shards is
    ``wds``; a folder holding images is ``folder``)."""
    cfg = data_cfg.image
    if cfg.format not in FORMATS:
        raise DataError(f"data.image.format must be one of {', '.join(FORMATS)}; got {cfg.format!r}")
    if cfg.source == "shapes":
        fmt = "wds" if cfg.format == "wds" else "folder"
        cache = data_cfg.cache_dir or _default_cache()
        return str(shapes.ensure(cache, cfg.shapes_n, cfg.shapes_seed, cfg.shapes_size, fmt)), fmt
    if not cfg.source:
        raise DataError("data.image.source is empty: use 'shapes', a folder, a .tar, or a brace pattern of shards")
    if cfg.format != "auto":
        return cfg.source, cfg.format
    if _is_url(cfg.source) or "{" in cfg.source or _is_shard(cfg.source):
        return cfg.source, "wds"
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(f"data.image.source not found: {cfg.source}")
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)]
        if any(p.suffix.lower() in IMAGE_EXTENSIONS for p in files):
            return str(path), "folder"
        if any(_is_shard(p.name) for p in files):
            return str(path), "wds"
        raise DataError(f"data.image.source {cfg.source} holds no images ({', '.join(IMAGE_EXTENSIONS)}) "
                        f"and no WebDataset shards ({', '.join(SHARD_SUFFIXES)})")
    raise DataError(f"data.image.source {cfg.source} is neither a folder nor a .tar shard")


def shard_urls(location: str) -> list[str]:
    """One ``.tar``, a folder of shards (sorted, recursive) or a brace pattern -> the shard list.
    Local shards must exist (a typo in a pattern is an error, not an empty epoch)."""
    import webdataset as wds

    path = Path(location).expanduser()
    if not _is_url(location) and path.is_dir():
        urls = sorted(str(p) for p in path.rglob("*") if p.is_file() and _is_shard(p.name) and not _hidden(p, path))
        if not urls:
            raise DataError(f"no WebDataset shards ({', '.join(SHARD_SUFFIXES)}) under {location}")
        return urls
    urls = wds.shardlists.expand_urls(location)
    missing = [u for u in urls if not _is_url(u) and not Path(u).expanduser().is_file()]
    if missing:
        raise DataError(f"{len(missing)} of {len(urls)} shards of data.image.source={location} do not exist "
                        f"(first: {missing[0]})")
    return [u if _is_url(u) else str(Path(u).expanduser()) for u in urls]


def parse_wds_keys(spec: str) -> tuple[tuple[str, ...], str]:
    """``"jpg;png,txt"`` -> (("jpg", "png"), "txt"). Keys are lower case (webdataset lowercases them)."""
    parts = [p.strip().lower() for p in spec.split(",")]
    if len(parts) != 2 or not all(parts):
        raise DataError(f"data.image.wds_keys must be 'IMAGE_KEY,CAPTION_KEY' (e.g. 'png,txt' or 'jpg;png,txt'); "
                        f"got {spec!r}")
    image = tuple(k.strip() for k in parts[0].split(";") if k.strip())
    if not image:
        raise DataError(f"data.image.wds_keys has no image key: {spec!r}")
    return image, parts[1]


def _default_cache() -> str:
    from efftx import paths

    return paths.default_data_dir()


# ------------------------------------------------------------------------------------------ transforms

def random_resized_crop(img: Image.Image, size: int, lower_ratio: float, rng: np.random.Generator) -> Image.Image:
    """A random square of ``U(lower_ratio, 1)`` of the area (capped at the shorter side), resized to ``size``."""
    w, h = img.size
    side = min(math.sqrt(rng.uniform(lower_ratio, 1.0) * w * h), w, h)
    side = max(1, int(round(side)))
    x0, y0 = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
    return img.resize((size, size), Image.Resampling.BILINEAR, box=(x0, y0, x0 + side, y0 + side))


def center_crop(img: Image.Image, size: int) -> Image.Image:
    """The central square of the image, resized to ``size``."""
    w, h = img.size
    side = min(w, h)
    x0, y0 = (w - side) // 2, (h - side) // 2
    return img.resize((size, size), Image.Resampling.BILINEAR, box=(x0, y0, x0 + side, y0 + side))


def to_tensor(img: Image.Image) -> torch.Tensor:
    """Pillow image -> float32 ``(C, H, W)`` in ``[0, 1]``."""
    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return torch.from_numpy(arr.transpose(2, 0, 1).astype(np.float32) / 255.0)


def open_image(sample: Sample, channels: int) -> Image.Image:
    """Decode a sample's image in the mode of ``channels`` (1 = L, 3 = RGB, 4 = RGBA)."""
    try:
        with Image.open(io.BytesIO(sample.image) if isinstance(sample.image, bytes) else sample.image) as img:
            return img.convert(IMAGE_MODES[channels])
    except _DECODE_ERRORS as exc:  # it decoded when the source was scanned: the file changed since
        raise DataError(f"image {sample.name} can no longer be read: {exc}") from None


# ------------------------------------------------------------------------------------------ data set

def set_image_args(data, data_cfg, image_size: int, channels: int, text_seq_len: int, seed: int,
                   grad_accum: int) -> None:
    """Check and set what every image data source (in memory, or streamed: efftx/data/streaming.py) is built
    from: the data config, the model's image side, channels and caption length, the seed and grad_accum."""
    if channels not in IMAGE_MODES:
        raise DataError(f"images can have 1 (L), 3 (RGB) or 4 (RGBA) channels, not {channels}")
    if image_size < 1 or text_seq_len < 0 or grad_accum < 1:
        raise DataError(f"bad image data arguments: image_size={image_size}, text_seq_len={text_seq_len}, "
                        f"grad_accum={grad_accum}")
    data.data_cfg = data_cfg
    data.image_size, data.channels, data.text_seq_len = image_size, channels, text_seq_len
    data.seed, data.grad_accum = seed, grad_accum
    data.crop_lower_ratio = data_cfg.image.resize_crop_lower_ratio
    data.tokenizer = load_tokenizer(data_cfg.image.bpe_path) if text_seq_len else None


class ImageTextData:
    """Images and tokenized captions of ``data.image``, as micro batches that are pure functions of
    ``(step, micro, batch_size, rank, world)``, plus a fixed validation set.

    ``image_size``, ``channels`` and ``text_seq_len`` belong to the model (the dVAE's image side and
    channels, DALL-E's text length) and are passed in, so the data cannot disagree with the model;
    ``text_seq_len=0`` reads images only (dVAE training). The source is scanned lazily, on first use
    (or :meth:`load`).
    """

    def __init__(self, data_cfg, *, image_size: int, channels: int = 3, text_seq_len: int = 0,
                 seed: int = 0, grad_accum: int = 1):
        set_image_args(self, data_cfg, image_size, channels, text_seq_len, seed, grad_accum)
        self._samples: list[Sample] | None = None
        self.stats: LoadStats | None = None
        self._orders: dict[tuple[int, int, int], np.ndarray] = {}

    # --------------------------------------------------------------- loading
    def load(self) -> "ImageTextData":
        if self._samples is not None:
            return self
        cfg = self.data_cfg.image
        location, fmt = resolve_source(self.data_cfg)
        captions = (CaptionSpec(self.tokenizer, self.text_seq_len, cfg.truncate_captions)
                    if self.text_seq_len else None)
        if fmt == "folder":
            path = Path(location).expanduser()
            if not path.is_dir():
                raise DataError(f"data.image.source {location} is not a folder (data.image.format=folder)")
            samples, stats = read_folder(path, captions)
        else:
            image_keys, caption_key = parse_wds_keys(cfg.wds_keys)
            samples, stats = read_shards(shard_urls(location), image_keys, caption_key, captions)
        self.location, self.format, self.stats = location, fmt, stats
        if not samples:
            hint = ""
            if stats.keys_seen:
                hint = (f"; the shards' samples hold keys {', '.join(sorted(stats.keys_seen))} "
                        f"(data.image.wds_keys={cfg.wds_keys!r})")
            raise DataError(f"no usable {'image+caption ' if captions else 'image '}samples: {stats.summary()}{hint}")
        # debug: a training run prints the summary once, on the driver (train/tasks.py), not once per worker load
        logger.debug("image data: %s", stats.summary())
        self._split(samples, cfg.val_fraction)
        return self

    def _split(self, samples: list[Sample], val_fraction: float) -> None:
        """The fixed validation set: the ``val_fraction`` of samples (at least 1 when > 0, never all)
        with the smallest SHA-1 of their key; everything else is training data."""
        n = len(samples)
        n_val = min(n - 1, max(1, round(n * val_fraction))) if val_fraction > 0 else 0
        digests = [hashlib.sha1(s.key.encode()).hexdigest() for s in samples]
        val = set(sorted(range(n), key=lambda i: (digests[i], i))[:n_val])
        self._samples = samples
        self.train_ids = np.array([i for i in range(n) if i not in val], dtype=np.int64)
        self.val_ids = np.array(sorted(val), dtype=np.int64)

    @property
    def samples(self) -> list[Sample]:
        return self.load()._samples

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def vocab_size(self) -> int:
        """Text ids are in ``[0, vocab_size)`` (0 = padding); DALL-E's number of text tokens."""
        if self.tokenizer is None:
            raise DataError("this image data reads no captions (text_seq_len=0), so it has no text vocabulary")
        return self.tokenizer.vocab_size

    # --------------------------------------------------------------- order
    def order(self, epoch: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """Indices (into :attr:`samples`) of the training samples rank ``rank`` sees in ``epoch``."""
        key = (epoch, rank, world)
        if key not in self._orders:
            self.load()
            n, per = len(self.train_ids), self._per_rank(world)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            if len(self._orders) > 8:
                self._orders.clear()
            self._orders[key] = self.train_ids[perm[rank::world][:per]]
        return self._orders[key]

    def _per_rank(self, world: int) -> int:
        per = len(self.train_ids) // world
        if per == 0:
            raise DataError(f"{len(self.train_ids)} training images cannot be split over {world} workers "
                            f"(scaling.num_workers): use more data or fewer workers")
        return per

    def indices(self, step: int, micro: int, batch_size: int, rank: int = 0, world: int = 1) -> np.ndarray:
        """The sample indices of one micro batch (see the module docstring for the order)."""
        if not 0 <= micro < self.grad_accum:
            raise ValueError(f"micro batch {micro} out of range for grad_accum={self.grad_accum}")
        self.load()
        per = self._per_rank(world)
        positions = (step * self.grad_accum + micro) * batch_size + np.arange(batch_size)
        return np.array([self.order(int(p // per), rank, world)[p % per] for p in positions], dtype=np.int64)

    # --------------------------------------------------------------- batches
    def batch(self, step: int, micro: int, batch_size: int, rank: int = 0, world: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training micro batch: ``(images (B, C, H, W) float32 in [0, 1], text (B, text_seq_len) int64)``."""
        rng = np.random.default_rng([self.seed, rank, step, micro])
        return self._collate(self.indices(step, micro, batch_size, rank, world), rng)

    def val_batches(self, batch_size: int, rank: int = 0, world: int = 1, limit: int | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share (``[rank::world]``) of the first ``limit`` samples of the fixed validation set,
        in batches: central crops and each caption's first line, no randomness. With no held-out samples
        (``val_fraction=0`` or a single image) the first training samples stand in."""
        self.load()
        ids = self.val_ids if len(self.val_ids) else self.train_ids
        mine = ids[:limit][rank::world]
        return [self._collate(mine[i: i + batch_size], None) for i in range(0, len(mine), batch_size)]

    def captions(self, ids: Iterable[int], line: int = 0) -> list[str]:
        """Caption text of samples (``line`` of each caption file, wrapped around), e.g. to prompt samples."""
        return [s.texts[line % len(s.texts)] if s.texts else "" for s in (self.samples[i] for i in ids)]

    def _collate(self, ids: np.ndarray, rng: np.random.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        images, texts = [], []
        for i in ids:
            sample = self.samples[int(i)]
            img = open_image(sample, self.channels)
            if rng is None:
                img = center_crop(img, self.image_size)
                line = 0
            else:
                img = random_resized_crop(img, self.image_size, self.crop_lower_ratio, rng)
                line = int(rng.integers(len(sample.tokens))) if sample.tokens else 0
            images.append(to_tensor(img))
            texts.append(sample.tokens[line] if sample.tokens else np.zeros(0, dtype=np.int64))
        if not images:
            empty = torch.zeros(0, self.channels, self.image_size, self.image_size)
            return empty, torch.zeros(0, self.text_seq_len, dtype=torch.long)
        return torch.stack(images), torch.from_numpy(np.stack(texts))

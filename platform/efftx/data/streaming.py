"""Streaming image + caption data: WebDataset shards or an image folder of any size, read shard by shard
with bounded memory per worker (the in-memory alternative is :class:`efftx.data.images.ImageTextData`).

Which one a run uses: ``data.image.streaming`` = ``auto`` (default) | ``true`` | ``false``; ``auto`` streams
when the source is a URL (``http(s)://``, ``pipe:``, any ``scheme://``) or its files take more than
``data.image.stream_above_mb`` on disk (:func:`use_streaming`).

**Shards.** WebDataset shards are the source's ``.tar`` files (one, a folder of them, or a brace pattern);
a folder of images is listed once (sorted walk, hidden files skipped) and cut into virtual shards of
``data.image.folder_shard_size`` consecutive images. Shard ``i`` belongs to rank ``i % world``; a source
with fewer shards than workers is a :class:`~efftx.errors.DataError` naming the keys.

**A rank's stream.** Epoch ``e`` of rank ``r``: its shards in an order permuted by ``(seed, e, r)``, read
``data.image.interleave`` at a time, one sample from each in turn (a finished shard's slot takes the next
shard), the validation samples and samples without an image (or caption, when captions are read) left out,
through a shuffle buffer of ``data.image.shuffle_buffer`` samples drawn by a ``random.Random`` seeded by
``(seed, e, r)``; then epoch ``e + 1`` and so on. Ranks read different shards, so they may be in different
epochs; the loop runs by steps, never waiting for an epoch to end. Micro batch ``(step, micro)`` of a rank is
positions ``(step * grad_accum + micro) * B ...`` of that stream, its crops and caption lines drawn from
``(seed, rank, step, micro)`` as in memory: so a batch is a function of its coordinates.

**Resume at the right position** (:meth:`RankStream.iterate`): a position ``p`` is ``(epoch, consumed) =
divmod(p, L)`` with ``L`` the rank's training samples per epoch (known after one epoch; else counted by one
pass over the shards' tar *headers*, member data skipped by seeking). The buffer's decisions depend only on
its random draws and on how many samples came in, never on their content, so replaying them over sample
*numbers* gives exactly which samples the buffer holds after ``consumed`` outputs and where its input stands;
one pass over the headers up to there re-reads just those samples. The stream then goes on with the same
random state: batches ``k..`` of a resumed run are batches ``k..`` of an uninterrupted one.

**Bad samples.** Decided from headers alone, before the buffer (so counting and replay agree): a sample
without an image member (``missing_image``) or caption (``missing_caption``) is skipped. Decided when a batch
is built: an image Pillow cannot decode (``unreadable_image``) or a caption that is not UTF-8 / blank
(``undecodable_caption``, ``empty_caption``) gives its slot to another sample of the same micro batch, so a
batch still covers exactly its B positions; a batch with no usable sample is a DataError. A caption too long
for ``text_seq_len`` is cut with ``data.image.truncate_captions``, else a DataError naming it (as in memory).
An unreadable shard (missing, not a tar, a corrupt header) ends that shard for the epoch
(``unreadable_tar``). Counts are in :attr:`RankStream.stats`.

**Validation.** A sample is held out when the SHA-1 of its key, read as a fraction of 2^160, is below
``data.image.val_fraction``: a fixed set, whatever the seed, world size or order, decided sample by sample
without reading the whole source (the in-memory split takes the same-sized set of smallest hashes, so the two
modes hold out nearly, not exactly, the same samples). The validation batches are the first
``train.eval_batches x train.micro_batch_size`` held-out samples in source order (shard 0 first, no shuffle;
rank ``r`` of ``W`` takes ``[r::W]``), and the sample images the first ``data.image.sample_images``: the same
on every rank and every run.

**Memory per worker** is the shuffle buffer (``shuffle_buffer`` encoded samples), one decoded micro batch,
the validation samples, ``interleave`` open tar files and the list of shard names; nothing grows with the
number of samples, except for a folder source, whose listing keeps one path per image (tens of bytes each).
"""

from __future__ import annotations

import hashlib
import io
import os
import random
import re
import tarfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from efftx.data.images import (IMAGE_EXTENSIONS, IMAGE_MODES, CaptionSpec, LoadStats, _DECODE_ERRORS,
                               _is_url, _Skip, center_crop, parse_wds_keys, random_resized_crop, resolve_source,
                               set_image_args, shard_urls, to_tensor)
from efftx.errors import DataError

STREAMING_CHOICES = ("auto", "true", "false")
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's rule: key = path up to the basename's first dot


# ------------------------------------------------------------------------------------------ choosing


def source_bytes(location: str, fmt: str) -> int | None:
    """Bytes on disk of a local source (shards, or a folder's image files); None for a URL."""
    if _is_url(location):
        return None
    if fmt == "wds":
        return sum(os.path.getsize(u) for u in shard_urls(location) if not _is_url(u))
    total = 0
    for name in _walk_images(Path(location).expanduser()):
        total += os.path.getsize(name)
    return total


def use_streaming(data_cfg, location: str, fmt: str) -> bool:
    """``data.image.streaming``: true / false as given; auto streams a URL, or a source larger on disk than
    ``data.image.stream_above_mb``."""
    cfg = data_cfg.image
    if cfg.streaming not in STREAMING_CHOICES:
        raise DataError(f"data.image.streaming must be one of {', '.join(STREAMING_CHOICES)}; got {cfg.streaming!r}")
    if cfg.streaming != "auto":
        return cfg.streaming == "true"
    if _is_url(location) or any(_is_url(u) for u in ([location] if fmt == "folder" else shard_urls(location))):
        return True
    size = source_bytes(location, fmt)
    return size is not None and size > cfg.stream_above_mb * 2**20


# ------------------------------------------------------------------------------------------ shards


@dataclass
class Entry:
    """One sample as the headers describe it; ``load()`` reads its image and caption bytes."""

    key: str
    name: str
    has_image: bool
    has_caption: bool
    load: Callable[[], tuple[bytes | None, bytes | None]]


@dataclass(frozen=True)
class Raw:
    """A sample's encoded bytes: what the shuffle buffer holds."""

    key: str
    name: str
    image: bytes | None  # None: the bytes could not be read
    caption: bytes | None


def is_validation(key: str, val_fraction: float) -> bool:
    """The fixed hold-out: SHA-1 of the key, as a fraction of 2^160, below ``val_fraction``."""
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) < val_fraction * 2**160


def _walk_images(root: Path) -> Iterator[str]:
    """Image files under ``root`` in a fixed order (sorted walk, hidden files and folders skipped)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for f in sorted(filenames):
            if not f.startswith(".") and os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS:
                yield os.path.join(dirpath, f)


class TarShard:
    """A WebDataset shard: members grouped into samples by key (webdataset's naming rule), read lazily.

    A local file is opened seekable, so members whose data is not asked for are skipped by seeking (a header
    pass costs little); a URL (``pipe:``, ``http(s)://``) is read as a stream through ``webdataset.gopen`` and
    the wanted members' bytes are kept as they pass. An entry's ``load`` must be called before the next entry
    is asked for (the stream moves on)."""

    def __init__(self, url: str, image_keys: tuple[str, ...], caption_key: str | None):
        self.url, self.image_keys, self.caption_key = url, image_keys, caption_key
        self.wanted = set(image_keys) | ({caption_key} if caption_key else set())

    def __repr__(self) -> str:
        return self.url

    def entries(self, stats: LoadStats) -> Iterator[Entry]:
        stream = None
        try:
            if _is_url(self.url):
                import webdataset as wds

                stream = wds.gopen(self.url)
                tf = tarfile.open(fileobj=stream, mode="r|*")
            else:
                tf = tarfile.open(self.url, mode="r:*")
        except (OSError, tarfile.TarError, ValueError, EOFError) as exc:
            stats.skip("unreadable_tar", f"{self.url}: {exc}"[:200])
            if stream is not None:
                stream.close()
            return
        try:
            yield from self._grouped(tf, eager=stream is not None)
        except (OSError, tarfile.TarError, EOFError, ValueError) as exc:
            stats.skip("unreadable_tar", f"{self.url}: {exc}"[:200])
        finally:
            tf.close()
            if stream is not None:
                stream.close()

    def _grouped(self, tf: tarfile.TarFile, eager: bool) -> Iterator[Entry]:
        key, members = None, {}
        while (info := tf.next()) is not None:
            tf.members.clear()  # TarFile keeps every header it read: memory would grow with the shard
            if not info.isfile():
                continue
            m = _KEY_EXT.match(info.name)
            if not m:
                continue
            k, ext = m.group(1), m.group(2).lower()
            if k != key:
                if key is not None:
                    yield self._entry(tf, key, members)
                key, members = k, {}
            if ext in self.wanted:
                members[ext] = _read_member(tf, info) if eager else info
        if key is not None:
            yield self._entry(tf, key, members)

    def _entry(self, tf: tarfile.TarFile, key: str, members: dict) -> Entry:
        image_ext = next((e for e in self.image_keys if e in members), None)
        image = members.get(image_ext) if image_ext else None
        caption = members.get(self.caption_key) if self.caption_key else None

        def load():
            return _member_bytes(tf, image), _member_bytes(tf, caption)

        return Entry(key, f"{self.url}:{key}", image is not None, caption is not None, load)


def _read_member(tf: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    fh = tf.extractfile(info)
    return fh.read() if fh is not None else b""


def _member_bytes(tf: tarfile.TarFile, member) -> bytes | None:
    """A member's bytes (already read from a stream, or read now by seeking); None when it cannot be read."""
    if member is None or isinstance(member, bytes):
        return member
    try:
        return _read_member(tf, member)
    except (OSError, tarfile.TarError, EOFError, ValueError):
        return None


class FolderShard:
    """A virtual shard of a folder: ``folder_shard_size`` consecutive images of the sorted listing; the
    caption of ``x.png`` is ``x.txt`` beside it (the in-memory reader also finds one elsewhere by stem)."""

    def __init__(self, root: Path, files: list[str], captions: bool):
        self.root, self.files, self.captions = root, files, captions

    def __repr__(self) -> str:
        return f"{self.root}[{self.files[0]} ...]" if self.files else str(self.root)

    def entries(self, stats: LoadStats) -> Iterator[Entry]:
        for rel in self.files:
            path = self.root / rel
            key = os.path.splitext(rel)[0]
            cap = path.with_suffix(".txt") if self.captions else None
            if cap is not None and not cap.is_file():
                cap = next((p for p in (path.with_suffix(".TXT"), path.with_suffix(".Txt")) if p.is_file()), None)
            yield Entry(key, str(path), True, cap is not None, lambda p=path, c=cap: (_read_file(p), _read_file(c)))


def _read_file(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError:
        return None


def list_shards(location: str, fmt: str, image_keys: tuple[str, ...], caption_key: str | None,
                folder_shard_size: int) -> list:
    """The shards of a source, in source order."""
    if fmt == "wds":
        return [TarShard(u, image_keys, caption_key) for u in shard_urls(location)]
    root = Path(location).expanduser()
    if not root.is_dir():
        raise DataError(f"data.image.source {location} is not a folder (data.image.format=folder)")
    shards, chunk = [], []
    for path in _walk_images(root):
        chunk.append(os.path.relpath(path, root))
        if len(chunk) == folder_shard_size:
            shards.append(FolderShard(root, chunk, caption_key is not None))
            chunk = []
    if chunk:
        shards.append(FolderShard(root, chunk, caption_key is not None))
    if not shards:
        raise DataError(f"data.image.source {location} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return shards


# ------------------------------------------------------------------------------------------ shuffle buffer


class ShuffleBuffer:
    """Holds up to ``size`` items; once full, each new item takes the place of a random one, which comes out.
    Every decision is one ``rng.randrange`` over the buffer's length: a function of the random state and the
    number of items pushed, never of the items (which is what lets :meth:`RankStream.iterate` replay it)."""

    def __init__(self, size: int, rng: random.Random):
        self.size, self.rng, self.items = size, rng, []

    def push(self, item):
        """Add ``item``; returns the item that leaves (None while the buffer fills)."""
        if len(self.items) < self.size:
            self.items.append(item)
            return None
        j = self.rng.randrange(self.size)
        out, self.items[j] = self.items[j], item
        return out

    def pop(self):
        """Remove and return a random item (the input has ended)."""
        j = self.rng.randrange(len(self.items))
        out = self.items[j]
        self.items[j] = self.items[-1]
        self.items.pop()
        return out

    def __len__(self) -> int:
        return len(self.items)


def _seeded(*parts: int) -> random.Random:
    return random.Random(int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0]))


# ------------------------------------------------------------------------------------------ a rank's stream


class RankStream:
    """The training samples of one rank, epoch after epoch (see the module docstring): raw encoded samples."""

    def __init__(self, shards: list, rank: int, world: int, *, seed: int, buffer_size: int, interleave: int,
                 val_fraction: float, need_captions: bool, source: str):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for {world} workers")
        if len(shards) < world:
            raise DataError(f"data.image.source={source} has {len(shards)} shard(s), fewer than the "
                            f"{world} workers (scaling.num_workers): streaming gives each worker whole shards; "
                            f"use more shards (folders: a smaller data.image.folder_shard_size) or fewer workers")
        self.mine = shards[rank::world]  # shard i -> rank i % world
        self.rank, self.world, self.seed = rank, world, seed
        self.buffer_size, self.interleave = max(1, buffer_size), max(1, interleave)
        self.val_fraction, self.need_captions = val_fraction, need_captions
        self.source = source
        self.length: int | None = None  # training samples per epoch of this rank, once known
        self.stats = LoadStats(f"{source} (rank {rank} of {world}, {len(self.mine)} shards)")

    # ------------------------------------------------------------- inputs of an epoch (headers only)
    def _keep(self, entry: Entry) -> bool:
        if is_validation(entry.key, self.val_fraction):
            return False
        if not entry.has_image:
            self.stats.skip("missing_image", entry.name)
            return False
        if self.need_captions and not entry.has_caption:
            self.stats.skip("missing_caption", entry.name)
            return False
        return True

    def inputs(self, epoch: int) -> Iterator[Entry]:
        """The epoch's training entries before the shuffle buffer: shards in a per-epoch order, interleaved."""
        order = np.random.default_rng([self.seed, epoch, self.rank, 7]).permutation(len(self.mine))
        pending = iter(int(i) for i in order)
        active: list[Iterator[Entry]] = []
        for _ in range(self.interleave):
            i = next(pending, None)
            if i is not None:
                active.append(self.mine[i].entries(self.stats))
        slot = 0
        while active:
            slot %= len(active)
            entry = next(active[slot], None)
            if entry is None:
                i = next(pending, None)
                if i is None:
                    active.pop(slot)
                else:
                    active[slot] = self.mine[i].entries(self.stats)
                continue
            slot += 1
            if self._keep(entry):
                yield entry

    def count(self) -> int:
        """Training samples per epoch of this rank (one pass over the headers)."""
        if self.length is None:
            self.length = sum(1 for _ in self.inputs(0))
        return self.length

    # ------------------------------------------------------------- outputs
    def _load(self, entry: Entry) -> Raw:
        image, caption = entry.load()
        return Raw(entry.key, entry.name, image, caption)

    def _epoch(self, epoch: int, consumed: int) -> Iterator[Raw]:
        """Epoch ``epoch`` from output ``consumed`` on."""
        rng = _seeded(self.seed, epoch, self.rank, 11)
        buf = ShuffleBuffer(self.buffer_size, rng)
        entries = self.inputs(epoch)
        if consumed:
            n = self.count()
            # replay the buffer's decisions over sample numbers: which ones it holds after `consumed` outputs
            sim, taken, out = ShuffleBuffer(self.buffer_size, rng), 0, 0
            while out < consumed:
                if taken < n:
                    out += sim.push(taken) is not None
                    taken += 1
                else:
                    sim.pop()
                    out += 1
            where = {number: slot for slot, number in enumerate(sim.items)}
            buf.items = [None] * len(sim.items)
            for number in range(taken):  # re-read just the samples the buffer holds
                entry = next(entries)
                slot = where.get(number)
                if slot is not None:
                    buf.items[slot] = self._load(entry)
        for entry in entries:
            out = buf.push(self._load(entry))
            if out is not None:
                yield out
        while len(buf):
            yield buf.pop()

    def iterate(self, position: int = 0) -> Iterator[Raw]:
        """The rank's endless stream of training samples from ``position`` (0 = the first of epoch 0)."""
        epoch, consumed = divmod(position, self.count()) if position else (0, 0)
        while True:
            n = 0
            for raw in self._epoch(epoch, consumed):
                n += 1
                yield raw
            if self.length is None:
                self.length = consumed + n
            if consumed + n == 0:
                raise DataError(f"rank {self.rank} of {self.world} has no training samples in its "
                                f"{len(self.mine)} shard(s) of data.image.source={self.source}: "
                                f"{self.stats.summary()}")
            epoch, consumed = epoch + 1, 0


# ------------------------------------------------------------------------------------------ the data object


class StreamingImageData:
    """The streaming counterpart of :class:`efftx.data.images.ImageTextData`, with the same batch methods:
    ``batch(step, micro, B, rank, world)`` (training) and ``val_batches(B, rank, world, limit)``.

    Successive batches of a rank read on from where the last one ended; a batch asked for out of sequence
    (the first after a resume) repositions the stream (:meth:`RankStream.iterate`)."""

    streaming = True

    def __init__(self, data_cfg, *, image_size: int, channels: int = 3, text_seq_len: int = 0, seed: int = 0,
                 grad_accum: int = 1):
        cfg = data_cfg.image
        set_image_args(self, data_cfg, image_size, channels, text_seq_len, seed, grad_accum)
        self.captions = CaptionSpec(self.tokenizer, text_seq_len, cfg.truncate_captions) if text_seq_len else None
        self.location, self.format = resolve_source(data_cfg)
        self.image_keys, caption_key = parse_wds_keys(cfg.wds_keys)
        self.caption_key = caption_key if text_seq_len else None
        self._shards: list | None = None
        self._stream: RankStream | None = None
        self._iter: Iterator[Raw] | None = None
        self._pos = -1
        self._head: list[Raw] = []  # the first held-out samples in source order (validation, sample images)
        self._head_done = False
        self.stats = LoadStats(self.location)  # what building batches skipped

    @property
    def shards(self) -> list:
        if self._shards is None:
            self._shards = list_shards(self.location, self.format, self.image_keys, self.caption_key,
                                       self.data_cfg.image.folder_shard_size)
        return self._shards

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None:
            raise DataError("this image data reads no captions (text_seq_len=0), so it has no text vocabulary")
        return self.tokenizer.vocab_size

    def stream(self, rank: int = 0, world: int = 1) -> RankStream:
        if self._stream is None or (self._stream.rank, self._stream.world) != (rank, world):
            cfg = self.data_cfg.image
            self._stream = RankStream(self.shards, rank, world, seed=self.seed, buffer_size=cfg.shuffle_buffer,
                                      interleave=cfg.interleave, val_fraction=cfg.val_fraction,
                                      need_captions=self.caption_key is not None, source=cfg.source)
            self._iter, self._pos = None, -1
        return self._stream

    # --------------------------------------------------------------- training
    def raw_batch(self, step: int, micro: int, batch_size: int, rank: int = 0, world: int = 1) -> list[Raw]:
        """The encoded samples of one micro batch (positions of the rank's stream, see the module docstring)."""
        if not 0 <= micro < self.grad_accum:
            raise ValueError(f"micro batch {micro} out of range for grad_accum={self.grad_accum}")
        stream = self.stream(rank, world)
        position = (step * self.grad_accum + micro) * batch_size
        if self._iter is None or self._pos != position:
            self._iter, self._pos = stream.iterate(position), position
        out = [next(self._iter) for _ in range(batch_size)]
        self._pos += batch_size
        return out

    def batch(self, step: int, micro: int, batch_size: int, rank: int = 0, world: int = 1
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training micro batch: ``(images (B, C, H, W) float32 in [0, 1], text (B, text_seq_len) int64)``."""
        raws = self.raw_batch(step, micro, batch_size, rank, world)
        rng = np.random.default_rng([self.seed, rank, step, micro])
        decoded = [self._decode(r) for r in raws]
        usable = [d for d in decoded if d is not None]
        if not usable:
            raise DataError(f"no usable sample in micro batch ({step}, {micro}) of rank {rank}: "
                            f"{self.stats.summary()}")
        images, texts = [], []
        for i, d in enumerate(decoded):
            img, tokens = d if d is not None else usable[i % len(usable)]
            img = random_resized_crop(img, self.image_size, self.crop_lower_ratio, rng)
            line = int(rng.integers(len(tokens))) if tokens else 0
            images.append(to_tensor(img))
            texts.append(tokens[line] if tokens else np.zeros(0, dtype=np.int64))
        return torch.stack(images), torch.from_numpy(np.stack(texts))

    def _decode(self, raw: Raw):
        """(Pillow image, caption token rows), or None when the sample cannot be used (counted)."""
        from PIL import Image

        try:
            if raw.image is None:
                raise _Skip("unreadable_image")
            tokens = ()
            if self.captions is not None:
                if raw.caption is None:
                    raise _Skip("missing_caption")
                _, tokens = self.captions.parse(raw.caption, f"{raw.name}.{self.caption_key}")
            try:
                with Image.open(io.BytesIO(raw.image)) as img:
                    return img.convert(IMAGE_MODES[self.channels]), tokens
            except _DECODE_ERRORS:
                raise _Skip("unreadable_image") from None
        except _Skip as skip:
            self.stats.skip(skip.reason, raw.name)
            return None

    # --------------------------------------------------------------- validation
    def head(self, limit: int) -> list[Raw]:
        """The first ``limit`` usable held-out samples in source order (shards in order, not shuffled); with
        ``data.image.val_fraction=0``, the first samples of the source."""
        frac = self.data_cfg.image.val_fraction
        if len(self._head) < limit and not self._head_done:
            self._head, stats = [], LoadStats(self.location)
            for shard in self.shards:
                for entry in shard.entries(stats):
                    if frac > 0 and not is_validation(entry.key, frac):
                        continue
                    if not entry.has_image or (self.caption_key and not entry.has_caption):
                        continue
                    image, caption = entry.load()
                    raw = Raw(entry.key, entry.name, image, caption)
                    if self._decode(raw) is not None:
                        self._head.append(raw)
                    if len(self._head) >= limit:
                        break
                if len(self._head) >= limit:
                    break
            else:
                self._head_done = True
        return self._head[:limit]

    def val_batches(self, batch_size: int, rank: int = 0, world: int = 1, limit: int | None = None
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share (``[rank::world]``) of the first ``limit`` held-out samples, in batches: central
        crops and each caption's first line."""
        if limit is None:
            raise DataError("streaming image data needs a limit on the validation samples (train.eval_batches)")
        mine = self.head(limit)[rank::world]
        out = []
        for i in range(0, len(mine), batch_size):
            images, texts = [], []
            for raw in mine[i: i + batch_size]:
                img, tokens = self._decode(raw)
                images.append(to_tensor(center_crop(img, self.image_size)))
                texts.append(tokens[0] if tokens else np.zeros(0, dtype=np.int64))
            out.append((torch.stack(images), torch.from_numpy(np.stack(texts))))
        return out

    def check(self, world: int, needed: int) -> dict:
        """Driver-side checks before any worker starts: enough shards for the workers, and usable samples at
        the head of the source (else a DataError naming the keys). Returns a summary."""
        self.stream(0, world)
        head = self.head(needed)
        if not head:
            keys = Counter()
            stats = LoadStats(self.location)
            for entry in self.shards[0].entries(stats):
                keys.update(["image" if entry.has_image else "no image", "caption" if entry.has_caption else
                             "no caption"])
            raise DataError(f"no usable {'image+caption ' if self.caption_key else 'image '}held-out samples "
                            f"found in data.image.source={self.data_cfg.image.source} (data.image.wds_keys="
                            f"{self.data_cfg.image.wds_keys!r}, data.image.val_fraction="
                            f"{self.data_cfg.image.val_fraction}); the first shard's samples: {dict(keys)}; "
                            f"{stats.summary() if stats.skipped else ''}")
        size = source_bytes(self.location, self.format) if not _is_url(self.location) else None
        return {"source": self.data_cfg.image.source, "streaming": True, "shards": len(self.shards),
                "bytes": size, "validation_samples": len(head)}

"""Synthetic captioned shapes: the image + caption data set that exists offline on every machine.

Each image is one flat-coloured shape on a flat background, drawn with Pillow, with captions that
say what is in it::

    a small green triangle in the upper left on a blue background   (full caption, line 1)
    a green triangle on a blue background                           (line 2)
    a small green triangle in the upper left                        (line 3)

Every caption file holds these three lines (the readers pick one at random per sample, as they do
for any caption file with several lines). Attributes: 4 shapes x 7 colours x 6 background colours
(never the shape's colour) x 2 sizes x 5 positions; the pixels are jittered a little (position and
size) so that two images with the same caption differ.

Determinism: sample ``i`` of seed ``s`` is drawn from ``numpy.random.default_rng([s, i])`` alone, so
the same (seed, index, size) gives the same pixels and caption whatever ``n`` is, and files written
twice are byte-identical (PNG from Pillow; tar members with fixed mtime/owner).

Held-out combinations: a (shape, colour, background) triple is held out when
``(shape_index + 2 * colour_index + 3 * background_index) % 7 == 0`` (24 of the 168 triples). The
``train`` split never draws them; ``captions("heldout")`` lists their captions, so an evaluation can
ask a model trained on shapes for combinations it has never seen. Every single colour, shape and
background still occurs in training.

Every caption is at most ``MAX_CAPTION_BYTES = 64`` bytes, so the byte tokenizer with a
``text_seq_len`` of 64 holds any of them whole.

Command line::

    python -m efftx.data.shapes --out DIR --n N [--format folder|wds] [--size 64] [--seed 0]
                                [--split train|heldout|all] [--shard-size 1000]
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from PIL import Image, ImageDraw

from efftx.errors import DataError

SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (240, 210, 40),
    "pink": (240, 120, 190), "white": (245, 245, 245), "black": (20, 20, 20),
}
SIZES = {"small": 0.28, "large": 0.46}  # side of the shape's bounding box, as a fraction of the image side
POSITIONS = {  # centre of the shape, as fractions of the image side (x, y)
    "upper left": (0.28, 0.28), "upper right": (0.72, 0.28), "center": (0.5, 0.5),
    "lower left": (0.28, 0.72), "lower right": (0.72, 0.72),
}
SPLITS = ("train", "heldout", "all")
MAX_CAPTION_BYTES = 64  # "a small yellow triangle in the lower right on a white background"
IMAGE_KEY, CAPTION_KEY = "png", "txt"  # file extensions in folders, sample keys in WebDataset shards
_COLOUR_NAMES = tuple(COLOURS)
_POLYGONS = {  # corners relative to the centre, in units of half the bounding box side
    "square": ((-1, -1), (1, -1), (1, 1), (-1, 1)),
    "triangle": ((0, -1), (1, 1), (-1, 1)),
    "diamond": ((0, -1), (1, 0), (0, 1), (-1, 0)),
}


@dataclass(frozen=True)
class ShapeCaption:
    """What a caption says. Fields a caption leaves out (lines 2 and 3) are ``None``."""

    shape: str
    colour: str  # of the shape
    background: str | None = None
    size: str | None = None
    position: str | None = None

    @property
    def text(self) -> str:
        words = ["a"] + ([self.size] if self.size else []) + [self.colour, self.shape]
        if self.position:
            words += ["in the", self.position]
        if self.background:
            words += ["on a", self.background, "background"]
        return " ".join(words)

    def lines(self) -> list[str]:
        """The caption file of an image with every attribute set: full, then two shorter phrasings."""
        short = ShapeCaption(self.shape, self.colour, background=self.background)
        no_bg = ShapeCaption(self.shape, self.colour, size=self.size, position=self.position)
        return [self.text, short.text, no_bg.text]


_CAPTION_RE = re.compile(
    r"^an? (?:(?P<size>{sizes}) )?(?P<colour>{colours}) (?P<shape>{shapes})"
    r"(?: in the (?P<position>{positions}))?(?: on an? (?P<background>{colours}) background)?$".format(
        sizes="|".join(SIZES), colours="|".join(COLOURS), shapes="|".join(SHAPES), positions="|".join(POSITIONS)))


def parse_caption(text: str) -> ShapeCaption:
    """A shapes caption (any of the three phrasings) -> its attributes; a DataError for anything else."""
    m = _CAPTION_RE.match(text.strip().lower())
    if not m:
        raise DataError(f"not a shapes caption: {text!r} (expected e.g. 'a small red circle in the upper left "
                        f"on a blue background')")
    return ShapeCaption(**m.groupdict())


def is_held_out(shape: str, colour: str, background: str) -> bool:
    """Whether a (shape, colour, background) triple is reserved for evaluation (see module docstring)."""
    s, c, b = SHAPES.index(shape), _COLOUR_NAMES.index(colour), _COLOUR_NAMES.index(background)
    return (s + 2 * c + 3 * b) % 7 == 0


def _triples(split: str) -> list[tuple[str, str, str]]:
    if split not in SPLITS:
        raise DataError(f"shapes split must be one of {', '.join(SPLITS)}; got {split!r}")
    out = [(s, c, b) for s in SHAPES for c in COLOURS for b in COLOURS if b != c]
    if split == "all":
        return out
    return [t for t in out if is_held_out(*t) == (split == "heldout")]


def captions(split: str = "heldout") -> list[ShapeCaption]:
    """Every full caption of a split (fixed order): 'heldout' for evaluation, 'train', or 'all'."""
    return [ShapeCaption(s, c, b, size, pos) for s, c, b in _triples(split) for size in SIZES for pos in POSITIONS]


# ------------------------------------------------------------------------------------------ drawing

def render(caption: ShapeCaption, size: int = 64, rng: np.random.Generator | None = None) -> Image.Image:
    """Draw the image a full caption describes, ``size`` x ``size`` RGB. ``rng`` jitters the shape's
    centre (up to 4% of the side) and scale (+-10%); without it the shape sits exactly on the grid."""
    if caption.background is None or caption.size is None or caption.position is None:
        raise DataError(f"render needs a full caption (shape, colour, background, size, position): {caption}")
    cx, cy = POSITIONS[caption.position]
    half = SIZES[caption.size] / 2
    if rng is not None:
        cx, cy = cx + rng.uniform(-0.04, 0.04), cy + rng.uniform(-0.04, 0.04)
        half *= rng.uniform(0.9, 1.1)
    cx, cy, half = cx * size, cy * size, half * size
    img = Image.new("RGB", (size, size), COLOURS[caption.background])
    draw = ImageDraw.Draw(img)
    fill = COLOURS[caption.colour]
    if caption.shape == "circle":
        draw.ellipse([cx - half, cy - half, cx + half, cy + half], fill=fill)
    else:
        draw.polygon([(cx + dx * half, cy + dy * half) for dx, dy in _POLYGONS[caption.shape]], fill=fill)
    return img


def sample(index: int, seed: int = 0, size: int = 64, split: str = "train") -> tuple[Image.Image, ShapeCaption]:
    """Sample ``index`` of the data set with this seed: (image, its full caption)."""
    rng = np.random.default_rng([seed, index])
    triples = _triples(split)
    shape, colour, background = triples[rng.integers(len(triples))]
    cap = ShapeCaption(shape, colour, background, str(rng.choice(list(SIZES))), str(rng.choice(list(POSITIONS))))
    return render(cap, size, rng), cap


def samples(n: int, seed: int = 0, size: int = 64, split: str = "train") -> Iterator[tuple[str, bytes, str]]:
    """``(key, png bytes, caption file text)`` for samples ``0 .. n-1``."""
    _check_args(n, size, seed)
    for i in range(n):
        img, cap = sample(i, seed, size, split)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        yield f"{i:06d}", buf.getvalue(), "\n".join(cap.lines()) + "\n"


def _check_args(n: int, size: int, seed: int, shard_size: int = 1) -> None:
    if n < 1:
        raise DataError(f"--n must be >= 1, got {n}")
    if size < 8:
        raise DataError(f"--size must be >= 8 pixels, got {size}")
    if seed < 0:
        raise DataError(f"--seed must be >= 0, got {seed}")
    if shard_size < 1:
        raise DataError(f"--shard-size must be >= 1, got {shard_size}")


# ------------------------------------------------------------------------------------------ writing

def write_folder(out: str | os.PathLike, n: int, seed: int = 0, size: int = 64, split: str = "train") -> Path:
    """``out/<key>.png`` + ``out/<key>.txt`` for every sample. Returns ``out``."""
    _check_args(n, size, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for key, png, text in samples(n, seed, size, split):
        (out / f"{key}.{IMAGE_KEY}").write_bytes(png)
        (out / f"{key}.{CAPTION_KEY}").write_text(text, encoding="utf-8")
    return out


def write_shards(out: str | os.PathLike, n: int, seed: int = 0, size: int = 64, split: str = "train",
                 shard_size: int = 1000) -> list[Path]:
    """WebDataset shards ``out/shapes-000000.tar ...`` (``shard_size`` samples each; keys ``png`` and
    ``txt``), written with webdataset's TarWriter. Returns the shard paths."""
    import webdataset as wds

    _check_args(n, size, seed, shard_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    writer = None
    try:
        for i, (key, png, text) in enumerate(samples(n, seed, size, split)):
            if i % shard_size == 0:
                if writer is not None:
                    writer.close()
                paths.append(out / f"shapes-{len(paths):06d}.tar")
                # fixed mtime/owner/mode: the same samples give byte-identical shards
                writer = wds.TarWriter(str(paths[-1]), encoder=False, mtime=0, user="efftx", group="efftx", mode=0o644)
            writer.write({"__key__": key, IMAGE_KEY: png, CAPTION_KEY: text.encode("utf-8")})
    finally:
        if writer is not None:
            writer.close()
    return paths


def shard_pattern(paths: list[Path]) -> str:
    """The brace pattern naming ``paths`` written by :func:`write_shards`, e.g. ``DIR/shapes-{000000..000003}.tar``."""
    if len(paths) == 1:
        return str(paths[0])
    return str(paths[0].parent / f"shapes-{{{0:06d}..{len(paths) - 1:06d}}}.tar")


def ensure(cache_dir: str | os.PathLike, n: int, seed: int = 0, size: int = 64, fmt: str = "folder",
           split: str = "train") -> Path:
    """The shapes data set under ``cache_dir`` (a folder, or a folder of shards), generated once.

    Written into a temporary folder and renamed into place, so concurrent callers (several workers)
    never see a partial data set; whoever renames first wins, the others discard identical copies.
    """
    if fmt not in ("folder", "wds"):
        raise DataError(f"shapes format must be 'folder' or 'wds', got {fmt!r}")
    _check_args(n, size, seed)
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"shapes-{split}-s{seed}-n{n}-px{size}-{fmt}"
    if final.is_dir():
        return final
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{final.name}."))
    try:
        if fmt == "folder":
            write_folder(tmp, n, seed, size, split)
        else:
            write_shards(tmp, n, seed, size, split)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# ------------------------------------------------------------------------------------------ CLI

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.data.shapes",
                                description="Write the synthetic captioned shapes data set (png + txt).")
    p.add_argument("--out", required=True, help="output folder (created; must be empty if it exists)")
    p.add_argument("--n", type=int, required=True, help="number of images")
    p.add_argument("--format", choices=("folder", "wds"), default="folder",
                   help="folder: <key>.png + <key>.txt files; wds: WebDataset .tar shards (keys png, txt)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=SPLITS, default="train",
                   help="train: no held-out combination; heldout: only those; all: both")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard (wds only)")
    args = p.parse_args(argv)
    out = Path(args.out)
    try:
        _check_args(args.n, args.size, args.seed, args.shard_size)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise DataError(f"--out {out} exists and is not an empty folder")
        if args.format == "folder":
            write_folder(out, args.n, args.seed, args.size, args.split)
            where = str(out)
        else:
            where = shard_pattern(write_shards(out, args.n, args.seed, args.size, args.split, args.shard_size))
    except (DataError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.n} {args.split} samples ({args.size}x{args.size}, seed {args.seed}) to {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

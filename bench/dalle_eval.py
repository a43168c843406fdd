"""Do DALL-E's images follow their captions? Read from pixels, for captions it never saw, beside chance.

    python bench/dalle_eval.py [--quick] [--pair _shapes_small|_shapes_debug] [--vae PATH|models:/NAME/VERSION]
        [--dalle PATH|models:/NAME/VERSION] [--dvae-steps N] [--dalle-steps N] [--captions N]
        [--filter-thres F] [--temperature T] [--cond-scale S] [--threads N] [--save DIR] [--out DIR]

**Models.** ``--dalle``: an exported DALL-E (its dVAE inside) is evaluated as it is. Otherwise the pair
``dvae<pair>`` / ``dalle<pair>`` of :mod:`efftx.recipes` is trained here, in this process (a plain AdamW
loop with the recipe's learning-rate schedule, clipping and effective batch ``micro_batch_size x
grad_accum x num_workers``; no Ray, no DeepSpeed), on the recipe's synthetic shapes (the ``train``
split); ``--vae`` skips the dVAE's training and uses that export. ``--save DIR`` exports what was trained
(``DIR/dvae``, ``DIR/dalle``), so a later run can evaluate other sampling settings with ``--dalle DIR/dalle``.

**Captions.** ``shapes.captions("heldout")``: the (shape, colour, background) triples the ``train``
split never draws, at every size and position (240 captions), in their full phrasing; ``--captions N``
takes N of them, evenly spaced. One image per caption.

**Reading an image** (:func:`read_image`, checked on rendered shapes by ``tests/test_dalle_bench.py``):
every pixel gets its nearest palette colour (``shapes.COLOURS``, RGB distance); the *background* is the
most common colour of the border ring; the *shape* pixels are the others, and the shape's *colour* is
their most common colour. Shape kind and size: the template (each of the 4 shapes x 2 sizes x 3 scales,
drawn by ``shapes.render`` centred on the shape pixels' centroid) of highest IoU with the shape
pixels; *position*: the centroid, corrected by that template's centroid offset (a triangle's centroid
lies below its box centre), nearest of the 5 positions. An image without shape pixels reads as no
shape: wrong on everything but the background.

**Rows of the table.** ``ground truth``: ``shapes.render`` of the captions (jittered as the training
data), the reader's own accuracy, an upper bound; ``dVAE reconstruction``: those images through the
dVAE's codes and back, the best DALL-E can do with this dVAE; ``DALL-E``: generated images;
``DALL-E, shuffled captions``: the same images scored against a derangement of the captions, the
chance level of this model's output distribution. Beside them ``chance`` (1 / number of classes) and
the base rate of the most common class among the evaluated captions (what always answering it scores).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from efftx.data import shapes

COLOUR_NAMES = tuple(shapes.COLOURS)
PALETTE = np.array([shapes.COLOURS[c] for c in COLOUR_NAMES], dtype=np.float32)  # (7, 3) RGB
ATTRIBUTES = ("colour", "background", "shape", "size", "position")
CLASSES = {"colour": COLOUR_NAMES, "background": COLOUR_NAMES, "shape": shapes.SHAPES,
           "size": tuple(shapes.SIZES), "position": tuple(shapes.POSITIONS)}
SCALES = (0.9, 1.0, 1.1)  # template scales: render jitters the shape's scale by +-10%


# ------------------------------------------------------------------------------------------ reading pixels

@dataclass(frozen=True)
class Reading:
    """What an image shows, read from its pixels. ``None``: no shape pixels to read it from."""

    colour: str | None
    background: str
    shape: str | None
    size: str | None
    position: str | None


def to_array(image) -> np.ndarray:
    """A Pillow image, a (C, S, S) float tensor in [0, 1] or an (S, S, 3) uint8 array -> (S, S, 3) uint8."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"))
    if isinstance(image, torch.Tensor):
        return (image.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return np.asarray(image)


def palette_index(pixels: np.ndarray) -> np.ndarray:
    """(..., 3) RGB in [0, 255] -> (...) index of the nearest palette colour (``COLOUR_NAMES`` order)."""
    d = ((pixels[..., None, :].astype(np.float32) - PALETTE) ** 2).sum(-1)
    return d.argmin(-1)


def _majority(indices: np.ndarray) -> int:
    return int(np.bincount(indices.ravel(), minlength=len(COLOUR_NAMES)).argmax())


class _Fixed:
    """Stands in for ``shapes.render``'s random generator: render draws ``uniform`` three times (centre x
    offset, centre y offset, scale); this returns fixed values instead, to draw a template anywhere."""

    def __init__(self, dx: float, dy: float, scale: float):
        self._values = iter((dx, dy, scale))

    def uniform(self, low: float, high: float) -> float:
        return next(self._values)


def _template(shape: str, size: str, scale: float, side: int, cx: float = 0.5, cy: float = 0.5) -> np.ndarray:
    """(side, side) bool mask of a shape drawn by ``shapes.render`` centred at (cx, cy) (fractions of the side)."""
    cap = shapes.ShapeCaption(shape, "white", "black", size, "center")
    return np.asarray(shapes.render(cap, side, _Fixed(cx - 0.5, cy - 0.5, scale)))[..., 0] > 128


def _centroid(mask: np.ndarray) -> tuple[float, float]:
    """Centroid of a mask's pixels as fractions of the side (pixel i covers [i, i + 1))."""
    ys, xs = np.nonzero(mask)
    side = mask.shape[0]
    return (xs.mean() + 0.5) / side, (ys.mean() + 0.5) / side


@functools.lru_cache(maxsize=None)
def _centroid_offset(shape: str, size: str, scale: float, side: int) -> tuple[float, float]:
    """How far a shape's pixel centroid lies from the centre it was drawn at (fractions of the side)."""
    x, y = _centroid(_template(shape, size, scale, side))
    return x - 0.5, y - 0.5


def _match_template(mask: np.ndarray) -> tuple[str, str, tuple[float, float]]:
    """(shape, size, drawn centre) of the template of highest IoU with ``mask``, each candidate drawn so
    that its centroid falls on the mask's."""
    side = mask.shape[0]
    mx, my = _centroid(mask)
    best, best_iou = None, -1.0
    for shape in shapes.SHAPES:
        for size in shapes.SIZES:
            for scale in SCALES:
                ox, oy = _centroid_offset(shape, size, scale, side)
                t = _template(shape, size, scale, side, mx - ox, my - oy)
                iou = (t & mask).sum() / max((t | mask).sum(), 1)
                if iou > best_iou:
                    best, best_iou = (shape, size, (mx - ox, my - oy)), iou
    return best


def read_image(image) -> Reading:
    """Read an image's background, shape colour, shape kind, size and position (see the module docstring)."""
    idx = palette_index(to_array(image))  # (S, S)
    side = idx.shape[0]
    ring = max(1, side // 16)
    border = np.concatenate([idx[:ring].ravel(), idx[-ring:].ravel(), idx[:, :ring].ravel(), idx[:, -ring:].ravel()])
    background = _majority(border)
    mask = idx != background
    if not mask.any():
        return Reading(None, COLOUR_NAMES[background], None, None, None)
    colour = _majority(idx[mask])
    shape, size, (cx, cy) = _match_template(mask)
    position = min(shapes.POSITIONS, key=lambda p: math.dist(shapes.POSITIONS[p], (cx, cy)))
    return Reading(COLOUR_NAMES[colour], COLOUR_NAMES[background], shape, size, position)


def accuracy(readings: Sequence[Reading], captions: Sequence[shapes.ShapeCaption]) -> dict[str, float]:
    """Fraction of images whose reading agrees with the caption, per attribute, and ``colours``: both
    the shape's and the background's colour right."""
    if len(readings) != len(captions) or not captions:
        raise ValueError(f"{len(readings)} readings for {len(captions)} captions")
    hits = {a: [getattr(r, a) == getattr(c, a) for r, c in zip(readings, captions)] for a in ATTRIBUTES}
    hits["colours"] = [a and b for a, b in zip(hits["colour"], hits["background"])]
    return {a: float(np.mean(h)) for a, h in hits.items()}


def chance(captions: Sequence[shapes.ShapeCaption]) -> tuple[dict[str, float], dict[str, float]]:
    """(1 / number of classes, the base rate of the most common class among ``captions``) per attribute;
    ``colours`` (both right): 1 / (colours x backgrounds), and the most common (colour, background) pair."""
    uniform = {a: 1 / len(CLASSES[a]) for a in ATTRIBUTES}
    uniform["colours"] = 1 / (len(COLOUR_NAMES) * (len(COLOUR_NAMES) - 1))  # the background never is the colour
    values = {a: [getattr(c, a) for c in captions] for a in ATTRIBUTES}
    values["colours"] = list(zip(values["colour"], values["background"]))
    majority = {a: max(v.count(x) for x in set(v)) / len(v) for a, v in values.items()}
    return uniform, majority


def derangement(n: int, seed: int = 0) -> np.ndarray:
    """A permutation of range(n) that moves every index (n >= 2): a random shift of a random order."""
    order = np.random.default_rng(seed).permutation(n)
    out = np.empty(n, dtype=np.int64)
    out[order] = np.roll(order, 1)
    return out


# ------------------------------------------------------------------------------------------ models

def _log(message: str) -> None:
    print(f"[dalle_eval] {message}", file=sys.stderr, flush=True)


def train_in_process(model, cfg, data, loss_of, steps: int, label: str) -> list[float]:
    """A plain training loop: AdamW (weight decay on matrices) with the recipe's lr schedule and clipping,
    one batch of ``micro_batch_size x grad_accum x num_workers`` samples per step (the Ray run's effective
    batch), ``data.batch(step, 0, batch)``. ``loss_of(model, images, text, step) -> loss``. Returns the
    losses, logged every ~10% of the run."""
    from efftx.train.engine import lr_lambda, param_groups

    t = cfg.train
    batch = t.micro_batch_size * t.grad_accum * cfg.scaling.num_workers
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    model.train()
    losses, t0 = [], time.perf_counter()
    for step in range(steps):
        images, text = data.batch(step, 0, batch)
        loss = loss_of(model, images, text, step)
        loss.backward()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            _log(f"{label} step {step + 1}/{steps} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f}s)")
    return losses


def _data(cfg, text_seq_len: int):
    from efftx.data.images import ImageTextData

    return ImageTextData(cfg.data, image_size=cfg.vae.image_size, channels=cfg.vae.channels,
                         text_seq_len=text_seq_len, seed=cfg.train.seed)


def load_export_of(source: str, family: str):
    """(model, cfg) of an export folder or models:/ URI, which must be of ``family``; ExportError otherwise."""
    from efftx.errors import ExportError
    from efftx.export import load_export, resolve_export

    model, cfg, _ = load_export(resolve_export(source))
    if cfg.model.family != family:
        raise ExportError(f"{source} is a {cfg.model.family!r} export, not a {family!r} one")
    return model.eval(), cfg


def build_models(args) -> tuple[torch.nn.Module, object, dict]:
    """(DALL-E with its dVAE, caption tokenizer, what was done) from --dalle, or trained here (see docstring)."""
    from efftx import recipes
    from efftx.models.dalle import DALLE
    from efftx.models.dvae import DiscreteVAE, temperature

    if args.dalle:
        from efftx.generation.text_to_image import DalleGenerator

        gen = DalleGenerator.load(args.dalle)
        return gen.model, gen.tokenizer, {"dalle": args.dalle}
    done = {}
    if args.vae:
        vae, vae_cfg = load_export_of(args.vae, "dvae")
        done["dvae"] = args.vae
    else:
        vae_cfg = recipes.get(f"dvae{args.pair}")
        torch.manual_seed(vae_cfg.train.seed)
        vae = DiscreteVAE(vae_cfg.vae)
        steps = args.dvae_steps or vae_cfg.train.steps
        t0 = time.perf_counter()
        losses = train_in_process(vae, vae_cfg, _data(vae_cfg, 0),
                                  lambda m, images, _, step: m(images, temperature(vae_cfg.vae, step))[0],
                                  steps, "dvae")
        done["dvae"] = {"recipe": vae_cfg.recipe, "steps": steps, "seconds": round(time.perf_counter() - t0),
                        "loss": [round(losses[0], 4), round(float(np.mean(losses[-10:])), 4)]}
        vae.eval()
        if args.save:
            from efftx.export import export

            export(vae, vae_cfg, Path(args.save) / "dvae", {"trained_by": "bench/dalle_eval.py"})

    cfg = recipes.get(f"dalle{args.pair}")
    cfg.vae = vae_cfg.vae  # as DALLETask.configure: the dVAE's own section
    data = _data(cfg, cfg.dalle.text_seq_len)
    cfg.model.vocab_size = data.tokenizer.vocab_size
    cfg.name = "dalle_eval"
    cfg.validate()
    torch.manual_seed(cfg.train.seed)
    model = DALLE(cfg.model, cfg.attention, cfg.dalle, cfg.vae, seed=cfg.train.seed, vae=vae)
    steps = args.dalle_steps or cfg.train.steps
    t0 = time.perf_counter()
    losses = train_in_process(model, cfg, data, lambda m, images, text, _: m(text, images)[0], steps, "dalle")
    done["dalle"] = {"recipe": cfg.recipe, "steps": steps, "seconds": round(time.perf_counter() - t0),
                     "loss": [round(losses[0], 4), round(float(np.mean(losses[-10:])), 4)]}
    if args.save:
        from efftx.export import export

        export(model, cfg, Path(args.save) / "dalle", {"trained_by": "bench/dalle_eval.py"})
    return model.eval(), data.tokenizer, done


# ------------------------------------------------------------------------------------------ evaluation

def evaluation_captions(n: int | None) -> list[shapes.ShapeCaption]:
    """The held-out captions, or ``n`` of them evenly spaced (every triple, size and position still mixed)."""
    caps = shapes.captions("heldout")
    if n is None or n >= len(caps):
        return caps
    if n < 2:
        raise SystemExit(f"error: --captions must be >= 2, got {n}")
    return [caps[i] for i in np.linspace(0, len(caps) - 1, n).round().astype(int)]


@torch.no_grad()
def generate(model, tokenizer, captions: Sequence[shapes.ShapeCaption], args) -> torch.Tensor:
    """One image per caption: (P, C, S, S) in [0, 1], in chunks of --batch-size, seed ``args.seed + chunk``."""
    from efftx.data.text_tokens import tokenize_batch
    from efftx.generation.images import generate_images

    text = tokenize_batch(tokenizer, [c.text for c in captions], model.text_seq_len)
    out = []
    for j, start in enumerate(range(0, len(captions), args.batch_size)):
        images, _ = generate_images(model, text[start:start + args.batch_size], filter_thres=args.filter_thres,
                                    temperature=args.temperature, cond_scale=args.cond_scale, seed=args.seed + j)
        out.append(images)
    return torch.cat(out)


def print_table(rows: dict[str, dict[str, float]], uniform: dict[str, float], majority: dict[str, float]) -> None:
    cols = (*ATTRIBUTES, "colours")
    heads = {"colour": "colour", "background": "backgrnd", "shape": "shape", "size": "size",
             "position": "position", "colours": "both col."}
    print(f"{'':<30}" + "".join(f"{heads[c]:>10}" for c in cols))
    for label, acc in (("chance (1 / classes)", uniform), ("majority-class base rate", majority), *rows.items()):
        print(f"{label:<30}" + "".join(f"{acc[c]:>10.1%}" for c in cols))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: the _shapes_debug pair, 40 + 60 steps, 48 captions (~2 minutes on 2 cores)")
    p.add_argument("--pair", default=None, help="recipe pair suffix: _shapes_small (default) or _shapes_debug")
    p.add_argument("--vae", default="", help="a trained dVAE (export folder or models:/NAME/VERSION): "
                                             "train only DALL-E")
    p.add_argument("--dalle", default="", help="a trained DALL-E export or models:/ URI: evaluate it, train nothing")
    p.add_argument("--dvae-steps", type=int, default=0, help="dVAE steps (default: the recipe's train.steps)")
    p.add_argument("--dalle-steps", type=int, default=0, help="DALL-E steps (default: the recipe's train.steps)")
    p.add_argument("--captions", type=int, default=None, help="held-out captions to evaluate (default: all 240)")
    p.add_argument("--filter-thres", type=float, default=0.9, help="top-k keeps the top (1 - F) of the codes")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--cond-scale", type=float, default=1.0,
                   help="guidance; the shapes recipes train without caption dropout (dalle.null_cond_prob=0)")
    p.add_argument("--batch-size", type=int, default=60, help="images generated at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--save", default="", help="export the models trained here into DIR/dvae and DIR/dalle")
    p.add_argument("--out", default="", help="write DIR/samples.png: ground truth, reconstruction, generated")
    args = p.parse_args(argv)
    if args.quick:
        args.pair = args.pair or "_shapes_debug"
        args.dvae_steps = args.dvae_steps or 40
        args.dalle_steps = args.dalle_steps or 60
        args.captions = args.captions or 48
    args.pair = args.pair or "_shapes_small"
    if args.dalle and args.vae:
        p.error("--dalle already holds its dVAE: give --dalle or --vae, not both")
    for name in ("dvae_steps", "dalle_steps", "batch_size", "threads"):
        if getattr(args, name) < 0 or (name in ("batch_size", "threads") and getattr(args, name) < 1):
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    from efftx.errors import EfftxError

    try:
        model, tokenizer, done = build_models(args)
    except EfftxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    caps = evaluation_captions(args.captions)
    side = model.vae.image_size
    truth = [shapes.render(c, side, np.random.default_rng([args.seed, i])) for i, c in enumerate(caps)]
    truth_t = torch.stack([torch.from_numpy(to_array(im)).permute(2, 0, 1).float() / 255 for im in truth])
    recon = torch.cat([model.vae.reconstruct(truth_t[i:i + 64]) for i in range(0, len(caps), 64)])
    t0 = time.perf_counter()
    generated = generate(model, tokenizer, caps, args)
    gen_seconds = time.perf_counter() - t0

    readings = {"ground truth (render)": [read_image(im) for im in truth],
                "dVAE reconstruction": [read_image(im) for im in recon],
                "DALL-E generated": [read_image(im) for im in generated]}
    rows = {label: accuracy(r, caps) for label, r in readings.items()}
    shuffled = [caps[j] for j in derangement(len(caps), args.seed)]
    rows["DALL-E vs shuffled captions"] = accuracy(readings["DALL-E generated"], shuffled)
    uniform, majority = chance(caps)

    print(f"\n{json.dumps(done)}")
    print(f"held-out captions: {len(caps)} of {len(shapes.captions('heldout'))} (shape/colour/background triples "
          f"never in training), {side}x{side} images, one each; sampling filter_thres {args.filter_thres}, "
          f"temperature {args.temperature}, cond_scale {args.cond_scale}; generation {gen_seconds:.1f}s; "
          f"{args.threads} torch threads; total {time.perf_counter() - t_start:.0f}s")
    print_table(rows, uniform, majority)
    if args.out:
        from efftx.generation.png import grid

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        n = min(8, len(caps))
        pics = [im for i in range(n) for im in (truth_t[i], recon[i], generated[i])]
        labels = [s for c in caps[:n] for s in (c.text, "dVAE reconstruction", "DALL-E")]
        grid(pics, labels, columns=6, cell=128).save(out / "samples.png")
        print(f"samples: {out / 'samples.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

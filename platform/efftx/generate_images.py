"""Generate images from text with an exported DALL-E (its frozen dVAE inside), as PNG files and a grid.

    python -m efftx.generate_images --model PATH|models:/NAME/VERSION --prompt TEXT [--prompt TEXT ...]
        [--num-images N] [--out DIR] [--filter-thres F | --top-k K] [--top-p P] [--temperature T]
        [--cond-scale S] [--seed S] [--batch-size B] [--device D]

For each prompt, ``DIR/<prompt as a file name>/<i>.png`` (i = 0 .. N-1), and ``DIR/grid.png`` with every
image under its prompt; the last line printed is a JSON object listing the files. As the original repository's
generate.py, except PNG instead of JPEG and no ``--gentxt`` (see docs/dalle.md).

Library API (also what an image endpoint uses)::

    gen = DalleGenerator.load("runs/x/export")            # or "models:/dalle_shapes_debug/1"
    images = gen.generate(["a red circle on a blue background"], num_images=2, seed=0)   # (2, C, S, S) in [0, 1]
    png = png_bytes(images[0])                             # efftx.generation.png

The captions are tokenized as in training: the export's ``tokenizer.json`` when it has one (trained with
``data.image.bpe_path``), else bytes. Prompts longer than ``dalle.text_seq_len`` tokens are cut (and reported).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from efftx.errors import EfftxError, ExportError


def check_sampling(*, num_images: int = 1, filter_thres: float = 0.9, top_p: float = 1.0, temperature: float = 1.0,
                   cond_scale: float = 1.0, batch_size: int | None = None) -> None:
    """Sampling arguments, checked before any model is loaded; ExportError naming the argument."""
    problems = []
    if num_images < 1:
        problems.append(f"num_images must be >= 1, got {num_images}")
    if batch_size is not None and batch_size < 1:
        problems.append(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= filter_thres <= 1:
        problems.append(f"filter_thres must be in [0, 1], got {filter_thres}")
    if not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {top_p}")
    if not temperature >= 0:
        problems.append(f"temperature must be >= 0, got {temperature}")
    if not (math.isfinite(cond_scale) and cond_scale >= 0):
        problems.append(f"cond_scale must be a finite number >= 0, got {cond_scale}")
    if problems:
        raise ExportError("; ".join(problems))


@dataclass
class DalleGenerator:
    """An exported DALL-E ready to draw: the model (eval mode), its run config and caption tokenizer."""

    model: torch.nn.Module
    cfg: Any  # efftx.config.Config of the export
    tokenizer: Any  # efftx.data.text_tokens.Tokenizer
    source: str

    @classmethod
    def load(cls, source: str, device: str | torch.device = "cpu", tracking_uri: str = "") -> "DalleGenerator":
        """From an export folder or an MLflow registered model (models:/NAME/VERSION or models:/NAME@ALIAS)."""
        from efftx.data.text_tokens import HFTokenizer, load_tokenizer
        from efftx.train.checkpoint import load_export, read_export_config, resolve_export
        from efftx.train.tasks import DALLETask

        path = resolve_export(source, tracking_uri)
        cfg, _ = read_export_config(path)
        if cfg.model.family != "dalle":
            raise ExportError(f"{source} is a {cfg.model.family!r} export, not a DALL-E (model.family=dalle)")
        token_file = path / DALLETask.TOKENIZER_FILE
        if token_file.is_file():
            tokenizer = HFTokenizer(token_file.read_text(encoding="utf-8"), source=str(token_file))
        else:
            tokenizer = load_tokenizer(cfg.data.image.bpe_path)  # bytes, or the training machine's JSON
        if tokenizer.vocab_size != cfg.model.vocab_size:
            raise ExportError(f"the tokenizer of {source} has {tokenizer.vocab_size} ids, the model "
                              f"model.vocab_size={cfg.model.vocab_size}")
        model, _, _ = load_export(path, device)
        return cls(model, cfg, tokenizer, source)

    @property
    def image_size(self) -> int:
        return self.cfg.vae.image_size

    @property
    def channels(self) -> int:
        return self.cfg.vae.channels

    @property
    def text_seq_len(self) -> int:
        return self.cfg.dalle.text_seq_len

    def encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, list[bool]]:
        """Prompts -> ((P, text_seq_len) caption ids, which prompts were cut to fit). Empty prompts are an error."""
        from efftx.data.text_tokens import tokenize_batch

        if not prompts or any(not p.strip() for p in prompts):
            raise ExportError("every prompt must hold some text")
        cut = [len(self.tokenizer.encode(p)) > self.text_seq_len for p in prompts]
        return tokenize_batch(self.tokenizer, list(prompts), self.text_seq_len, truncate=True), cut

    @torch.no_grad()
    def generate(self, prompts: Sequence[str], *, num_images: int = 1, filter_thres: float = 0.9, top_p: float = 1.0,
                 temperature: float = 1.0, cond_scale: float = 1.0, seed: int | None = None,
                 batch_size: int | None = None, use_cache: bool = True) -> torch.Tensor:
        """``num_images`` images per prompt: (P * num_images, C, S, S) float in [0, 1], row ``p * num_images + i``
        = image i of prompt p, drawn with its own seed ``seed + i`` (as the image server does), so an image does
        not depend on ``batch_size`` (images drawn at once; default: a prompt's images at once)."""
        from efftx.generation.images import generate_images

        check_sampling(num_images=num_images, filter_thres=filter_thres, top_p=top_p, temperature=temperature,
                       cond_scale=cond_scale, batch_size=batch_size)
        text, _ = self.encode(prompts)
        sampling = {"filter_thres": filter_thres, "top_p": top_p, "temperature": temperature,
                    "cond_scale": cond_scale, "use_cache": use_cache}
        chunk = batch_size or num_images
        out = []
        for p in range(len(prompts)):
            for start in range(0, num_images, chunk):
                n = min(chunk, num_images - start)
                seeds = [None if seed is None else seed + start + i for i in range(n)]
                images, _ = generate_images(self.model, text[p:p + 1], num_images=n, seed=seeds, **sampling)
                out.append(images.float().cpu())
        return torch.cat(out)


def slug(prompt: str, limit: int = 100) -> str:
    """A prompt as a folder name: word characters kept, everything else an underscore, at most ``limit`` long."""
    return re.sub(r"[^\w\-]+", "_", prompt.strip()).strip("_")[:limit] or "prompt"


def write_images(images: torch.Tensor, prompts: Sequence[str], out_dir: str | Path, num_images: int) -> dict[str, Any]:
    """PNG files of :meth:`DalleGenerator.generate`'s output: one folder per prompt, and a captioned grid."""
    from efftx.generation.png import grid, png_bytes

    out = Path(out_dir)
    files, captions = [], []
    for p, prompt in enumerate(prompts):
        folder = out / slug(prompt)
        if sum(slug(q) == slug(prompt) for q in prompts[:p]):  # two prompts with the same folder name
            folder = out / f"{slug(prompt)}_{p}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(num_images):
            path = folder / f"{i}.png"
            path.write_bytes(png_bytes(images[p * num_images + i]))
            files.append(str(path))
            captions.append(prompt)
    grid_path = out / "grid.png"
    grid(list(images), captions, columns=min(8, max(num_images, 4)), cell=max(128, images.shape[-1])).save(grid_path)
    return {"images": files, "grid": str(grid_path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--model", required=True, help="DALL-E export folder, or models:/NAME/VERSION of the MLflow registry")
    p.add_argument("--prompt", action="append", required=True, help="caption to draw (repeatable)")
    p.add_argument("--num-images", type=int, default=4, help="images per prompt")
    p.add_argument("--out", default="outputs", help="folder for the PNG files (default: ./outputs)")
    k = p.add_mutually_exclusive_group()
    k.add_argument("--filter-thres", type=float, default=0.9,
                   help="keep the top (1 - F) of the image codes at each step (the original's --top_k 0.9)")
    k.add_argument("--top-k", type=int, help="keep the K most likely image codes at each step (instead of --filter-thres)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--cond-scale", type=float, default=1.0, help="classifier-free guidance scale (1 = none)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=8, help="images drawn at once")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    try:
        if args.top_k is not None and args.top_k < 1:
            raise ExportError(f"--top-k must be >= 1, got {args.top_k}")
        check_sampling(num_images=args.num_images, filter_thres=args.filter_thres, top_p=args.top_p,
                       temperature=args.temperature, cond_scale=args.cond_scale, batch_size=args.batch_size)
        gen = DalleGenerator.load(args.model, args.device)
        filter_thres = args.filter_thres
        if args.top_k is not None:  # top-k of K codes = filter_thres 1 - k / K (efftx.generation.images)
            filter_thres = 1 - min(args.top_k, gen.model.num_image_tokens) / gen.model.num_image_tokens
        _, cut = gen.encode(args.prompt)
        for prompt, was_cut in zip(args.prompt, cut):
            if was_cut:
                print(f"note: prompt cut to dalle.text_seq_len={gen.text_seq_len} tokens: {prompt[:60]!r}",
                      file=sys.stderr)
        t0 = time.perf_counter()
        images = gen.generate(args.prompt, num_images=args.num_images, filter_thres=filter_thres, top_p=args.top_p,
                              temperature=args.temperature, cond_scale=args.cond_scale, seed=args.seed,
                              batch_size=args.batch_size)
        seconds = time.perf_counter() - t0
        written = write_images(images, args.prompt, args.out, args.num_images)
    except EfftxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"model": args.model, "prompts": args.prompt, "seconds": round(seconds, 3),
                      "image_size": gen.image_size, **written}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

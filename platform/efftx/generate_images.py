"""Generate images from text with an exported DALL-E (its frozen dVAE inside), as PNG files and a grid.

    python -m efftx.generate_images --model PATH|models:/NAME/VERSION --prompt TEXT [--prompt TEXT ...]
        [--num-images N] [--out DIR] [--filter-thres F | --top-k K] [--top-p P] [--temperature T]
        [--cond-scale S] [--seed S] [--batch-size B] [--device D]

For each prompt, ``DIR/<prompt as a file name>/<i>.png`` (i = 0 .. N-1), and ``DIR/grid.png`` with every
image under its prompt; the last line printed is a JSON object listing the files. As the original repository's
generate.py, except PNG instead of JPEG and no ``--gentxt`` (see docs/dalle.md).

The library API (what the image endpoint uses too) is :class:`efftx.generation.text_to_image.DalleGenerator`;
this module only parses arguments and writes files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from efftx.errors import EfftxError, ExportError
from efftx.generation.text_to_image import DalleGenerator, check_sampling  # noqa: F401  (the library API)


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

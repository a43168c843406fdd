"""Train each LM family's small recipe for the same token budget on the same data; compare.

    python bench/compare_lms.py [--recipes lm_small sinkhorn_small performer_small] [--steps 300] [--workers 2]

Every recipe runs through the same launch (Ray Train, DeepSpeed, 2 workers) with the same sequence
length, batch, steps and seed on the bundled corpus, so they see the same tokens. Prints validation
bits-per-byte, tokens/s and peak memory per worker, with ratios against the first recipe.
"""

from __future__ import annotations

import argparse
import time

from efftx import recipes
from efftx.train.launch import launch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["lm_small", "sinkhorn_small", "performer_small"])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()

    same = {"train.steps": args.steps, "scaling.num_workers": args.workers, "data.corpus": "bundled",
            "data.seq_len": 128, "train.micro_batch_size": 16, "train.grad_accum": 1, "train.seed": 0,
            "train.sample_every": 0, "train.checkpoint_every": args.steps}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for name in args.recipes:
        cfg = recipes.get(name).override(same).override(args.overrides)
        cfg.name = f"compare-{name}-{stamp}"
        s = launch(cfg)
        tokens = args.steps * args.workers * cfg.train.micro_batch_size * cfg.data.seq_len
        rows.append((name, tokens, s["val_bpb"], s["tokens_per_s"], s["peak_memory_mb"]))

    ref = rows[0]
    print(f"\nsame budget: {args.steps} steps x {args.workers} workers x 16 x 128 tokens = {ref[1]:,} tokens each")
    print(f"{'recipe':<18}{'val bpb':>9}{'vs ' + ref[0]:>18}{'tokens/s':>11}{'ratio':>8}{'peak MiB':>10}{'ratio':>8}")
    for name, _, bpb, tps, mem in rows:
        print(f"{name:<18}{bpb:>9.3f}{bpb - ref[2]:>+17.3f} {tps:>11,.0f}{tps / ref[3]:>7.2f}x{mem:>10.0f}{mem / ref[4]:>7.2f}x")


if __name__ == "__main__":
    main()

"""Train-step throughput and MFU of a recipe, against this machine's measured matmul peak.

    python bench/train_throughput.py [--recipe lm_small] [--steps 20] [--threads N] [--set key=value ...]

Both numbers are measured in the same process, one after the other, with the same thread count:
1. the fp32 peak: best time of large square matmuls (what this machine's BLAS can reach);
2. the train step of the recipe (forward + backward + AdamW, the model FLOPs the loop counts).
It prints tokens/s, achieved FLOP/s and MFU = achieved / peak. The step excludes Ray and DeepSpeed
overheads: it is the model's own cost (the loop's logged MFU includes those).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from efftx import recipes
from efftx.flops import measure_matmul_peak
from efftx.train.engine import lr_lambda, param_groups
from efftx import models


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="lm_small")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    cfg = recipes.get(args.recipe).override(args.overrides)
    cfg.name = "bench"
    cfg.validate()
    peak = max(measure_matmul_peak("cpu", torch.float32, n=n) for n in (1024, 2048))

    torch.manual_seed(0)
    model = models.build(cfg)
    opt = torch.optim.AdamW(param_groups(model, cfg.train.weight_decay), lr=cfg.train.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    b, t = cfg.train.micro_batch_size, cfg.data.seq_len
    data = torch.randint(0, cfg.model.vocab_size, (b, t + 1))

    def step() -> None:
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tok_s = b * t / median
    achieved = model.flops_per_token(t) * tok_s

    print(f"recipe {args.recipe}: {model.num_params():,} params, batch {b} x {t} tokens, {args.threads} threads")
    print(f"{'measure':<28}{'value':>16}")
    print(f"{'fp32 matmul peak':<28}{peak / 1e9:>12.1f} GFLOP/s")
    print(f"{'train step (median)':<28}{median * 1e3:>13.1f} ms")
    print(f"{'tokens/s':<28}{tok_s:>16,.0f}")
    print(f"{'achieved':<28}{achieved / 1e9:>12.1f} GFLOP/s")
    print(f"{'MFU (achieved / peak)':<28}{achieved / peak:>16.1%}")


if __name__ == "__main__":
    main()

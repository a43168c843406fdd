"""Eager vs compiled decoding tokens/s, side by side in one run (efftx.generation.compiled).

    python bench/compiled_decode.py [--recipe spec_target_small] [--new-tokens 64] [--prompt-len 32]
                                    [--batches 1,8] [--repeats 3] [--device cpu|cuda]

The model is the recipe's architecture with untrained weights (seeded), in eval mode. Each figure is the median of
``--repeats`` full ``generate`` calls (eager prefill + greedy steps; the prefill is the same eager pass on both
paths), with the device synchronised around each call on CUDA. The compiled path's first call (tracing and code
generation, for each batch size) is reported separately as its compile time and left out of its tokens/s.
``same`` says whether the compiled greedy tokens equal the eager ones. On a CPU the eager path is timed twice, side by
side: through eager decoding's plan (efftx.models.cpu_plan, the default) and through the module path
(``EFFTX_CPU_PLAN=off``); ``plan`` is their ratio, and ``same`` also holds the two paths' tokens together.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from efftx import recipes
from efftx.generation.decode import generate
from efftx.models import build, cpu_plan


def clock(fn, device: str) -> tuple[float, object]:
    """Seconds of one call of ``fn`` (after the device's queued work is done) and its result."""
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="spec_target_small")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device, n = args.device, args.new_tokens

    torch.manual_seed(0)
    model = build(recipes.get(args.recipe)).to(device).eval()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.recipe}: {model.num_params():,} params, {len(model.blocks)} layers, untrained; device {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load:.1f}")
    print(f"{n} new tokens after {args.prompt_len}, greedy; median of {args.repeats} calls")
    modules = device == "cpu"  # the eager module path beside the plan
    print(f"{'batch':>5}" + (f"{'module tok/s':>14}" if modules else "") + f"{'eager tok/s':>13}"
          + (f"{'plan':>7}" if modules else "") + f"{'compiled tok/s':>16}{'ratio':>8}{'compile s':>11}{'same':>6}")
    g = torch.Generator().manual_seed(0)
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = torch.randint(0, model.vocab_size, (batch, args.prompt_len), generator=g).to(device)

        def eager():
            return generate(model, prompts, n, temperature=0.0)

        def compiled():
            return generate(model, prompts, n, temperature=0.0, compile="on")

        def module_path():
            with cpu_plan.disabled():
                return generate(model, prompts, n, temperature=0.0)

        first_s, _ = clock(compiled, device)  # compiles for this batch size
        clock(eager, device)  # warm-up
        eager_s, compiled_s, module_s = [], [], []
        module_out = None
        for _ in range(args.repeats):  # interleaved, so load changes hit them alike
            if modules:
                t, module_out = clock(module_path, device)
                module_s.append(t)
            t, eager_out = clock(eager, device)
            eager_s.append(t)
            t, compiled_out = clock(compiled, device)
            compiled_s.append(t)
        e, c = statistics.median(eager_s), statistics.median(compiled_s)
        same = torch.equal(eager_out, compiled_out) and (module_out is None or torch.equal(module_out, eager_out))
        m = statistics.median(module_s) if modules else None
        print(f"{batch:>5}" + (f"{batch * n / m:>14,.1f}" if modules else "") + f"{batch * n / e:>13,.1f}"
              + (f"{m / e:>6.2f}x" if modules else "")
              + f"{batch * n / c:>16,.1f}{e / c:>7.2f}x{max(first_s - c, 0):>11.1f}{'yes' if same else 'NO':>6}")


if __name__ == "__main__":
    main()

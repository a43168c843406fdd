"""Cost of one cached decoding step of an attention layer per backend vs `full`, at long context.

    python bench/decode_cost.py [--contexts 2048 8192] [--backends full performer nsa sinkhorn]
                                [--steps 32] [--rounds 2] [--device cpu|cuda]

The layer of bench/attention_scaling.py (projections, rotary, the backend; batch 1, 8 heads x 64, float32 on
CPU / bfloat16 on CUDA) holds a cache of ``context`` tokens (one prefill pass); a step feeds the next token and
returns its output (the context grows by --steps tokens over the point, a fraction of a percent). A point's
time is the median over --steps steps after a warm-up step, each (backend, context) in a fresh subprocess
(peak memory is that point's alone: the cache and the step, bench/measure.py); with --rounds N every point is
measured N times, interleaved, keeping the least disturbed. Ratios are against `full` in the same run, and
issue 17's decoding goals are marked met or not at the end: at context 8192 a step of Performer (O(1)
running-sum state) at least 4x cheaper than dense's, of NSA at least 2x.
"""

from __future__ import annotations

import argparse
import json
import sys

from attention_scaling import HEAD_DIM, HEADS, OPTIONS, best_of, run_point  # bench/attention_scaling.py
from measure import timed_peak  # bench/measure.py

# issue 17: (backend, context, bound on backend step / full step)
GOALS = [("performer", 8192, 1 / 4), ("nsa", 8192, 1 / 2)]


def measure(kind: str, context: int, device: str, steps: int) -> dict:
    """One point in this process: {"step_ms": median step, "prefill_s": the prefill, "peak_mb"}."""
    import time

    import torch

    from efftx.attention.base import AttentionSpec
    from efftx.config import Config
    from efftx.models.layers import Attention, Rotary

    cfg = Config().override({"model.dim": HEADS * HEAD_DIM, "model.heads": HEADS,
                             "model.max_seq_len": context + steps + 1,
                             "attention.kind": kind, **OPTIONS.get(kind, {})})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    spec = AttentionSpec.from_config(cfg.model, cfg.attention, seed=cfg.train.seed)
    torch.manual_seed(0)
    total = context + steps + 1  # the warm-up step and the timed ones follow the context
    layer = Attention(spec, Rotary(spec.head_dim, total)).to(device=device, dtype=dtype).eval()
    x = torch.randn(1, total, spec.dim, device=device, dtype=dtype)
    cache = layer.inner.new_cache(1, total, torch.device(device), dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        layer(x[:, :context], cache=cache)
        sync()  # the device's time, not the launches'
        prefill = time.perf_counter() - t0
        position = iter(range(context, total))

        def step():
            i = next(position)
            layer(x[:, i:i + 1], cache=cache)

        seconds, peak = timed_peak(step, device, steps)
    return {"step_ms": seconds * 1e3, "prefill_s": prefill, "peak_mb": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--backends", nargs="+", default=["full", "performer", "nsa", "sinkhorn"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--point", nargs=2, metavar=("KIND", "CONTEXT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.point:
        print(json.dumps(measure(args.point[0], int(args.point[1]), args.device, args.steps)))
        return

    kinds = ["full"] + [k for k in args.backends if k != "full"]
    rounds: dict[tuple[str, int], list[dict]] = {}
    for _ in range(args.rounds):
        for context in args.contexts:
            for kind in kinds:
                point = run_point(__file__, [kind, str(context), "--device", args.device, "--steps", str(args.steps)])
                rounds.setdefault((kind, context), []).append(point)
    results = {key: best_of(points) for key, points in rounds.items()}

    print(f"one cached decoding step of an attention layer, batch 1, {HEADS} heads x {HEAD_DIM}, {args.device}; "
          f"median of {args.steps} steps, best of {args.rounds} rounds")
    print(f"{'backend':10} {'context':>8} {'step ms':>9} {'full/this':>10} {'prefill s':>10} {'peak MiB':>9}")
    for context in args.contexts:
        full = results[("full", context)]
        for kind in kinds:
            r = results[(kind, context)]
            if "error" in r:
                print(f"{kind:10} {context:>8} error: {r['error']}")
                continue
            speedup = f"{full['step_ms'] / r['step_ms']:.2f}x" if "step_ms" in full else "-"
            print(f"{kind:10} {context:>8} {r['step_ms']:9.2f} {speedup:>10} {r['prefill_s']:10.2f} "
                  f"{r['peak_mb']:9.1f}")
    print("goals (issue 17):")
    for kind, context, bound in GOALS:
        r, f = results.get((kind, context), {}), results.get(("full", context), {})
        name = f"{kind} cached step at context {context}: at least {1 / bound:.0f}x cheaper than full's"
        if "step_ms" not in r or "step_ms" not in f:
            print(f"  [not measured] {name}")
            continue
        ratio = f["step_ms"] / r["step_ms"]
        print(f"  [{'met' if ratio >= 1 / bound else 'NOT met'}] {name}: {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(main())

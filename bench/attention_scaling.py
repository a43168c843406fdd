"""Forward+backward time and peak memory of an attention layer per backend vs `full`, as T grows.

    python bench/attention_scaling.py [--lengths 512 ... 32768] [--backends ...] [--device cpu|cuda]
                                      [--rounds 2] [--repeats 3] [--composed]

One attention layer with its projections (q, kv and output projections, rotary, the backend; the layer a
model runs), batch 1, 8 heads, head dim 64, causal, float32 on CPU / bfloat16 on CUDA; the gradient reaches
the layer's input and weights. Each (backend, T) point runs in a fresh subprocess so peak memory is that
point's alone: on CUDA the allocator's peak over the inputs, on CPU the process's peak RSS over its RSS just
before the first pass (bench/measure.py). Every pass starts with the gradients reset
(``zero_grad(set_to_none=True)``, as a train step's optimizer does), so a layer's weight gradients count once,
not with a second, accumulating copy. A point's time is the median of --repeats passes after one warm-up;
with --rounds N every point is measured N times, the rounds interleaved (all backends at one T, then the
next round), and the table keeps each point's smallest time and peak, which on a shared machine is the
least disturbed. Ratios are against `full` measured in the same run. The goals of issue 17 are marked met
or not at the end. ``--composed`` runs nsa and performer on their branch-by-branch autograd compositions
(what CUDA runs) instead of their CPU autograd.Functions: the numbers before those existed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from measure import timed_peak  # bench/measure.py

HEADS, HEAD_DIM = 8, 64
# Backend options at benchmark scale (the recipes' enwik8 settings; nsa: the seed's, NSAOptions' defaults;
# performer: 256 features, PerformerOptions' default chunk of 64 tokens).
OPTIONS = {
    "sinkhorn": {"attention.sinkhorn.bucket_size": 128, "attention.sinkhorn.n_local_attn_heads": 4},
    "performer": {"attention.performer.nb_features": 256, "attention.performer.chunk_size": 64},
}

# issue 17, CPU: (backend, what, T or None = every T from `since`, bound on backend/full, since)
GOALS = [
    ("performer", "time", 2048, 1.0, None), ("performer", "time", 16384, 1 / 3, None),
    ("performer", "memory", None, 1.5, 2048),
    ("nsa", "time", 4096, 1.0, None), ("nsa", "time", 16384, 1 / 3, None), ("nsa", "time", 32768, 1 / 5, None),
    ("nsa", "memory", None, 2.0, 0),
    ("sinkhorn", "time", None, 1.0, 2048), ("sinkhorn", "memory", None, 1.5, 0),  # keep the time lead
]


def layer_point(cfg, t: int, device: str, repeats: int, composed: bool = False) -> dict:
    """fwd+bwd of one attention layer (projections + rotary + backend) of ``cfg`` on (1, t, dim) inputs:
    {"seconds": median time, "peak_mb": peak memory}, measured in this process."""
    import torch

    from efftx.attention.base import AttentionSpec
    from efftx.models.layers import Attention, Rotary

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    spec = AttentionSpec.from_config(cfg.model, cfg.attention, seed=cfg.train.seed)
    torch.manual_seed(0)
    layer = Attention(spec, Rotary(spec.head_dim, t)).to(device=device, dtype=dtype).train()
    if composed and hasattr(layer.inner, "chunked"):
        layer.inner.chunked = False
    if getattr(layer.inner, "cpu_kernel", "off") != "off" and device == "cpu":
        # NSA's C++ kernel is loaded once per process (as the modules are): not inside the measured peak
        from efftx.kernels.nsa_selected_cpu import kernel

        kernel(required=layer.inner.cpu_kernel == "on")
    x = torch.randn(1, t, spec.dim, device=device, dtype=dtype, requires_grad=True)

    def step():  # a train step's pass: gradients reset as the optimizer's zero_grad does, not accumulated
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).float().sum().backward()

    with flash_only(cfg.attention.kind, device):
        seconds, peak = timed_peak(step, device, repeats)
    return {"seconds": seconds, "peak_mb": peak}


def flash_only(kind: str, device: str):
    """On CUDA, `full` runs on SDPA's flash kernel, not whichever backend SDPA would fall back to: an error if
    flash cannot run it. Elsewhere (and for other backends) nothing changes."""
    import contextlib

    if device != "cuda" or kind != "full":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def measure(kind: str, t: int, device: str, repeats: int, composed: bool = False) -> dict:
    """One point of this bench, in this process."""
    from efftx.config import Config

    cfg = Config().override({"model.dim": HEADS * HEAD_DIM, "model.heads": HEADS, "model.max_seq_len": t,
                             "attention.kind": kind, **OPTIONS.get(kind, {})})
    return layer_point(cfg, t, device, repeats, composed)


def run_point(script: str, args: list[str]) -> dict:
    """Run ``script --point ...`` in a fresh subprocess; its JSON result, or {"error": last stderr line}."""
    proc = subprocess.run([sys.executable, script, "--point", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_of(results: list[dict]) -> dict:
    """Smallest value of every key over the rounds that succeeded (the first error if none did)."""
    ok = [r for r in results if "error" not in r]
    if not ok:
        return results[0]
    return {key: min(r[key] for r in ok) for key in ok[0]}


def goal_lines(results: dict, kind_time: str, kind_mem: str, goals, lengths: list[int]) -> list[str]:
    """One 'met' / 'NOT met' / 'not measured' line per goal. ``results[(kind, T)]`` holds kind_time (seconds)
    and kind_mem (peak) keys; goals: (backend, "time" | "memory", T or None, bound, since)."""
    lines = []
    for kind, what, t, bound, since in goals:
        key = kind_time if what == "time" else kind_mem
        ts = [t] if t is not None else [x for x in lengths if x >= since]
        ratios = {}
        for x in ts:
            r, f = results.get((kind, x), {}), results.get(("full", x), {})
            if key in r and f.get(key):
                ratios[x] = r[key] / f[key]
        if what == "time":
            at = f"T={t}" if t is not None else f"every T >= {since}"
            name = f"{kind} fwd+bwd at {at}: at least {1 / bound:.0f}x as fast as full"
        else:
            name = f"{kind} peak memory at most {bound:g}x full's at every T" + (f" >= {since}" if since else "")
        if not ratios or len(ratios) < len(ts):
            missing = [x for x in ts if x not in ratios]
            lines.append(f"  [not measured] {name} (no result at T={missing})")
            continue
        met = all(v <= bound for v in ratios.values())
        worst = max(ratios, key=ratios.get)
        if what == "time":
            detail = f"full/{kind} = {1 / ratios[worst]:.2f}x"
        else:
            detail = ", ".join(f"T={x}: {v:.2f}x" for x, v in ratios.items())
            mems = [(x, results[(kind, x)][key]) for x in sorted(ratios)]
            if len(mems) >= 2:  # linear growth: the per-token increment of the last doubling vs the average
                (t0, m0), (t1, m1) = mems[-2], mems[-1]
                detail += f"; last step {(m1 - m0) / (t1 - t0) * 1024:.1f} MiB per 1k tokens"
        lines.append(f"  [{'met' if met else 'NOT met'}] {name}: {detail}")
    return lines


def main() -> None:
    from efftx import attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384, 32768])
    p.add_argument("--backends", nargs="+", default=attention.names())
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="measure every point this many times, keep the best")
    p.add_argument("--composed", action="store_true", help="nsa/performer on their autograd compositions")
    p.add_argument("--point", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.point:
        print(json.dumps(measure(args.point[0], int(args.point[1]), args.device, args.repeats, args.composed)))
        return

    kinds = ["full"] + [k for k in args.backends
                        if k != "full" and not getattr(attention.get(k), "requires_image_layout", False)]
    rounds: dict[tuple[str, int], list[dict]] = {}
    for r in range(args.rounds):
        for t in args.lengths:
            for kind in kinds:
                flags = ["--device", args.device, "--repeats", str(args.repeats)] + (["--composed"] * args.composed)
                res = run_point(__file__, [kind, str(t), *flags])
                rounds.setdefault((kind, t), []).append(res)
                print(f"  round {r + 1}: {kind:<10} T={t:<6} {res}", file=sys.stderr, flush=True)
    results = {key: best_of(rs) for key, rs in rounds.items()}

    which = "autograd compositions (--composed)" if args.composed else "CPU autograd.Functions"
    print(f"\nattention layer (projections + rotary + backend) fwd+bwd, batch 1, {HEADS} heads, head dim {HEAD_DIM}, "
          f"causal, device {args.device}; best of {args.rounds} rounds; nsa/performer: {which}")
    print(f"{'backend':<10}{'T':>7}{'time ms':>11}{'vs full':>9}{'speed-up':>9}{'peak MiB':>10}{'vs full':>9}")
    for kind in kinds:
        for t in args.lengths:
            r, f = results[kind, t], results["full", t]
            if "error" in r:
                print(f"{kind:<10}{t:>7}  error: {r['error'][:70]}")
                continue
            time_ratio = r["seconds"] / f["seconds"] if "seconds" in f else float("nan")
            mem_ratio = r["peak_mb"] / f["peak_mb"] if f.get("peak_mb") else float("nan")
            print(f"{kind:<10}{t:>7}{r['seconds'] * 1e3:>11.1f}{time_ratio:>8.2f}x{1 / time_ratio:>8.2f}x"
                  f"{r['peak_mb']:>10.1f}{mem_ratio:>8.2f}x")
    print("\nwhere each backend overtakes full (first T at which it is faster / uses less memory):")
    for kind in kinds[1:]:
        ok = [t for t in args.lengths if "seconds" in results[kind, t] and "seconds" in results["full", t]]
        faster = next((t for t in ok if results[kind, t]["seconds"] < results["full", t]["seconds"]), None)
        leaner = next((t for t in ok if results[kind, t]["peak_mb"] < results["full", t]["peak_mb"]), None)
        print(f"  {kind:<10} time: {faster or 'not within the lengths measured'}; "
              f"memory: {leaner or 'not within the lengths measured'}")
    if args.device == "cpu":
        goals = [g for g in GOALS if g[0] in kinds]
        if goals:
            print("\ngoals (issue 17, CPU float32, ratios against full in this run):")
            print("\n".join(goal_lines(results, "seconds", "peak_mb", goals, args.lengths)))


if __name__ == "__main__":
    main()

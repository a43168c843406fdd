"""Forward+backward time and peak memory of every attention backend vs `full`, as T grows.

    python bench/attention_scaling.py [--lengths 512 1024 2048 4096 8192] [--backends ...] [--device cpu|cuda]

Batch 1, 8 heads, head dim 64, causal, float32 on CPU / bfloat16 on CUDA. Each (backend, T) point runs
in a fresh subprocess so peak memory is that point's alone: on CUDA the allocator's peak over the
inputs, on CPU the process's peak RSS over its RSS just before the first pass. Times are the median of
--repeats passes after one warm-up. Ratios are against `full` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from measure import timed_peak  # bench/measure.py

HEADS, HEAD_DIM = 8, 64
# Backend options at benchmark scale (the recipes' enwik8 settings).
OPTIONS = {
    "sinkhorn": {"attention.sinkhorn.bucket_size": 128, "attention.sinkhorn.n_local_attn_heads": 4},
    "performer": {"attention.performer.nb_features": 256, "attention.performer.chunk_size": 128},
}


def measure(kind: str, t: int, device: str, repeats: int) -> dict:
    """One point, in this process: median fwd+bwd seconds and peak memory (MiB)."""
    import torch

    from efftx import attention
    from efftx.attention.base import AttentionSpec
    from efftx.config import Config

    cfg = Config().override({"model.dim": HEADS * HEAD_DIM, "model.heads": HEADS, "model.max_seq_len": t,
                             "attention.kind": kind, **OPTIONS.get(kind, {})})
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    backend = attention.build(AttentionSpec.from_config(cfg)).to(device=device).train()
    q, k, v = (torch.randn(1, t, HEADS, HEAD_DIM, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    x = torch.randn(1, t, HEADS * HEAD_DIM, device=device, dtype=dtype)

    seconds, peak = timed_peak(lambda: backend(q, k, v, x=x).float().sum().backward(), device, repeats)
    return {"seconds": seconds, "peak_mb": peak}


def main() -> None:
    from efftx import attention

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    p.add_argument("--backends", nargs="+", default=attention.names())
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--point", nargs=2, metavar=("KIND", "T"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.point:
        print(json.dumps(measure(args.point[0], int(args.point[1]), args.device, args.repeats)))
        return

    kinds = ["full"] + [k for k in args.backends if k != "full"]
    results: dict[tuple[str, int], dict] = {}
    for t in args.lengths:
        for kind in kinds:
            proc = subprocess.run([sys.executable, __file__, "--point", kind, str(t), "--device", args.device,
                                   "--repeats", str(args.repeats)], capture_output=True, text=True)
            if proc.returncode != 0:
                results[kind, t] = {"error": proc.stderr.strip().splitlines()[-1]}
            else:
                results[kind, t] = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"  measured {kind:<10} T={t:<6} {results[kind, t]}", file=sys.stderr, flush=True)

    print(f"\nattention fwd+bwd, batch 1, {HEADS} heads, head dim {HEAD_DIM}, causal, device {args.device}")
    print(f"{'backend':<10}{'T':>7}{'time ms':>11}{'vs full':>9}{'peak MiB':>10}{'vs full':>9}")
    for kind in kinds:
        for t in args.lengths:
            r, f = results[kind, t], results["full", t]
            if "error" in r:
                print(f"{kind:<10}{t:>7}  error: {r['error'][:60]}")
                continue
            time_ratio = r["seconds"] / f["seconds"] if "seconds" in f else float("nan")
            mem_ratio = r["peak_mb"] / f["peak_mb"] if f.get("peak_mb") else float("nan")
            print(f"{kind:<10}{t:>7}{r['seconds'] * 1e3:>11.1f}{time_ratio:>8.2f}x{r['peak_mb']:>10.1f}{mem_ratio:>8.2f}x")
    print("\nwhere each backend overtakes full (first T at which it is faster / uses less memory):")
    for kind in kinds[1:]:
        ok = [t for t in args.lengths if "seconds" in results[kind, t] and "seconds" in results["full", t]]
        faster = next((t for t in ok if results[kind, t]["seconds"] < results["full", t]["seconds"]), None)
        leaner = next((t for t in ok if results[kind, t]["peak_mb"] < results["full", t]["peak_mb"]), None)
        print(f"  {kind:<10} time: {faster or 'not within the lengths measured'}; "
              f"memory: {leaner or 'not within the lengths measured'}")


if __name__ == "__main__":
    main()

"""Native Sparse Attention vs full attention: one layer, the selected-block kernel, one training step.

    python bench/nsa.py [--quick] [--cpu-lengths 2048 4096 8192 16384 32768] [--gpu-lengths ... 65536]
                        [--no-cpu] [--repeats N] [--rounds N] [--composed] [--profile T]

One attention layer of the NSA seed (8 query heads, 4 kv heads, head dim 64, compressed blocks of 16,
selection blocks of 16, 4 selected, window 64; batch 1, causal), with its projections (q, kv, output,
rotary: the layer the model runs), against the same layer with `full` (torch SDPA), side by side:

1. CPU, float32: forward+backward time and peak memory at each T (NSA on its chunked CPU autograd.Function,
   efftx/attention/nsa_cpu.py; ``--composed``: on the branch-by-branch composition, the numbers before it),
   the goals of issue 17 marked met or not; and the selected-block attention alone on its torch reference
   (the Triton kernel needs CUDA), up to T = 8192 (it gathers every query's blocks at once).
2. CUDA only (skipped without a GPU), bfloat16: forward time, forward+backward time and peak memory of
   NSA (Triton selected-block kernel) vs SDPA (flash) up to T = 65536; the kernel vs its torch reference;
   one optimizer step (forward, backward, AdamW) of the nsa_enwik8 recipe vs nsa_full_enwik8.

Every point runs in a fresh subprocess so its peak memory is its own: on CUDA the allocator's peak
above the inputs, on CPU the peak RSS above the RSS before the first pass. Times are medians of
--repeats passes after one warm-up; with --rounds N (CPU layer table) every point is measured N times,
interleaved, and the best time and peak are kept. A point that fails (e.g. out of memory) prints its error line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from measure import timed_peak  # bench/measure.py

RECIPE = "nsa_enwik8"  # the layer's shape and NSA options come from the seed recipe


def seed_config(kind: str, t: int):
    """The seed recipe's config with backend ``kind`` at length ``t``."""
    from efftx import recipes

    return recipes.get(RECIPE).override({"attention.kind": kind, "model.max_seq_len": t})


def seed_layer(cfg, t: int, device: str):
    """``cfg``'s attention layer (projections, rotary, backend) for length ``t`` on ``device`` (bfloat16 on CUDA,
    float32 elsewhere), in training mode: (layer, dtype)."""
    import torch

    from efftx.attention.base import AttentionSpec
    from efftx.models.layers import Attention, Rotary

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    spec = AttentionSpec.from_config(cfg.model, cfg.attention, seed=cfg.train.seed)
    return Attention(spec, Rotary(spec.head_dim, t)).to(device=device, dtype=dtype).train(), dtype


def measure_layer(kind: str, t: int, device: str, repeats: int, composed: bool = False) -> dict:
    """One attention layer with its projections: forward time, forward+backward time, peak memory of
    forward+backward."""
    import torch

    from attention_scaling import flash_only, layer_point  # bench/attention_scaling.py

    cfg = seed_config(kind, t)
    result = layer_point(cfg, t, device, repeats, composed)  # first: its peak is measured without this layer
    layer, dtype = seed_layer(cfg, t, device)
    if composed and hasattr(layer.inner, "chunked"):
        layer.inner.chunked = False
    x = torch.randn(1, t, cfg.model.dim, device=device, dtype=dtype)
    with torch.no_grad(), flash_only(kind, device):
        fwd, _ = timed_peak(lambda: layer(x), device, repeats)
    return {"fwd_s": fwd, "fwd_bwd_s": result["seconds"], "peak_mb": result["peak_mb"]}


def measure_kernel(impl: str, t: int, device: str, repeats: int) -> dict:
    """The selected-block attention alone, forward+backward, on NSA-like selections (own block + 4 past)."""
    import torch

    from efftx import recipes
    from efftx.kernels import selected_attention

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cfg = recipes.get(RECIPE)
    m, o = cfg.model, cfg.attention.nsa
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, t, m.heads, m.head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
    k, v = (torch.randn(1, t, m.kv_heads, m.head_dim, device=device, dtype=dtype, generator=g).requires_grad_()
            for _ in "kv")
    own = (torch.arange(t, device=device) // o.selection_block_size).view(1, t, 1, 1).expand(1, t, m.kv_heads, 1)
    past = (torch.rand(1, t, m.kv_heads, o.num_selected_blocks, device=device, generator=g) * own).long()
    idx = torch.cat([own, torch.where(own > 0, past, -1)], -1)  # random past blocks (repeats count once)

    def step():
        selected_attention(q, k, v, idx, o.selection_block_size, impl=impl).float().sum().backward()

    seconds, peak = timed_peak(step, device, repeats)
    return {"fwd_bwd_s": seconds, "peak_mb": peak}


def measure_step(recipe: str, device: str, repeats: int) -> dict:
    """One optimizer step (micro batch x seq_len of the recipe, bf16 autocast on CUDA) of a recipe's LM."""
    import torch
    import torch.nn.functional as F

    from efftx import recipes
    from efftx.models import build as build_model

    cfg = recipes.get(recipe)
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    b, t = cfg.train.micro_batch_size, cfg.data.seq_len
    data = torch.randint(0, cfg.model.vocab_size, (b, t + 1), device=device)

    def step():
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            logits = model(data[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds, peak = timed_peak(step, device, repeats)
    return {"step_s": seconds, "tokens_per_s": b * t / seconds, "peak_mb": peak}


MEASURES = {"layer": measure_layer, "kernel": measure_kernel, "step": measure_step}


def point(what: str, *args, repeats: int, composed: bool = False) -> dict:
    """Run ``MEASURES[what](*args, repeats[, composed])`` in a fresh subprocess; {"error": line} if it fails."""
    extra = [composed] if composed else []
    proc = subprocess.run([sys.executable, __file__, "--point", json.dumps([what, *args, repeats, *extra])],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        result = {"error": lines[-1][:80]}
    else:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  measured {what} {args}: {result}", file=sys.stderr, flush=True)
    return result


def _ratio(a: dict, b: dict, key: str) -> str:
    if key in a and key in b and b[key] > 0:
        return f"{a[key] / b[key]:.2f}x"
    return "-"


def _cell(r: dict, key: str, scale: float = 1e3, fmt: str = "{:.1f}") -> str:
    return fmt.format(r[key] * scale) if key in r else r.get("error", "-")[:24]


# issue 17, CPU float32: (what, T or None = every T, bound on nsa/full)
GOALS = [("time", 4096, 1.0, None), ("time", 16384, 1 / 3, None), ("time", 32768, 1 / 5, None),
         ("memory", None, 2.0, 0)]


def layer_table(device: str, lengths: list[int], repeats: int, rounds: int = 1, composed: bool = False) -> None:
    from attention_scaling import best_of, goal_lines  # bench/attention_scaling.py

    runs: dict[tuple[str, int], list[dict]] = {}
    for _ in range(rounds):
        for t in lengths:
            for kind in ("full", "nsa"):
                runs.setdefault((kind, t), []).append(point("layer", kind, t, device, repeats=repeats,
                                                            composed=composed))
    res = {key: best_of(rs) for key, rs in runs.items()}
    rows = [(t, res["full", t], res["nsa", t]) for t in lengths]
    if device == "cuda":
        impl = "Triton selected-block kernel"
    else:
        impl = "branch-by-branch composition (--composed)" if composed else "chunked CPU autograd.Function"
    dtype = "bfloat16" if device == "cuda" else "float32"
    print(f"\none attention layer with projections, batch 1, 8 heads / 4 kv heads, head dim 64, {dtype}, {device}; "
          f"nsa = {impl}; best of {rounds} round(s)")
    print(f"{'T':>7} | {'fwd ms full':>11} {'nsa':>9} {'nsa/full':>8} | {'fwd+bwd ms full':>15} {'nsa':>9} "
          f"{'nsa/full':>8} | {'peak MiB full':>13} {'nsa':>9} {'nsa/full':>8}")
    for t, full, nsa in rows:
        print(f"{t:>7} | {_cell(full, 'fwd_s'):>11} {_cell(nsa, 'fwd_s'):>9} {_ratio(nsa, full, 'fwd_s'):>8} | "
              f"{_cell(full, 'fwd_bwd_s'):>15} {_cell(nsa, 'fwd_bwd_s'):>9} {_ratio(nsa, full, 'fwd_bwd_s'):>8} | "
              f"{_cell(full, 'peak_mb', 1):>13} {_cell(nsa, 'peak_mb', 1):>9} {_ratio(nsa, full, 'peak_mb'):>8}")
    print("speed-up of nsa over full (full / nsa): "
          + ", ".join(f"T={t}: fwd {_ratio(full, nsa, 'fwd_s')}, fwd+bwd {_ratio(full, nsa, 'fwd_bwd_s')}"
                      for t, full, nsa in rows))
    if device == "cpu":
        print("goals (issue 17, CPU float32, ratios against full in this run):")
        print("\n".join(goal_lines(res, "fwd_bwd_s", "peak_mb", [("nsa", *g) for g in GOALS], lengths)))


def kernel_table(device: str, lengths: list[int], repeats: int) -> None:
    impls = ["reference", "triton"] if device == "cuda" else ["reference"]
    rows = [(t, {impl: point("kernel", impl, t, device, repeats=repeats) for impl in impls}) for t in lengths]
    print(f"\nselected-block attention alone (own + 4 of the past blocks of 16), fwd+bwd, {device}")
    if device != "cuda":
        print("(the Triton kernel needs CUDA; on CPU only its torch reference is measured)")
    head = f"{'T':>7} | {'reference ms':>12} {'MiB':>8}"
    if device == "cuda":
        head += f" | {'triton ms':>10} {'MiB':>8} | {'speed-up':>8} {'memory':>8}"
    print(head)
    for t, r in rows:
        line = f"{t:>7} | {_cell(r['reference'], 'fwd_bwd_s'):>12} {_cell(r['reference'], 'peak_mb', 1):>8}"
        if device == "cuda":
            tr = r["triton"]
            line += (f" | {_cell(tr, 'fwd_bwd_s'):>10} {_cell(tr, 'peak_mb', 1):>8} | "
                     f"{_ratio(r['reference'], tr, 'fwd_bwd_s'):>8} {_ratio(tr, r['reference'], 'peak_mb'):>8}")
        print(line)


def step_table(repeats: int) -> None:
    full = point("step", "nsa_full_enwik8", "cuda", repeats=repeats)
    nsa = point("step", "nsa_enwik8", "cuda", repeats=repeats)
    print("\none optimizer step of the seed recipe (micro batch 4 x 512 tokens, bf16 autocast, AdamW), cuda")
    print(f"{'recipe':<16} {'step ms':>9} {'tokens/s':>10} {'peak MiB':>9}")
    for name, r in (("nsa_full_enwik8", full), ("nsa_enwik8", nsa)):
        print(f"{name:<16} {_cell(r, 'step_s'):>9} {_cell(r, 'tokens_per_s', 1, '{:,.0f}'):>10} "
              f"{_cell(r, 'peak_mb', 1):>9}")
    print(f"nsa speed relative to full: {_ratio(full, nsa, 'step_s')} (the original repo reports 0.4x at T=512)")


def profile_layer(t: int, device: str, rows: int = 20) -> None:
    """torch.profiler's table of one fwd+bwd of the NSA layer (seed settings) at ``t``: where its time and memory
    go, top ``rows`` operations by device time (CPU time without CUDA)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cfg = seed_config("nsa", t)
    layer, dtype = seed_layer(cfg, t, device)
    x = torch.randn(1, t, cfg.model.dim, device=device, dtype=dtype, requires_grad=True)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up (Triton compiles)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:
        step()
    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(f"\nprofile of one NSA layer fwd+bwd at T={t}, {device}, {str(dtype)[6:]} (top {rows} by {key})")
    print(prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small lengths, one repeat: a smoke run")
    p.add_argument("--cpu-lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    p.add_argument("--gpu-lengths", type=int, nargs="+", default=[512, 2048, 8192, 16384, 32768, 65536])
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU tables (e.g. on a GPU machine)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="CPU layer table: measure every point this many times")
    p.add_argument("--composed", action="store_true", help="CPU: nsa on its branch-by-branch composition")
    p.add_argument("--profile", type=int, default=0, metavar="T",
                   help="also print torch.profiler's table of the NSA layer's fwd+bwd at T (on CUDA when present)")
    p.add_argument("--point", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.point:
        what, *rest = json.loads(args.point)
        print(json.dumps(MEASURES[what](*rest)))
        return

    import torch

    if args.quick:
        args.cpu_lengths, args.gpu_lengths, args.repeats, args.rounds = [256, 1024], [1024, 4096], 1, 1
    if not args.no_cpu:
        layer_table("cpu", args.cpu_lengths, args.repeats, args.rounds, args.composed)
        kernel_table("cpu", [t for t in args.cpu_lengths if t <= 8192], args.repeats)
    if torch.cuda.is_available():
        layer_table("cuda", args.gpu_lengths, args.repeats)
        kernel_table("cuda", args.gpu_lengths, args.repeats)
        step_table(max(args.repeats, 5))
    else:
        print("\n(no CUDA device: the GPU tables are skipped)")
    if args.profile:
        profile_layer(args.profile, "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()

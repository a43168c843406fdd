"""Compiled decode steps on a GPU: the Triton decode attention kernel against attention over the whole capacity.

    python bench/decode_attention.py [--recipe spec_target_small] [--capacity 2048] [--batches 1,16]
                                     [--fills 128,1024] [--tokens 1,6] [--steps 20] [--repeats 5] [--device cuda]

Compiled decoding keeps keys in buffers of a fixed capacity (continuous batching's slots: the model's
``max_seq_len``) so that a step replays as a CUDA graph. Without the kernel (``efftx.kernels.decode_attention``,
switched off with ``disabled()``) each layer attends with two matmuls over every slot of the capacity under a mask;
with it, each row reads only its own keys. Per (batch, tokens per row, row length) this prints the median time of a
compiled step (``StaticDecoder.forward`` of the recipe's architecture, untrained, with ``--capacity`` positions;
``--steps`` steps per timing, rewound after) both ways, side by side in one run, and their ratio; then the
attention operation alone (one layer's shapes, both captured in a CUDA graph).

Then eager passes over a KVCache (decoding without ``compile``, continuous batching's eager slots: the host holds
the row lengths) with the kernel against SDPA under a (B, T, L) mask, rows of different lengths.

Goals (the kernel must pay where rows are short and cost nothing where they fill the cache):
* compiled steps, rows at 1/16 of the capacity or less: at least 1.5x faster with the kernel;
* compiled steps, rows filling half the capacity or more, and every eager pass: at least 0.9x (no slower, within
  noise).

On a CPU (no CUDA) it runs the same plumbing through Triton's interpreter when ``TRITON_INTERPRET=1`` (the test
suite does, with a tiny model): its times say nothing, and the goals are marked "not judged".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from efftx import recipes
from efftx.attention.full import few_query_attention
from efftx.generation import compiled
from efftx.kernels import decode_attention as da
from efftx.kernels import decode_attention_cpu
from efftx.models import build

SHORT_GOAL, LONG_GOAL = 1.5, 0.9


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_seconds(decoder, tokens: torch.Tensor, fill: int, steps: int, repeats: int, device: str) -> float:
    """Median seconds of one compiled pass over rows holding ``fill`` keys (``steps`` passes per timing)."""
    t = tokens.shape[1]
    decoder.cache.lengths.fill_(fill)
    decoder.row_lengths = [fill] * decoder.batch
    decoder.used = fill
    decoder.forward(tokens)  # compiles (first call of this shape) or warms
    decoder.rewind([t] * decoder.batch)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            decoder.forward(tokens)
        sync(device)
        times.append((time.perf_counter() - t0) / steps)
        decoder.rewind([t * steps] * decoder.batch)
    return statistics.median(times)


def kv_step_seconds(model, cache, rows: list[int], tokens: torch.Tensor, steps: int, repeats: int,
                    device: str) -> float:
    """Median seconds of one eager pass over a KVCache whose rows hold ``rows`` keys (``steps`` per timing,
    rewound after)."""
    t = tokens.shape[1]
    for layer in cache.layers:
        layer.lengths = list(rows)
    model(tokens, cache=cache)  # warms (on CUDA: the kernel's first launch compiles it)
    cache.rewind(t)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            model(tokens, cache=cache)
        sync(device)
        times.append((time.perf_counter() - t0) / steps)
        cache.rewind(t * steps)
    return statistics.median(times)


def op_seconds(fn, steps: int, repeats: int, device: str) -> float:
    """Median seconds of ``fn()``: on CUDA ``steps`` calls captured in one CUDA graph and replayed."""
    fn()
    if device != "cuda":
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            times.append((time.perf_counter() - t0) / steps)
        return statistics.median(times)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def judge(fill: int, capacity: int, ratio: float, judged: bool) -> str:
    if fill * 16 <= capacity:
        goal, line = SHORT_GOAL, f">= {SHORT_GOAL}x"
    elif fill * 2 >= capacity:
        goal, line = LONG_GOAL, f">= {LONG_GOAL}x"
    else:
        return "-"
    if not judged:
        return f"{line}: not judged"
    return f"{line}: {'met' if ratio >= goal else 'not met'}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="spec_target_small")
    p.add_argument("--capacity", type=int, default=2048)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--fills", default="128,1024", help="keys each row holds before the pass")
    p.add_argument("--tokens", default="1,6", help="tokens per row per pass (1: decoding, 6: a gamma-5 verify)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--depth", type=int, default=None, help="layers (default: the recipe's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    device = args.device
    judged = device == "cuda"
    if not judged and not da.INTERPRETED:
        p.error("without CUDA the kernel runs only through Triton's interpreter: set TRITON_INTERPRET=1 "
                "(times are then meaningless; the run checks the plumbing)")
    batches = [int(b) for b in args.batches.split(",")]
    fills = [int(f) for f in args.fills.split(",")]
    tokens_per_row = [int(t) for t in args.tokens.split(",")]
    if max(fills) + max(tokens_per_row) * (args.steps + 1) > args.capacity:
        p.error(f"--fills up to {max(fills)} + {args.steps + 1} passes of {max(tokens_per_row)} tokens exceed "
                f"--capacity {args.capacity}")

    over = {"model.max_seq_len": args.capacity}
    if args.depth is not None:
        over["model.depth"] = args.depth
    torch.manual_seed(0)
    model = build(recipes.get(args.recipe).override(over)).to(device).eval()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = model.to(dtype)
    spec = model.blocks[0].attention.spec
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{args.recipe}: {len(model.blocks)} layers, {spec.heads} heads / {spec.kv_heads} kv heads of "
          f"{spec.head_dim}, {str(dtype)[6:]}, capacity {args.capacity}; device {device}, torch {torch.__version__}, "
          f"load average {load:.1f}; median of {args.repeats} timings of {args.steps} compiled passes")
    here = contextlib.nullcontext() if judged else da.on_cpu()
    met = []
    print(f"{'batch':>5}{'tokens':>7}{'row keys':>9}{'capacity-wide ms':>18}{'kernel ms':>11}{'ratio':>8}  goal")
    with torch.no_grad(), here, decode_attention_cpu.disabled():
        seconds = {}  # (mode, batch, tokens, fill) -> s; one compile per mode and shape (fills share a graph)
        for name, switch in (("wide", da.disabled), ("kernel", contextlib.nullcontext)):
            torch._dynamo.reset()
            compiled._COMPILED.clear()
            with switch():
                for batch in batches:
                    for t in tokens_per_row:
                        tokens = torch.randint(0, model.vocab_size, (batch, t), device=device)
                        decoder = compiled.StaticDecoder(model, batch, args.capacity, True, "on")
                        for fill in fills:
                            seconds[name, batch, t, fill] = step_seconds(decoder, tokens, fill, args.steps,
                                                                         args.repeats, device)
                        decoder.release()
        torch._dynamo.reset()
        compiled._COMPILED.clear()
        for batch in batches:
            for t in tokens_per_row:
                for fill in fills:
                    wide, mine = seconds["wide", batch, t, fill], seconds["kernel", batch, t, fill]
                    verdict = judge(fill, args.capacity, wide / mine, judged)
                    met.append(verdict)
                    print(f"{batch:>5}{t:>7}{fill:>9}{wide * 1e3:>18.3f}{mine * 1e3:>11.3f}{wide / mine:>7.2f}x  "
                          f"{verdict}")

        print("eager passes over a KVCache (rows of different lengths, the host holding them: decoding without "
              "compile, continuous batching's eager slots): SDPA with a mask vs the kernel")
        print(f"{'batch':>5}{'tokens':>7}{'row keys':>9}{'SDPA ms':>18}{'kernel ms':>11}{'ratio':>8}  goal")
        for batch in batches:
            for t in tokens_per_row:
                tokens = torch.randint(0, model.vocab_size, (batch, t), device=device)
                for fill in fills:
                    cache = model.new_cache(batch, args.capacity)
                    rows = [max(fill - 3 * r, 1) for r in range(batch)]  # ragged, as a running batch's rows are
                    eager = {}
                    for name, switch in (("sdpa", da.disabled), ("kernel", da.everywhere)):
                        with switch():
                            eager[name] = kv_step_seconds(model, cache, rows, tokens, args.steps, args.repeats,
                                                          device)
                    ratio = eager["sdpa"] / eager["kernel"]
                    verdict = (f">= {LONG_GOAL}x: " + ("met" if ratio >= LONG_GOAL else "not met")) if judged else (
                        f">= {LONG_GOAL}x: not judged")
                    met.append(verdict)
                    print(f"{batch:>5}{t:>7}{fill:>9}{eager['sdpa'] * 1e3:>18.3f}{eager['kernel'] * 1e3:>11.3f}"
                          f"{ratio:>7.2f}x  {verdict}")

        print("attention alone (one layer): capacity-wide matmuls vs the kernel")
        print(f"{'batch':>5}{'tokens':>7}{'row keys':>9}{'capacity-wide us':>18}{'kernel us':>11}{'ratio':>8}")
        for batch in batches:
            for t in tokens_per_row:
                for fill in fills:
                    q = torch.randn(batch, t, spec.heads, spec.head_dim, device=device, dtype=dtype)
                    k = torch.randn(batch, args.capacity, spec.kv_heads, spec.head_dim, device=device, dtype=dtype)
                    v = torch.randn_like(k)
                    lengths = torch.full((batch,), fill, device=device, dtype=torch.long)
                    end = da.visible_end(lengths, t, True)
                    mask = torch.arange(args.capacity, device=device)[None, None, :] < end[:, :, None]
                    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
                    wide = op_seconds(lambda: few_query_attention(qt, kt, vt, mask[:, None]), args.steps,
                                      args.repeats, device)
                    mine = op_seconds(lambda: da.decode_attention(q, k, v, lengths, True), args.steps,
                                      args.repeats, device)
                    print(f"{batch:>5}{t:>7}{fill:>9}{wide * 1e6:>18.1f}{mine * 1e6:>11.1f}{wide / mine:>7.2f}x")
    judged_lines = [m for m in met if m != "-"]
    print(f"goals: {sum(m.endswith(': met') for m in judged_lines)} of {len(judged_lines)} met"
          + ("" if judged else " (not judged: no GPU)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

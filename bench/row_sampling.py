"""Sampling's per-row work in one call for every row, against a call per row or per setting.

    python bench/row_sampling.py [--device cpu|cuda] [--rows 1 4 16 32] [--repeats 200] [--steps]

Three parts, each measured side by side in one run:

* **a draw's noise** for ``rows`` rows, as base decoding draws it (a vocabulary of 256) and as a speculative step
  draws it (gamma 5: a block of 6 x 257 per row): one ``exponential_`` call per row with its own generator (what
  sampling did before :class:`efftx.generation.sampling.Stream`) against one call for every row
  (:func:`~efftx.generation.sampling.stream_noise`: the C++ kernel on a CPU, the Triton kernel on a GPU), and the
  torch reference of the same function. Best of ``--repeats`` (on CUDA each timed with a device synchronisation).
  Goal: at 16 rows the streams' draw is at least 4x faster than the generators' (marked met or not);
* **a step's distributions** for ``rows`` rows of mixed sampling settings (every row its own temperature, half
  of them a top-k, a third a nucleus: what many clients send), over a vocabulary of 256: a pass per setting (rows
  gathered by setting, each group through :func:`~efftx.generation.sampling.probabilities`, scattered back: what
  continuous batching did before) against one pass with per-row settings
  (:func:`~efftx.generation.sampling.probabilities_per_row`), whose rows are bit for bit the grouped ones
  (checked here), and the torch operations each runs (counted with the C++ sampling kernel off, as on a GPU; views
  aside: on a GPU each is a kernel launch, the cost
  that matters beside a step of a few hundred microseconds). Goal: at 16 rows of 16 settings the one pass runs at
  most a third of the operations of a pass per setting (its time is printed beside);
* **the C++ sampling kernel** (:mod:`efftx.kernels.sampling_cpu`; CPU) against torch's operators
  (``EFFTX_CPU_SAMPLING=off``'s path), per call at each row count: a draft pass's distributions ((rows, 256), T=0.8,
  top-k 32) and race, a verify pass's distributions ((rows, 6, 256)), a step's acceptance (gamma 5), and what a
  speculative step samples in all (5 draws, the verify's distributions, the acceptance). Both paths' tokens and
  acceptance are checked equal here. Goal: a speculative step's sampling at least 2x faster through the kernel at
  1 and at 16 rows;
* ``--steps``: the continuous-batching scheduler's decoding steps (every row in every step, after a warm-up, best
  of 3) at each row count, base and speculative, on untrained ``spec_{target,draft}_small`` models, its rows
  drawing from streams against torch generators (the same scheduler, its requests' generators swapped), and with
  streams, the sampling kernel off against on: the
  draws' share of whole steps, as time per row stepped (a speculative row's acceptance, so how many rows each
  step holds, follows its noise, which differs between the two). Printed, no goal: on a CPU a step costs milliseconds and the draws tens of
  microseconds; on a GPU each generator call is a kernel launch, the step a few hundred microseconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from efftx.generation.sampling import Stream, probabilities, probabilities_per_row, stream_noise  # noqa: E402
from efftx.kernels import row_noise as rn  # noqa: E402
from efftx.kernels import sampling_cpu  # noqa: E402

SHAPES = (("base (V=256)", 256), ("speculative (6 x 257)", 6 * 257))


def best_us(fn, repeats: int, device: str) -> float:
    """Best time of ``fn()`` in microseconds (after one warm-up call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def generator_draw(gens: list[torch.Generator], width: int, device: str) -> torch.Tensor:
    noise = torch.ones(len(gens), width, device=device)
    for b, g in enumerate(gens):
        noise[b].exponential_(generator=g)
    return noise


def reference_draw(streams: list[Stream], width: int, device: str) -> torch.Tensor:
    keys = torch.tensor([s.key() for s in streams], dtype=torch.int64, device=device)
    return rn.row_noise_reference(keys, width)


def draws(rows: list[int], repeats: int, device: str) -> dict[tuple[str, int], dict[str, float]]:
    out = {}
    for name, width in SHAPES:
        for n in rows:
            gens = [torch.Generator(device=device).manual_seed(s) for s in range(n)]
            streams = [Stream(s) for s in range(n)]
            times = {"generators": best_us(lambda: generator_draw(gens, width, device), repeats, device),
                     "streams": best_us(lambda: stream_noise(streams, width, device), repeats, device),
                     "reference": best_us(lambda: reference_draw(streams, width, device), repeats, device)}
            out[(name, n)] = times
            print(f"  {name:22s} {n:3d} rows: generators {times['generators']:8.1f} us, streams "
                  f"{times['streams']:7.1f} us ({times['generators'] / times['streams']:5.1f}x), torch reference "
                  f"{times['reference']:7.1f} us ({times['generators'] / times['reference']:4.1f}x)", flush=True)
    return out


def operations(fn) -> int:
    """The torch operations ``fn()`` runs, views aside (what launches kernels on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def mixed_settings(n: int) -> list[tuple[float, int, float]]:
    """``n`` rows' (temperature, top_k, top_p): every row its own temperature, every other row a top-k, every
    third a nucleus."""
    return [(0.5 + 0.05 * i, 20 + i if i % 2 else 0, 0.9 if i % 3 == 0 else 1.0) for i in range(n)]


def grouped(logits: torch.Tensor, settings: list[tuple[float, int, float]]) -> torch.Tensor:
    """A pass per setting: each group's rows gathered, through :func:`probabilities`, and scattered back."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(settings):
        groups.setdefault(s, []).append(i)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for (t, k, p), idx in groups.items():
        rows = torch.tensor(idx, device=logits.device)
        out[rows] = probabilities(logits.index_select(0, rows), t, k, p).float()
    return out


def distributions(rows: list[int], repeats: int, device: str) -> dict[int, dict[str, float]]:
    out = {}
    for n in rows:
        settings = mixed_settings(n)
        logits = torch.randn(n, 256, generator=torch.Generator().manual_seed(n)).to(device) * 3

        kmax, nucleus = max(k for _, k, _ in settings), any(p < 1 for _, _, p in settings)  # known on the host

        def one_pass():  # as continuous batching runs it: the settings to the device, one pass
            t, k, p = (torch.tensor(col, device=device) for col in zip(*settings))
            return probabilities_per_row(logits, t.float(), k, p.float(), kmax=kmax, nucleus=nucleus)

        if not torch.equal(one_pass(), grouped(logits, settings)):
            raise SystemExit(f"{n} rows: the one pass's distributions are not the grouped ones")
        with sampling_cpu.disabled():  # torch's operators, as a GPU runs them (on a CPU the C++ kernel is one call)
            ops = {"grouped ops": operations(lambda: grouped(logits, settings)), "one pass ops": operations(one_pass)}
        times = {"grouped": best_us(lambda: grouped(logits, settings), repeats, device),
                 "one pass": best_us(one_pass, repeats, device), **ops}
        out[n] = times
        print(f"  {n:3d} rows, {len(set(settings)):2d} settings: a pass per setting {times['grouped']:8.1f} us "
              f"({times['grouped ops']} operations), one pass {times['one pass']:7.1f} us ({times['one pass ops']} "
              f"operations): {times['grouped'] / times['one pass']:4.1f}x the time, "
              f"{times['grouped ops'] / times['one pass ops']:4.1f}x the operations; the same distributions", flush=True)
    return out


def kernel_calls(rows: list[int], repeats: int) -> dict[int, dict[str, float]]:
    """The sampling kernel against torch's operators, per call (see the module docstring)."""
    from efftx.generation.sampling import race
    from efftx.generation.speculative import accept_sampled, step_noise

    if sampling_cpu.kernel() is None:
        raise SystemExit(f"the C++ sampling kernel is unavailable here: {sampling_cpu.KERNEL.load()[1]}")
    gamma, vocab = 5, 256
    out = {}
    for n in rows:
        g = torch.Generator().manual_seed(n)
        draft_logits = [torch.randn(n, vocab, generator=g) * 3 for _ in range(gamma)]
        verify_logits = torch.randn(n, gamma + 1, vocab, generator=g) * 3
        noises, u, last = step_noise([Stream(i) for i in range(n)], [gamma] * n, gamma, vocab, "cpu")
        own = torch.full((n,), gamma)

        def draft_draw(i=0):
            q = probabilities(draft_logits[i], 0.8, 32, 1.0)
            return q, race(q, noises[i])

        def step():
            qs, drafted = zip(*(draft_draw(i) for i in range(gamma)))
            q = torch.stack(qs, 1)
            p = probabilities(verify_logits, 0.8, 32, 1.0)
            return accept_sampled(p, q, torch.stack(drafted, 1), u, last, own)

        p = probabilities(verify_logits, 0.8, 32, 1.0)
        q = torch.stack([draft_draw(i)[0] for i in range(gamma)], 1)
        drafted = torch.stack([draft_draw(i)[1] for i in range(gamma)], 1)
        parts = {"draft draw": draft_draw, "verify distributions": lambda: probabilities(verify_logits, 0.8, 32, 1.0),
                 "acceptance": lambda: accept_sampled(p, q, drafted, u, last, own), "a step's sampling": step}
        kernel_step = step()
        with sampling_cpu.disabled():
            if not torch.equal(step(), kernel_step):
                raise SystemExit(f"{n} rows: the kernel's tokens or acceptance differ from torch's")
        times = {}
        for name, fn in parts.items():
            on = best_us(fn, repeats, "cpu")
            with sampling_cpu.disabled():
                off = best_us(fn, repeats, "cpu")
            times[name] = off / on
            print(f"  {n:3d} rows, {name:21s}: torch {off:8.1f} us, kernel {on:7.1f} us ({off / on:4.1f}x)", flush=True)
        out[n] = times
    return out


def steps(rows: list[int], device: str) -> None:
    """The scheduler's decoding step, streams against per-row torch generators (see the module docstring)."""
    import serve_load

    from efftx.serving import batches
    from efftx.serving.continuous import Job, Sampling, Scheduler

    paths, note = serve_load.export_models("small")
    print(f"  ({note})")
    target, draft = serve_load.load_models(paths, device)
    real = batches._generator

    def torch_generator(seed):
        return torch.Generator(device=device).manual_seed(int(seed))

    for mode in ("base", "speculative"):
        best: dict[tuple[str, int], float] = {}
        for rep in range(4):  # the first round warms up
            for n in rows:
                for kind, make in (("generators", torch_generator), ("torch sampling", real), ("streams", real)):
                    batches._generator = make
                    sampling_cpu._state["enabled"] = kind != "torch sampling" and device == "cpu"
                    stepped = [0]  # rows stepped (a speculative row's acceptance, so its steps, follow its noise)
                    try:
                        scheduler = Scheduler(target, draft, max_rows=max(rows), short_tokens=0, prefill_rows=0,
                                              observe=lambda kind, r: stepped.__setitem__(0, stepped[0] + r))
                        for i in range(n):
                            scheduler.submit(Job(list(serve_load.PROMPTS[i % 10].encode()), 48, Sampling(0.8, 32),
                                                 i, 5 if mode == "speculative" else None))
                        scheduler.run_once()
                        before = stepped[0]
                        t0 = time.perf_counter()
                        scheduler.drain()
                        us = (time.perf_counter() - t0) * 1e6 / max(stepped[0] - before, 1)
                    finally:
                        batches._generator = real
                        sampling_cpu._state["enabled"] = True
                    if rep:
                        best[(kind, n)] = min(best.get((kind, n), float("inf")), us)
        line = ", ".join(f"{n} rows {best[('generators', n)]:.0f} / {best[('streams', n)]:.0f} us "
                         f"({best[('generators', n)] / best[('streams', n)]:.3f}x)" for n in rows)
        print(f"  {mode:12s} per row stepped, generators / streams: {line}", flush=True)
        if device == "cpu":
            line = ", ".join(f"{n} rows {best[('torch sampling', n)]:.0f} / {best[('streams', n)]:.0f} us "
                             f"({best[('torch sampling', n)] / best[('streams', n)]:.3f}x)" for n in rows)
            print(f"  {mode:12s} per row stepped, sampling kernel off / on: {line}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--steps", action="store_true", help="also the scheduler's decoding step, both ways")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if any(n < 1 for n in args.rows) or args.repeats < 1:
        p.error("--rows and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    print(f"a draw's noise on {args.device} ({torch.get_num_threads()} torch threads), best of {args.repeats}:")
    out = draws(args.rows, args.repeats, args.device)
    print(f"a step's distributions, rows of mixed settings (V=256), best of {args.repeats}:")
    dists = distributions(args.rows, args.repeats, args.device)
    kernel = {}
    if args.device == "cpu":
        print(f"the C++ sampling kernel against torch's operators, best of {args.repeats}:")
        kernel = kernel_calls(args.rows, args.repeats)
    if args.steps:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        print("the scheduler's decoding step (best of 3):")
        steps(args.rows, args.device)
    print("\ngoals:")
    for name, _ in SHAPES:
        if (name, 16) in out:
            t = out[(name, 16)]
            ratio = t["generators"] / t["streams"]
            print(f"  [{'met' if ratio >= 4 else 'NOT met'}] {name}: a 16-row draw with streams >= 4x faster than "
                  f"per-row generators: {ratio:.1f}x ({t['streams']:.1f} vs {t['generators']:.1f} us)")
    if 16 in dists:
        t = dists[16]
        ratio = t["grouped ops"] / t["one pass ops"]
        print(f"  [{'met' if ratio >= 3 else 'NOT met'}] distributions of 16 rows of 16 settings in one pass: at most "
              f"a third of the operations (kernel launches on a GPU) of a pass per setting: {ratio:.1f}x fewer "
              f"({t['one pass ops']} vs {t['grouped ops']}; time {t['grouped'] / t['one pass']:.1f}x here)")
    for n in (1, 16):
        if n in kernel:
            ratio = kernel[n]["a step's sampling"]
            print(f"  [{'met' if ratio >= 2 else 'NOT met'}] a speculative step's sampling at {n} row(s) at least 2x "
                  f"faster through the C++ kernel than torch's operators: {ratio:.1f}x")


if __name__ == "__main__":
    main()

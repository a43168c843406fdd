"""Continuous batching's slots fitted to their rows' positions against slots of the model's whole context, side by
side in one run, on the same requests: under a cache budget, how many rows a running batch holds and the decoding
CPU time; the most memory the slots and pooled caches held.

    PYTHONPATH=platform python bench/slot_positions.py [--budget-rows 8] [--requests 32] [--device cpu|cuda]

Untrained ``spec_target_small`` / ``spec_draft_small`` (context 256, as ``bench/serve_load.py`` exports them).
Requests arrive at once (a burst) and decode to the end on the calling thread (``Scheduler.drain``), every arrival
admitted as soon as the budget has room (``prefill_rows=0``, ``short_tokens=0``); two loads:

* ``short``: 8 to 32 new tokens on 4-24 byte prompts, every row under 64 positions (speculative: with gamma 5 + 1);
* ``mixed``: ``bench/serve_load.py``'s lengths (a third 8 or 16 new tokens, the rest 8 to 128).

The budget is ``--budget-rows`` rows of the whole context (a speculative row: the target's and the draft's caches).
With slots fitted to their rows (``Scheduler(fit_positions=True)``, the default) a batch of short requests takes 64
positions a row, a quarter of the context; the goal printed (``[info]``: the issue sets none) is the short load's
rows per step at least 2x those of whole-context slots. Outputs are not compared here (the tests do that).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time

import torch

from efftx import recipes
from efftx.generation.decode import cache_bytes, free_memory
from efftx.models import build as build_model
from efftx.serving.continuous import Job, Sampling, Scheduler

PROMPTS = ["def main():\n    ", "import os\n", "class Foo(object):\n", "for i in range(10):\n    ", "x = "]


def models(device: str):
    out = []
    for role, seed in (("target", 0), ("draft", 1)):
        cfg = recipes.get(f"spec_{role}_small")
        if cfg.model.max_seq_len < 256:
            cfg = cfg.override({"model.max_seq_len": 256})
        torch.manual_seed(seed)
        out.append(build_model(cfg).eval().to(device))
    return out


def lengths_of(load: str, n: int) -> list[int]:
    rng = random.Random(0)
    if load == "short":
        return [rng.randint(8, 32) for _ in range(n)]
    return [rng.choice([8, 16]) if i % 3 == 0 else rng.randint(8, 128) for i in range(n)]


def run(target, draft, mode: str, lengths: list[int], budget: int, fit: bool) -> dict:
    free_memory()  # no caches pooled by the previous run
    rows, held = [], []
    # every arrival admitted as soon as memory allows (no prefill limit, no priority): the rows a step holds are what
    # the budget holds
    scheduler = Scheduler(target, draft, cache_budget=budget, fit_positions=fit, prefill_rows=0, short_tokens=0,
                          observe=lambda kind, n: rows.append(n),
                          hook=lambda kind, jobs: held.append(scheduler.budget.held() + scheduler.budget.pooled()))
    jobs = [scheduler.submit(Job(list(PROMPTS[i % len(PROMPTS)].encode()), n, Sampling(0.8, 32), i,
                                 5 if mode == "speculative" else None)) for i, n in enumerate(lengths)]
    t0 = time.thread_time()
    scheduler.drain()
    seconds = time.thread_time() - t0
    errors = [j for j in jobs if j.error is not None]
    return {"most": max(rows), "mean": statistics.mean(rows), "steps": len(rows), "seconds": seconds,
            "held": max(held) / 2**20, "errors": len(errors)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget-rows", type=int, default=8, help="the budget: this many rows of the whole context")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--modes", default="base,speculative")
    p.add_argument("--loads", default="short,mixed")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args()
    if args.budget_rows < 1 or args.requests < 1:
        p.error("--budget-rows and --requests must be at least 1")
    modes, loads = args.modes.split(","), args.loads.split(",")
    if not set(modes) <= {"base", "speculative"} or not set(loads) <= {"short", "mixed"}:
        p.error("--modes: base, speculative; --loads: short, mixed")
    torch.set_num_threads(1)
    logging.getLogger("ray.serve").setLevel(logging.ERROR)  # the scheduler's warning at each refusal: expected here
    target, draft = models(args.device)
    row = {mode: sum(cache_bytes(m.new_cache(1, m.max_seq_len)) for m in ((target,) if mode == "base" else (target, draft)))
           for mode in modes}
    print(f"spec_target_small / spec_draft_small (untrained, context {target.max_seq_len}) on {args.device}, "
          f"{args.requests} requests at once, a budget of {args.budget_rows} rows of the context; 1 torch thread")
    print(f"{'load':<7}{'mode':<12}{'slots':<9}{'rows/step most':>15}{'mean':>7}{'steps':>7}{'cpu s':>8}"
          f"{'held MiB':>10}{'errors':>7}")
    goals = []
    for load in loads:
        lengths = lengths_of(load, args.requests)
        for mode in modes:
            budget = args.budget_rows * row[mode]
            got = {}
            for name, fit in (("fit", True), ("context", False)):
                r = got[name] = run(target, draft, mode, lengths, budget, fit)
                print(f"{load:<7}{mode:<12}{name:<9}{r['most']:>15}{r['mean']:>7.1f}{r['steps']:>7}"
                      f"{r['seconds']:>8.2f}{r['held']:>10.2f}{r['errors']:>7}", flush=True)
            ratio = got["fit"]["mean"] / got["context"]["mean"]
            faster = got["context"]["seconds"] / got["fit"]["seconds"]
            line = (f"{load} {mode}: rows per step, fitted over context {ratio:.2f}x (most {got['fit']['most']} vs "
                    f"{got['context']['most']}); decoding time, context over fitted {faster:.2f}x")
            if load == "short":
                goals.append(f"[{'met' if ratio >= 2 else 'NOT met'}] (info) {line}: rows >= 2x")
            else:
                goals.append(f"[info] {line}")
            if got["fit"]["errors"] or got["context"]["errors"]:
                goals.append(f"[NOT met] {load} {mode}: no errors")
    print("\ngoals:")
    for line in goals:
        print("  " + line)


if __name__ == "__main__":
    main()

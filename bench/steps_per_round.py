"""Continuous batching's decoding with several steps a round against one, side by side.

    python bench/steps_per_round.py [--device cpu|cuda] [--rows 1 4 16] [--tokens 128] [--steps 4] [--rounds 3]
                                    [--size small|debug] [--threads 1] [--compile off|on|auto]
                                    [--mode base|speculative] [--gamma 5] [--pipeline]

For each row count, that many base decoding requests (``--mode speculative``: speculative, gamma ``--gamma``;
``--tokens`` new tokens each, temperature 0.8, top-k 32, each its own seed) start together on the
continuous-batching scheduler (:class:`efftx.serving.continuous.Scheduler`, every row stepped every round, nothing
queued once they joined), which decodes them to the end on this thread, once with ``steps_per_round=1`` and once
with ``--steps``: the batch then runs that many steps per scheduling round, each fed the last one's tokens, and the
host schedules once per round (base decoding: the steps run on the device back to back and the host reads their
tokens once; speculative decoding reads each step's acceptance, and stops a round's steps after the one in which a
row got its last token). Untrained ``spec_target_{size}`` weights (and ``spec_draft_{size}``'s; the load, not the
text, is measured). The two take turns, ``--rounds`` times after a warm-up round; each figure is the best of the
rounds, on the wall clock (on CUDA every pass ends with a device synchronisation, as the scheduler times it).
Printed per row count and setting: tokens/s, scheduling rounds, per token the time in the passes and the scheduler's
own time besides them (:meth:`Scheduler.timing`'s ``host_us``: choosing what runs, handing tokens to requests, and
once per request its admission: its slots reserved, its row placed), and that own time per round. Each request's
tokens must be the same both ways (checked; the bench fails otherwise). ``--compile on|auto``: the scheduler's
compiled passes (CUDA graphs on a GPU).

``--pipeline``: base decoding with ``--steps`` steps a round (1 allowed here), unpipelined against pipelined
(:class:`~efftx.serving.continuous.Scheduler`'s ``pipeline``: the next step queued on the device before the host
reads the last one's tokens) instead. Without it both sides take the scheduler's default (pipelined on CUDA).

Goal (marked met or not at every row count): with ``--steps`` 4, the scheduler's own time per token at most half
of one step a round's. The tokens/s ratio is printed beside it, with no goal here: on a CPU a step costs
milliseconds and the host's share of a round is about a tenth; on a GPU, whose steps take a few hundred
microseconds, the host's share is what several steps a round remove (and the device runs the steps back to back).
With ``--pipeline``, on CUDA: pipelined tokens/s at least 1.1x unpipelined (on a CPU, which runs nothing ahead of
the host, the ratio is printed without a goal).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "platform"))
sys.path.insert(0, str(HERE))

HOST_GOAL = 0.5  # the scheduler's own time per token with several steps a round, at most this share of one's
PIPELINE_GOAL = 1.1  # pipelined steps' tokens/s on CUDA, at least this many times unpipelined steps'


def decode(target, rows: int, tokens: int, steps: int, compile: str = "off", draft=None, gamma: int | None = None,
           pipeline: bool | None = None) -> dict:
    """``rows`` requests decoded together to the end with ``steps_per_round=steps`` (speculative with ``gamma``
    over ``draft``; None: base) and ``pipeline`` (None: the scheduler's default): their tokens and timings."""
    import serve_load

    from efftx.serving.continuous import Job, Sampling, Scheduler

    scheduler = Scheduler(target, draft, max_rows=rows, short_tokens=0, prefill_rows=0, steps_per_round=steps,
                          compile=compile, pipeline=pipeline)
    jobs = [scheduler.submit(Job(list(serve_load.PROMPTS[i % len(serve_load.PROMPTS)].encode()), tokens,
                                 Sampling(0.8, 32), seed=i, gamma=gamma)) for i in range(rows)]
    t0 = time.perf_counter()
    scheduler.drain()
    seconds = time.perf_counter() - t0
    failed = [j.failure for j in jobs if j.failure is not None]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0]}")
    timing = scheduler.timing()
    made = sum(len(j.out) for j in jobs)
    accepted = [n for j in jobs if j.stats is not None for n in j.stats.accepted]
    return {"out": [j.out for j in jobs], "accepted": accepted, "tokens_s": made / seconds,
            "rounds": timing["rounds"],
            "host_us": timing["host_us"] * timing["rounds"] / made,
            "pass_us": timing["pass_us"] * timing["rounds"] / made, "host_round_us": timing["host_us"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--tokens", type=int, default=128, help="new tokens per request (the issue's 128)")
    p.add_argument("--steps", type=int, default=4, help="steps per round to compare with 1")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds (after a warm-up round)")
    p.add_argument("--size", default="small", choices=["small", "debug"])
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--compile", default="off", choices=["off", "on", "auto"], help="the scheduler's compiled passes")
    p.add_argument("--mode", default="base", choices=["base", "speculative"], help="the requests' decoding")
    p.add_argument("--gamma", type=int, default=5, help="--mode speculative: drafts per step")
    p.add_argument("--pipeline", action="store_true",
                   help="compare unpipelined with pipelined base steps, both with --steps steps a round")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if min(args.rows) < 1 or args.tokens < 1 or args.steps < 1 + (not args.pipeline) or args.rounds < 1:
        p.error("--rows, --tokens and --rounds must be >= 1, --steps >= 2 (>= 1 with --pipeline)")
    if args.gamma < 1:
        p.error("--gamma must be >= 1")
    if args.pipeline and args.mode != "base":
        p.error("--pipeline: base decoding's steps are pipelined (speculative steps read their acceptance)")
    torch.set_num_threads(args.threads)
    import serve_load

    paths, note = serve_load.export_models(args.size)
    target, draft = serve_load.load_models(paths, args.device, args.threads)
    spec = args.mode == "speculative"
    draft, gamma = (draft, args.gamma) if spec else (None, None)
    what = f"speculative decoding (gamma {gamma})" if spec else "base decoding"
    # the two sides: (steps a round, pipeline)
    sides = [(args.steps, False), (args.steps, True)] if args.pipeline else [(1, None), (args.steps, None)]
    against = (f"{args.steps} steps a round, unpipelined against pipelined" if args.pipeline
               else f"steps per round 1 against {args.steps}")
    print(f"{what}, {args.tokens} new tokens per request, {against} "
          f"({note}; {args.device}, {args.threads} torch thread(s), compile {args.compile}; best of {args.rounds} "
          "rounds after a warm-up)")
    print(f"{'rows':>4}  {'steps/round':>11}  {'pipelined':>9}  {'tokens/s':>9}  {'rounds':>6}  {'pass us/token':>13}  "
          f"{'host us/token':>13}  {'host us/round':>13}")
    goals = []
    with torch.no_grad():
        for rows in args.rows:
            best: dict[tuple, dict] = {}
            first = None  # the tokens of the first run: every other run, either way, must give the same
            for rep in range(args.rounds + 1):  # the first round warms up
                for side in sides:
                    got = decode(target, rows, args.tokens, side[0], args.compile, draft, gamma, side[1])
                    first = first if first is not None else (got["out"], got["accepted"])
                    if (got["out"], got["accepted"]) != first:
                        raise SystemExit(f"{rows} rows: steps_per_round={side[0]}, pipeline={side[1]} gave other "
                                         f"tokens (or acceptance) than steps_per_round={sides[0][0]}, "
                                         f"pipeline={sides[0][1]}")
                    if rep and (side not in best or got["tokens_s"] > best[side]["tokens_s"]):
                        best[side] = got
            for side in sides:
                b = best[side]
                piped = {None: "default", False: "no", True: "yes"}[side[1]]
                print(f"{rows:>4}  {side[0]:>11}  {piped:>9}  {b['tokens_s']:>9.0f}  {b['rounds']:>6}  "
                      f"{b['pass_us']:>13.1f}  {b['host_us']:>13.1f}  {b['host_round_us']:>13.1f}", flush=True)
            one, many = best[sides[0]], best[sides[1]]
            host = many["host_us"] / one["host_us"] if one["host_us"] > 0 else float("inf")
            speed = many["tokens_s"] / one["tokens_s"]
            label = "pipelined / unpipelined" if args.pipeline else f"{args.steps} steps a round / 1"
            print(f"{rows:>4}  {label}: {speed:.3f}x the tokens/s, {host:.3f}x the host time "
                  f"per token; the same tokens{' and acceptance' if spec else ''}", flush=True)
            goals.append((rows, speed if args.pipeline else host))
    print("\ngoals:")
    if args.pipeline:
        for rows, speed in goals:
            if args.device == "cuda":
                mark = "met" if speed >= PIPELINE_GOAL else "NOT met"
            else:
                mark = "not judged (a CPU runs nothing ahead of the host)"
            print(f"  [{mark}] {rows} rows: pipelined tokens/s at least {PIPELINE_GOAL}x unpipelined on CUDA: "
                  f"{speed:.3f}x")
        return
    for rows, host in goals:
        judged = args.steps == 4
        mark = ("met" if host <= HOST_GOAL else "NOT met") if judged else "not judged (--steps is not 4)"
        print(f"  [{mark}] {rows} rows: the scheduler's own time per token with 4 steps a round at most "
              f"{HOST_GOAL}x one step's: {host:.3f}x")


if __name__ == "__main__":
    main()

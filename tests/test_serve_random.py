"""Continuous batching under random load: every scheduler feature at once, each request still as alone.

The other tests of :mod:`efftx.serving.continuous` (``tests/test_serve_continuous.py``) drive one feature each
with a plan written by hand. Here a seeded generator draws both the load and the scheduler's knobs, so that the
features meet in combinations nobody wrote down: requests arriving at random rounds with short and long prompts
(chunked prefills), short and long outputs (slots that widen and narrow), base, fixed-gamma and adaptive
speculative decoding, greedy and sampled, some cancelled while queued, running or after they finished, some that
the models cannot hold (refused alone), some whose passes raise a fault (contained: they fail alone); the
priority lanes, prefill limits, a cache budget or none, fitted or whole-context slots, several steps a round or
one, pipelined base steps or not; a replica's warm-up first, or none. The scheduler runs on a counting clock, so a seed replays the same rounds.

What each run must show:

* every request that was not cancelled or refused gets exactly the tokens (and, speculative, the acceptance and
  draft lengths, step by step) it gets alone: the library's own ``generate`` / ``speculative_generate``, or, for a
  chunked prompt, a scheduler running it alone with the same chunks;
* a cancelled request, or one failed by its fault, is done and holds a prefix of those tokens; a refused one fails
  with an error naming the context, and nothing else fails;
* under a budget, the caches (slots and pooled) hold at most the budget at every prefill and step;
* at the end nothing runs, nothing waits, and no batch holds memory.

``tests/test_serve_compiled.py`` runs the same load with compiled passes.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from efftx.generation import decode
from efftx.serving.continuous import Job, Sampling, Scheduler, warm_up

from test_serve_continuous import pair, row_bytes, solo

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLINGS = [Sampling(0.0), Sampling(1.0, 20, 1.0), Sampling(0.8, 0, 0.9)]
CHUNK = 8


@pytest.fixture(scope="module")
def pairs():
    return {}


def knobs(rng: random.Random, target, draft) -> dict:
    """A scheduler's settings, drawn."""
    rows = row_bytes(target) + row_bytes(draft)  # a speculative row of the whole context
    return {"max_rows": rng.choice([3, 5, 8]), "short_tokens": rng.choice([0, 8, 16]),
            "fast_rows": rng.choice([1, 2, 4]), "long_every": rng.choice([1, 3, 16]),
            "prefill_rows": rng.choice([0, 1, 2]), "prefill_chunk": rng.choice([0, CHUNK]),
            "short_slowdown": rng.choice([0.0, 1.5, 4.0]), "max_wait_rounds": rng.choice([4, 64]),
            "fit_positions": rng.random() < 0.7,
            "cache_budget": rng.choice([None, rows, 2 * rows, 3 * rows]),
            "warm_up": rng.choice([0, 0, 2, 4])}


def plan(rng: random.Random, context: int, n: int) -> list[dict]:
    """``n`` requests: arrival round, prompt, new tokens, mode, sampling, seed; when (if ever) to cancel it, and
    from which of its steps (if any) a fault is raised in every pass that holds its row (the scheduler's hook)."""
    out = []
    for i in range(n):
        mode = rng.choices(["base", "fixed", "adaptive"], [0.5, 0.35, 0.15])[0]
        gamma, max_gamma = {"base": (None, None), "fixed": (rng.choice([2, 3]), None), "adaptive": (2, 4)}[mode]
        cap = 0 if gamma is None else (max_gamma or gamma)  # the draft tokens a verify pass adds
        prompt_len = rng.randint(1, 10) if rng.random() < 0.7 else rng.randint(11, 40)
        room = context - prompt_len - cap  # the most new tokens the models hold
        if rng.random() < 0.08:
            new = room + rng.randint(1, 5)  # more than the context holds: refused
        elif rng.random() < 0.1:
            new = room  # exactly at the context's edge
        elif rng.random() < 0.6:
            new = rng.randint(1, 16)
        else:
            new = rng.randint(17, min(room, 90))
        arrival = rng.randint(0, 30)
        cancel = arrival + rng.randint(0, 25) if rng.random() < 0.15 else None
        poison = rng.randint(0, 10) if new <= room and rng.random() < 0.1 else None
        out.append({"arrival": arrival, "prompt": [rng.randint(1, 60) for _ in range(prompt_len)], "new": new,
                    "sampling": rng.choice(SAMPLINGS), "seed": 1000 + i, "gamma": gamma, "max_gamma": max_gamma,
                    "cancel": cancel, "refused": new > room, "poison": poison})
    return out


def run(scheduler: Scheduler, requests: list[dict]) -> list[Job]:
    """Submit and cancel each request at its round; run rounds until nothing runs or waits."""
    jobs: dict[int, Job] = {}
    last = max(max(r["arrival"], r["cancel"] or 0) for r in requests)
    r = 0
    with torch.no_grad():
        while r <= last or scheduler.running or scheduler._queue:
            for i, req in enumerate(requests):
                if req["arrival"] == r:
                    jobs[i] = scheduler.submit(Job(req["prompt"], req["new"], req["sampling"], req["seed"],
                                                   req["gamma"], max_gamma=req["max_gamma"], tag=i))
                if req["cancel"] == r:
                    scheduler.cancel(jobs[i])
            scheduler.run_once()
            r += 1
            assert r < 3000, "the load did not drain"
    return [jobs[i] for i in range(len(requests))]


def alone(target, draft, req: dict, chunk: int):
    """(tokens, stats) of one request decoded alone: the library's entry points, or with a chunked prompt, a
    scheduler of its own with the same chunks (a chunked prefill's numbers are those of its chunks)."""
    if chunk and len(req["prompt"]) - (req["gamma"] is not None) > chunk:
        (job,) = run(Scheduler(target, draft, short_tokens=0, prefill_chunk=chunk), [{**req, "cancel": None}])
        assert job.done and job.error is None, job.error
        return job.out, job.stats
    p = (0, req["prompt"], req["new"], req["sampling"], req["seed"], req["gamma"], req["max_gamma"])
    return solo(target, draft, p)


def check(target, draft, requests: list[dict], jobs: list[Job], chunk: int) -> None:
    for req, job in zip(requests, jobs):
        assert job.done, req
        if req["refused"]:  # (or cancelled while it waited, before its check)
            assert not job.out and (job.cancelled or job.error is not None), req
            assert job.error is None or "max_seq_len" in str(job.error), (req, job.error)
            continue
        tokens, stats = alone(target, draft, req, chunk)
        if job.cancelled or (req["poison"] is not None and job.error is not None):
            assert job.out == tokens[:len(job.out)], req
            assert job.error is None or str(job.error) == "injected fault", (req, job.error)
            continue
        assert job.error is None, (req, job.error)
        assert job.out == tokens, req
        if stats is not None:
            assert job.stats.accepted == stats.accepted, req
            assert job.stats.drafted == stats.drafted, req
            assert (job.stats.target_calls, job.stats.draft_calls) == (stats.target_calls, stats.draft_calls), req


def soak(target, draft, seed: int, n: int = 16, **extra) -> tuple[dict, list[Job]]:
    """One seed's load on a scheduler with the seed's knobs (and ``extra`` ones), checked as the module says."""
    rng = random.Random(seed)
    settings = knobs(rng, target, draft)
    # several base steps a round on about half the seeds (drawn apart, so that each seed's plan stays what it was)
    settings["steps_per_round"] = random.Random(~seed).choice([1, 4])
    drawn = random.Random(seed + 1000).random() < 0.5  # pipelined base steps, likewise (or as ``extra`` says)
    settings["pipeline"] = extra.pop("pipeline", drawn)
    requests = plan(rng, target.max_seq_len, n)
    decode.free_memory()  # no caches pooled by earlier tests (a budget counts its own)
    rows = settings.pop("warm_up")
    if rows:  # as a replica starts: throwaway batches, and caches pooled for the first real ones (every width)
        warm_up(target, draft, rows=rows, gamma=2, cache_budget=settings["cache_budget"],
                compile=extra.get("compile", "off"))
    ticks = itertools.count()
    held: list[int] = []
    scheduler = None

    def hook(kind, jobs):
        if scheduler.budget is not None:
            held.append(scheduler.budget.held() + scheduler.budget.pooled())
        for job in jobs:
            poison = requests[job.tag]["poison"]
            if poison is not None and job.steps >= poison:
                raise RuntimeError("injected fault")  # contained: the batch's rows run alone, this one fails

    scheduler = Scheduler(target, draft, **settings, **extra, hook=hook, clock=lambda: next(ticks) * 1e-3)
    jobs = run(scheduler, requests)
    check(target, draft, requests, jobs, settings["prefill_chunk"])
    if settings["cache_budget"] is not None:
        assert held and max(held) <= settings["cache_budget"], settings
        assert scheduler.budget.held() == 0
    assert scheduler.running == 0 and not scheduler._queue
    assert all(len(engine) == 0 for engine in scheduler._engines())
    return settings, jobs


@pytest.mark.parametrize("seed", range(12))
def test_random_load_on_full_attention_gets_every_request_its_solo_output(pairs, seed):
    """Full attention: the backend with every feature (fitted slots that widen and narrow, pooled caches).

    Power (run and seen): on the code before this test (61798ab) seeds 2, 5, 8, 9 and 11 fail (43 of seeds 0-299):
    under a cache budget an idle replica answered valid requests with a 503, where a request refused at its prefill
    had left its slots reserved, or where arrivals needing wider slots found the budget filled at the narrow width
    (both now also tested on their own in tests/test_serve_continuous.py); and a replica's budget did not count the
    caches its warm-up pooled for the draft until the draft's first slots asked, so the target's slots grew past it
    (with the other fixes, seeds 2 and 8 still failed: 12 of 0-299)."""
    target, draft = pair(pairs, "full")
    settings, jobs = soak(target, draft, seed)
    if settings["cache_budget"] is None:  # rows really shared steps (a budget may hold one row at a time)
        assert max(j.batch_size for j in jobs) >= 2, settings


@pytest.mark.parametrize("kind,seed", [("performer", 10), ("sinkhorn", 11), ("nsa", 12)])
def test_random_load_on_other_backends_gets_every_request_its_solo_output(pairs, kind, seed):
    """The checks of :func:`soak` (each request's solo tokens and acceptance, the budget, nothing left held) on
    Performer's, Sinkhorn's and NSA's caches; and the load was not all refused or cancelled."""
    target, draft = pair(pairs, kind)
    _, jobs = soak(target, draft, seed, n=10)
    assert sum(bool(job.out) for job in jobs) >= 5, [len(job.out) for job in jobs]

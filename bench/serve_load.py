"""Load on the text app over loopback: continuous batching vs static batching vs unbatched serving.

    python bench/serve_load.py [--clients 16] [--requests 64] [--modes base,speculative[,coupled]] [--rounds 1]
                               [--target PATH --draft PATH | --size small|debug] [--quick] [--device cpu|cuda]
                               [--short-slowdown X] [--decode-weights float32|bfloat16] [--ingress proxy,haproxy]
    python bench/serve_load.py --inprocess [--device cpu|cuda] [--clock cpu|wall] [--threads N] [--adaptive-gamma]
                               [--compile off|on|auto] [--compile-rows N] [--long-prompts BYTES]
                               [--prefill-chunk TOKENS] [--one-pass] [--steps-per-round N] [the load options]

Starts a local Ray cluster and Serve on 127.0.0.1 and deploys the text app several ways, one after another, in
one run: ``unbatched`` (``batching=static``, ``max_batch_size=1``), ``static`` (``@serve.batch``, 8 per batch),
``fifo`` (continuous batching without priority: ``short_tokens=0``, every row in every step), ``continuous``
(iteration-level scheduling with its default priority to short requests; ``--short-slowdown`` sets its
measured-cost knob) and ``process`` (the same, with ``engine=process``: the scheduler in a decoding process of the
replica's own, :mod:`efftx.serving.engine_process`; its goals are marked too, and its requests/s paired with
``continuous``'s in an [info] line). Without ``--target``/``--draft`` it exports randomly initialised
``spec_{target,draft}_{size}`` models itself (the load, not the text, is measured;
``debug`` models get a 256-token context so that 128 new tokens fit) and says so.

``--ingress`` chooses how HTTP reaches the replicas (:mod:`efftx.serving.ingress`): ``proxy`` (Serve's Python proxy,
the default), ``haproxy`` (Serve's HAProxy ingress, straight to the replicas' own HTTP servers) or both
(``proxy,haproxy``): each in a Ray cluster of its own, alternated within every round; a table and the goals per
ingress, then HAProxy's requests/s and unloaded latency over the proxy's, per configuration and mode.

For each configuration and mode (base, speculative with gamma 5; ``--modes base,speculative,coupled`` adds
speculative requests with ``coupled`` acceptance, whose tokens are base decoding's and whose draft lengths, at most 5,
the server chooses by its load, :mod:`efftx.generation.draft_length`):

* **unloaded**: short requests of 8 and of 16 new tokens (the shortest and the longest short request) sent one
  at a time: their median latency per length;
* **load**: ``--clients`` client threads send ``--requests`` requests between them, each with its own seed and a
  length drawn from 8..128 new tokens (a fixed, seeded mix; every 4th request is a ``/generate/stream`` whose
  time to the first ``step`` event is its time to first token, the others ``POST /generate``).

Before the load, the scheduler's step cost is measured in-process for 1, 4, 8 and ``--clients`` rows (best of 3,
after a warm-up; with the scheduler's own time in it, besides the passes): a short request sharing a step of many
rows cannot beat that ratio, which is why the scheduler steps short requests apart (``fast_rows`` is best set
where this cost stops being nearly flat). Printed per row:
requests/s, p50/p99 latency, p50/p99 latency of the short requests (8..16 new tokens), each short request's
latency over the unloaded latency at its own length (interpolated between the 8- and 16-token medians; p50/p99),
time to first token (streams, p50/p99), errors, and the load average. Then the goals, each met or not:
continuous batching serves >= 3x the requests/s of unbatched serving (base and speculative), the short requests'
p99 latency ratio under load is <= 2x (also printed without the opening burst: the short requests among the
first ``--clients``, which all start at once), and no request fails. ``--rounds N`` measures every configuration N times,
alternated (round 1: unbatched, ..., continuous; round 2: the same again), prints a row per round and takes each
goal's median over the rounds (the throughput ratio paired within a round): one run's ratio moves by about 15%
on this machine. ``--device cuda``: the models decode on the GPU (each replica is given one); ``--threads N``: each
replica's torch threads (the app's ``threads``); ``--adaptive-gamma``: the speculative requests ask for
``adaptive_gamma`` (from gamma 5 up to the limits' max_gamma, 8).

``--compile on|auto`` (``--compile-rows N``): continuous batching's compiled passes (the app's ``compile``, for the
``fifo`` and ``continuous`` configurations; in-process for every policy, unbatched included), and the step costs
compiled at every row count beside the eager ones (eager over compiled, per row count).

``--inprocess``: the same load on the scheduler itself, no HTTP and no Ray (torch alone: the GPU check's
``serveload`` section runs it on a bare GPU image), for three policies of :class:`efftx.serving.continuous.Scheduler`:
``unbatched`` (one row at a time), ``fifo`` and ``continuous``; timed on the decoding thread's CPU clock
(``--clock cpu``, the default on a CPU: the figures measure the scheduling, hardly the machine's other load) or
the wall clock (``--clock wall``, the default with ``--device cuda``), with the same goals marked, and an [info]
line per mode with the scheduler's own time per round besides its passes (:meth:`Scheduler.timing`).
``--long-prompts BYTES``: every other long request's prompt has that many bytes (a prefill of many decoding
steps' cost); ``--prefill-chunk TOKENS``: a fourth policy, ``chunked`` (the scheduler's ``prefill_chunk``: long
prompts prefilled that many tokens a round), beside ``continuous`` with whole prompts, compared in an [info] line.
``--steps-per-round N``: another policy, ``multi-step`` (the scheduler's ``steps_per_round=N``: a batch runs up to
N steps a round while nothing waits), beside ``continuous``, compared in an [info] line: requests/s, the short
requests' p99, time to first token and the scheduling's time per round.
``--attention-reference``: the step costs again with the CPU attention kernel key by key (its reference path,
:func:`efftx.kernels.decode_attention_cpu.key_by_key`: the same bits), printed beside the blocked path's as their
ratio per row count.
``--unpipelined``: another policy, ``unpipelined`` (the scheduler's ``pipeline=False``), beside ``continuous`` (the
scheduler's default: base decoding's steps pipelined on CUDA, not on a CPU), compared in an [info] line as
``multi-step`` is.
``--one-pass``: another policy, ``one-pass`` (the scheduler's ``group_prefills=False``: a round's arrivals for a
lane are prefilled in one pass, padded to the longest prompt), beside ``continuous`` (arrivals grouped into the
passes the measured costs say cost least), compared in an [info] line: the prefills' time, passes and padded
tokens, requests/s and the short requests' p99.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time

import torch

PROMPTS = ["def main():\n    ", "import os\n", "class Foo(object):\n", "for i in range(10):\n    ", "x = ",
           "# a helper that reads a file\n", "while True:\n", "return sorted(", "print(", "if __name__ =="]
CONFIGS = [("unbatched", {"batching": "static", "max_batch_size": 1}),
           ("static (8)", {"batching": "static", "max_batch_size": 8, "batch_wait_timeout_s": 0.02}),
           ("fifo", {"batching": "continuous", "max_batch_size": 32, "short_tokens": 0}),
           ("continuous", {"batching": "continuous", "max_batch_size": 32}),
           # continuous batching in a decoding process of the replica's own (efftx.serving.engine_process)
           ("process", {"batching": "continuous", "max_batch_size": 32, "engine": "process"})]
SHORT = 16  # requests with at most this many new tokens are "short"
ADAPTIVE_CAP = None  # --adaptive-gamma: speculative requests' draft lengths follow their acceptance, up to this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def body_for(i: int, new: int, mode: str) -> dict:
    """Request ``i``'s body in ``mode`` (``coupled``: a speculative request with coupled acceptance)."""
    return {"prompt": PROMPTS[i % len(PROMPTS)], "max_new_tokens": new, "temperature": 0.8, "top_k": 32,
            "seed": 1000 + i, "mode": "base" if mode == "base" else "speculative", "gamma": 5,
            **({"adaptive_gamma": True} if ADAPTIVE_CAP else {}), **({"coupled": True} if mode == "coupled" else {})}


def one(url: str, body: dict, stream: bool, timeout: float) -> tuple[bool, float, float | None]:
    """(ok, latency s, time to first token s or None) of one request."""
    import requests  # HTTP runs only: --inprocess needs torch alone

    t0 = time.perf_counter()
    try:
        if not stream:
            res = requests.post(f"{url}/generate", json=body, timeout=timeout)
            return res.status_code == 200, time.perf_counter() - t0, None
        first = None
        ok = False
        with requests.post(f"{url}/generate/stream", json={**body}, stream=True, timeout=timeout) as res:
            if res.status_code != 200:
                return False, time.perf_counter() - t0, None
            for line in res.iter_lines(decode_unicode=True):
                if line == "event: step" and first is None:
                    first = time.perf_counter() - t0
                elif line == "event: done":
                    ok = True
                elif line == "event: error":
                    ok = False
                    break
        return ok and first is not None, time.perf_counter() - t0, first
    except requests.RequestException:
        return False, time.perf_counter() - t0, None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))] * 1e3


def load(url: str, mode: str, clients: int, total: int, lengths: list[int], timeout: float) -> dict:
    results: list[tuple[int, bool, float, float | None, int]] = []
    lock = threading.Lock()
    nxt = [0]
    deadline = time.perf_counter() + timeout

    def client():
        while time.perf_counter() < deadline:
            with lock:
                i = nxt[0]
                if i >= total:
                    return
                nxt[0] += 1
            ok, secs, first = one(url, body_for(i, lengths[i], mode), i % 4 == 3, timeout)
            with lock:
                results.append((lengths[i], ok, secs, first, i))

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r[1]]
    lat = [r[2] for r in ok]
    short = [r[2] for r in ok if r[0] <= SHORT]
    shorts = [(r[0], r[2]) for r in ok if r[0] <= SHORT]
    later = [(r[0], r[2]) for r in ok if r[0] <= SHORT and r[4] >= clients]  # after the opening burst
    ttft = [r[3] for r in ok if r[3] is not None]
    return {"ok": len(ok), "errors": total - len(ok), "rps": len(ok) / wall, "tokens_s": sum(r[0] for r in ok) / wall,
            "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "short_p50": pct(short, 0.5), "short_p99": pct(short, 0.99), "shorts": len(short),
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "short_list": shorts,
            "later_list": later}


def unloaded_short(url: str, mode: str, n: int, timeout: float, lengths=(8, SHORT)) -> dict[int, float]:
    """Median latency (ms) of short requests sent one at a time, per length (the shortest and the longest short
    request: latency is affine in the tokens, :func:`short_ratios` interpolates between them)."""
    out = {}
    for new in lengths:
        lat = []
        for i in range(n):
            ok, secs, _ = one(url, body_for(10000 + i, new, mode), False, timeout)
            if ok:
                lat.append(secs)
        out[new] = statistics.median(lat) * 1e3 if lat else float("nan")
    return out


def short_ratios(shorts: list[tuple[int, float]], alone: dict[int, float]) -> list[float]:
    """Each short request's latency under load over its unloaded latency at its own length (interpolated)."""
    (a, la), (b, lb) = sorted(alone.items())
    return [secs * 1e3 / (la + (lb - la) * (n - a) / (b - a)) for n, secs in shorts]


def step_costs(target, draft, counts: list[int], modes: list[str], repeats: int = 3,
               compiled: dict | None = None, host: dict | None = None) -> dict[str, dict[int, float]]:
    """In-process, no HTTP: ms per decoding step of the continuous-batching scheduler (no priority: every row in
    every step) for each row count in ``counts`` (what a short request's latency scales with when it shares a
    step), after a warm-up; the counts are interleaved and each takes its best of ``repeats`` (the machine's
    other load inflates single timings). Every step reads its tokens back to the host, so on CUDA the wall clock
    waits for the device. ``compiled``: the scheduler's ``compile`` / ``compile_rows`` (default: eager).
    ``host``: filled per mode and row count with the scheduler's own us per round besides its passes (the same
    best run's, :meth:`Scheduler.timing`)."""
    from efftx.serving.continuous import Job, Sampling, Scheduler

    out = {}
    for mode in modes:
        best: dict[int, float] = {}
        own: dict[int, float] = {}
        measured: dict = {}  # the schedulers' measured costs, carried on (coupled: the draft lengths' costs)
        for rep in range(repeats + 1):  # the first round warms up
            for n in counts:
                scheduler = Scheduler(target, draft, max_rows=max(counts), short_tokens=0, prefill_rows=0,
                                      costs=measured, **(compiled or {}))
                measured = scheduler.costs
                for i in range(n):
                    scheduler.submit(Job(list(PROMPTS[i % len(PROMPTS)].encode()), 32, Sampling(0.8, 32), i,
                                         5 if mode != "base" else None, coupled=mode == "coupled"))
                scheduler.run_once()  # admission (prefill) and a first step, not timed
                steps, rounds, host_s = scheduler.steps, scheduler.rounds, scheduler.host_seconds
                t0 = time.perf_counter()
                scheduler.drain()
                ms = (time.perf_counter() - t0) * 1e3 / max(scheduler.steps - steps, 1)
                if rep and ms < best.get(n, float("inf")):
                    best[n] = ms
                    own[n] = (scheduler.host_seconds - host_s) * 1e6 / max(scheduler.rounds - rounds, 1)
        out[mode] = best
        if host is not None:
            host[mode] = own
    return out


def prefill_costs(target, draft, counts: list[int], modes: list[str], repeats: int = 3,
                  compiled: dict | None = None) -> dict[str, dict[int, float]]:
    """In-process: ms to prefill a burst of ``n`` of the load's prompts in one pass (an engine's ``prefill``: the
    prompts padded to the longest; speculative decoding's prefixes in both models) for each ``n`` in ``counts``,
    best of ``repeats`` after a warm-up round; ``compiled`` as in :func:`step_costs` (compiled passes prefill short
    prompts compiled too)."""
    from efftx.serving.continuous import Job, Sampling, Scheduler

    out = {}
    for mode in modes:
        scheduler = Scheduler(target, draft, max_rows=max(counts), short_tokens=0, prefill_rows=0, **(compiled or {}))
        best: dict[int, float] = {}
        for rep in range(repeats + 1):
            for n in counts:
                jobs = [Job(list(PROMPTS[i % len(PROMPTS)].encode()), 32, Sampling(0.8, 32), i,
                            5 if mode != "base" else None, coupled=mode == "coupled") for i in range(n)]
                engine = scheduler._engine(jobs[0])
                t0 = time.perf_counter()
                with torch.no_grad():
                    _, result = engine.prefill(jobs)
                    if result is not None:
                        result.tolist()  # the first tokens reach the host (on CUDA: the device is done)
                if next(target.parameters()).device.type == "cuda":
                    torch.cuda.synchronize()
                ms = (time.perf_counter() - t0) * 1e3
                if rep:
                    best[n] = min(best.get(n, float("inf")), ms)
        out[mode] = best
    return out


def prefill_lengths(target, repeats: int = 5) -> list[tuple[int, float, float, float]]:
    """In-process, on a CPU: ms to prefill one prompt of each of a few lengths (best of ``repeats``, the three ways
    alternated): as decoding does (the CPU attention kernel up to ``decode_attention_cpu.MAX_QUERIES`` tokens a row,
    eager decoding's plan), with torch's attention past 16 tokens (the kernel's earlier limit) in the plan, and on the
    module path with torch's attention past 16 tokens (before the plan ran prefills of more than 16 tokens).
    -> (tokens, now, SDPA in the plan, module path) per length."""
    from efftx.generation.decode import Rows
    from efftx.kernels import decode_attention_cpu
    from efftx.models import cpu_plan

    @contextlib.contextmanager
    def before(plan: bool):
        kept, decode_attention_cpu.MAX_QUERIES = decode_attention_cpu.MAX_QUERIES, 16
        try:
            with contextlib.nullcontext() if plan else cpu_plan.disabled():
                yield
        finally:
            decode_attention_cpu.MAX_QUERIES = kept

    ways = [contextlib.nullcontext, lambda: before(True), lambda: before(False)]
    rows = []
    for n in sorted({16, 17, 29, 64, decode_attention_cpu.MAX_QUERIES, decode_attention_cpu.MAX_QUERIES + 1, 200}):
        if n + 1 > target.max_seq_len:
            continue
        prompt = [(7 * i + 3) % target.vocab_size for i in range(n)]
        best = [float("inf")] * len(ways)
        for _ in range(repeats):
            for w, way in enumerate(ways):
                fresh = Rows(target, 1, n + 1)
                with torch.no_grad(), way():
                    t0 = time.perf_counter()
                    fresh.prefill([prompt])
                    best[w] = min(best[w], (time.perf_counter() - t0) * 1e3)
        rows.append((n, *best))
    return rows


def print_prefill_lengths(rows: list[tuple[int, float, float, float]]) -> None:
    print("in-process prefill of one prompt (base), best of 5: " + ", ".join(
        f"{n} tokens {now:.2f} ms (SDPA past 16 tokens in the plan {plan:.2f} ms, {plan / now:.2f}x; on the module "
        f"path {module:.2f} ms, {module / now:.2f}x)" for n, now, plan, module in rows), flush=True)


def print_prefill_costs(eager: dict[str, dict[int, float]], compiled: dict[str, dict[int, float]]) -> None:
    for mode, costs in eager.items():
        print(f"in-process prefill of a burst, {mode}, best of 3: " + ", ".join(
            f"{n} prompts eager {ms:.2f} ms, compiled {compiled[mode][n]:.2f} ms ({ms / compiled[mode][n]:.2f}x)"
            for n, ms in sorted(costs.items())), flush=True)


def print_step_costs(floors: dict[str, dict[int, float]], eager: dict[str, dict[int, float]] | None = None,
                     what: str = "", host: dict[str, dict[int, float]] | None = None, versus: str = "eager") -> None:
    """Each mode's step cost per row count (and its ratio to one row); with ``eager``, also each cost's ratio to
    the step's of the same rows in ``eager`` (measured in the same run; ``versus`` names it); with ``host``, the
    scheduler's own time per round in it (:func:`step_costs`)."""
    for mode, costs in floors.items():
        print(f"in-process decoding step{what}, {mode}, best of 3: " + ", ".join(
            f"{n} rows {ms:.2f} ms ({ms / costs[1]:.2f}x"
            + (f"; {versus} / this: {eager[mode][n] / ms:.2f}x" if eager else "")
            + (f"; scheduling {host[mode][n]:.0f} us of it" if host else "") + ")"
            for n, ms in sorted(costs.items())), flush=True)


def load_models(paths: dict, device: str, threads: int = 1, weights: str = "float32"):
    """(target, draft or None) on ``device``, with ``threads`` torch threads (a replica's ``threads``; the
    scheduler's decoding thread takes them from here) and their Linear weights in ``weights`` (a replica's
    ``decode_weights``)."""
    from efftx.export import load_export
    from efftx.kernels.linear_cpu import use_weights

    torch.set_num_threads(threads)
    target = use_weights(load_export(paths["target"], device)[0], weights)
    draft = use_weights(load_export(paths["draft"], device)[0], weights) if "draft" in paths else None
    return target, draft


# the in-process policies: one row at a time (the unbatched baseline), continuous batching without priority, with it
POLICIES = [("unbatched", {"max_rows": 1, "short_tokens": 0}), ("fifo", {"short_tokens": 0}), ("continuous", {})]


def prompt_of(i: int, new: int, long_prompt: int = 0) -> list[int]:
    """Request ``i``'s prompt (bytes): one of :data:`PROMPTS`, or, with ``long_prompt``, for every other long
    request (more than :data:`SHORT` new tokens), that many bytes of them run together (a long prompt: its
    prefill costs many decoding steps)."""
    if long_prompt and new > SHORT and i % 2:
        text = "".join(PROMPTS[(i + k) % len(PROMPTS)] for k in range(len(PROMPTS))) * (long_prompt // 100 + 1)
        return list(text.encode()[:long_prompt])
    return list(PROMPTS[i % len(PROMPTS)].encode())


def inprocess_load(target, draft, mode: str, knobs: dict, clients: int, lengths: list[int], unloaded: int,
                   clock: str, timeout: float = 300.0, long_prompt: int = 0, costs: dict | None = None) -> dict:
    """One policy's closed-loop load on a scheduler of its own (see :func:`inprocess`): its figures. ``costs``: the
    warm-up's measured costs, which the scheduler starts from (a copy each), as a replica's does."""
    import copy

    from efftx.serving.continuous import Job, Sampling, Scheduler

    scheduler = Scheduler(target, draft, **{"max_rows": 32, **knobs}, costs=copy.deepcopy(costs)).start()
    if clock == "cpu":
        clock_id = time.pthread_getcpuclockid(scheduler._thread.ident)
        now = lambda: time.clock_gettime(clock_id)  # noqa: E731 - the decoding thread's CPU clock, from any thread
    else:
        now = time.perf_counter

    def run(i: int, new: int) -> tuple[float, float | None, Job]:
        done = threading.Event()
        job = Job(prompt_of(i, new, long_prompt), new, Sampling(0.8, 32), 1000 + i,
                  5 if mode != "base" else None,
                  max_gamma=ADAPTIVE_CAP if mode != "base" else None, coupled=mode == "coupled")
        spent = []
        job.on_done = lambda j: (spent.append(now() - t0), done.set())  # runs on the decoding thread
        t0 = now()
        scheduler.submit(job)
        if not done.wait(timeout):
            raise TimeoutError(f"a request of {new} new tokens did not finish within {timeout} s")
        return spent[0], job.first_token_s, job

    try:
        run(0, SHORT)  # warm-up
        alone = {n: statistics.median(run(10000 + k, n)[0] for k in range(unloaded)) * 1e3 for n in (8, SHORT)}
        results, lock, nxt = [], threading.Lock(), [0]

        def client():
            while True:
                with lock:
                    i = nxt[0]
                    if i >= len(lengths):
                        return
                    nxt[0] += 1
                secs, first, job = run(i, lengths[i])
                with lock:
                    results.append((lengths[i], secs, i, first, job))

        c_start = now()
        threads = [threading.Thread(target=client) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = now() - c_start
    finally:
        scheduler.close()
    ok = [r for r in results if r[4].error is None]
    ratios = short_ratios([(n, c) for n, c, *_ in ok if n <= SHORT], alone)
    later = short_ratios([(n, c) for n, c, i, *_ in ok if n <= SHORT and i >= clients], alone)
    ttft = [r[3] for r in ok if r[3] is not None]
    return {"ok": len(ok), "errors": len(lengths) - len(ok), "seconds": total, "rps": len(ok) / total,
            "short_ratio_p50": pct(ratios, 0.5) / 1e3, "short_ratio_p99": pct(ratios, 0.99) / 1e3,
            "later_ratio_p99": pct(later, 0.99) / 1e3, "unloaded": alone, "ttft_p50": pct(ttft, 0.5),
            "ttft_p99": pct(ttft, 0.99), "rows": max((r[4].batch_size for r in ok), default=0),
            "long_rounds": scheduler.long_rounds, "rounds": scheduler.rounds, "knobs": knobs,
            "prefills": scheduler.prefills, "prefill_tokens": scheduler.prefill_tokens,
            "prefill_s": scheduler.prefill_s, "free_joins": scheduler.free_joins, "timing": scheduler.timing(),
            "pipelining": scheduler.pipelining(),
            "draft_lengths": [m["draft_lengths"] for m in scheduler.measured().values() if "draft_lengths" in m]}


def inprocess(target, draft, modes: list[str], clients: int, lengths: list[int], unloaded: int, device: str = "cpu",
              clock: str = "cpu", rounds: int = 1, timeout: float = 300.0, threads: int = 1,
              compiled: dict | None = None, continuous: dict | None = None, long_prompt: int = 0,
              prefill_chunk: int | None = None, one_pass: bool = False, steps_per_round: int | None = None,
              unpipelined: bool = False) -> dict:
    """``--inprocess``: the same closed-loop load on the scheduler itself (no HTTP, no Ray: torch alone), for each
    of :data:`POLICIES`, the policies alternated round after round. ``clock="cpu"``: timed on the decoding
    thread's CPU clock (a request's "latency" is the CPU time the decoding thread spent from its submission to
    its last token), so the figures measure the scheduling and hardly the machine's other load; ``"wall"``: the
    wall clock (on CUDA, where the device's time is not the thread's). Prints per mode and policy the load's
    seconds (the throughput), the short requests' latency over their unloaded latency, the most rows a request
    shared a step with, then the goals as the HTTP load does. ``compiled``: every policy's ``compile`` /
    ``compile_rows`` (default: eager); ``continuous``: more knobs of the ``continuous`` policy
    (``--short-slowdown``). ``long_prompt``: every other long request's prompt has that many bytes
    (:func:`prompt_of`); ``prefill_chunk``: a fourth policy, ``chunked``, continuous batching with that
    ``prefill_chunk`` beside ``continuous`` with whole prompts (``prefill_chunk=0``); ``one_pass``: another,
    ``one-pass``, continuous batching with ``group_prefills=False``; ``steps_per_round``: another, ``multi-step``,
    continuous batching with that ``steps_per_round``; ``unpipelined``: another, ``unpipelined``, continuous batching
    with ``pipeline=False``. Returns the figures per
    (policy, mode)."""
    from efftx.serving.continuous import warm_up

    compiled = compiled or {}
    # as a replica starts (one-time costs: on CUDA its kernels' first launches; the compiled passes' graphs), for
    # the modes this load runs (a base-only load compiles no speculative pass)
    spec = {"speculative", "coupled"} & set(modes) and draft is not None
    warmed = warm_up(target, draft if spec else None, gamma=5 if spec else None,
                     max_gamma=ADAPTIVE_CAP if spec else None, coupled="coupled" in modes, **compiled)
    print(f"in-process on {device} ({clock} clock, {threads} torch thread{'s' * (threads > 1)}"
          + (f", compile={compiled['compile']} up to {compiled.get('compile_rows') or 'any number of'} rows"
             if compiled.get("compile", "off") != "off" else "") + f"), {clients} clients, "
          f"{len(lengths)} requests; load average " + " ".join(f"{x:.1f}" for x in os.getloadavg()), flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    policies = POLICIES
    if prefill_chunk is not None:  # side by side: whole prompts, and prompts in chunks
        policies = [(n, {**k, "prefill_chunk": 0} if n == "continuous" else k) for n, k in POLICIES]
        policies.append(("chunked", {"prefill_chunk": prefill_chunk}))
    if one_pass:  # side by side: arrivals in the passes that cost least, and in one pass
        policies.append(("one-pass", {"group_prefills": False}))
    if steps_per_round is not None:  # side by side: a step a round, and several while nothing waits
        policies.append(("multi-step", {"steps_per_round": steps_per_round}))
    if unpipelined:  # side by side: the scheduler's default (pipelined on CUDA), and no pipelining
        policies.append(("unpipelined", {"pipeline": False}))
    for rnd in range(rounds):
        for mode in modes:
            for name, knobs in policies:
                if name == "unpipelined" and mode != "base":  # only base decoding's steps are pipelined
                    continue
                tuned = ("continuous", "chunked", "one-pass", "multi-step", "unpipelined")  # take --short-slowdown
                extra = (continuous or {}) if name in tuned else {}
                r = inprocess_load(target, draft, mode, {**knobs, **compiled, **extra}, clients, lengths, unloaded,
                                   clock, timeout, long_prompt, warmed.get("costs"))
                runs.setdefault((name, mode), []).append(r)
                print(f"  {f'round {rnd + 1}: ' if rounds > 1 else ''}{mode:<12}{name:<11} {clock} seconds "
                      f"{r['seconds']:6.2f} ({r['rps']:6.2f} req/s), errors {r['errors']}, up to {r['rows']} rows a "
                      f"step; short requests' latency / unloaded: p50 {r['short_ratio_p50']:.2f}x, p99 "
                      f"{r['short_ratio_p99']:.2f}x (without the opening burst {r['later_ratio_p99']:.2f}x) "
                      f"(unloaded 8/{SHORT} tokens {r['unloaded'][8]:.0f}/{r['unloaded'][SHORT]:.0f} ms)"
                      + (f"; first token p50 {r['ttft_p50']:.0f} ms" if clock == "wall" else "")
                      + (f"; first token p99 {r['ttft_p99']:.0f} ms" if long_prompt else "")
                      + (f"; the slow lanes stepped beside short rows by their slack in {r['long_rounds']} of "
                         f"{r['rounds']} rounds" if r["long_rounds"] else "")
                      + (f"; {r['free_joins']} arrivals joined past prefill_rows at next to no cost"
                         if r["free_joins"] else ""), flush=True)
    print(f"\ngoals (in-process, {clock} clock, continuous batching"
          + (f"; the median over {rounds} rounds" if rounds > 1 else "") + "):")
    for line in goals(runs, modes):
        print("  " + line)
    return runs


def goals(runs: dict[tuple[str, str], list[dict]], modes: list[str], notes: dict[str, str] | None = None
          ) -> list[str]:
    """The issue's goals for continuous batching, each line marked met or NOT met: requests/s >= 3x unbatched
    (each round's paired ratio, their median), short requests' p99 latency under load <= 2x unloaded, no errors;
    with [info] lines (``notes[mode]`` among them)."""
    def throughput(who: str, got: list[dict], u: list[dict]) -> str:
        """The requests/s goal of ``got`` (one result per round) against unbatched ``u``: each round's paired ratio,
        their median marked."""
        paired = [a["rps"] / b["rps"] if b["rps"] else float("nan") for a, b in zip(got, u)]
        ratio = statistics.median(paired)
        return (f"[{'met' if ratio >= 3 else 'NOT met'}] {who}: requests/s >= 3x unbatched: {ratio:.2f}x"
                f"{rounds_of(paired, '.2f')} ({statistics.median(a['rps'] for a in got):.2f} vs "
                f"{statistics.median(b['rps'] for b in u):.2f})")

    def no_errors(who: str, got: list[dict]) -> str:
        errors = sum(a["errors"] for a in got)
        return f"[{'met' if errors == 0 else 'NOT met'}] {who}: no errors: {errors}"

    lines = []
    for mode in modes:
        c, u, f = (runs.get((n, mode)) for n in ("continuous", "unbatched", "fifo"))
        if c and u:
            fifo = statistics.median(a["rps"] / b["rps"] for a, b in zip(f, u)) if f else None
            lines.append(throughput(mode, c, u) + (f"; without priority (fifo): {fifo:.2f}x" if fifo is not None
                                                   else ""))
        if c:
            lats = [a["short_ratio_p99"] for a in c]
            lat = statistics.median(lats)
            lines.append(f"[{'met' if lat <= 2 else 'NOT met'}] {mode}: short requests' p99 under load <= 2x unloaded "
                         f"(at their own lengths): {lat:.2f}x{rounds_of(lats, '.2f')} (unloaded 8/{SHORT} tokens "
                         + "/".join(f"{v:.0f}" for _, v in sorted(c[0]["unloaded"].items())) + " ms)"
                         + (f"; without priority (fifo): {statistics.median(a['short_ratio_p99'] for a in f):.2f}x"
                            if f else "") + (f"; {notes[mode]}" if notes and mode in notes else ""))
            later = [a["later_ratio_p99"] for a in c]
            lines.append(f"[info] {mode}: the same p99 without the opening burst (the short requests among the first "
                         f"clients, sent at once): {statistics.median(later):.2f}x{rounds_of(later, '.2f')}")
            lines.append(no_errors(mode, c))
            chunked = runs.get(("chunked", mode))
            if chunked:  # --prefill-chunk: continuous batching with long prompts in chunks, beside whole prompts
                p99 = [a["short_ratio_p99"] for a in chunked]
                rps = [a["rps"] / b["rps"] for a, b in zip(chunked, c)]
                lines.append(f"[info] {mode}: prompts in chunks of {chunked[0]['knobs']['prefill_chunk']} tokens: "
                             f"short p99 {statistics.median(p99):.2f}x{rounds_of(p99, '.2f')} unloaded against "
                             f"{lat:.2f}x with whole prompts; requests/s {statistics.median(rps):.2f}x the whole "
                             f"prompts'{rounds_of(rps, '.2f')}; time to first token p99 "
                             f"{statistics.median(a['ttft_p99'] for a in chunked):.0f} ms against "
                             f"{statistics.median(a['ttft_p99'] for a in c):.0f} ms; errors "
                             f"{sum(a['errors'] for a in chunked)}")
            single = runs.get(("one-pass", mode))
            if single:  # --one-pass: each round's arrivals for a lane in one padded pass, beside the grouped passes
                spent = [a["prefill_s"] / b["prefill_s"] for a, b in zip(c, single)]
                lines.append(f"[info] {mode}: arrivals in one pass per lane (group_prefills off) against grouped by "
                             f"cost: prefills' wall seconds (the scheduler's clock) "
                             f"{statistics.median(a['prefill_s'] for a in single):.3f} against "
                             f"{statistics.median(a['prefill_s'] for a in c):.3f} (grouped "
                             f"{statistics.median(spent):.2f}x{rounds_of(spent, '.2f')}), "
                             f"passes {statistics.median(a['prefills'] for a in single):.0f} against "
                             f"{statistics.median(a['prefills'] for a in c):.0f}, padded tokens "
                             f"{statistics.median(a['prefill_tokens'] for a in single):.0f} against "
                             f"{statistics.median(a['prefill_tokens'] for a in c):.0f}; requests/s grouped "
                             f"{statistics.median(a['rps'] / b['rps'] for a, b in zip(c, single)):.2f}x one pass's; "
                             f"short p99 {statistics.median(a['short_ratio_p99'] for a in single):.2f}x unloaded "
                             f"against {lat:.2f}x; errors {sum(a['errors'] for a in single)}")
            # --steps-per-round: several steps a round while nothing waits, beside one; --unpipelined: base steps
            # unpipelined, beside the scheduler's default
            for other, what, against in (("multi-step", "{} steps a round while nothing waits", "one step's"),
                                         ("unpipelined", "unpipelined", "continuous's (the default)")):
                multi = runs.get((other, mode))
                if not multi:
                    continue
                rps = [a["rps"] / b["rps"] for a, b in zip(multi, c)]
                p99 = [a["short_ratio_p99"] for a in multi]
                lines.append(f"[info] {mode}: {what.format(multi[0]['knobs'].get('steps_per_round'))}: requests/s "
                             f"{statistics.median(rps):.2f}x {against}{rounds_of(rps, '.2f')}; "
                             f"short p99 {statistics.median(p99):.2f}x unloaded against {lat:.2f}x; "
                             + (f"first token p99 {statistics.median(a['ttft_p99'] for a in multi):.0f} ms against "
                                f"{statistics.median(a['ttft_p99'] for a in c):.0f} ms; " if u else "")
                             + (f"scheduling {statistics.median(a['timing']['host_us'] for a in multi):.0f} us of a "
                                f"{statistics.median(a['timing']['round_us'] for a in multi):.0f} us round against "
                                f"{statistics.median(a['timing']['host_us'] for a in c):.0f} of "
                                f"{statistics.median(a['timing']['round_us'] for a in c):.0f}; "
                                if all(a.get("timing") for a in (*multi, *c)) else "")
                             + f"errors {sum(a['errors'] for a in multi)}")
            host = [(name, rs) for name in ("continuous", "fifo", "unbatched")
                    if (rs := runs.get((name, mode))) and all(r.get("timing") for r in rs)]
            if host:  # in-process: the scheduler's own time besides its passes (a GPU's steps take little more)
                lines.append(f"[info] {mode}: the scheduling besides the passes, per round (wall clock): " + ", ".join(
                    f"{name} {statistics.median(r['timing']['host_us'] for r in rs):.0f} us of a "
                    f"{statistics.median(r['timing']['round_us'] for r in rs):.0f} us round "
                    f"({100 * statistics.median(r['timing']['host_share'] for r in rs):.0f}%)" for name, rs in host))
            piped = [r["pipelining"] for r in c if r.get("pipelining")]
            if piped:  # pipelined base steps: how many followed the step in flight (the rest waited for its read)
                lines.append(f"[info] {mode}: continuous batching's pipelined base steps that followed the step in "
                             f"flight: {statistics.median(p['share'] for p in piped):.0%} of "
                             f"{statistics.median(p['steps'] for p in piped):.0f} (the others had none to follow: "
                             "a batch's first step, or the first after a round that did not step it)")
            for policy, got in (("unbatched", u), ("continuous", c)):
                # coupled: the steps the load chose at each draft length (the warm-up's among them; the other modes'
                # schedulers hold the warm-up's coupled costs too, untouched)
                chosen = [a["draft_lengths"][0] for a in got or () if a.get("draft_lengths") and mode == "coupled"]
                if chosen:
                    lines.append(f"[info] {mode}: {policy}: steps per draft length 0..: "
                                 + ", ".join(str(r["steps"]) for r in chosen) + "; measured acceptance "
                                 + ", ".join(f"{r['acceptance']:.2f}" for r in chosen))
            if u:
                lines.append(f"[info] {mode}: time to first token p50 {statistics.median(a['ttft_p50'] for a in c):.0f}"
                             f" ms, p99 {statistics.median(a['ttft_p99'] for a in c):.0f} ms (unbatched: p50 "
                             f"{statistics.median(b['ttft_p50'] for b in u):.0f} ms, p99 "
                             f"{statistics.median(b['ttft_p99'] for b in u):.0f} ms)")
        proc = runs.get(("process", mode))
        if proc:  # the scheduler in a decoding process of the replica's own, beside the one on a thread
            if u:
                lines.append(throughput(f"{mode} (engine=process)", proc, u))
            p99 = [a["short_ratio_p99"] for a in proc]
            lines.append(f"[{'met' if statistics.median(p99) <= 2 else 'NOT met'}] {mode} (engine=process): short "
                         f"requests' p99 under load <= 2x unloaded: {statistics.median(p99):.2f}x"
                         f"{rounds_of(p99, '.2f')}; without the opening burst "
                         f"{statistics.median(a['later_ratio_p99'] for a in proc):.2f}x")
            lines.append(no_errors(f"{mode} (engine=process)", proc))
            rps = [a["rps"] / b["rps"] for a, b in zip(proc, c)] if c else []
            lines.append(f"[info] {mode}: engine=process: "
                         + (f"requests/s {statistics.median(rps):.2f}x engine=thread's{rounds_of(rps, '.2f')}; "
                            if rps else "") + "time to first token p50 "
                         f"{statistics.median(a['ttft_p50'] for a in proc):.0f} ms, p99 "
                         f"{statistics.median(a['ttft_p99'] for a in proc):.0f} ms")
    return lines


def rounds_of(values: list[float], fmt: str) -> str:
    return "" if len(values) == 1 else " [" + ", ".join(format(v, fmt) for v in values) + "]"


def export_models(size: str) -> tuple[dict, str]:
    from efftx import recipes
    from efftx.models import build as build_model
    from efftx.export import export

    root = tempfile.mkdtemp(prefix="efftx-serve-load-")
    paths = {}
    for role, seed in (("target", 0), ("draft", 1)):
        cfg = recipes.get(f"spec_{role}_{size}")
        if cfg.model.max_seq_len < 256:
            cfg = cfg.override({"model.max_seq_len": 256})  # room for 128 new tokens + prompt + gamma
        torch.manual_seed(seed)
        paths[role] = str(export(build_model(cfg), cfg, f"{root}/{role}", {}))
    note = (f"models: untrained spec_target_{size} / spec_draft_{size} exported by this bench to {root} "
            f"(pass --target/--draft to load others)")
    return paths, note


def main() -> None:
    from efftx.kernels.linear_cpu import WEIGHTS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=64, help="requests per configuration and mode")
    p.add_argument("--modes", default="base,speculative")
    p.add_argument("--configs", default=",".join(c for c, _ in CONFIGS), help="some of: unbatched, static (8), fifo, "
                                                                              "continuous, process (continuous "
                                                                              "batching with engine=process)")
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--size", default="small", choices=["debug", "small"], help="models to export when none given")
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--unloaded", type=int, default=7, help="short requests sent alone, per configuration and mode")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--quick", action="store_true", help="8 clients, 24 requests, up to 48 new tokens")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every configuration this many times, the configurations alternated round after round "
                        "(the goals take the median of the rounds' paired ratios; runs on one machine vary by 15%%)")
    p.add_argument("--json", default=None, help="also write the figures here")
    p.add_argument("--inprocess", action="store_true", help="only the load on the scheduler itself (no HTTP, no "
                                                              "Ray: torch alone), unbatched vs fifo vs continuous")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the models decode (cuda: the "
                                                                            "replicas get a GPU)")
    p.add_argument("--adaptive-gamma", action="store_true", help="speculative requests with adaptive_gamma (from 5, "
                                                                 "at most the limits' max_gamma, 8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the replica (its ``threads``) or of the "
                                                          "in-process decoding thread")
    p.add_argument("--compile", default="off", choices=["off", "on", "auto"],
                   help="continuous batching's compiled passes (the app's compile; in-process: every policy)")
    p.add_argument("--compile-rows", type=int, default=None,
                   help="with --compile: passes over more rows run eagerly (default: none; 2 on a CPU without "
                        "the decode attention kernel)")
    p.add_argument("--long-prompts", type=int, default=0, metavar="BYTES",
                   help="--inprocess: every other long request's prompt has this many bytes (0: the short prompts)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="TOKENS",
                   help="--inprocess: a fourth policy, continuous batching with long prompts prefilled this many "
                        "tokens a round, beside continuous with whole prompts")
    p.add_argument("--one-pass", action="store_true",
                   help="--inprocess: another policy, continuous batching with each round's arrivals for a lane "
                        "prefilled in one pass (group_prefills off), beside continuous (grouped by measured cost)")
    p.add_argument("--steps-per-round", type=int, default=None, metavar="N",
                   help="--inprocess: another policy, continuous batching with a batch's N steps a round while "
                        "nothing waits (steps_per_round), beside continuous (one)")
    p.add_argument("--unpipelined", action="store_true",
                   help="--inprocess: another policy, continuous batching with base steps unpipelined "
                        "(pipeline=False), beside continuous (the scheduler's default: pipelined on CUDA)")
    p.add_argument("--attention-reference", action="store_true",
                   help="the step costs again with the CPU attention kernel key by key (its reference path, "
                        "efftx.kernels.decode_attention_cpu.key_by_key), beside the blocked path's")
    p.add_argument("--short-slowdown", type=float, default=None,
                   help="the continuous configuration's short_slowdown (the scheduler's measured-cost priority; "
                        "default: the scheduler's, 1.2; 0: only long_every)")
    p.add_argument("--decode-weights", default="float32", choices=WEIGHTS,
                   help="the models' Linear weights, in-process and in the replicas (the text app's decode_weights; "
                        "bfloat16: weight-only, CPU only)")
    p.add_argument("--ingress", default="proxy",
                   help="how HTTP reaches the replicas (efftx.serving.ingress): proxy (Serve's Python proxy), haproxy "
                        "(Serve's HAProxy ingress), or both, e.g. proxy,haproxy: each in a Ray cluster of its own, "
                        "alternated round after round, printed side by side")
    p.add_argument("--clock", default=None, choices=["cpu", "wall"], help="--inprocess: the decoding thread's CPU "
                                                                          "clock (default on cpu) or the wall clock "
                                                                          "(default on cuda)")
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    if args.clock == "cpu" and args.device == "cuda":
        p.error("--clock cpu measures the decoding thread, not the GPU: use --clock wall with --device cuda")
    if args.threads < 1:
        p.error(f"--threads must be at least 1, got {args.threads}")
    if args.attention_reference and args.device != "cpu":
        p.error("--attention-reference times the CPU attention kernel: it needs --device cpu")
    if args.decode_weights == "bfloat16" and args.device == "cuda":
        p.error("--decode-weights bfloat16 is a CPU option (weight-only bfloat16 for CPU decoding)")
    if args.compile_rows is not None and (args.compile == "off" or args.compile_rows < 1):
        p.error(f"--compile-rows takes a count >= 1 with --compile on|auto, got {args.compile_rows} with --compile "
                f"{args.compile}")
    if (args.long_prompts or args.prefill_chunk is not None or args.one_pass or args.steps_per_round is not None
            or args.unpipelined) and not args.inprocess:
        p.error("--long-prompts, --prefill-chunk, --one-pass, --steps-per-round and --unpipelined are --inprocess "
                "options")
    if args.steps_per_round is not None and args.steps_per_round < 2:
        p.error(f"--steps-per-round takes a count >= 2 (1 is the continuous policy), got {args.steps_per_round}")
    if args.long_prompts < 0 or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        p.error(f"--long-prompts takes bytes >= 0 and --prefill-chunk tokens >= 1, got {args.long_prompts} and "
                f"{args.prefill_chunk}")
    from efftx.serving.continuous import slowdown_ok

    if args.short_slowdown is not None and not slowdown_ok(args.short_slowdown):
        p.error(f"--short-slowdown takes 0 (off) or a number >= 1, got {args.short_slowdown}")
    if args.clock == "cpu" and args.threads > 1:
        p.error("--clock cpu counts the decoding thread alone, not the threads it spreads a product over: use "
                "--clock wall with --threads above 1")
    global ADAPTIVE_CAP
    ADAPTIVE_CAP = 8 if args.adaptive_gamma else None  # the server's cap: its limits' max_gamma (8 by default)
    args.clock = args.clock or ("wall" if args.device == "cuda" or args.threads > 1 else "cpu")
    modes = [m for m in args.modes.split(",") if m]
    ingresses = list(dict.fromkeys(k for k in args.ingress.split(",") if k))
    from efftx.errors import ConfigError
    from efftx.serving.ingress import Ingress

    try:
        if not ingresses:
            raise ConfigError("--ingress names none")
        for kind in ingresses:
            Ingress(kind).check()  # an unknown name, or haproxy without its binary: refused before any work
    except ConfigError as exc:
        p.error(f"--ingress: {exc}")
    if args.inprocess and args.ingress != "proxy":
        p.error("--ingress is about HTTP: --inprocess has none")
    if not modes or not set(modes) <= {"base", "speculative", "coupled"}:
        p.error(f"--modes takes base, speculative and/or coupled, got {args.modes!r}")
    if args.quick:
        args.clients, args.requests, args.max_new, args.unloaded = 8, 24, 48, 3
    configs = [(name, cfg) for name, cfg in CONFIGS if name in args.configs.split(",")]
    slowdown = {} if args.short_slowdown is None else {"short_slowdown": args.short_slowdown}
    configs = [(name, {**cfg, **slowdown} if name in ("continuous", "process") else cfg) for name, cfg in configs]

    if args.target:
        paths = {"target": args.target, **({"draft": args.draft} if args.draft else {})}
        note = f"models: {paths}"
    else:
        paths, note = export_models(args.size)
    if args.decode_weights != "float32":
        note += f"; Linear weights in {args.decode_weights} (decode_weights)"
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    rng = random.Random(0)
    # a fixed mix of lengths (the same for every configuration): a third short, the rest spread up to max_new
    lengths = [rng.choice([args.min_new, SHORT]) if i % 3 == 0 else rng.randint(args.min_new, args.max_new)
               for i in range(args.requests)]
    counts = sorted({1, 4, 8, args.clients})
    # in this process: the step costs (and --inprocess)
    target, draft = load_models(paths, args.device, args.threads, args.decode_weights)
    host: tuple[dict, dict] = ({}, {})  # the scheduler's own us per round in those steps: eager, compiled
    floors = step_costs(target, draft, counts, modes, host=host[0])
    reference = None  # --attention-reference: the same steps with the attention kernel key by key
    if args.attention_reference:
        from efftx.kernels.decode_attention_cpu import key_by_key

        with key_by_key():
            reference = step_costs(target, draft, counts, modes)
    compiled = {}
    if args.compile != "off":  # the app's default rows: every pass (2 rows on a CPU without the attention kernel)
        from efftx.generation.device_slots import compile_knobs

        compiled = compile_knobs(args.compile, args.compile_rows, args.device)
        # side by side: every pass compiled (the row limit aside), and the passes the limit leaves eager
        every = step_costs(target, draft, counts, modes, compiled={"compile": args.compile}, host=host[1])
        bursts = [1, 2, 4]  # up to device_slots.PREFILL_ROWS prompts prefill compiled; 4 shows the eager rule
        prefills = (prefill_costs(target, draft, bursts, modes),
                    prefill_costs(target, draft, bursts, modes, compiled={"compile": args.compile}))
    if args.inprocess:
        print(note)
        print_step_costs(floors, host=host[0])
        if args.device == "cpu":
            print_prefill_lengths(prefill_lengths(target))
        if reference:
            print_step_costs(floors, reference, " (the attention kernel blocked)", versus="key by key")
        if compiled:
            print_step_costs(every, floors, f" compiled ({args.compile}) at every row count", host[1])
            print_prefill_costs(*prefills)
        write_json(args.json, inprocess(target, draft, modes, args.clients, lengths, args.unloaded, args.device,
                                        args.clock, args.rounds, args.timeout, args.threads, compiled, slowdown,
                                        args.long_prompts, args.prefill_chunk, args.one_pass, args.steps_per_round,
                                        args.unpipelined))
        return
    del target, draft  # the replicas load their own
    import ray
    from ray import serve

    from efftx.serving.app_args import TextAppArgs
    from efftx.serving.schemas import Limits
    from efftx.serving.text import build

    cuda = args.device == "cuda"
    limits = Limits(max_new_tokens=256, max_prompt_bytes=512)
    # per ingress, per configuration and mode: one result per round
    by_ingress: dict[str, dict[tuple[str, str], list[dict]]] = {k: {} for k in ingresses}
    for rnd in range(args.rounds):
        for kind in ingresses:  # a cluster of its own per ingress (its processes read the choice when they start)
            Ingress(kind).apply()
            ray.init(num_cpus=4, num_gpus=1 if cuda else 0, include_dashboard=False, log_to_driver=False)
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            url = f"http://127.0.0.1:{port}"
            runs = by_ingress[kind]
            try:
                for name, cfg in configs:
                    devices = {"device": "cuda", "num_gpus": 1} if cuda else {"threads": args.threads}
                    app_compile = ({"compile": args.compile, "compile_rows": args.compile_rows}
                                   if args.compile != "off" and cfg["batching"] == "continuous" else {})
                    serve.run(build(TextAppArgs(**paths, name="load", limits=limits, **devices, **cfg, **app_compile,
                                                decode_weights=args.decode_weights)),
                              name="load", route_prefix="/")
                    for mode in modes:
                        one(url, body_for(0, 16, mode), False, args.timeout)  # warm-up
                        one(url, body_for(1, 16, mode), True, args.timeout)
                        alone = unloaded_short(url, mode, args.unloaded, args.timeout)  # per length: 8, 16
                        r = load(url, mode, args.clients, args.requests, lengths, args.timeout)
                        r["unloaded"] = alone
                        r["unloaded_short"] = max(alone.values())
                        ratios = short_ratios(r.pop("short_list"), alone)
                        r["short_ratio_p50"], r["short_ratio_p99"] = pct(ratios, 0.5) / 1e3, pct(ratios, 0.99) / 1e3
                        r["later_ratio_p99"] = pct(short_ratios(r.pop("later_list"), alone), 0.99) / 1e3
                        runs.setdefault((name, mode), []).append(r)
                        print(f"  round {rnd + 1}: {kind:<8} {name:<12} {mode:<12} {r['rps']:6.2f} req/s, "
                              f"errors {r['errors']}", flush=True)
                    serve.delete("load")
            finally:
                serve.shutdown()
                ray.shutdown()
                Ingress().apply()

    print(f"\n{note}")
    print(f"{args.clients} clients, {args.requests} requests per row, {args.min_new}..{args.max_new} new tokens "
          f"(mean {statistics.mean(lengths):.0f}; {sum(n <= SHORT for n in lengths)} short <= {SHORT}), every 4th a "
          f"stream; torch {torch.__version__}, {args.device}, replicas with {args.threads} torch thread(s)")
    w = 13 if args.rounds == 1 else 18  # the row labels: configuration (and round)
    head = (f"{'':<{w}}{'mode':<12}{'ok':>4}{'err':>5}{'req/s':>8}{'vs unb.':>8}{'tok/s':>8}{'p50 ms':>8}{'p99 ms':>8}"
            f"{'short p50':>10}{'short p99':>10}{'unl. 8/16':>11}{'x p50':>7}{'x p99':>7}{'ttft p50':>9}{'ttft p99':>9}")
    for kind, runs in by_ingress.items():
        print(f"ingress {kind}: " + ("Serve's Python proxy" if kind == "proxy" else
                                     "HAProxy to the replicas' own HTTP servers (RAY_SERVE_ENABLE_HA_PROXY=1)"))
        print(head)
        for rnd in range(args.rounds):
            for (name, mode), rs in runs.items():
                r, ref = rs[rnd], runs.get(("unbatched", mode), [None] * args.rounds)[rnd]
                ratio = r["rps"] / ref["rps"] if ref and ref["rps"] else float("nan")
                unl = "/".join(f"{v:.0f}" for _, v in sorted(r["unloaded"].items()))
                label = name if args.rounds == 1 else f"{name} ({rnd + 1})"
                print(f"{label:<{w}}{mode:<12}{r['ok']:>4}{r['errors']:>5}{r['rps']:>8.2f}{ratio:>7.2f}x"
                      f"{r['tokens_s']:>8.0f}{r['p50']:>8.0f}{r['p99']:>8.0f}{r['short_p50']:>10.0f}"
                      f"{r['short_p99']:>10.0f}{unl:>11}{r['short_ratio_p50']:>6.2f}x{r['short_ratio_p99']:>6.2f}x"
                      f"{r['ttft_p50']:>9.0f}{r['ttft_p99']:>9.0f}")
    print("(x p50 / x p99: a short request's latency under load over the unloaded latency at its own length, "
          "interpolated between the 8- and 16-token medians; fifo: continuous batching without priority, "
          "short_tokens=0)")
    for line in ingress_lines(by_ingress):
        print(line)
    print_step_costs(floors, host=host[0])
    if reference:
        print_step_costs(floors, reference, " (the attention kernel blocked)", versus="key by key")
    if compiled:
        print_step_costs(every, floors, f" compiled ({args.compile}) at every row count", host[1])
        print_prefill_costs(*prefills)
    print(f"load average: {load_before} before, {' '.join(f'{x:.1f}' for x in os.getloadavg())} after")
    print("\ngoals (continuous batching" + (f"; the median over {args.rounds} rounds, each round's configurations "
                                          "measured one after another, the rounds listed" if args.rounds > 1 else "")
          + "):")
    steps = {mode: f"a step of {args.clients} rows costs {floors[mode][args.clients] / floors[mode][1]:.1f}x one "
                   f"of 1 row (in-process)" for mode in modes}
    for kind, runs in by_ingress.items():
        for line in goals(runs, modes, steps):
            print(f"  {line}" if len(by_ingress) == 1 else f"  {kind}: {line}")
    write_json(args.json, by_ingress[ingresses[0]] if len(ingresses) == 1 else
               {(f"{kind}/{n}", m): rs for kind, runs in by_ingress.items() for (n, m), rs in runs.items()})


def ingress_lines(by_ingress: dict[str, dict[tuple[str, str], list[dict]]]) -> list[str]:
    """``--ingress proxy,haproxy``: per configuration and mode measured through both, HAProxy's requests/s and
    unloaded short latency over the proxy's (the median of the rounds' paired ratios)."""
    if not {"proxy", "haproxy"} <= set(by_ingress):
        return []
    proxy, ha = by_ingress["proxy"], by_ingress["haproxy"]
    lines = ["haproxy vs proxy, side by side (requests/s under the load; a short request's unloaded latency):"]
    for key in proxy:
        if key in ha:
            rps = [b["rps"] / a["rps"] for a, b in zip(proxy[key], ha[key]) if a["rps"]]
            lat = [b["unloaded_short"] / a["unloaded_short"] for a, b in zip(proxy[key], ha[key])
                   if a["unloaded_short"]]
            if rps and lat:
                lines.append(f"  {key[0]:<12} {key[1]:<12} requests/s {statistics.median(rps):.2f}x"
                             f"{rounds_of(rps, '.2f')}, unloaded latency {statistics.median(lat):.2f}x"
                             f"{rounds_of(lat, '.2f')}")
    return lines


def write_json(path: str | None, runs: dict[tuple[str, str], list[dict]]) -> None:
    """``--json``: the figures per "configuration/mode", one entry per round."""
    if path:
        with open(path, "w") as f:
            json.dump({f"{n}/{m}": rs for (n, m), rs in runs.items()}, f, indent=2)


if __name__ == "__main__":
    main()

"""Continuous batching: iteration-level scheduling of the text app's decoding.

A :class:`Scheduler` per replica keeps **running batches** and one background thread (off the replica's event
loop) that repeats rounds: admit the requests that may start, then run one decoding step of the running rows
(all of them, or only the short ones: see *Priority*).

* **Joining.** A request that arrives while others decode joins at the next step (a long one, while short rows
  run and the fast lane is full, at the next step of the slow lane): its prompt is prefilled (the arrivals of
  that moment for one lane in one ragged pass), its cache rows are appended to its lane's, and from then on it
  decodes with the rest. Base decoding draws its first token from the prefill, so a short request's first
  token never waits for a long request to finish.
* **Leaving.** A row that has its ``max_new_tokens`` leaves at once: its result is handed back in the step that
  finished it, and its cache rows are dropped from its lane.
* **Batches.** One running batch for base decoding (target only), and one per ``gamma`` for speculative decoding
  (target + draft; rows of one batch draft ``gamma`` tokens in the same passes and are verified in one target
  pass, each row with its own acceptance and its own rewind, as in
  :func:`~efftx.generation.speculative.iter_speculative_rows`); rows with an adaptive gamma (``max_gamma``: a
  row's draft length follows its acceptance, :func:`~efftx.generation.speculative.next_gamma`) have a batch per
  starting gamma and cap, whose step drafts as many tokens as its longest-drafting row: each row draws for and
  verifies only its own drafts. Sampling settings (temperature, top-k, top-p)
  are per row: rows share every forward pass whatever their settings, and the logits are turned into
  distributions in one pass with per-row settings (:func:`~efftx.generation.sampling.probabilities_per_row`). Every row draws from its own counter-based stream
  (:class:`~efftx.generation.sampling.Stream`, from its ``seed``; every row of a step in one kernel call), so
  each request's tokens, and in speculative decoding its acceptance, are exactly those it gets alone.
* **Priority to short requests.** A decoding step of many rows costs more than one of a few (on a CPU a 16-row
  step costs several times a 1-row step, while up to a few rows cost about one), so a short request stepped with
  every running row would take several times its unloaded latency. Requests declare ``max_new_tokens``: those
  asking for at most ``short_tokens`` are *short*. Each batch keeps its rows in two lanes, stepped as separate
  passes. The **fast lane** steps every round: every short row, and long ones while it has fewer than ``fast_rows``
  rows (while short rows run, only while the measured costs say they can afford them: see :class:`Scheduler`).
  The **slow lane** holds the other long rows: it steps every round while no short request runs or waits,
  and otherwise once every ``long_every`` rounds (with the fast lane, in one pass); so a short request's rounds are
  mostly one small step, and a long request is at most about ``long_every`` times slower while short ones run (it
  cannot starve). A short arrival takes a free fast row, or the one of the fast long row with the most tokens left
  (that row moves to the slow lane: its cache rows swap places with another row's, its tokens unchanged), or else
  joins the fast lane beyond ``fast_rows`` (a burst of short requests shares small steps rather than waiting for
  each other). The queue is served short requests first, fewest tokens first, at most ``prefill_rows`` per round
  (0: no limit), so a burst of arrivals is spread over a few rounds. A prefill costs several steps' time, so while
  short requests run or wait, long arrivals are prefilled only in the rounds in which the slow lane steps (their
  first token waits up to ``long_every`` rounds). A queued request that waited ``max_wait_rounds`` rounds goes
  ahead of every other. ``short_tokens=0`` turns priority off: both lanes step every round and the queue is served
  in arrival order. A row's tokens (and acceptance) do not depend on when or in which lane it is stepped: priority
  changes a request's latency, never its output.
* **Streams** are rows like any other: their ``on_step`` callback receives each step's tokens as they are
  produced.
* **Several steps a round** (``steps_per_round``, default 1): while no request waits in the queue and every row
  steps, a batch runs up to that many steps in one pass of the scheduler, each step fed the last one's tokens where
  they already are (base decoding: on a GPU the device runs the steps back to back, and the host reads the tokens
  once for all of them) and the host does its scheduling once for all of them. No row computes past its own last
  token (:meth:`~efftx.serving.batches.BaseEngine.steps_for`; a speculative batch, whose every step reads its
  acceptance, stops after the step in which a row got its last token), so its tokens, its stream's draws, its
  acceptance and its cache are those of steps one at a time. An arrival ends the round's steps after the one
  running (the host checks the queue before it starts each step: on a GPU, where the host runs ahead of the device,
  the base steps it already queued still run), and joins in the next round.
* **Pipelined steps** (``pipeline``, default on where the target is on a CUDA device): a base batch's step is fed
  the tokens of the step before while they are still on the device, and queued behind it; only then does the host
  read that step's tokens and hand them to their requests. So on a GPU the device runs the next step while the host
  reads, hands over and schedules, instead of waiting for it. A step's tokens are sent to the host as soon as it is
  queued (:class:`~efftx.host.Readback`), so that their read waits for that step and not for the next one. Rows
  join, leave, move between lanes and are
  cancelled while a step is in flight: the engine keeps, per slot, which row of that step holds the slot's last
  token (the rest are on the host), so the next step is fed every row's token, whatever changed, and a lane change
  does not stop the pipeline either. A row whose last token is in flight leaves before the next step (no row
  computes past its own last token), its tokens handed over when that step is read; a batch not stepped in a round,
  or whose rows all left, has its step read at the round's end. A request's tokens and its stream's draws are
  exactly those of unpipelined steps; its tokens reach it (and its stream) one round later. A step that raises is
  undone as any other, after the step before is read.
* **Caches.** A running batch keeps its rows in preallocated slots of each model's cache
  (:class:`~efftx.generation.decode.Slots`), the fast lane's rows first: a step runs a lane, or all rows when both
  lanes step in the same round, as one batched forward pass over a range of the slots, written in place; a row
  joins by one copy of its prefilled cache rows into a slot, and a leaving row's slot is filled by the last row of
  its lane (and the fast lane's last slot by the last slow row): a few rows' copies, never the whole batch's caches.
  Every backend's cache is ragged and splittable (:func:`~efftx.generation.decode.splittable`); a model whose cache
  is not falls back to **row by row**: each row keeps its own batch-1 cache and a step runs the rows one after
  another; rows still join and leave at every step, so a short request is not held up by a long one.
* **Compiled passes** (``compile="on"|"auto"``, dense models: :mod:`efftx.generation.device_slots`): a pass over the
  first ``n`` slots (every step starts at slot 0) runs as a compiled step (CUDA graphs on a GPU) over a bucket of
  ``n`` rounded up to a power of two rows, the rest of the bucket padding that never changes what a row sees;
  passes over more than ``compile_rows`` rows run eagerly over the same buffers (on a CPU a compiled pass pays for
  one or two rows only). Tokens are the eager path's.
* **Containment.** If a batched step (or a prefill) raises, the caches are rewound to where they were and every
  generator restored, then the step is run for each row alone: only the row at fault fails (a
  :class:`~efftx.serving.isolation.RowFailure`: 422 for a ``ValueError``, 503 for running out of memory, else
  500), the others go on with exactly the tokens they would have had.
* **Device memory.** Arrivals reserve their slots before they are prefilled. Where the device has no memory for
  the slots to grow (doubling, else to just the rows needed), as many arrivals join as the slots already hold (where
  that is none, the first arrival alone where the slots can be resized for it: wider, with fewer empty slots) and
  the others wait in the queue; the batch takes no more rows until it drains, a speculative batch gives its caches
  back, or ``max_wait_rounds`` rounds have passed (then it tries again): the running rows never notice. A request
  whose new batch finds no memory waits while rows run elsewhere, and with nothing running fails alone with a 503
  (retry later). Slots reserved for arrivals that fail at their prefill (or finish there) are given back at once.
  A pass that runs out of memory is
  undone and run row by row (containment), and the batch's later passes take half as many rows at a time (until
  it drains); a move between lanes swaps its rows through a free slot (no memory allocated; where every slot holds
  a row and the slots cannot grow, it does not happen), and a shrink that finds no memory keeps the cache.
  A ``cache_budget`` (bytes) bounds the caches before the device does: slots that would pass it are refused
  without allocating (:class:`~efftx.generation.decode.CacheBudgetFull`, handled as above), pooled caches in the
  way are dropped first, and pooled caches past it are not kept.
* **Positions.** A batch's eager slots of a full-attention model hold as many positions as its longest row may need
  (:meth:`_Engine.need`: prompt, new tokens, and a verify pass's gamma + 1), a power of two from 64
  (``Slots(fit=True)``): they widen when a row that needs more joins and narrow when it leaves, the rows copied,
  so a budget (or the device) holds more rows of short requests. An arrival that needs wider slots than the
  memory allows waits like any other, and none of the arrivals behind it passes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from efftx.generation.compiled import CompileOptions, CompileUnavailable
from efftx.generation.decode import CacheBudget, free_memory, pool_widths
from efftx.generation.device_slots import MIN_PREFILL, PREFILL_ROWS, PREFILL_TOKENS, eager_reason, slots_for
# the running batches; Job, Sampling and DeviceMemoryFull are this module's API too (the app and benches use them)
from efftx.generation.faults import DeviceFault
from efftx.serving.batches import (BaseEngine, DeviceMemoryFull, Job, PassTime, Sampling,
                                   SpeculativeEngine, _call, _device, _Engine, _engine_name, device_sync)
from efftx.generation.cost_table import CostTable
from efftx.generation.draft_length import DraftLength
from efftx.serving.faults import FaultLatch

__all__ = ["DeviceFault", "DeviceMemoryFull", "Job", "Sampling", "Scheduler", "StepCosts", "slowdown_ok",
           "start_scheduler", "warm_up"]

logger = logging.getLogger("ray.serve")


# ---------------------------------------------------------------------------------------------- warm-up
def warm_up(target, draft=None, *, rows: int = 16, gamma: int | None = None, tokens: int = 4,
            compile: str = "off", compile_rows: int | None = None, max_gamma: int | None = None,
            cache_budget: int | None = None, pipeline: bool | None = None, coupled: bool = False) -> dict[str, Any]:
    """Decode throwaway requests at a replica's start, so that its first real burst does not pay one-time costs.

    A freshly loaded model's first batched steps are slower than later ones of the same size (first use of each
    product shape, the slots' first growth, the sampling path): in-process on a 2-core CPU, with the untrained
    ``spec_target_small``, a burst of 16 requests of 16 new tokens took 195-199 ms on a fresh model and 109-120 ms
    afterwards; after ``warm_up(rows=16)`` (0.16 s) the first burst took 122-131 ms. Runs batches of ``rows``,
    ``rows // 2``, ..., 1 requests of ``tokens`` new tokens (each batch drained before the next; prompts of 1 to
    16 tokens, sampled at temperature 1, top-k 8), base decoding and, with a draft and ``gamma``, speculative
    decoding with that gamma, on a scheduler of its own (no hook, no metrics: nothing of it is counted or kept);
    with ``compile``, also batches of 2 and 1 prompts of 32 tokens (the compiled prefills' shapes, with those of
    the batches before). ``cache_budget``: the replica's (its batches take no more rows than it holds); ``pipeline``:
    the replica's (the costs measured are those of the steps it will run). ``coupled`` (with a draft and ``gamma``):
    also coupled speculative batches, their steps taking every draft length 0..gamma in turn with ``3 * (gamma + 1)``
    new tokens a request (or the context's room), so that the replica's draft lengths
    (:class:`~efftx.generation.draft_length.DraftLength`) start from measured costs at every length and row count.
    In a short context the requests get fewer new tokens, and a mode none of whose requests fits is skipped.
    ``rows=0`` does nothing. Returns ``{"rows": requests decoded, "seconds": wall time, "costs": the step and prefill
    costs measured}`` (``costs``, on :func:`time.perf_counter`, is for the replica's :class:`Scheduler` to start
    from; not with ``rows=0``). A model that cannot
    decode fails here, when the replica starts, with the error it would give the first request."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"warm-up rows must be an integer >= 0, got {rows!r}")
    if rows == 0:
        return {"rows": 0, "seconds": 0.0}
    started, done = time.perf_counter(), 0
    # every batch's prompts in one prefill (group_prefills off): its shapes are the ones warmed, not those the
    # first batches' measured costs would cut them into
    scheduler = Scheduler(target, draft, max_rows=rows, short_tokens=0, prefill_rows=0, compile=compile,
                          compile_rows=compile_rows, cache_budget=cache_budget, group_prefills=False,
                          pipeline=pipeline)
    batches = [rows >> k for k in range(rows.bit_length())]  # rows, rows // 2, ..., 1
    kinds = [(None, None, False)] + ([(gamma, None, False)] if draft is not None and gamma else [])
    if draft is not None and gamma and max_gamma:
        kinds.append((gamma, max_gamma, False))  # adaptive requests: a batch of their own (with compiled passes: its
        # graphs)
    if draft is not None and gamma and coupled:
        kinds.append((gamma, None, True))
    for gam, cap, joint in kinds:
        # a prompt and its new tokens (speculative: and gamma) must fit the context: fewer new tokens in a short
        # one, and no warm-up of a mode whose requests cannot fit at all
        room = target.max_seq_len if gam is None else min(target.max_seq_len, draft.max_seq_len) - (cap or gam)
        new = min(3 * (gam + 1) if joint else tokens, room - 1)
        if new < 1:
            continue
        longest = max(1, min(16, room - new))
        # speculative prompts of 2 tokens or more: a prefix to prefill (a 1-token prompt has none) in every batch
        first = min(longest, 1 if gam is None else 2)
        prompts = [[[1] * max(first, 1 + i % longest) for i in range(n)] for n in batches]
        if compile != "off":  # compiled prefills' other length (device_slots.PREFILL_TOKENS), in their row buckets
            prompts += [[[1] * min(PREFILL_TOKENS, room - new)] * n for n in batches
                        if n <= PREFILL_ROWS and room - new > MIN_PREFILL]
        for batch in prompts:
            jobs = [scheduler.submit(Job(prompt, new, Sampling(1.0, 8), i, gam, max_gamma=cap, coupled=joint))
                    for i, prompt in enumerate(batch)]
            if joint:  # every draft length in turn
                scheduler._costs(_engine_name(jobs[0])).draft_length(gam).sweep = True
            scheduler.drain()
            for job in jobs:
                if job.error is not None:
                    raise job.error
            done += len(batch)
    # slots that fit their rows widen when long requests come: a cache of each width and size, kept for them
    for model in [target] + ([draft] if draft is not None and gamma else []):
        if slots_for(model, compile, budget=scheduler.budget).fits:
            pool_widths(model, rows, scheduler.budget)
    for costs in scheduler.costs.values():
        if costs.lengths is not None:
            costs.lengths.sweep = False
            costs.lengths.forget_acceptance()
    return {"rows": done, "seconds": round(time.perf_counter() - started, 3), "costs": scheduler.costs}


def start_scheduler(target, draft=None, *, warm: dict[str, Any], knobs: dict[str, Any],
                    hook: Callable[[str, list["Job"]], None] | None = None,
                    observe: Callable[[str, int], None] | None = None) -> tuple["Scheduler", dict[str, Any]]:
    """A replica's running :class:`Scheduler`, warmed up first: :func:`warm_up` with ``warm``, then the scheduler
    with ``knobs``, starting from the costs the warm-up measured, its thread started. The text app runs this in its
    replica (``engine="thread"``) or in its decoding process (``engine="process"``,
    :mod:`efftx.serving.engine_process`): the same code, the same tokens. Returns the scheduler and what the app
    reports of it (``warm_up_rows``, ``warm_up_s``, ``steps_per_round``, ``pipeline``)."""
    warmed = warm_up(target, draft, **warm)
    scheduler = Scheduler(target, draft, **knobs, costs=warmed.get("costs"), hook=hook, observe=observe).start()
    return scheduler, {"warm_up_rows": warmed["rows"], "warm_up_s": warmed["seconds"],
                       "steps_per_round": scheduler.steps_per_round, "pipeline": scheduler.pipeline}


# ---------------------------------------------------------------------------------------------- scheduler
def _budget(limit: int | None, target, draft=None) -> CacheBudget | None:
    """The scheduler's :class:`~efftx.generation.decode.CacheBudget` of ``limit`` bytes (None: no budget), checked
    to hold at least one row of each mode the models serve (a base row: the target's cache; a speculative row: the
    target's and the draft's)."""
    if limit is None:
        return None
    budget = CacheBudget(limit, (target, draft))  # checks the limit
    row = sum(budget.row_bytes(m, m.max_seq_len) for m in (target, draft) if m is not None)
    if row > limit:
        models = "the target's and the draft's caches" if draft is not None else "the target's cache"
        raise ValueError(f"cache_budget of {limit / 2**20:.3g} MiB holds no row: a row takes {row / 2**20:.3g} MiB "
                         f"({models} of {target.max_seq_len} positions)")
    return budget


def slowdown_ok(value) -> bool:
    """Whether ``value`` is a valid ``short_slowdown``: 0 (off) or a finite number >= 1 (the scheduler, the text
    app's arguments and bench/serve_load.py check it alike)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and (value == 0 or 1 <= value < float("inf")))


# Stepping every row costs at most this share of the fast lanes' step more (a GPU's flat costs): the lanes step
# together even when a short request is already late (holding long rows back would hardly help it)
NEGLIGIBLE = 0.1


class _Room(NamedTuple):
    """A round's long work that fits the short requests' slack (:meth:`Scheduler._room`)."""

    lanes: bool  # the slow lanes step with the fast ones
    arrivals: bool  # and long arrivals are prefilled
    fast_longs: bool  # the fast lanes' long rows keep stepping beside the short ones (else they leave for the slow)


NO_ROOM = _Room(False, False, True)  # the fixed lanes: long_every alone, the fast lanes' long rows keep stepping


def _padded(sizes: list[int]) -> int:
    """The tokens a prefill pass of prompts of ``sizes`` tokens runs: its rows times the longest."""
    return len(sizes) * max(sizes)


class StepCosts:
    """One engine's measured costs (see :class:`Scheduler`'s *Measured costs*): its steps' seconds per row count,
    its prefills' per prompt tokens (rows times the longest prompt), and the tokens a step gives a row
    (speculative decoding: its acceptance)."""

    def __init__(self, weight: float = 0.25):
        self.steps, self.prefills = CostTable(weight), CostTable(weight)
        self.weight = weight
        self.tokens_per_step = 1.0
        self.lengths: DraftLength | None = None  # a coupled speculative batch's draft lengths (draft_length)
        self.count_from_zero()

    def count_from_zero(self) -> None:
        """The counts below start again (the costs measured stay): a scheduler counts its own passes."""
        # prefill passes run, their tokens padded (rows times the longest prompt), their prompts' own tokens, and
        # their seconds
        self.prefill_passes = self.padded_tokens = self.prompt_tokens = 0
        self.prefill_seconds = 0.0

    def draft_length(self, cap: int) -> DraftLength:
        """The draft lengths of a coupled speculative batch drafting at most ``cap`` tokens a row (kept here, with
        its other costs, so a warm-up's measured lengths carry over to the replica's scheduler)."""
        if self.lengths is None or self.lengths.cap != cap:
            self.lengths = DraftLength(cap, self.weight)
        return self.lengths

    def add_prefill(self, padded: int, prompt: int, seconds: float) -> None:
        self.prefills.add(padded, seconds)
        self.prefill_passes += 1
        self.padded_tokens += padded
        self.prompt_tokens += prompt
        self.prefill_seconds += seconds

    def add_step(self, rows: int, seconds: float, tokens: int) -> None:
        self.steps.add(rows, seconds)
        if rows:
            self.tokens_per_step += self.weight * (max(tokens / rows, 1.0) - self.tokens_per_step)

    def unloaded(self, job: "Job") -> float | None:
        """``job``'s latency alone (its prefill and its steps of one row), None before both were measured. Base
        decoding's prefill gives the first token."""
        step, prefill = self.steps.estimate(1), self.prefills.estimate(len(job.prompt))
        alone = self.lengths.alone() if self.lengths is not None else None
        if alone is not None:  # a coupled batch: a row alone takes the draft length it pays best
            step = alone[0]
        if step is None or prefill is None:
            return None
        return prefill + self.steps_left(job.max_new - (not job.speculative)) * step

    def steps_left(self, tokens: int) -> int:
        """Steps a row alone takes for ``tokens`` more (coupled batches: at the draft length it would take alone;
        their measured tokens a step mix every length the load chose)."""
        alone = self.lengths.alone() if self.lengths is not None else None
        per_step = alone[1] if alone is not None else self.tokens_per_step
        return -(-max(tokens, 0) // max(1, int(per_step)))


class Scheduler:
    """Continuous batching over a target (and a draft) for one replica; see the module docstring.

    ``max_rows``: the most rows of one running batch (the rest wait in the queue).
    ``admit_wait_s``: when nothing is running, the first arrival waits up to this long for others to join it
    (0: start at once). ``hook(kind, jobs)``: called before every prefill and step with the rows it covers
    (tests use it to inject faults). ``observe(kind, rows)``: called after every decoding step of a running batch
    with its kind (``base`` | ``speculative``) and its rows (the app's metrics, :mod:`efftx.serving.metrics`).
    The decoding thread uses as many torch threads as the thread that built the scheduler
    (``torch.get_num_threads()``; a new thread would start with the process default instead).
    ``cache_budget``: the most bytes the running batches' caches may hold (their slots, and the caches pooled for
    reuse; :class:`~efftx.generation.decode.CacheBudget`), None for no limit but the device's. Arrivals beyond it
    wait in the queue, as they do where the device itself has no memory for them (see the module docstring), but
    without an out-of-memory error first. It must hold at least one row of each mode (a ``ValueError`` says how
    much a row takes).
    ``costs``: measured costs to start from (:func:`warm_up`'s, on the same ``clock``; the scheduler updates them
    in place), so that what needs measured costs (below: the priority's slack, prefill grouping, arrivals past
    ``prefill_rows``) works from the first request, a replica's opening burst included.
    ``fit_positions`` (default True): slots fitted to their rows' positions (see the module docstring); False: every
    slot holds the model's whole context (no widening or narrowing copies).

    Priority to short requests (see the module docstring), its knobs:

    * ``short_tokens``: a request asking for at most this many new tokens is *short* (0: none is; then the slow
      lanes step every round like the fast ones and the queue is served in arrival order);
    * ``fast_rows``: the fast lanes, stepped every round, take long rows in while they have fewer rows than this
      (short rows always step there: a short arrival takes a long row's place, or joins beyond). Set it where a
      decoding step's cost stops being nearly flat in its rows (``bench/serve_load.py`` prints the step cost per
      row count). With ``short_slowdown``, long rows stay in a fast lane beside short ones only while the short
      requests can afford them (below): else they leave for the slow lane;
    * ``short_slowdown``: while short requests run or wait, the slow lanes step with the fast ones, and long
      arrivals are prefilled, in the rounds where every short request can afford it: where, by the measured costs
      (below), it still finishes within this many times its latency alone (0: no such rounds, only
      ``long_every``'s). Where a step's cost hardly grows with its rows (a GPU) that is nearly every round; on a
      CPU a many-row step costs several one-row steps and the long work mostly waits for ``long_every``. The bound
      is kept on estimates at each round, and what is not foreseen (the rounds ``long_every`` forces, later
      arrivals' prefills) comes on top: on a 2-core CPU (the small pair, ``bench/serve_load.py``'s load in-process,
      five paired runs) the short requests' p99 after the opening burst was 2.0-2.27x their latency alone at 1.5
      and 1.63-1.77x at 1.2 (the default), for 1-7% fewer requests/s (77.7 against 75.6 req/s, medians);
    * ``long_every``: and at least once every this many rounds (1: every round): a long row in the slow lane is at
      most about this many times slower than it would be stepped every round, so it cannot starve;
    * ``max_wait_rounds``: a queued request waits at most this many rounds before it goes ahead of every other;
    * ``prefill_rows``: at most this many queued requests are prefilled in one round (in the order above; 0: no
      limit). A prefill costs several decoding steps' time (its prompt's tokens go through every weight), and
      requests that finish in the same step come back as arrivals together: without a limit, one round could
      prefill a whole burst while every running row waits. Prefilling two rows costs about twice one (on a CPU), so
      the limit spreads bursts at no cost in throughput. With ``short_slowdown`` on, more arrivals join a round
      where the measured costs say they cost next to nothing (their prefill, and a step with their rows, at most a
      tenth more: a GPU's flat costs), so that a burst of short requests is not spread over rounds for nothing;
    * ``prefill_chunk``: a prompt longer than this many tokens is prefilled this many tokens a round (a *chunked
      prefill*: its chunks go into rows of its own, its last one joins the batch), so that one long prompt does
      not stall every running row for its whole prefill (the small pair's target on a 2-core CPU: 15 ms for 200
      tokens against about 1 ms for a decoding step). 0 (the default): whole prompts. A chunk counts as one of the
      round's ``prefill_rows``, and a long request's chunks wait, as its prefill would, for the rounds the long
      work may run. A chunked request's tokens are those it gets alone with the same ``prefill_chunk``: the
      chunks are cut the same way, whatever else runs. On that CPU, with 120-token prompts on half the long
      requests, 32-token chunks did not lower the short requests' p99 and cost 6-17% of the requests/s
      (``bench/serve_load.py --inprocess --long-prompts 120 --prefill-chunk 32``): the priority already defers long
      arrivals' prefills, and small chunks prefill less efficiently. It is meant for contexts whose prefills cost
      far more than a step (thousands of tokens on a GPU).
    * ``steps_per_round`` (default 1): a batch's steps per round while the queue is empty and every row steps
      (see *Several steps a round* in the module docstring). The measured step costs stay per step.
    * ``pipeline`` (None: on where the target is on a CUDA device): base decoding's steps are pipelined (see
      *Pipelined steps* in the module docstring). A pipelined step's measured cost is its launch and the wait for
      the step before it (on a GPU about a step's device time; a prefill, or a speculative step, queued behind that
      step waits for it first, and that wait counts as the step's, not theirs), and its tokens count in the round
      that reads them. A batch's first step, queued behind none, waits for nothing: its time is measured with the
      next step's.
    * ``group_prefills`` (default True): a round's arrivals for one lane are prefilled in the passes the measured
      costs say cost least, rather than always in one. A pass runs its prompts right-padded to the longest, so a
      short prompt beside a long one pays for the long one's tokens. The arrivals, ordered by prompt length, are cut
      into runs of neighbours whose passes' estimated costs (the prefill costs per padded tokens, below) sum to the
      least: on a CPU, where a prefill costs about its tokens, prompts of like length go together; on a GPU, where a
      pass of a few short prompts costs about one's time, they stay in one pass. One pass before the costs it
      needs were measured, where the slots have no room for every arrival at once (they join as the device's
      memory allows, below), or with False. A request's tokens do not depend on the pass it was prefilled in.

    *Measured costs.* The time of every step and prefill on ``clock`` (default :func:`time.perf_counter`; a pass
    ends with its tokens read back to the host, so on a GPU this is the device's time) is kept per engine
    (:class:`StepCosts`: moving averages per row count and per prompt tokens, and a step's tokens per row). A short
    request's latency alone is estimated as its prefill plus one-row steps; its *slack* is ``short_slowdown`` times
    that, less the time it has had so far and what its remaining steps (at this round's cost without the long
    work: the short rows' step alone) and, queued, its prefill will take. The long work of a round runs when it
    fits in the smallest slack: every row's step (its extra cost over the short rows' step), and with it the long
    arrivals' prefills (and their rows in that step); else the fast lanes' long rows' step (its extra cost), or
    else they leave for the slow lanes and the short rows step alone. Work that costs at most a tenth more than
    the short rows' step runs however late a short request is (on a GPU holding the long rows back would not make
    it faster); nothing runs on estimates before the costs it needs were measured.
    """

    def __init__(self, target, draft=None, *, max_rows: int = 32, admit_wait_s: float = 0.0,
                 short_tokens: int = 16, fast_rows: int = 4, long_every: int = 16, max_wait_rounds: int = 64,
                 prefill_rows: int = 2, short_slowdown: float = 1.2, prefill_chunk: int = 0,
                 hook: Callable[[str, list[Job]], None] | None = None,
                 observe: Callable[[str, int], None] | None = None, compile: str = "off",
                 compile_rows: int | None = None, clock: Callable[[], float] = time.perf_counter,
                 cache_budget: int | None = None, fit_positions: bool = True, group_prefills: bool = True,
                 costs: dict[str, StepCosts] | None = None, steps_per_round: int = 1, pipeline: bool | None = None):
        if not isinstance(group_prefills, bool):
            raise ValueError(f"group_prefills must be True or False, got {group_prefills!r}")
        if pipeline is not None and not isinstance(pipeline, bool):
            raise ValueError(f"pipeline must be True, False or None (on a GPU), got {pipeline!r}")
        for name, value, least in (("max_rows", max_rows, 1), ("short_tokens", short_tokens, 0),
                                   ("fast_rows", fast_rows, 1), ("long_every", long_every, 1),
                                   ("max_wait_rounds", max_wait_rounds, 0), ("prefill_rows", prefill_rows, 0),
                                   ("prefill_chunk", prefill_chunk, 0), ("steps_per_round", steps_per_round, 1),
                                   *((("compile_rows", compile_rows, 1),) if compile_rows is not None else ())):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if not admit_wait_s >= 0:
            raise ValueError(f"admit_wait_s must be >= 0, got {admit_wait_s!r}")
        if not slowdown_ok(short_slowdown):
            raise ValueError(f"short_slowdown must be 0 (off) or a number >= 1, got {short_slowdown!r}")
        self.target, self.draft = target, draft
        self.max_rows, self.admit_wait_s, self.hook = int(max_rows), float(admit_wait_s), hook
        self.short_tokens, self.fast_rows, self.long_every = short_tokens, fast_rows, long_every
        self.max_wait_rounds, self.prefill_rows, self.prefill_chunk = max_wait_rounds, prefill_rows, prefill_chunk
        self.short_slowdown, self.clock = float(short_slowdown), clock
        self.observe = observe
        # torch's intra-op threads as the creating thread has them: a new thread does not inherit
        # torch.set_num_threads (its OpenMP pool starts at the process default, e.g. every core outside Ray)
        self.threads = torch.get_num_threads()
        self.compile = CompileOptions(compile).compile
        self.compile_rows = compile_rows
        self.budget = _budget(cache_budget, target, draft)
        self.fit_positions = bool(fit_positions)
        self.group_prefills = group_prefills
        self.steps_per_round = steps_per_round
        self.pass_time = PassTime(clock, device_sync(_device(target)))  # every batch's passes (see host_seconds)
        self.round_seconds = 0.0  # the scheduling rounds' time on the clock, their passes included
        self.base = BaseEngine(target, hook, self.compile, compile_rows, self.budget, self.fit_positions,
                               self.pass_time)
        self.base.interrupt = self._arrived  # an arrival ends a round's several steps after the one running
        self.base.engines = self._engines  # the device's other batches: their steps in flight are waited for apart
        self.pipeline = _device(target).type == "cuda" if pipeline is None else pipeline
        # the device's failure, once a batch met one (see _faulted): every request fails from then on; the Serve app's
        # health check reads it
        self.latch = self.base.latch = FaultLatch("continuous batching")
        self.base.pipeline = self.pipeline
        if draft is not None and self.compile == "on" and eager_reason(draft):  # now, not at the first request
            raise CompileUnavailable(f"compile='on' but compiled continuous batching cannot run the draft: "
                                     f"{eager_reason(draft)}")
        self.spec: dict[tuple[int, int | None, bool], SpeculativeEngine] = {}  # per (gamma, max_gamma, coupled)
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self.steps = 0  # decoding steps run (all batches and lanes)
        self.rounds = 0  # scheduling rounds run
        self.moves = 0  # long rows moved from a fast lane to a slow one to make room for short ones
        self._long_round = 0  # the round the slow lanes last stepped
        # per engine (:func:`_engine_name`): measured costs, from the warm-up's where given
        self.costs: dict[str, StepCosts] = dict(costs or {})
        for given in self.costs.values():
            given.count_from_zero()
        self.long_rounds = 0  # rounds in which the slow lanes stepped beside short rows before long_every said so
        self.free_joins = 0  # arrivals that joined past prefill_rows, costing next to nothing (_free_prefill)
        self._refusal: tuple | None = None  # the last batch memory held back: (its name, its rows, its room)
        self._memory = self.budget.report() if self.budget is not None else None  # see cache_memory

    # -- the outside (any thread)
    def submit(self, job: Job) -> Job:
        if job.speculative and self.draft is None:
            raise ValueError("speculative decoding needs a draft model")
        job.submitted = time.perf_counter()
        job.clocked = self.clock()  # the same moment on the scheduler's clock (see *Measured costs*)
        if self.fault is not None:  # the device failed: nothing decodes here any more
            job._fail(self.fault, f"{job.mode} decoding")
            return job
        with self._cv:
            self._queue.append(job)
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        """Drop ``job`` at the next step (e.g. its client went away)."""
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="efftx-continuous-batching", daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def running(self) -> int:
        return len(self.base) + sum(len(e) for e in self.spec.values())

    # -- the decoding thread
    def _engine(self, job: Job) -> _Engine:
        if not job.speculative:
            return self.base
        # a batch per fixed gamma, and per starting gamma and cap when adaptive; coupled requests batch apart
        key = (job.gamma, job.max_gamma, job.coupled)
        if key not in self.spec:
            lengths = self._costs(_engine_name(job)).draft_length(job.max_gamma or job.gamma) if job.coupled else None
            self.spec[key] = SpeculativeEngine(self.target, self.draft, job.gamma, self.hook, job.max_gamma,
                                               self.compile, self.compile_rows, self.budget, self.fit_positions,
                                               self.pass_time, job.coupled, lengths)
            self.spec[key].interrupt = self._arrived  # as the base batch's
            self.spec[key].latch = self.latch
            self.spec[key].engines = self._engines
        return self.spec[key]

    def _engines(self) -> list[_Engine]:
        return [self.base, *self.spec.values()]

    def _flight_waits(self, but: _Engine | None = None) -> float:
        """Seconds the passes waited for the batches' (``but`` one's) steps in flight, apart, not counted yet in their
        steps' costs."""
        return sum(engine.flight_wait for engine in self._engines() if engine is not but)

    def short(self, job: Job) -> bool:
        """Whether ``job`` asks for at most ``short_tokens`` new tokens (then it has priority)."""
        return 0 < job.max_new <= self.short_tokens

    def _take(self, long_due: bool, fast_longs: bool = True
              ) -> tuple[dict[_Engine, dict[str, list[Job]]], list[tuple[_Engine, Job]]]:
        """The queued jobs to prefill now, per engine and lane (the others stay queued, in arrival order), and the
        long rows to move from the fast lane to the slow one to make room for short arrivals.

        Taken first: jobs queued for ``max_wait_rounds`` rounds or more (in arrival order), then short jobs (fewest
        tokens first), then long ones in arrival order, each while its batch has room (``max_rows``) and the round
        has prefills left (``prefill_rows``). A short job takes a fast row: a free one, else one a long row leaves
        for the slow lane (the one with the most tokens left), else a new one beyond ``fast_rows``. A long job waits
        unless the slow lanes step this round (``long_due``: no short request runs or waits, or it is their turn) or
        it has waited too long; then it takes a free fast row (unless long rows may not step beside short ones this
        round: ``fast_longs`` false), else a slow one."""
        taken: dict[_Engine, dict[str, list[Job]]] = {}
        with self._cv:
            pending: list[Job] = []
            while self._queue:
                job = self._queue.popleft()
                if job.cancelled or job.max_new <= 0:
                    job._finish()
                    continue
                if job.speculative and (job.gamma < 1 or (job.max_gamma is not None and job.max_gamma < job.gamma)):
                    job._fail(ValueError(f"gamma must be >= 1 and max_gamma >= gamma, got gamma={job.gamma}, "
                                         f"max_gamma={job.max_gamma}"), "speculative decoding")
                    continue
                if job.queued_round is None:
                    job.queued_round = self.rounds
                pending.append(job)
        aged = {id(j) for j in pending if self.rounds - j.queued_round >= self.max_wait_rounds}

        def order(item):
            i, job = item
            if id(job) in aged:
                return (0, 0, i)
            return (1, job.max_new, i) if self.short(job) else (2, 0, i)

        fast = sum(e.rows("fast") for e in self._engines())
        # long rows of the fast lanes that may leave for a short arrival: the most tokens left first
        movable = sorted(((e, j) for e in self._engines() for j in e.jobs("fast") if not self.short(j)),
                         key=lambda ej: -(ej[1].max_new - len(ej[1].out)))
        moves: list[tuple[_Engine, Job]] = []
        waiting = []
        admitted = 0
        within: dict[_Engine, list[Job]] = {}  # per batch, its arrivals taken within prefill_rows
        extra = True  # arrivals past prefill_rows may still join where they cost next to nothing (until one may not)
        for i, job in sorted(enumerate(pending), key=order):
            try:
                engine = self._engine(job)
            except torch.OutOfMemoryError as exc:  # no memory (or cache budget) for a new batch's slots
                free_memory(exc)
                if self._memory_full(job, exc):
                    waiting.append((i, job))
                continue
            lanes = taken.setdefault(engine, {"fast": [], "slow": [], "chunk": []})
            cap = min(self.max_rows, engine.row_limit or self.max_rows)  # row_limit: the device's memory
            limited = bool(self.prefill_rows) and admitted >= self.prefill_rows
            if limited and extra and not self._free_prefill(engine, within.get(engine, []),
                                                            lanes["fast"] + lanes["slow"], job):
                extra = False  # none passes an arrival that had to wait for the limit
            if len(engine) + len(lanes["fast"]) + len(lanes["slow"]) >= cap or (limited and not extra):
                waiting.append((i, job))
            elif not (self.short(job) or long_due or id(job) in aged):
                waiting.append((i, job))  # a long arrival, while short requests run or wait
            elif self._chunks_left(job):  # a chunk of its prompt this round, no row yet
                lanes["chunk"].append(job)
                admitted += 1
            elif fast < self.fast_rows and (fast_longs or self.short(job)):
                lanes["fast"].append(job)
                fast += 1
                admitted += 1
            elif self.short(job):
                if movable:
                    moves.append(movable.pop(0))
                else:
                    fast += 1
                lanes["fast"].append(job)
                admitted += 1
            else:
                lanes["slow"].append(job)
                admitted += 1
            if job in lanes["fast"] + lanes["slow"]:
                if limited:
                    self.free_joins += 1
                else:
                    within.setdefault(engine, []).append(job)
        if waiting:
            with self._cv:  # ahead of what arrived meanwhile, in arrival order
                self._queue.extendleft(job for _, job in sorted(waiting, key=lambda item: -item[0]))
        return taken, moves

    def _free_prefill(self, engine: _Engine, within: list[Job], joining: list[Job], job: Job) -> bool:
        """Whether ``job`` may join this round past ``prefill_rows``: with the measured-cost priority on
        (``short_slowdown``), where by the measured costs it costs next to nothing: its batch's arrivals' prefill
        with it costs at most :data:`NEGLIGIBLE` more than that of the arrivals taken within the limit
        (``within``; ``joining``: every arrival taken so far), and so does a step of the batch's rows with it. On a
        GPU, whose passes of a few rows or short prompts cost about one's time, a burst of short requests then
        joins in one round instead of ``prefill_rows`` a round; on a CPU, whose costs grow with rows and tokens,
        the limit holds. Never a chunk of a chunked prefill, nor before the costs it needs were measured."""
        if self.short_slowdown == 0 or not within or self._chunks_left(job):
            return False
        costs = self._costs(engine.name)

        base = costs.prefills.estimate(_padded([len(j.prompt) - j.fed for j in within]))
        more = costs.prefills.estimate(_padded([len(j.prompt) - j.fed for j in [*joining, job]]))
        rows = len(engine)
        step, bigger = costs.steps.estimate(rows + len(within)), costs.steps.estimate(rows + len(joining) + 1)
        if None in (base, more, step, bigger):
            return False
        return more <= (1 + NEGLIGIBLE) * base and bigger <= (1 + NEGLIGIBLE) * step

    def _arrived(self) -> bool:
        """Whether a request waits in the queue (read without the lock: a deque's length is read atomically)."""
        return bool(self._queue)

    def run_once(self) -> int:
        """One scheduling round: admit what may start now, one step of the fast lanes, and one step of the slow
        lanes when no short row runs, or else once every ``long_every`` rounds. Returns the rows still running."""
        t0 = self.clock()
        try:
            return self._round()
        finally:
            self.round_seconds += self.clock() - t0
            self._faulted()

    @property
    def fault(self) -> DeviceFault | None:
        """The device's failure, once a batch met one (:class:`~efftx.serving.faults.FaultLatch`)."""
        return self.latch.fault

    def _faulted(self) -> None:
        """After a round: where a batch met a device fault (:class:`~efftx.generation.faults.DeviceFault`), every
        request fails with it (a 503: the replica is replaced), running or queued, and new ones fail at once."""
        if self.fault is None:
            return
        with self._cv:
            queued, self._queue = list(self._queue), deque()
        for job in queued:
            job._fail(self.fault, f"{job.mode} decoding")
        for engine in self._engines():
            if len(engine):
                engine.fail_all(self.fault)

    @property
    def pass_seconds(self) -> float:
        """Seconds the rounds spent in the batches' passes (:class:`~efftx.serving.batches.PassTime`)."""
        return self.pass_time.seconds

    @property
    def host_seconds(self) -> float:
        """Seconds the rounds spent besides their passes: the scheduling itself (choosing what runs, moving rows
        between slots and lanes, handing tokens to requests). Where a pass takes a few hundred microseconds (a
        GPU's compiled steps), this is what bounds a replica's rounds per second."""
        return self.round_seconds - self.pass_time.seconds

    def pipelining(self) -> dict[str, float] | None:
        """With ``pipeline`` on (any thread): the base steps left in flight (``steps``), how many of them followed the
        step in flight, fed its tokens on the device (``followed``; the others had none to follow: a batch's first
        step, or the first after a round that did not step it), and their ``share``; None with it off."""
        if not self.pipeline:
            return None
        steps, followed = self.base.deferred, self.base.followed
        return {"steps": steps, "followed": followed, "share": round(followed / steps, 4) if steps else 0.0}

    def timing(self) -> dict[str, float] | None:
        """Where the rounds' time went (any thread), per round on average: ``round_us`` in all, ``pass_us`` in the
        batches' passes, ``host_us`` besides them (:attr:`host_seconds`), ``host_share`` of the rounds' time, and
        the ``rounds``; None before the first round."""
        rounds, total, passes = self.rounds, self.round_seconds, self.pass_time.seconds
        if not rounds:
            return None
        per_round = lambda seconds: round(seconds / rounds * 1e6, 1)  # noqa: E731
        return {"rounds": rounds, "round_us": per_round(total), "pass_us": per_round(passes),
                "host_us": per_round(total - passes),
                "host_share": round((total - passes) / total, 4) if total > 0 else 0.0}

    def _round(self) -> int:
        self.rounds += 1
        for engine in self._engines():
            engine.drop_cancelled()
            if engine.row_limit is not None and self.rounds - engine.limited_at >= self.max_wait_rounds:
                engine.row_limit = None  # memory may have come free meanwhile (elsewhere on the device): try again
        with self._cv:
            short_soon = any(self.short(j) for j in self._queue)
        short_soon = short_soon or any(self.short(j) for e in self._engines() for j in e.jobs())
        room = self._safe_room() if short_soon else NO_ROOM
        long_due = not short_soon or room.arrivals or self.rounds - self._long_round >= self.long_every
        taken, moves = self._take(long_due, room.fast_longs)
        if not room.fast_longs:  # the short rows step alone: the fast lanes' long rows leave for the slow ones
            moves += [(e, j) for e in self._engines() for j in e.jobs("fast")
                      if not self.short(j) and (e, j) not in moves]
        for engine, job in moves:
            self._guarded(engine, self._move, engine, job, jobs=[job])
        for engine, lanes in taken.items():
            self._chunk(engine, lanes.pop("chunk", []))
            for lane, jobs in lanes.items():
                # a chunked prefill's last chunk joins alone (its rows are its own), the others in the passes that
                # cost least
                whole = [j for j in jobs if j.partial is None]
                for group in self._prefill_groups(engine, whole) + [[j] for j in jobs if j.partial is not None]:
                    left = {id(j): len(j.prompt) - j.fed for j in group}  # what each has left to feed
                    ran: list[Job] = []  # those prefilled (where memory held back some, fewer)
                    t0, waited = self.clock(), self._flight_waits()
                    self._guarded(engine, lambda g=group: ran.extend(self._admit(engine, g, lane)), jobs=group)
                    if ran:  # keyed by the tokens it ran: the rows' prompts right-padded to the longest
                        sizes = [left[id(j)] for j in ran]
                        seconds = self.clock() - t0 - (self._flight_waits() - waited)  # not the steps in flight's
                        self._costs(engine.name).add_prefill(_padded(sizes), sum(sizes), seconds)
        engines = [e for e in self._engines() if len(e)]
        # the slow lanes step when due, or when no short row runs after all (e.g. the short arrivals failed): then
        # with the fast lane, in one pass of all the rows
        if long_due or room.lanes or not any(self.short(j) for e in engines for j in e.jobs()):
            lanes = ("all",)
            if short_soon and self.rounds - self._long_round < self.long_every:
                self.long_rounds += 1
            self._long_round = self.rounds
        else:
            lanes = ("fast",)
        # steps a batch takes in this round (steps_per_round): only while every row steps and nothing waits
        many = self.steps_per_round if lanes == ("all",) and not self._arrived() else 1
        stepped = set()
        for lane in lanes:
            for engine in engines:
                rows = engine.rows(lane)
                if rows:
                    stepped.add(id(engine))
                    jobs = engine.jobs(lane)
                    steps = engine.steps_for(jobs, many)
                    before = sum(len(j.out) for j in jobs)
                    launched, followed = engine.deferred, engine.followed
                    own, waited = engine.flight_wait, self._flight_waits(but=engine)
                    t0 = self.clock()
                    steps = self._guarded(engine, engine.step, lane, steps) or steps  # those that ran
                    # a pipelined step's cost: its launch and the wait for the step before it, the other passes'
                    # waits for that one included (_Engine.flight_wait), and its own for the other batches' not
                    seconds = self.clock() - t0 - (self._flight_waits(but=engine) - waited) + own
                    tokens = sum(len(j.out) for j in jobs) - before
                    # a pipelined step launched behind none waited for nothing: its time is the next one's to measure
                    alone = engine.deferred > launched and engine.followed == followed
                    if not alone:
                        self._costs(engine.name).add_step(rows, seconds / steps, tokens / steps)  # per step
                    self.steps += steps
                    if self.observe is not None:
                        for _ in range(steps):
                            _call(self.observe, engine.kind, rows)
        # a pipelined step not followed in this round is read now, not held back; so is one whose rows all left (they
        # finished in it: nothing runs to read it later)
        for engine in self._engines():
            if id(engine) not in stepped or not len(engine):
                engine.land()
        with self._cv:  # a speculative batch that queued requests wait for stays (its slots emptied), not made anew
            wanted = {(j.gamma, j.max_gamma, j.coupled) for j in self._queue if j.speculative}
        released = [k for k, e in self.spec.items() if not len(e) and k not in wanted]
        for key, engine in self.spec.items():
            if not len(engine) and key in wanted:  # as a new batch would be (its row limit: cleared as it drained)
                for slots in engine.slots:
                    slots.shrink(0)  # rows' memory it took while refused: under a budget none stays held
        for key in released:
            for slots in self.spec.pop(key).slots:
                slots.release()
        if released:  # their caches are pooled, and dropped where a growth finds no memory: it may try again
            for engine in self._engines():
                engine.row_limit = None
        if self.budget is not None:
            self._memory = self.budget.report()
        return self.running

    @property
    def prefills(self) -> int:
        """Prefill passes run (every batch; chunks of chunked prefills included)."""
        return sum(c.prefill_passes for c in list(self.costs.values()))

    @property
    def prefill_tokens(self) -> int:
        """Their tokens: each pass's rows times its longest prompt (padding included)."""
        return sum(c.padded_tokens for c in list(self.costs.values()))

    @property
    def prefill_s(self) -> float:
        """Their time on ``clock``."""
        return sum(c.prefill_seconds for c in list(self.costs.values()))

    def cache_memory(self) -> dict[str, float] | None:
        """With a ``cache_budget``: MiB of the budget (``limit_mib``), of what the slots hold (``held_mib``) and of
        the caches pooled for reuse (``pooled_mib``), as the last round left them (any thread: the decoding thread
        takes the figures, as only it changes the slots and the pool)."""
        return self._memory

    def _costs(self, name: str) -> StepCosts:
        return self.costs.setdefault(name, StepCosts())

    def report(self) -> dict[str, Any]:
        """What the app's ``GET /models/info`` shows of the scheduler (any thread): ``costs`` (:meth:`measured`),
        ``cache_memory`` and ``scheduling`` (:meth:`timing`)."""
        return {"costs": self.measured(), "cache_memory": self.cache_memory(), "scheduling": self.timing()}

    def measured(self) -> dict[str, dict]:
        """The measured costs per running batch (any thread: dict copies are atomic): ``step_ms`` per row count,
        ``prefill_ms`` per prompt tokens (past 64, at the nearest of 16 sizes an octave:
        :meth:`~efftx.generation.cost_table.CostTable.key`), ``tokens_per_step``, ``positions`` (a slot's positions now:
        its rows' need with slots that fit them, else the model's context), ``prefill_passes`` run and their
        ``prompt_tokens`` and ``padded_tokens`` (each pass's rows times its longest prompt: what padding costs), and
        for a coupled speculative batch ``draft_lengths`` (:meth:`~efftx.generation.draft_length.DraftLength.report`:
        its measured acceptance, steps per draft length, step costs per length and rows);
        batches not measured yet are left out. A batch the
        device's memory holds back also reports it: ``row_limit`` (the rows it takes) and ``step_rows`` (the most
        rows of a pass)."""
        out = {}
        engines = {e.name: e for e in self._engines()}
        for name, costs in list(self.costs.items()):
            steps, prefills = dict(costs.steps.seconds), dict(costs.prefills.seconds)
            if steps or prefills:
                out[name] = {"step_ms": {str(n): round(s * 1e3, 3) for n, s in sorted(steps.items())},
                             "prefill_ms": {str(n): round(s * 1e3, 3) for n, s in sorted(prefills.items())},
                             "tokens_per_step": round(costs.tokens_per_step, 3),
                             "prefill_passes": costs.prefill_passes, "prompt_tokens": costs.prompt_tokens,
                             "padded_tokens": costs.padded_tokens}
                if costs.lengths is not None:
                    out[name]["draft_lengths"] = costs.lengths.report()
                engine = engines.get(name)
                if engine is not None:
                    out[name]["positions"] = max(s.capacity for s in engine.slots)
                for key in ("row_limit", "step_rows"):
                    if engine is not None and getattr(engine, key) is not None:
                        out[name][key] = getattr(engine, key)
        return out

    def _safe_room(self) -> "_Room":
        """:meth:`_room`; should it fail, the fixed lanes (``long_every`` alone, long rows keep their fast rows): a
        policy's estimate never stops decoding."""
        try:
            return self._room()
        except Exception:  # noqa: BLE001 - logged; the round goes on without the long work
            logger.exception("continuous batching: the measured-cost estimate failed; long rows wait for long_every")
            return NO_ROOM

    def _room(self) -> "_Room":
        """While short requests run or wait: whether this round has room (``short_slowdown``, see *Measured costs*)
        for the slow lanes to step with the fast ones, for long arrivals' prefills, and for the fast lanes' long
        rows to step beside the short ones."""
        if self.short_slowdown == 0:
            return NO_ROOM
        with self._cv:
            queued = list(self._queue)
        # queued short requests in the order they are prefilled (fewest tokens first); this round's join the fast
        # lanes (at most prefill_rows of them)
        shorts = sorted((j for j in queued if self.short(j) and not j.done), key=lambda j: j.max_new)
        joining = Counter(_engine_name(job) for job in shorts[:self.prefill_rows or None])
        longs = [j for j in queued if not self.short(j) and not j.done][:self.prefill_rows or None]
        # prefilled this round if it has room: they step too (unless it is not their last chunk)
        arriving = Counter(_engine_name(job) for job in longs if not self._chunks_left(job))
        # this round's steps of the short rows alone, and what the fast lanes' long rows, every row, and every row
        # with the long arrivals add
        short_round = fast_extra = extra = grown = 0.0
        engines = {e.name: e for e in self._engines() if len(e)}
        for name in set(engines) | set(joining) | set(arriving):
            engine = engines.get(name)
            n_short, n_fast, n_all = ((sum(self.short(j) for j in engine.jobs("fast")), engine.rows("fast"),
                                       len(engine)) if engine is not None else (0, 0, 0))
            steps, more = self._costs(name).steps, joining.get(name, 0)
            costs = [steps.estimate(n + more) if n + more else 0.0
                     for n in (n_short, n_fast, n_all, n_all + arriving.get(name, 0))]
            if None in costs:
                return NO_ROOM
            alone, fast, every, bigger = costs
            short_round += alone
            fast_extra += max(fast - alone, 0.0)
            extra += max(every - alone, 0.0)
            grown += max(bigger - alone, 0.0)
        now, slack, ahead = self.clock(), float("inf"), 0.0
        for job, waiting in [(j, False) for e in engines.values() for j in e.jobs()] + [(j, True) for j in shorts]:
            if not self.short(job) or job.done:
                continue
            costs = self._costs(_engine_name(job))
            unloaded = costs.unloaded(job)
            if unloaded is None:
                return NO_ROOM
            left = costs.steps_left(job.max_new - len(job.out)) * short_round
            if waiting:  # its prefill, after those of the short requests before it
                ahead += costs.prefills.estimate(len(job.prompt) - job.fed)
                left += ahead
            slack = min(slack, self.short_slowdown * unloaded - (now - job.clocked) - left)

        def fits(cost: float) -> bool:
            return cost <= slack or cost <= NEGLIGIBLE * short_round

        if not fits(extra):
            return _Room(False, False, fits(fast_extra))
        prefill = 0.0
        for job in longs:
            left = len(job.prompt) - job.fed  # this round's: a chunk of a long prompt
            one = self._costs(_engine_name(job)).prefills.estimate(min(left, self.prefill_chunk or left))
            if one is None:
                return _Room(True, False, True)
            prefill += one
        return _Room(True, grown + prefill <= slack, True)

    def _prefill_groups(self, engine: _Engine, jobs: list[Job]) -> list[list[Job]]:
        """``jobs`` (whole prompts joining one lane of ``engine``) in the prefill passes that cost least by the
        measured costs (``group_prefills``): ordered by prompt length, cut into runs of neighbours whose passes' cost
        estimates (rows times the longest prompt: :class:`StepCosts`' prefills) sum to the least, fewer passes where
        the sums tie. One pass without ``group_prefills``, before any prefill was measured, or where the slots have
        no room for every arrival at once (then :meth:`_admit` takes as many as they hold, in their order)."""
        if len(jobs) < 2 or not self.group_prefills:
            return [jobs] if jobs else []
        table = self._costs(engine.name).prefills
        order = sorted(jobs, key=lambda j: len(j.prompt))  # stable: equal lengths keep the round's order
        sizes = [len(j.prompt) for j in order]
        # least[k]: the least cost of prefilling order[:k]; cut[k]: where its last pass starts
        least, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
        for k in range(1, len(order) + 1):
            for i in range(k):  # the last pass: order[i:k], padded to sizes[k - 1]
                cost = table.estimate((k - i) * sizes[k - 1])
                if cost is None:
                    return [jobs]
                if least[i] + cost < least[k]:
                    least[k], cut[k] = least[i] + cost, i
        groups, k = [], len(order)
        while k:
            groups.append(order[cut[k]:k])
            k = cut[k]
        if len(groups) == 1:
            return [jobs]
        try:  # room for them all first: where there is none, one pass, as many joining as the slots hold
            engine.reserve(len(engine) + len(jobs), engine.positions(jobs))
        except torch.OutOfMemoryError:
            return [jobs]
        return groups[::-1]

    def _admit(self, engine: _Engine, jobs: list[Job], lane: str) -> list[Job]:
        """``engine.admit``; returns the jobs prefilled. Where the device has no memory for the arrivals' slots, the
        batch takes no more rows than its slots hold until it drains (``row_limit``): as many arrivals as they hold
        join, the others wait in the queue (ahead of later arrivals); the running rows go on untouched. A batch with
        no rows and no room for one (its slots empty, the cache budget held by other batches) is a new batch without
        memory (:meth:`_memory_full`)."""
        try:
            engine.admit(jobs, lane)
        except torch.OutOfMemoryError as exc:
            room = min(s.room for s in engine.slots)
            engine.row_limit = max(room, len(engine), 1)
            engine.limited_at = self.rounds
            fit = max(room - len(engine), 0)
            refusal, self._refusal = self._refusal, (engine.name, len(engine), room)
            log = logger.warning if refusal != self._refusal else logger.debug  # once, not every round it waits
            log("continuous batching: no memory (on the device or in the cache budget) for %d more %s rows beside %d "
                "(%s); %d join, the others wait for rows to leave", len(jobs), engine.kind, len(engine), exc, fit)
            # the arrivals that fit the slots as they are (their rows and positions) join, in their order, up to the
            # first that does not (it waits for room, and the others behind it with it: none passes it)
            take: list[Job] = []
            for job in jobs:
                if len(take) == fit or not engine.holds(job):
                    break
                take.append(job)
            if not take and self._room_for_one(engine, jobs[0]):
                take = jobs[:1]
                engine.row_limit = max(min(s.room for s in engine.slots), len(engine) + 1)
            wait = [j for j in jobs if j not in take]
            if not (take or len(engine)):  # a batch with no rows that takes none: a new batch without memory
                wait = [j for j in wait if self._memory_full(j, exc)]
            with self._cv:
                self._queue.extendleft(reversed(wait))
            if take:
                engine.admit(take, lane)  # in the slots it has: no memory to allocate
            return take
        return jobs

    @staticmethod
    def _room_for_one(engine: _Engine, job: Job) -> bool:
        """Whether ``engine``'s slots can be resized to hold one more row, ``job``'s (wider where it needs more
        positions, with fewer empty slots): a refused batch of several arrivals filled its slots at the positions
        they had, which may hold none of a long arrival's rows though the memory holds one."""
        try:
            engine.reserve(len(engine) + 1, engine.positions([job]))
        except torch.OutOfMemoryError:
            return False
        return True

    def _chunks_left(self, job: Job) -> bool:
        """Whether ``job``'s prefill has more than one chunk (``prefill_chunk`` tokens) left to feed: then this
        round feeds one and it waits for the next."""
        return 0 < self.prefill_chunk < job.feed_tokens - job.fed

    def _chunk(self, engine: _Engine, jobs: list[Job]) -> None:
        """One chunk of each of ``jobs``' prompts (:meth:`_Engine.prefill_chunk`); they go back to the head of the
        queue for the next. A chunk that raises fails its job alone."""
        for job in jobs:
            t0, waited = self.clock(), self._flight_waits()
            try:
                engine.prefill_chunk(job, self.prefill_chunk)
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                job._fail(engine.latch.failed(exc) or exc, f"{engine.kind} decoding")
                continue
            seconds = self.clock() - t0 - (self._flight_waits() - waited)  # not the steps in flight's (their waits)
            self._costs(engine.name).add_prefill(self.prefill_chunk, self.prefill_chunk, seconds)
        with self._cv:
            self._queue.extendleft(reversed([j for j in jobs if not j.done]))

    def _move(self, engine: _Engine, job: Job) -> None:
        """``job``'s row to the slow lane; where the device has no memory for the swap, it stays (the lanes are a
        policy: a short row then steps beside it)."""
        try:
            engine.move(job, "slow")
        except torch.OutOfMemoryError as exc:
            free_memory(exc)
            logger.warning("continuous batching: no device memory to move a long row to the slow lane (%s)", exc)
        else:
            self.moves += 1

    def _memory_full(self, job: Job, exc: BaseException) -> bool:
        """A new running batch for ``job`` found no device memory: it waits (True) while rows run elsewhere (they
        will free some), else it fails with a 503."""
        if self.running:
            return True
        job._fail(DeviceMemoryFull(f"no memory for this request's cache ({job.mode} decoding), on the device or in "
                                   f"the cache budget: {exc}"), f"{job.mode} decoding")
        return False

    @staticmethod
    def _guarded(engine: _Engine, fn, *args, jobs: Sequence[Job] = ()) -> Any:
        """``fn(*args)``'s result; None where it raised (then the batch, and ``jobs``, fail)."""
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a fault outside the contained passes: fail this batch, go on
            logger.exception("continuous batching: the %s batch failed outside its rows' passes", engine.kind)
            exc = engine.latch.failed(exc) or exc
            for job in jobs:
                if not job.done:
                    job._fail(exc, f"{engine.kind} decoding")
            engine.fail_all(exc)

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # per thread, as grad mode is
        device = _device(self.target)
        if device.type == "cuda":  # per thread too (a new thread starts on cuda:0): the models' (on cuda:N)
            torch.cuda.set_device(device)
        with torch.no_grad():  # grad mode is per thread
            while True:
                with self._cv:
                    while not self._stop and not self._queue and not self.running:
                        self._cv.wait()
                    if self._stop:
                        return
                    if not self.running and self.admit_wait_s > 0 and self._queue:
                        deadline = self._queue[0].submitted + self.admit_wait_s
                        while not self._stop and len(self._queue) < self.max_rows:
                            left = deadline - time.perf_counter()
                            if left <= 0:
                                break
                            self._cv.wait(left)
                try:
                    self.run_once()
                except Exception:  # noqa: BLE001 - the loop must outlive anything
                    logger.exception("continuous batching: a scheduling round failed")

    def drain(self, limit: int = 100000) -> None:
        """Run rounds on the calling thread until nothing is queued or running (tests; no thread started)."""
        with torch.no_grad():
            for _ in range(limit):
                if not self._queue and not self.running:
                    return
                self.run_once()
        raise RuntimeError("the scheduler did not drain")

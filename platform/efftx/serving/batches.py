"""Continuous batching's running batches (:mod:`efftx.serving.continuous` schedules them): the requests
(:class:`Job`), their rows' sampling (:class:`Sampling`, per row within one batched pass), and the engines that
prefill, step and contain a batch's rows in their cache slots: :class:`BaseEngine` (one target pass per step) and
:class:`SpeculativeEngine` (draft passes and one verify pass per step, per row acceptance).

An engine keeps its rows in two lanes (fast rows first in the slots), joins arrivals by one copy of their prefilled
cache rows, lets finished rows leave by filling their slots with the last rows, and runs every batched pass so
that a failure is contained: the caches rewound and every generator restored, the pass rerun row by row, only the
row at fault failing. The scheduler's module docstring gives the whole design: lanes, caches, compiled passes,
device memory and positions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from efftx.generation.decode import CacheBudget, CacheBudgetFull, Rows, free_memory, kv_only, splittable
from efftx.generation.device_slots import slots_for
from efftx.generation.sampling import (Stream, draw, is_greedy, position_noise, probabilities, probabilities_per_row,
                                      race)
from efftx.generation.speculative import (SpecStats, accept_sampled, agreed_row, coupled_tokens, kept_tokens,
                                          next_gamma, step_noise, draft_with_tails)
from efftx.host import Readback, host_values
from efftx.generation.draft_length import DraftLength
from efftx.serving.faults import FaultLatch

if TYPE_CHECKING:  # the scheduler runs with torch alone (bench/serve_load.py --inprocess on a bare GPU image)
    from efftx.serving.isolation import RowFailure

logger = logging.getLogger("ray.serve")


class DeviceMemoryFull(MemoryError):
    """A request's cache does not fit the device's memory, and no running row will free any: 503 (retry later)."""


# ---------------------------------------------------------------------------------------------- sampling
@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def distributions(samplings: Sequence[Sampling], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """(B, ..., V) logits -> distributions, row b with ``samplings[b]``: exactly the distribution it gets alone. Rows
    of one setting take :func:`~efftx.generation.sampling.probabilities`; rows of several settings one pass with
    per-row settings (:func:`~efftx.generation.sampling.probabilities_per_row`; not a pass per setting: on a GPU each
    is a dozen kernel launches), their settings sent to ``device`` once, here, for every pass of a step to use, and
    what no row asks for (top-k, a nucleus) skipped."""
    if len(set(samplings)) == 1:
        s = samplings[0]
        return lambda logits: probabilities(logits, s.temperature, s.top_k, s.top_p)
    ks = [s.top_k for s in samplings]
    settings = (host_values([s.temperature for s in samplings], torch.float32, device),
                host_values(ks, torch.long, device), host_values([s.top_p for s in samplings], torch.float32, device))
    kmax, nucleus = max(max(ks), 0), any(s.top_p < 1.0 for s in samplings)
    return lambda logits: probabilities_per_row(logits, *settings, kmax=kmax, nucleus=nucleus)


def token_picker(samplings: Sequence[Sampling], gens: Sequence[Stream | torch.Generator | None],
                 device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """(B, V) logits -> (B,) next tokens as :func:`~efftx.generation.decode.iter_generate` picks them, per row:
    the argmax for greedy settings, else a draw from the row's distribution with the row's generator (greedy rows
    draw nothing). Built once for a step's passes (the rows' settings go to ``device`` once)."""
    greedy = [is_greedy(s.temperature) for s in samplings]
    if all(greedy):
        return lambda logits: logits.argmax(-1)
    dist_of, gens = distributions(samplings, device), list(gens)
    if not any(greedy):
        return lambda logits: draw(dist_of(logits), gens)
    need = [not g for g in greedy]
    return lambda logits: draw(dist_of(logits), gens, need=need)


def row_tokens(logits: torch.Tensor, samplings: Sequence[Sampling], gens: Sequence[Stream | torch.Generator | None]
               ) -> torch.Tensor:
    """:func:`token_picker` for one pass."""
    return token_picker(samplings, gens, logits.device)(logits)


# ---------------------------------------------------------------------------------------------- jobs
class Job:
    """One request's decoding in one mode. Callbacks run on the decoding thread and must not block:
    ``on_step(tokens, accepted)`` per step (``accepted`` is None in base decoding), ``on_done(job)`` once, when the
    job has its tokens or has failed (``job.failure`` / ``job.error``) or was cancelled."""

    def __init__(self, prompt: Sequence[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                 seed: int | None = None, gamma: int | None = None, *, max_gamma: int | None = None,
                 coupled: bool = False, on_step: Callable[[list[int], int | None], None] | None = None,
                 on_done: Callable[["Job"], None] | None = None, tag: Any = None):
        self.prompt = [int(t) for t in prompt]
        self.max_new = int(max_new_tokens)
        self.sampling = sampling
        self.seed = seed
        self.gamma = gamma
        self.max_gamma = max_gamma  # adaptive gamma: each step's draft length follows the acceptance, up to this
        self.draft_gamma = gamma  # this step's draft length (speculative decoding)
        # speculative: coupled acceptance (its tokens are base decoding's; the draft length may follow the load)
        self.coupled = bool(coupled) and gamma is not None
        self.on_step, self.on_done, self.tag = on_step, on_done, tag
        self.out: list[int] = []
        self.ahead = 0  # tokens its row computed that the host has not read yet (a pipelined step, _Engine.settle)
        self.stats = SpecStats(gamma=max_gamma or gamma) if gamma is not None else None
        self.steps = 0
        self.draft_tail: list[int] = []  # speculative: tokens kept but not fed to the draft model yet
        self.generator: Stream | None = None
        self.batch_size = 0  # the most rows it shared a step with (itself included)
        self.submitted = time.perf_counter()
        self.queued_round: int | None = None  # the scheduling round that first saw it queued
        self.clocked: float | None = None  # when it was submitted, on its scheduler's clock
        self.first_token: float | None = None
        self.finished: float | None = None
        self.failure: "RowFailure | None" = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.done = False
        # chunked prefill (Scheduler.prefill_chunk): the rows its prompt's first chunks went into, one per model,
        # and how many of its tokens they hold; its last chunk joins the batch like any prefill
        self.partial: list[Rows] | None = None
        self.fed = 0

    @property
    def speculative(self) -> bool:
        return self.gamma is not None

    @property
    def mode(self) -> str:
        return "speculative" if self.speculative else "base"

    @property
    def left(self) -> int:
        """The new tokens its row has still to compute (those computed but not read yet count as made)."""
        return self.max_new - len(self.out) - self.ahead

    @property
    def latency_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.submitted

    @property
    def first_token_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    def _push(self, tokens: list[int], accepted: int | None, batch: int) -> bool:
        """Record one step's tokens; True when the job is complete (then its result is handed back)."""
        self.steps += 1
        self.batch_size = max(self.batch_size, batch)
        if tokens and self.first_token is None:
            self.first_token = time.perf_counter()
        self.out.extend(tokens)
        if self.on_step is not None:
            _call(self.on_step, tokens, accepted)
        if len(self.out) >= self.max_new:
            self._finish()
            return True
        return False

    @property
    def feed_tokens(self) -> int:
        """The tokens its prefill feeds each model: the prompt (speculative decoding: all but its last token,
        which the first step feeds)."""
        return len(self.prompt) - self.speculative

    def _finish(self) -> None:
        self.partial = None
        if not self.done:
            self.done = True
            self.finished = time.perf_counter()
            if self.on_done is not None:
                _call(self.on_done, self)

    def _fail(self, exc: BaseException, what: str) -> None:
        self.error = exc
        try:
            from efftx.serving.isolation import row_failure  # the HTTP answer (FastAPI's)
        except ImportError:  # the scheduler alone, without the web stack (a bench on a bare GPU image)
            self.failure = None
        else:
            self.failure = row_failure(exc, what)
        self._finish()


def _call(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a callback (e.g. a closed event loop) must not stop the decoding
        logger.exception("a continuous-batching callback failed")


def _generator(seed: int | None) -> Stream:
    """A request's random numbers: its seed's :class:`~efftx.generation.sampling.Stream`, or one seeded from torch's
    global RNG (a request without a seed), so that every row of a step draws in one call."""
    return Stream.fresh() if seed is None else Stream(int(seed))


def _gen_states(jobs: Sequence[Job]) -> list:
    return [None if j.generator is None else j.generator.get_state() for j in jobs]


def _set_gen_states(jobs: Sequence[Job], states: list) -> None:
    for job, state in zip(jobs, states):
        if state is not None:
            job.generator.set_state(state)


class PassTime:
    """Seconds a scheduler's running batches spent in their passes, on ``clock``: prefills, prefill chunks and steps
    (the models' forward passes and the draws, on a GPU until the device has run them), the containment's
    row-by-row reruns included. What a scheduling round spends besides is the host's: choosing, moving rows between
    slots and lanes, handing tokens to requests (:attr:`~efftx.serving.continuous.Scheduler.host_seconds`). One is
    shared by a scheduler's batches, so a batch's time outlives the batch. ``sync``: waits for the device's work
    (:func:`device_sync`), so that a pass's time on a GPU, whose kernels run after their launch, is the device's
    too and not the first read back's after it (which comes at once after a pass anyway)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, sync: Callable[[], None] | None = None):
        self.clock, self.sync, self.seconds, self.passes = clock, sync, 0.0, 0

    def run(self, fn: Callable, *args, sync: bool = True):
        """``fn(*args)``, timed as a pass (``sync`` False: without waiting for the device, a pipelined step's launch,
        whose wait is added where its tokens are read, :meth:`_Engine.settle`)."""
        t0 = self.clock()
        try:
            out = fn(*args)
            if sync and self.sync is not None:
                self.sync()
            return out
        finally:
            self.seconds += self.clock() - t0
            self.passes += 1


def device_sync(device: torch.device) -> Callable[[], None] | None:
    """A wait for ``device``'s queued work (CUDA), None where work runs when it is called (a CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


class _State:
    """Rows being prefilled or stepped: per model a :class:`Rows` (a range of the engine's :class:`Slots`, or rows
    prefilled apart), each row's last token (base: the token to feed next; speculative: the pending token) and its
    job; ``start``: the slot of its first row (None: not in the slots yet). ``lasts``: the last tokens on the host
    too, where the host has them (None: read them from ``last``, a wait for the device on a GPU)."""

    def __init__(self, rows: list[Rows], last: torch.Tensor, jobs: list[Job], start: int | None = None,
                 lasts: list[int] | None = None):
        self.rows, self.last, self.jobs, self.start, self.lasts = rows, last, jobs, start, lasts
        self.steps = 1  # the decoding steps its next compute runs (see _Engine.steps_for)

    def host_lasts(self) -> list[int]:
        """Each row's last token on the host (read from the device only where the host does not have them)."""
        if self.lasts is None:
            self.lasts = self.last.tolist()
        return self.lasts

    def snapshot(self) -> list:
        return [r.snapshot() for r in self.rows]

    def restore(self, snapshot: list) -> None:
        for r, snap in zip(self.rows, snapshot):
            r.restore(snap)


# ---------------------------------------------------------------------------------------------- engines
class _Engine:
    """One running batch: its rows in :class:`~efftx.generation.decode.Slots` (one per model), in two lanes: slots
    ``0 .. fast - 1`` the ``fast`` lane (stepped every round: the short requests and, in the room left, long ones),
    the rest the ``slow`` lane (long requests the scheduler steps less often while short ones run). A step runs one
    lane, or ``all`` rows, as one batched pass over a range of the slots (no cache is copied); a row joins by a copy
    of its prefilled cache into a slot, and leaves by the last row of its lane (and, for the fast lane, the last
    slow row) moving into its slot: a few rows' copies, never the whole batch. Subclasses pass their models and
    define ``prefill(jobs) -> (state, result)``, ``compute(state) -> result`` (the step's forward passes, cache
    rewinds and draws: all that can fail) and ``commit(state, result, batch)`` (host bookkeeping: tokens to the
    jobs)."""

    kind = "?"
    pipelines = False  # whether its steps can be pipelined (the next one fed on the device, see settle)

    def __init__(self, hook: Callable[[str, list[Job]], None] | None, models: list, batched: bool,
                 compile: str = "off", compile_rows: int | None = None, budget: CacheBudget | None = None,
                 fit: bool = True, pass_time: PassTime | None = None):
        self.hook = hook
        self.batched = batched
        self.slots = [slots_for(m, compile, batched, max_rows=compile_rows, budget=budget, fit=fit) for m in models]
        self.device = _device(models[0])
        # its passes' time (the scheduler's, shared)
        self.pass_time = pass_time if pass_time is not None else PassTime(sync=device_sync(self.device))
        self.order: list[Job] = []  # the job of each slot
        self.last: list[int] = []  # each slot's last token
        self.fast = 0  # slots 0 .. fast - 1: the fast lane; the rest: the slow lane
        self._apart = False  # prefills of a containment retry: several before their rows join (eager, see Slots.prefill)
        self.row_limit: int | None = None  # rows whose caches the device had memory for, when more had none
        self.limited_at = 0  # the scheduling round that set row_limit
        self.step_rows: int | None = None  # the most rows of a pass, after a larger one ran out of device memory
        # rows placed, swapped, left or reserved (each counts): _leave does nothing while nothing changed since it ran
        self._changes, self._settled = 0, -1
        # the device's failure, once met (FaultLatch.failed): the replica's, shared with the scheduler's other batches
        self.latch = FaultLatch()
        # several steps at once stop after the one running when this says so (the scheduler: a request arrived)
        self.interrupt: Callable[[], bool] | None = None
        # pipelined steps (engines that allow it, :attr:`pipelines`): a step's tokens are read once the next step is
        # queued behind it (or at the end of a round that does not step the batch); the step in flight: (its state,
        # its result, rows, its tokens on their way to the host: :meth:`_send`)
        self.pipeline = False
        self._flight: tuple[_State, Any, int, Any] | None = None
        # while a step is in flight: per slot, the row of that step whose last token the slot's row holds (rows move,
        # join and leave before it is read), or None (the slot's token is on the host, in self.last)
        self._flown: list[int | None] = []
        self.deferred = self.followed = 0  # steps left in flight, and those of them fed by the step in flight
        # seconds other passes (prefills, another batch's steps) waited for this batch's step in flight, apart
        # (:meth:`_await_flight`): that step's time, not theirs; the scheduler counts it in the measured cost of the
        # step that follows it (whose own wait for it is then short). The batches whose steps in flight passes wait
        # for: the scheduler's (they share the device), else this one.
        self.flight_wait = 0.0
        self.engines: Callable[[], Sequence[_Engine]] = lambda: (self,)

    def __len__(self) -> int:
        return len(self.order)

    def _room(self, model, needed: int) -> int:
        """The capacity of a prefill's cache for ``model``: ``needed`` positions where every layer keeps a key/value
        cache (its rows fill a slot's first positions, Slots.put), else the model's context (caches laid out by
        capacity)."""
        return max(int(needed), 1) if kv_only(model) else model.max_seq_len

    def _bounds(self, lane: str) -> tuple[int, int]:
        if lane == "fast":
            return 0, self.fast
        if lane == "slow":
            return self.fast, len(self.order)
        if lane == "all":
            return 0, len(self.order)
        raise ValueError(f"no lane {lane!r}")

    def rows(self, lane: str) -> int:
        a, b = self._bounds(lane)
        return b - a

    def jobs(self, lane: str | None = None) -> list[Job]:
        a, b = self._bounds(lane or "all")
        return self.order[a:b]

    def _hook(self, jobs: list[Job]) -> None:
        if self.hook is not None:
            self.hook(self.kind, jobs)

    def _view(self, a: int, b: int, last: torch.Tensor | None = None) -> _State:
        """Rows ``a .. b - 1`` to step, fed their last tokens (``last``: those still on the device, of the step in
        flight)."""
        if last is not None:
            return _State([s.rows(a, b) for s in self.slots], last, self.order[a:b], a)
        lasts = self.last[a:b]
        return _State([s.rows(a, b) for s in self.slots], host_values(lasts, torch.long, self.device),
                      self.order[a:b], a, lasts)

    # -- pipelining: a step's tokens read while the next step runs
    def _carried(self, a: int, b: int) -> torch.Tensor:
        """Rows ``a .. b - 1``'s last tokens on the device, with a step in flight: its tokens for its rows (wherever
        they moved since), the host's for the others (rows that joined since, or that it did not step)."""
        carry = self._carry(self._flight[1])
        rows = self._flown[a:b]
        if rows == list(range(len(self._flight[0].jobs))):
            return carry  # the same rows in the same slots
        if None not in rows:
            return carry[host_values(rows, torch.long, carry.device)]
        out = host_values([t if k is None else 0 for t, k in zip(self.last[a:b], rows)], torch.long, carry.device)
        at = [i for i, k in enumerate(rows) if k is not None]
        if at:
            out[host_values(at, torch.long, carry.device)] = carry[host_values([rows[i] for i in at], torch.long,
                                                                               carry.device)]
        return out

    def settle(self) -> None:
        """Read the step in flight and hand its tokens over (nothing where none is in flight): its rows' last tokens
        go to the host, in the slots where those rows are now (:attr:`_flown`). Where the read raises (an error of the
        device's, surfacing at the first wait after the step ran), the step's rows fail: their caches hold a step
        whose tokens are lost."""
        flight, self._flight = self._flight, None
        self.flight_wait = 0.0  # (counted by the scheduler before the step that settles it)
        if flight is None:
            return
        flown, self._flown = self._flown, []
        state, _, batch, sent = flight
        for job in state.jobs:
            job.ahead = 0
        t0 = self.pass_time.clock()
        try:
            result = self._read(state, sent)
        except Exception as exc:  # noqa: BLE001 - the step's rows fail, the batch goes on
            exc = self.latch.failed(exc) or exc
            for job in state.jobs:
                job._fail(exc, f"{self.kind} decoding")
            return
        finally:
            self.pass_time.seconds += self.pass_time.clock() - t0  # the wait for the device: the pass's time
        self.commit(state, result, batch)
        lasts = state.host_lasts()
        for slot, k in enumerate(flown[:len(self.order)]):
            if k is not None:
                self.last[slot] = lasts[k]

    def land(self) -> None:
        """:meth:`settle`, and the rows it finished leave (a batch not stepped in a round: its step in flight is
        read at the round's end, not held back)."""
        if self._flight is not None:
            self.settle()
            self._leave()

    def _send(self, result: Any) -> Any:
        """A deferred step's result on its way to the host, sent as soon as the step is queued (before the next one:
        on a GPU its read then waits for this step alone, :class:`~efftx.host.Readback`)."""
        return result

    def _read(self, state: _State, sent: Any) -> Any:
        """A result as :meth:`commit` takes it, read back to the host (``sent``: :meth:`_send`'s)."""
        return sent

    def _carry(self, result: Any) -> torch.Tensor:
        """The rows' last tokens in a step's result, on the device (engines whose steps are pipelined)."""
        raise NotImplementedError

    def _await(self, sent: Any) -> None:
        """Wait until the step whose result is on its way (``sent``: :meth:`_send`'s) has run, reading nothing."""

    def _await_flight(self) -> None:
        """Wait for this batch's step in flight (if any), reading nothing, the wait timed into :attr:`flight_wait`.
        On a GPU a pass queued behind that step (a prefill, another batch's step) would otherwise wait for both in
        its own wait (:class:`PassTime`, a read), and the measured costs would count the step's remaining time as
        that pass's, and next to none for the step (its tokens ready by the time they are read)."""
        if self._flight is None:
            return
        t0 = self.pass_time.clock()
        try:
            self._await(self._flight[3])
        except Exception:  # noqa: BLE001 - the step's read raises it again, where its rows fail (settle)
            pass
        self.flight_wait += self.pass_time.clock() - t0

    def _await_flights(self, but: _Engine | None = None) -> None:
        """:meth:`_await_flight` of every batch on the device (:attr:`engines`) but ``but``."""
        for engine in self.engines():
            if engine is not but:
                engine._await_flight()

    def _behind_flight(self, fn: Callable, *args):
        """``fn(*args)``, a prefill or a prefill chunk, queued behind the steps in flight; then the waits for those
        steps, apart (:meth:`_await_flight`)."""
        out = fn(*args)
        self._await_flights()
        return out

    def _compute_behind(self, state: _State) -> Any:
        """:meth:`compute` of a step read at once, after the waits for the other batches' steps in flight, apart
        (:meth:`_await_flight`; its reads would wait for them: the device runs one stream)."""
        self._await_flights(but=self)
        return self.compute(state)

    # -- slot surgery (every model's slots, the jobs and last tokens alike)
    def _place(self, slot: int, job: Job, last: int, flown: int | None = None) -> None:
        """``job`` and its last token at ``slot`` (a row, or one past the last); ``flown``: the row of the step in
        flight whose last token is its (:attr:`_flown`; None: ``last``)."""
        if self._flight is not None:
            self._flown[slot:slot + 1] = [flown]
        self._changes += 1
        if slot == len(self.order):
            self.order.append(job)
            self.last.append(last)
        else:
            self.order[slot], self.last[slot] = job, last

    def _copy(self, source: int, slot: int) -> None:
        """Row ``source`` copied into ``slot`` (with the step in flight, it stays in flight: see :attr:`_flown`)."""
        if source == slot:
            return
        for s in self.slots:
            s.copy(source, slot)
        self._place(slot, self.order[source], self.last[source], self._flown[source] if self._flight else None)

    def _swap(self, a: int, b: int) -> None:
        if self._flight is not None:
            self._flown[a], self._flown[b] = self._flown[b], self._flown[a]
        for s in self.slots:
            s.swap(a, b)
        self.order[a], self.order[b] = self.order[b], self.order[a]
        self._changes += 1
        self.last[a], self.last[b] = self.last[b], self.last[a]

    def _insert(self, state: _State, lane: str) -> None:
        """The rows of a prefilled ``state`` whose jobs are not done join ``lane``."""
        lasts = state.host_lasts()
        for i, job in enumerate(state.jobs):
            if job.done:
                continue
            n = len(self.order)
            slot = n
            if lane == "fast":
                self._copy(self.fast, n)  # the first slow row (if any) moves to a new last slot
                slot = self.fast
                self.fast += 1
            for s, rows in zip(self.slots, state.rows):
                s.put(rows, i, slot)
            self._place(slot, job, lasts[i])

    def _leave(self) -> None:
        """Rows whose jobs are done leave (the highest slot first, so that only kept rows fill the holes), and the
        slots give back what their rows no longer need. Nothing to do where no row is done and no row was placed,
        moved or reserved since the last call (three calls a round: the rows' needs are not worked out again)."""
        # done, or with their last tokens in the step in flight (they leave before it is read, their tokens handed
        # over when it is)
        gone = [i for i, job in enumerate(self.order) if job.done or job.left <= 0]
        if not gone and self.order and self._settled == self._changes:
            return
        for i in reversed(gone):
            last = len(self.order) - 1
            if i < self.fast:
                self._copy(self.fast - 1, i)
                self._copy(last, self.fast - 1)
                self.fast -= 1
            else:
                self._copy(last, i)
            del self.order[last], self.last[last], self._flown[last:last + 1]
            for s in self.slots:
                s.truncate(last)
        positions = self.positions()
        for s in self.slots:
            s.shrink(positions)  # after a burst (or the long rows): slots a quarter full or less give memory back
        if not self.order:  # drained: the next burst may try to grow the slots again, in passes of any size
            self.row_limit = self.step_rows = None
        self._settled = self._changes

    # -- what the scheduler calls
    def move(self, job: Job, lane: str) -> None:
        """Move ``job``'s row to ``lane`` (its cache rows swapped with a row at the lanes' border; tokens unchanged)."""
        i = self.order.index(job)
        if lane == "slow" and i < self.fast:
            self._swap(i, self.fast - 1)
            self.fast -= 1
        elif lane == "fast" and i >= self.fast:
            self._swap(i, self.fast)
            self.fast += 1

    def need(self, job: Job) -> int:
        """The most positions ``job``'s row may hold in a model's cache."""
        raise NotImplementedError

    def positions(self, jobs: Sequence[Job] = ()) -> int:
        """The most positions a row of this batch (and of ``jobs``, about to join) may hold."""
        return max((self.need(j) for j in [*self.order, *jobs]), default=0)

    def holds(self, job: Job) -> bool:
        """Whether ``job``'s row fits every model's slots as they are (their positions; see ``Slots(fit=True)``)."""
        return all(s.holds(self.need(job)) for s in self.slots)

    def reserve(self, rows: int, positions: int = 0) -> None:
        """Room in every model's slots for ``rows`` rows of up to ``positions`` positions
        (:meth:`~efftx.generation.decode.Slots.reserve`: raises ``torch.OutOfMemoryError``, the rows unchanged,
        where the device has no memory for them)."""
        self._changes += 1
        try:
            for s in self.slots:
                s.reserve(rows, positions, fill=len(self.slots) == 1)
        except CacheBudgetFull:  # every model's slots take the rows the budget holds of all of them together
            if len(self.slots) > 1:
                first, *rest = self.slots
                fit = first.budget.free_rows(first, *rest)
                for s in sorted(self.slots, key=lambda s: -s.slots):  # those that give memory back first
                    s.fill(fit)
            raise

    def admit(self, jobs: list[Job], lane: str = "fast") -> None:
        """Prefill ``jobs`` and add them to a lane (a failing prefill is retried job by job). Their slots are
        reserved first: where the device has no memory for them, ``torch.OutOfMemoryError`` is raised before
        anything changed."""
        self.reserve(len(self) + len(jobs), self.positions(jobs))
        batch = len(self) + len(jobs)
        try:
            parts = [self.pass_time.run(self._behind_flight, self.prefill, jobs)]
        except Exception as exc:  # noqa: BLE001 - contained below
            parts = self._alone(jobs, exc)
        for state, result in parts:
            self.commit(state, result, batch)
            self._insert(state, lane)
        if len(self) < batch:  # rows that failed or finished at their prefill: the slots reserved for them go back
            self._leave()

    def drop_cancelled(self) -> None:
        """Cancelled rows leave (whichever lane they are in); so do rows that got their last tokens in the step in
        flight (they take no step after it; their tokens reach them when it is read)."""
        for job in self.order:
            if job.cancelled:
                job._finish()
        self._leave()

    def steps_for(self, jobs: Sequence[Job], wanted: int) -> int:
        """How many decoding steps (at most ``wanted``) a :meth:`step` of ``jobs``' rows may run at once: 1 here;
        see :meth:`BaseEngine.steps_for` and :meth:`SpeculativeEngine.steps_for`."""
        return 1

    def step(self, lane: str = "fast", steps: int = 1) -> int:
        """One decoding step of every row of ``lane`` (``fast``, ``slow`` or ``all``) in one batched pass, or
        ``steps`` steps back to back (at most :meth:`steps_for` the lane's rows; base decoding reads the tokens once,
        after the last); finished rows leave. -> the most steps a row ran (fewer than ``steps`` where :attr:`interrupt`
        stopped them)."""
        self.drop_cancelled()
        a, b = self._bounds(lane)
        allowed = self.steps_for(self.order[a:b], steps)
        if steps > allowed:
            raise ValueError(f"{steps} steps at once exceed what the {self.kind} rows allow ({allowed})")
        size = min(b - a, self.step_rows or b - a)  # after a pass ran out of device memory: passes of fewer rows
        starts = range(a, b, max(size, 1))
        defer = self.pipeline and self.pipelines and len(starts) == 1  # one pass: its tokens read after the next's
        ran = max([self._step_range(start, min(start + size, b), steps, defer) for start in starts], default=0)
        self._leave()
        return ran

    def _step_range(self, a: int, b: int, steps: int = 1, defer: bool = False) -> int:
        """One batched pass (or ``steps``) over rows ``a .. b - 1``; if it raises, it is undone and run row by row
        (one that ran out of device memory also halves the rows of this batch's later passes, :attr:`step_rows`).
        ``defer``: its tokens are left on the device, read later (:meth:`settle`). With a step in flight, this one is
        fed that step's tokens for its rows (:meth:`_carried`), queued behind it, and only then is that one read
        (pipelined steps: on a GPU the device runs the next step while the host reads and hands over the last one's
        tokens and schedules). -> the most steps its rows ran (0: every row failed)."""
        follow = self._flight is not None and b > a  # fed on the device where the step in flight has the tokens
        state = self._view(a, b, self._carried(a, b) if follow else None)
        state.steps = steps
        snapshot, gens = state.snapshot(), _gen_states(state.jobs)
        try:
            result = self.pass_time.run(self.compute if defer else self._compute_behind, state, sync=not defer)
            sent = self._send(result) if defer else None  # queued right behind the step, before the next one
        except Exception as exc:  # noqa: BLE001 - contained below
            state.restore(snapshot)
            _set_gen_states(state.jobs, gens)
            self.settle()  # the step before (if in flight) read: its tokens are the rows' last ones, to run them alone
            if isinstance(exc, torch.OutOfMemoryError) and b - a > 1:
                free_memory()
                self.step_rows = half = max((b - a) // 2, 1)
                logger.warning("continuous batching: a %s pass of %d rows ran out of device memory; passes of at "
                               "most %d rows from now on", self.kind, b - a, half)
            parts = self._alone(state.jobs, exc, state)
        else:
            self.settle()  # the step before (if in flight: this one followed it) read, while this one runs
            if defer:
                for job in state.jobs:
                    job.ahead += state.steps
                self._flight = (state, result, b - a, sent)
                self._flown = [None] * len(self.order)
                self._flown[a:b] = range(b - a)
                self.deferred += 1
                self.followed += follow
                return state.steps
            parts = [(state, result)]
        for part, result in parts:
            self.commit(part, result, b - a)
            self.last[part.start:part.start + len(part.jobs)] = part.host_lasts()
        return max((part.steps for part, _ in parts), default=0)

    def _alone(self, jobs: list[Job], exc: Exception, state: _State | None = None) -> list[tuple[_State, Any]]:
        """A batched prefill (``state`` None) or step raised: run it for each row alone; a row that fails alone
        fails (only it)."""
        what = f"{self.kind} decoding"
        fault = self.latch.failed(exc)
        if fault is not None:  # sticky: each row alone would fail too (and touch the failed device again)
            for job in jobs:
                job._fail(fault, what)
            return []
        if len(jobs) > 1:
            logger.warning("%s of a batch of %d failed (%s: %s); running its rows one by one",
                           what, len(jobs), type(exc).__name__, exc)
        parts = []
        for i, job in enumerate(jobs):
            try:
                if len(jobs) == 1:
                    raise exc
                if state is None:
                    self._apart = True
                    try:
                        parts.append(self.pass_time.run(self.prefill, [job]))
                    finally:
                        self._apart = False
                else:
                    sub = self._view(state.start + i, state.start + i + 1)
                    sub.steps = state.steps
                    parts.append((sub, self.pass_time.run(self.compute, sub)))
            except Exception as own:  # noqa: BLE001 - this row's own failure
                job._fail(own, what)
        return parts

    def fail_all(self, exc: BaseException) -> None:
        exc = self.latch.failed(exc) or exc
        self._flight, self._flown, self.flight_wait = None, [], 0.0  # its tokens are never read: every row fails
        for job in self.jobs():
            job.ahead = 0
            job._fail(exc, f"{self.kind} decoding")
        self.order, self.last, self.fast, self.row_limit, self.step_rows = [], [], 0, None, None
        for s in self.slots:
            s.truncate(0)

    def prefill_chunk(self, job: Job, tokens: int) -> None:
        """A pass (:class:`PassTime`) of :meth:`_prefill_chunk`."""
        self.pass_time.run(self._behind_flight, self._prefill_chunk, job, tokens)

    def _prefill_chunk(self, job: Job, tokens: int) -> None:
        """Feed the next ``tokens`` tokens of ``job``'s prompt (never its last one: its last chunk is fed by
        :meth:`prefill`, which then takes the job alone) into rows of its own (:attr:`Job.partial`, made as its
        prefill alone would make them): a long prompt is prefilled over several rounds, while the running rows
        step. Raises what its prefill would (a bad request's ``ValueError`` at its first chunk)."""
        self._hook([job])
        if job.partial is None:
            self.check(job)
            job.partial = self.new_rows(job)
        piece = (job.prompt[:job.feed_tokens])[job.fed:job.fed + tokens]
        if job.fed + len(piece) >= job.feed_tokens:  # the scheduler's to ensure (Scheduler._chunks_left)
            raise RuntimeError("a prefill chunk may not feed a prompt's last tokens")
        for rows in job.partial:
            rows.prefill([piece])
        job.fed += len(piece)

    # subclasses
    def check(self, job: Job) -> None:
        """Raise ``ValueError`` naming the problem where ``job`` cannot decode here (its prompt, its lengths)."""
        raise NotImplementedError

    def new_rows(self, job: Job) -> list[Rows]:
        """Empty rows for ``job`` alone, one per model, as its prefill makes them."""
        raise NotImplementedError

    def _start(self, jobs: list[Job], model) -> torch.device:
        """A prefill's start: the hook, then each job checked (a ``ValueError`` fails it alone) and given its
        random numbers (:func:`_generator`); -> ``model``'s device."""
        self._hook(jobs)
        device = _device(model)
        for job in jobs:
            self.check(job)
            job.generator = _generator(job.seed)
        return device

    def prefill(self, jobs: list[Job]) -> tuple[_State, Any]:
        raise NotImplementedError

    def compute(self, state: _State) -> Any:
        raise NotImplementedError

    def commit(self, state: _State, result: Any, batch: int) -> list[bool]:
        raise NotImplementedError


def _engine_name(of) -> str:
    """The running batch a job (or an engine) belongs to: ``base``, or speculative with its gamma (and cap, and
    ``coupled``)."""
    gamma, cap = getattr(of, "gamma", None), getattr(of, "max_gamma", None)
    if gamma is None:
        return "base"
    return (f"speculative gamma={gamma}" + (f" max_gamma={cap}" if cap is not None else "")
            + (" coupled" if getattr(of, "coupled", False) else ""))


def _device(model) -> torch.device:
    return next(model.parameters()).device


class BaseEngine(_Engine):
    """Base decoding: one target pass per step, one new token per row."""

    kind = "base"
    pipelines = True

    def __init__(self, model, hook=None, compile: str = "off", compile_rows: int | None = None,
                 budget: CacheBudget | None = None, fit: bool = True, pass_time: PassTime | None = None):
        super().__init__(hook, [model], splittable(model), compile, compile_rows, budget, fit, pass_time)
        self.model = model
        self.name = _engine_name(self)

    def _capacity(self, job: Job) -> int:
        return self.model.max_seq_len if self.batched else self.need(job)

    def need(self, job):
        return len(job.prompt) + job.max_new

    def check(self, job):
        if not job.prompt:
            raise ValueError("the prompt is empty")
        total = len(job.prompt) + job.max_new
        if total > self.model.max_seq_len:
            raise ValueError(f"prompt ({len(job.prompt)}) + max_new_tokens ({job.max_new}) = {total} "
                             f"exceeds the model's max_seq_len={self.model.max_seq_len}")

    def new_rows(self, job):
        if self.batched:
            return [Rows(self.model, 1, self._room(self.model, len(job.prompt)), True)]
        return [Rows(self.model, 1, self._capacity(job), False)]

    def prefill(self, jobs):
        self._start(jobs, self.model)
        if jobs[0].partial is not None:  # the last chunk of a chunked prefill (the job alone)
            (rows,) = jobs[0].partial
            logits = rows.prefill([jobs[0].prompt[jobs[0].fed:]])
        elif self.batched:
            room = self._room(self.model, max(len(j.prompt) for j in jobs))
            rows, logits = self.slots[0].prefill([j.prompt for j in jobs], room, not self._apart)
        else:
            rows = Rows.concat([Rows(self.model, 1, self._capacity(j), False) for j in jobs])
            logits = rows.prefill([j.prompt for j in jobs])
        tokens = row_tokens(logits, [j.sampling for j in jobs], [j.generator for j in jobs])
        return _State([rows], tokens, list(jobs)), tokens

    def steps_for(self, jobs, wanted):
        """At most ``wanted``, and no more than any of ``jobs`` has tokens left: no row ever computes a token past
        its own (so its tokens, its stream's draws and its cache are exactly those of steps one at a time)."""
        return max(1, min([wanted, *(j.left for j in jobs)]))

    def compute(self, state):
        """``state.steps`` steps (fewer where :attr:`interrupt` says so after one): each feeds the last one's tokens,
        still on the device; -> (B, steps run) tokens."""
        self._hook(state.jobs)
        pick = token_picker([j.sampling for j in state.jobs], [j.generator for j in state.jobs], state.last.device)
        token, tokens = state.last, []
        for i in range(state.steps):
            if i and self.interrupt is not None and self.interrupt():
                break
            token = pick(state.rows[0].forward(token[:, None])[:, -1])
            tokens.append(token)
        state.steps = len(tokens)  # those that ran
        return torch.stack(tokens, 1)

    def _send(self, tokens):
        return Readback(tokens)

    def _await(self, sent):
        sent.wait()

    def _read(self, state, sent):
        return sent.tolist()

    def _carry(self, tokens):
        return tokens[:, -1]

    def commit(self, state, tokens, batch):
        """``tokens``: (B,) from a prefill, (B, steps) from :meth:`compute` (or read already: a list per row, from
        :meth:`settle`); each token is a step of its job (a job done meanwhile, cancelled or failed, takes none)."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.reshape(len(state.jobs), -1)
            rows = tokens.tolist()  # the one read back of a step (or of a round's several)
            state.last = tokens[:, -1]
        else:
            rows = tokens
        state.lasts = [row[-1] for row in rows]
        finished = []
        for job, row in zip(state.jobs, rows):
            done = False
            if job.done:
                finished.append(True)
                continue
            for t in row:
                done = job._push([t], None, batch)
            finished.append(done)
        return finished


def _next_own(gamma: int, drafted: int, accepted: int, cap: int) -> int:
    """An adaptive row's draft length after a step that drafted ``drafted`` tokens for it (a coupled step may draft
    fewer than its length, or none: then it learns nothing)."""
    return next_gamma(gamma, drafted, accepted, cap) if drafted else gamma


class SpeculativeEngine(_Engine):
    """Speculative decoding with one ``gamma``: ``gamma`` batched draft passes and one batched target pass per
    step, acceptance and rewinds per row (:func:`~efftx.generation.speculative.iter_speculative_rows`'s step).

    ``coupled``: acceptance by :func:`~efftx.generation.speculative.accept_coupled`, each row's noise that of its
    positions (:func:`~efftx.generation.sampling.position_noise`: the draws base decoding makes for those tokens), so
    a row's tokens are those base decoding gives it with the same seed and settings, whatever is drafted; each step's
    draft length is then chosen by the load (``lengths``, a :class:`~efftx.generation.draft_length.DraftLength`; a row
    drafts at most its own gamma), down to 0: a step of the target alone, the tokens it emits fed to the draft at
    the next step that drafts (the row's :attr:`Job.draft_tail`)."""

    kind = "speculative"

    def __init__(self, target, draft, gamma: int, hook=None, max_gamma: int | None = None, compile: str = "off",
                 compile_rows: int | None = None, budget: CacheBudget | None = None, fit: bool = True,
                 pass_time: PassTime | None = None, coupled: bool = False, lengths: DraftLength | None = None):
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if max_gamma is not None and max_gamma < gamma:
            raise ValueError(f"max_gamma ({max_gamma}) must be >= gamma ({gamma}), the starting value")
        super().__init__(hook, [target, draft], splittable(target) and splittable(draft), compile, compile_rows,
                         budget, fit, pass_time)
        self.target, self.draft, self.gamma = target, draft, gamma
        self.max_gamma = max_gamma  # adaptive rows (:func:`~efftx.generation.speculative.next_gamma`), or None
        self.coupled = bool(coupled)
        self.name = _engine_name(self)
        self.cap = max_gamma or gamma  # the most tokens a row drafts in one step
        self.lengths = (lengths if lengths is not None else DraftLength(self.cap)) if self.coupled else None
        if self.lengths is not None and compile != "off":  # compiled draft passes catch up one kept token, as ever:
            self.lengths.least = 1  # every step drafts (a step without drafts would leave the draft more behind)

    def check(self, job):
        if not job.prompt:
            raise ValueError("the prompt is empty")
        limit = min(self.target.max_seq_len, self.draft.max_seq_len)
        longest = len(job.prompt) + job.max_new
        if longest + self.cap > limit:
            raise ValueError(f"prompt + max_new_tokens ({longest}) + gamma ({self.cap}) "
                             f"exceeds the models' max_seq_len={limit}")

    def new_rows(self, job):
        if self.batched:
            return [Rows(m, 1, self._room(m, job.feed_tokens), True) for m in (self.target, self.draft)]
        return [Rows(m, 1, self.need(job), False) for m in (self.target, self.draft)]

    def need(self, job):
        # the caches hold the prompt but its last token, the tokens kept, and a verify pass's cap + 1 more
        return len(job.prompt) + job.max_new + self.cap + 1

    def prefill(self, jobs):
        device = self._start(jobs, self.target)
        prefixes = [j.prompt[:-1] for j in jobs]  # the caches hold every prompt token but the last: "pending"
        if jobs[0].partial is not None:  # the last chunk of a chunked prefill (the job alone)
            t, d = jobs[0].partial
            rest = [jobs[0].prompt[jobs[0].fed:-1]]
            t.prefill(rest)
            d.prefill(rest)
        elif self.batched:
            room = max(len(j.prompt) for j in jobs) - 1
            t, _ = self.slots[0].prefill(prefixes, self._room(self.target, room), not self._apart)
            d, _ = self.slots[1].prefill(prefixes, self._room(self.draft, room), not self._apart)
        else:
            caps = [self.need(j) for j in jobs]
            t = Rows.concat([Rows(self.target, 1, c, False) for c in caps])
            d = Rows.concat([Rows(self.draft, 1, c, False) for c in caps])
            t.prefill(prefixes)
            d.prefill(prefixes)
        lasts = [j.prompt[-1] for j in jobs]
        return _State([t, d], host_values(lasts, torch.long, device), list(jobs), lasts=lasts), None

    def steps_for(self, jobs, wanted):
        """``wanted``: every step reads its acceptance, so :meth:`compute` stops after the step in which a row got its
        last token (a row never steps past it)."""
        return max(1, wanted)

    def compute(self, state):
        """``state.steps`` speculative steps (fewer where a row got its last token, or :attr:`interrupt` said so,
        after one), each fed the one before's tokens, drafts per row and kept drafts, as :meth:`commit` would leave
        them: the jobs are left alone until the commit (a failing step is rerun from the first). -> the steps'
        results, in order."""
        self._hook(state.jobs)
        jobs = state.jobs
        dist_of = distributions([j.sampling for j in jobs], state.last.device)  # every pass: settings sent once
        pending, lasts = state.last, state.host_lasts()
        own, tails = [j.draft_gamma for j in jobs], [list(j.draft_tail) for j in jobs]
        left = [j.max_new - len(j.out) for j in jobs]
        results = []
        for i in range(state.steps):
            if i and self.interrupt is not None and self.interrupt():
                break
            if i:  # the next step's rows as the commit of this one will leave them
                lasts = [e[-1] for e in results[-1][0]]
                pending = host_values(lasts, torch.long, pending.device)
                tails = results[-1][3]
                if self.max_gamma is not None:
                    own = [_next_own(g, d, n, self.max_gamma) for g, d, n in zip(own, results[-1][4], results[-1][1])]
            results.append(self._step(state, pending, lasts, own, tails, left, dist_of))
            left = [n - len(e) for n, e in zip(left, results[-1][0])]
            if min(left) <= 0:  # a row has its tokens: it leaves before another step
                break
        state.steps = len(results)  # those that ran
        return results

    def _step(self, state, pending, lasts, own, tails, left, dist_of):
        """One speculative step of ``state``'s rows: ``pending`` tokens (``lasts`` on the host), draft lengths per row
        ``own``, kept tokens not fed to the draft yet ``tails`` (lists), tokens ``left`` -> (emitted, accepted, kept,
        next tails, drafted per row)."""
        t_rows, d_rows = state.rows
        jobs = state.jobs
        gens = [j.generator for j in jobs]
        device, vocab = pending.device, self.target.vocab_size
        started = self.pass_time.clock()  # the scheduler's clock, as its other measured costs
        if self.coupled:  # this step's draft length by the load (0: the target alone), at most each row's own
            cut = self.lengths.choose(own)
            own = [min(g, cut) for g in own]
        # each row drafts its own number of tokens (all alike but with an adaptive gamma); the step drafts as many
        # as its longest-drafting row, and a row verifies only its own (its extra drafts are never looked at)
        gamma = max(own)
        if self.coupled and not gamma:
            # a step of the target alone, as a base step: each token the race with its stream's next draw (counted),
            # base decoding's own pick, the pending token joining the row's draft tail. None of the verify's work
            # (noise of gamma + 1 positions, agreement on the host, rewinds of nothing): on a 2-core CPU that work
            # made a 16-row step of length 0 cost 7% more than a base step (bench/serve_load.py's pair)
            picked = draw(dist_of(t_rows.forward(pending[:, None])[:, -1]), gens).tolist()
            self.lengths.record(0, len(jobs), self.pass_time.clock() - started, own, [0] * len(jobs))
            return [[t] for t in picked], [0] * len(jobs), [0] * len(jobs), [t + [p] for t, p in zip(tails, lasts)], own
        if self.coupled:  # the noise of each row's next gamma + 1 positions, as base decoding draws it
            noise = position_noise(gens, gamma + 1, vocab, device)
            noises = noise.unbind(1)
        else:
            # every random number of the step first, each row's one draw as it makes it alone
            # (speculative.iter_speculative_rows): the races of its own drafts and of its last token, its uniforms
            noises, u, last_noise = step_noise(gens, own, gamma, vocab, device)
        # Tokens kept but not fed to the draft yet (a row's "tail": the last draft of a step that kept them all, or
        # the tokens of coupled steps that drafted nothing) go in the first draft pass, before pending (one pass
        # instead of separate passes for the tails).

        def pick(logits, i):
            dist = dist_of(logits)  # (B, V)
            return race(dist, noises[i]), dist

        drafted, q = draft_with_tails(d_rows, tails, lasts, pending, gamma, pick)  # (B, gamma), (B, gamma, V)
        verify = torch.cat([pending[:, None], drafted], 1)
        # a compiled verify pass always feeds cap + 1 tokens (padding after the drafts, rewound below: causal
        # attention keeps them from every real position), so that an adaptive gamma has one graph, not one per length
        pad = self.cap - gamma if t_rows.compiles(len(jobs)) else 0
        if pad:
            verify = torch.cat([verify, verify.new_zeros(len(jobs), pad)], 1)
        p = dist_of(t_rows.forward(verify)[:, :gamma + 1])
        # every row's acceptance and last token at once; the host reads one (B, gamma + 2) tensor
        if self.coupled:  # the target's tokens and the drafts in one read; each row's agreement on the host
            host = torch.cat([coupled_tokens(p, noise), drafted], 1).tolist()
            packed = [agreed_row(r[:gamma + 1], r[gamma + 1:], g) for r, g in zip(host, own)]
        else:
            packed = accept_sampled(p, q, drafted, u, last_noise, host_values(own, torch.long, device)).tolist()
        emitted, accepted, keep, next_tails = [], [], [], []
        for g, room, (n_r, last_r, *drafts) in zip(own, left, packed):
            out = (drafts[:n_r] + [last_r])[:room]
            emitted.append(out)
            accepted.append(n_r)
            keep.append(kept_tokens(n_r, len(out), g))  # tokens the caches keep after pending
            # the draft saw pending + gamma - 1 drafted; a row that keeps all lacks the last one
            next_tails.append([drafts[-1]] if keep[-1] == gamma else [])
        t_rows.rewind([gamma + pad - k for k in keep])  # the target saw pending + gamma drafted tokens (+ padding)
        d_rows.rewind([max(gamma - 1 - k, 0) for k in keep])
        if self.coupled:  # a row's stream moves on by the tokens it emitted: one draw each, as in base decoding
            for gen, out in zip(gens, emitted):
                if gen is not None:
                    gen.set_state(gen.get_state() + len(out))
            self.lengths.record(gamma, len(jobs), self.pass_time.clock() - started, own, accepted)
        return emitted, accepted, keep, next_tails, own

    def commit(self, state, result, batch):
        """``result``: None from a prefill, else the steps' results from :meth:`compute`, applied in order."""
        if result is None:  # the prefill: counted as a pass of each model when there was a prompt prefix
            for job in state.jobs:
                if len(job.prompt) > 1:
                    job.stats.target_calls += 1
                    job.stats.draft_calls += 1
            return [False] * len(state.jobs)
        finished = [False] * len(state.jobs)
        for emitted, accepted, keep, tails, own in result:
            for r, (job, out, n, tail, g) in enumerate(zip(state.jobs, emitted, accepted, tails, own)):
                job.draft_tail = tail
                st = job.stats
                st.steps += 1
                st.accepted.append(n)
                st.drafted.append(g)
                st.target_calls += 1
                st.draft_calls += g  # as alone: its draft passes a step (a tail rides on the next step's first)
                if self.max_gamma is not None:
                    job.draft_gamma = _next_own(job.draft_gamma, g, n, self.max_gamma)
                finished[r] = job._push(out, n, batch)
            state.lasts = [e[-1] if e else t for e, t in zip(emitted, state.host_lasts())]
        state.last = host_values(state.lasts, torch.long, state.last.device)
        return finished

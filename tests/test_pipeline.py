"""Pipelined base steps (``Scheduler(pipeline=True)``; on by default on a CUDA device): a base batch's step is fed the
tokens of the step before on the device and queued behind it, and only then are that step's tokens read.

On a CPU nothing runs ahead of the host, so these tests hold the order (the next step queued before the last one's
tokens are read), the exactness (every request's tokens, acceptance and stream exactly as alone) and the edges (rows
joining, leaving, moving, cancelled, failing while a step is in flight); the speed is the GPU check's
(``bench/steps_per_round.py --pipeline``).
"""

from __future__ import annotations

import pytest
import torch

from device_waits import DeviceWaits
from efftx.serving import batches
from efftx.serving.continuous import Job, Scheduler, warm_up
from test_serve_continuous import GREEDY, HOT, MIXED, NUCLEUS, assert_alone, pair, run_rounds

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pairs():
    return {}  # the tiny target and draft per backend, built once (test_serve_continuous.pair)


def spy(monkeypatch) -> dict:
    """Checks at every base compute that no row is asked for a token past its own (its tokens read, and those in
    flight, counted)."""
    seen = {"computes": 0, "past": []}
    real_compute = batches.BaseEngine.compute

    def compute(self, state):
        seen["computes"] += 1
        made = [len(j.out) + j.ahead for j in state.jobs]
        seen["past"] += [j.tag for j, m in zip(state.jobs, made) if m + state.steps > j.max_new]
        return real_compute(self, state)

    monkeypatch.setattr(batches.BaseEngine, "compute", compute)
    return seen


def streamed(plan):
    """Jobs of ``plan`` (as in MIXED) that stream: their ``on_step`` tokens are kept, to compare with their output."""
    def make(p):
        job = Job(p[1], p[2], p[3], p[4], p[5], tag=p, on_step=lambda tokens, accepted: job.streamed.extend(tokens))
        job.streamed = []
        return job
    return make


@pytest.mark.parametrize("kind, steps, priority", [("full", 1, False), ("full", 4, False), ("full", 1, True),
                                                   ("full", 4, True), ("performer", 2, False),
                                                   ("sinkhorn", 2, True), ("nsa", 1, False)])
def test_pipelined_steps_give_every_request_its_solo_output(pairs, kind, steps, priority, monkeypatch):
    """The mixed plan (base and speculative rows arriving over ten rounds, every sampling, streams), pipelined: every
    request gets exactly its solo tokens (and acceptance), its stream every token in order, no row computes past its
    own tokens, and most base steps followed the step in flight. With priority (two lanes stepped in turn, long rows
    moved to the slow lane) and with several steps a round."""
    target, draft = pair(pairs, kind)
    knobs = {"short_tokens": 8, "fast_rows": 2, "long_every": 2, "short_slowdown": 0} if priority else \
        {"short_tokens": 0}
    scheduler = Scheduler(target, draft, max_rows=8, steps_per_round=steps, pipeline=True, **knobs)
    seen = spy(monkeypatch)
    jobs = run_rounds(scheduler, MIXED, streamed(MIXED))
    monkeypatch.undo()
    assert_alone(target, draft, jobs)
    assert all(j.streamed == j.out for j in jobs)
    assert not seen["past"]
    assert all(j.ahead == 0 for j in jobs) and scheduler.base._flight is None
    piped = scheduler.pipelining()  # rows joining, leaving, moving and lane changes do not stop the pipeline
    assert piped["steps"] == seen["computes"] and piped["followed"] >= 0.85 * piped["steps"], piped


def events(scheduler: Scheduler, plan) -> tuple[list[str], list[int]]:
    """The order of a scheduler's base steps (``step``), their tokens sent to the host ahead of their read (``send``),
    reads of the device (``read``: waiting for all the work queued) and reads of values sent ahead (``read ahead``:
    waiting for the work queued before they were sent) over ``plan``; and per read ahead, the device work queued
    after its send (that it does not wait for)."""
    order: list[str] = []
    real, real_send = batches.BaseEngine.compute, batches.BaseEngine._send

    def compute(self, state):
        order.append("step")
        return real(self, state)

    def send(self, result):
        order.append("send")
        return real_send(self, result)

    batches.BaseEngine.compute, batches.BaseEngine._send = compute, send
    try:
        with DeviceWaits() as audit:
            real_wait = audit._wait
            audit._wait = lambda what: (order.append("read ahead" if "sent ahead" in what else "read"),
                                        real_wait(what))
            run_rounds(scheduler, plan)
    finally:
        batches.BaseEngine.compute, batches.BaseEngine._send = real, real_send
    return order, audit.ahead


def test_the_next_step_is_queued_before_the_last_ones_tokens_are_read(pairs):
    """One request of five new tokens (the prefill's and four steps'): unpipelined, each step's tokens are read
    before the next step; pipelined, each step's tokens are sent to the host as it is queued, the next step is queued
    behind it, and only then are they read (on a GPU: waiting for that step alone, not for the next one, queued
    after the send), and the last step (its row leaves as it is queued: it has all its tokens) is read at the end
    of its round, as nothing follows it. Nothing else reads the device."""
    target, draft = pair(pairs, "full")
    plan = [(0, [5, 6, 7], 5, HOT, 1, None)]
    assert events(Scheduler(target, pipeline=False), plan) == (["read"] + ["step", "read"] * 4, [])
    piped = Scheduler(target, pipeline=True)
    order, ahead = events(piped, plan)
    assert order == ["read", "step", "send", "step", "send", "read ahead", "step", "send", "read ahead", "step", "send",
                     "read ahead", "read ahead"]
    assert all(n > 0 for n in ahead[:3]) and ahead[3] == 0, ahead  # a whole step queued after each send but the last
    assert piped.rounds == 4 and not piped.running


def test_a_fault_while_a_step_is_in_flight_fails_only_its_row(pairs, monkeypatch):
    """A step that raises while the step before is in flight: the caches and streams are rewound, the step in
    flight is read (its tokens stay), the rows run alone from there, only the culprit fails, the others keep their
    solo tokens; so do requests cancelled while their tokens are in flight (none comes after the cancel)."""
    target, draft = pair(pairs, "full")
    real_draw = batches.draw
    culprit: list[Job] = []
    faults: list[bool] = []  # whether a step was in flight at each fault
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, pipeline=True)

    def faulty_draw(probs, gens, **kw):
        if culprit and culprit[0].generator in gens and culprit[0].generator.get_state() >= 4:
            faults.append(scheduler.base._flight is not None)
            raise RuntimeError("fault with a step in flight")
        return real_draw(probs, gens, **kw)

    monkeypatch.setattr(batches, "draw", faulty_draw)
    valid = [(0, [5, 6, 7], 14, HOT, 1, None), (0, [9] * 5, 11, NUCLEUS, 2, None), (0, [4], 9, GREEDY, 3, None),
             (1, [1, 2], 12, HOT, 4, 2)]

    def make(p):
        job = Job(p[1], p[2], p[3], p[4], p[5], tag=p)
        if p[4] == 9:
            culprit.append(job)
        return job

    cancelled = Job([8, 8], 20, HOT, 7, tag="cancelled")
    jobs = run_rounds(scheduler, [*valid, (0, [2, 3], 12, HOT, 9, None)], make)
    monkeypatch.undo()
    assert culprit[0].failure is not None and culprit[0].failure.status == 500
    assert faults[0] is True  # the batch's step raised with the step before in flight
    assert len(culprit[0].out) == 4  # its stream's fifth draw raised: the prefill's token and three steps' stay
    assert_alone(target, draft, [j for j in jobs if j is not culprit[0]])
    # a cancel while the row's tokens are in flight: it takes none after
    keep = Job([1, 2], 12, HOT, 3, tag=(0, [1, 2], 12, HOT, 3, None))
    scheduler.submit(keep)
    scheduler.submit(cancelled)
    with torch.no_grad():
        for _ in range(3):
            scheduler.run_once()
        assert scheduler.base._flight is not None
        scheduler.cancel(cancelled)
        taken = len(cancelled.out)
        scheduler.drain()
    assert cancelled.done and cancelled.cancelled and len(cancelled.out) == taken
    assert_alone(target, draft, [keep])


def test_pipeline_is_on_by_default_only_on_a_cuda_device_and_checked(pairs, monkeypatch):
    target, _ = pair(pairs, "full")
    assert Scheduler(target).pipeline is False and Scheduler(target, pipeline=True).base.pipeline is True
    assert Scheduler(target).pipelining() is None
    monkeypatch.setattr("efftx.serving.continuous._device", lambda model: torch.device("cuda", 0))
    assert Scheduler(target).pipeline is True and Scheduler(target, pipeline=False).pipeline is False
    for bad in (1, "yes"):
        with pytest.raises(ValueError, match="pipeline must be True, False or None"):
            Scheduler(target, pipeline=bad)


def in_flight_at(monkeypatch, method: str) -> list[bool]:
    """Wraps the engines' ``method`` (``land``, ``settle``): whether a step was in flight at each call."""
    seen: list[bool] = []
    real = getattr(batches._Engine, method)

    def wrapped(self):
        seen.append(self._flight is not None)
        real(self)

    monkeypatch.setattr(batches._Engine, method, wrapped)
    return seen


def lanes(target, draft) -> Scheduler:
    """A pipelined scheduler whose long base rows wait in the slow lane while short rows step (one fast row)."""
    return Scheduler(target, draft, max_rows=8, short_tokens=8, fast_rows=1, long_every=4, short_slowdown=0,
                     pipeline=True)


def test_a_batch_not_stepped_in_a_round_has_its_step_in_flight_read_by_the_rounds_end(pairs, monkeypatch):
    """Long base rows wait in the slow lane while short speculative rows step: a base step in flight is read at the
    end of the first round that does not step its batch (its tokens are not held back for ``long_every`` rounds),
    and every request still gets its solo output."""
    target, draft = pair(pairs, "full")
    scheduler = lanes(target, draft)
    landed = in_flight_at(monkeypatch, "land")
    plan = [(0, [5, 6, 7], 30, HOT, 1, None), (0, [9] * 5, 26, NUCLEUS, 2, None), (2, [1, 2], 8, HOT, 3, 2),
            (3, [4], 6, GREEDY, 4, 2), (5, [3, 3], 8, HOT, 5, 2)]
    jobs, r = [], 0
    with torch.no_grad():
        while r < 6 or scheduler.running:
            jobs += [scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p)) for p in plan if p[0] == r]
            launched = scheduler.base._flight
            scheduler.run_once()
            assert scheduler.base._flight is None or scheduler.base._flight is not launched  # read by the round's end
            r += 1
    monkeypatch.undo()
    assert any(landed)  # such rounds happened, with a base step in flight
    assert_alone(target, draft, jobs)


def test_a_step_whose_tokens_cannot_be_read_fails_its_rows_and_the_replica_goes_on(pairs, monkeypatch):
    """The read of a pipelined step raises (on a GPU: a device error surfacing at the first wait after the step
    ran): that step's rows fail (their caches hold a step whose tokens are lost), while a long base row waiting in
    the slow lane, a speculative row and a base request arriving later get their solo output, and no round raises."""
    target, draft = pair(pairs, "full")
    scheduler = lanes(target, draft)
    failed = []
    real = batches.BaseEngine._read

    def read(self, state, tokens):
        if not failed and [j.max_new for j in state.jobs] == [8] and len(self) == 2:  # the short row's step alone
            failed.append(state.jobs[0])
            raise RuntimeError("device error at the read")
        return real(self, state, tokens)

    monkeypatch.setattr(batches.BaseEngine, "_read", read)
    plan = [(0, [5, 6, 7], 30, HOT, 1, None), (1, [9] * 4, 8, NUCLEUS, 2, None), (1, [1, 2], 14, HOT, 3, 2),
            (12, [4, 4], 9, GREEDY, 4, None)]
    jobs = run_rounds(scheduler, plan)
    monkeypatch.undo()
    assert failed == [jobs[1]] and len(jobs[1].out) < 8
    assert jobs[1].failure.status == 500 and "device error" in str(jobs[1].error)
    assert_alone(target, draft, [jobs[0], *jobs[2:]])
    assert not scheduler.running and scheduler.base._flight is None


def test_a_replicas_warm_up_runs_its_steps_pipelined_as_the_replica_will(pairs, monkeypatch):
    """``warm_up(pipeline=...)`` (the app passes the replica's setting): its throwaway batches' steps run pipelined,
    so the costs handed to the replica's scheduler are those of the steps it will run; without it, not (a CPU)."""
    target, draft = pair(pairs, "full")
    flights = in_flight_at(monkeypatch, "settle")
    assert warm_up(target, draft, rows=4, gamma=2, pipeline=True)["rows"] > 0 and any(flights)
    flights.clear()
    assert warm_up(target, draft, rows=4, gamma=2)["rows"] > 0 and not any(flights)


class FakeGPU:
    """A GPU's timing on a fake clock, for a pipelined scheduler on a CPU: a pass's launch takes ``launch`` of the
    host's time, then its kernels run on the device after the work queued before them (a base step ``step``
    seconds, a prefill ``prefill``); a pass's own wait (``PassTime.sync``) waits for all the work queued, the read
    or wait of a step's tokens sent ahead (``Readback``) for that step alone. The scheduler's hook marks each pass."""

    def __init__(self, step: dict[str, float], prefill: float, launch: float = 0.001):
        self.step, self.prefill, self.launch = step, prefill, launch
        self.now = self.free_at = 0.0  # the host's clock; when the work queued so far will have run

    def clock(self) -> float:
        return self.now

    def hook(self, kind, jobs) -> None:
        self.now += self.launch
        # a prefill's rows have no generator yet
        cost = self.prefill if all(j.generator is None for j in jobs) else self.step[kind]
        self.free_at = max(self.now, self.free_at) + cost

    def sync(self) -> None:
        self.now = max(self.now, self.free_at)

    def readback(self, values):
        gpu = self

        class Sent:
            ready_at = gpu.free_at  # the step just queued

            def wait(self):
                gpu.now = max(gpu.now, self.ready_at)

            def tolist(self):
                self.wait()
                return values.tolist()
        return Sent()


def test_measured_costs_of_pipelined_steps_and_prefills_are_their_own_on_a_gpus_clock(pairs, monkeypatch):
    """On a GPU a prefill is queued behind the pipelined step in flight, and its own wait would wait for that step
    too: the prefill would be measured at the step's remaining time plus its own, and the next step (its
    predecessor's tokens ready by then) at next to nothing, which replaces a step's measured cost (a sample under
    half the average); so would a speculative step run after it (its read waits for all the work queued). With a
    fake GPU (base steps of 1.0 s, speculative ones of 2.0 s, prefills of 0.25 s on the device, launches of 1 ms),
    requests arriving while a step is in flight, a speculative one among them: every step cost measured is a step's
    time and every prefill cost a prefill's, and every request gets its solo output. Power: without the waits for
    the step in flight timed apart (a prefill's, a speculative step's), or with a batch's first step (queued behind
    none) measured at its launch, it fails."""
    target, draft = pair(pairs, "full")
    gpu = FakeGPU(step={"base": 1.0, "speculative": 2.0}, prefill=0.25)
    monkeypatch.setattr(batches, "Readback", gpu.readback)
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=1, pipeline=True, clock=gpu.clock,
                          hook=gpu.hook)
    scheduler.pass_time.sync = gpu.sync
    plan = [(0, [5, 6, 7], 24, HOT, 1, None), (3, [9] * 4, 12, NUCLEUS, 2, None), (6, [1, 2], 10, GREEDY, 3, None),
            (7, [4], 9, HOT, 4, None), (9, [3, 3, 3], 12, HOT, 5, 2)]
    jobs = run_rounds(scheduler, plan)
    assert_alone(target, draft, jobs)
    base, spec = scheduler.costs["base"], scheduler.costs["speculative gamma=2"]
    assert base.prefill_passes == 4 and scheduler.pipelining()["followed"] > 0 and spec.prefill_passes == 1
    for costs, step in ((base, 1.0), (spec, 2.0)):
        assert costs.prefills.seconds and all(s == pytest.approx(0.25 + 0.001) for s in costs.prefills.seconds.values())
        assert costs.steps.seconds and all(s == pytest.approx(step, abs=0.01) for s in costs.steps.seconds.values()), \
            (step, costs.steps.seconds)
    assert sorted(base.steps.seconds) == [1, 2, 3, 4]  # every row count of the plan

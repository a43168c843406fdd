"""Continuous batching with compiled passes (``Scheduler(compile=...)``, :mod:`efftx.generation.device_slots`).

Every request must still get exactly the tokens (and acceptance) it gets decoded alone by the library's eager entry
points, whichever passes ran compiled: buckets of rows padded with slow-lane rows and free slots, passes past
``compile_rows`` run eagerly over the same buffers, containment retries. Compiling takes seconds per graph on a
CPU, so the plans here keep to a few buckets (``compile_rows`` 4, gammas 2 and 3).
"""

from __future__ import annotations

import logging

import pytest
import torch

from efftx.generation import compiled, device_slots
from efftx.generation.compiled import CompileUnavailable
from efftx.generation.decode import Slots
from efftx.generation.device_slots import CompiledSlots, bucket
from efftx.serving import batches, continuous
from efftx.serving.continuous import Job, Scheduler

from test_serve_continuous import ADAPTIVE, GREEDY, HOT, MIXED, record_base_steps, assert_alone, lm, run_rounds

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def models():
    return lm(0), lm(1, 1)


@pytest.fixture
def passes(monkeypatch):
    """Counts the passes that ran compiled, per bucket, and the padding rows that were live rows."""
    seen = {"compiled": {}, "live_padding": 0}
    real = device_slots.CompiledSlots.runner

    def runner(self, size):
        out = real(self, size)
        seen["compiled"][size] = seen["compiled"].get(size, 0) + 1
        return out

    real_forward = device_slots._CompiledRows.forward

    def forward(self, tokens):
        n = tokens.shape[0]
        if self._slots.wants(self._start, n):
            seen["live_padding"] += max(0, min(bucket(n), self._slots.n) - n)
        return real_forward(self, tokens)

    monkeypatch.setattr(device_slots.CompiledSlots, "runner", runner)
    monkeypatch.setattr(device_slots._CompiledRows, "forward", forward)
    return seen


def test_the_bucket_of_a_pass_is_its_rows_rounded_up_to_a_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 17)] == [1, 2, 4, 4, 8, 8, 16, 32]


def test_slots_back_at_a_size_pass_the_buffers_their_graphs_were_recorded_over(models):
    """A CUDA graph is recorded over its inputs' addresses (the bucket views of the keys, values and device
    lengths): slots that grow and shrink back (a burst), or new slots of a size that ran before (the replica after
    its warm-up), get that size's pooled cache and its device lengths, so they replay the graphs recorded then;
    slots alive at once never share them. Power: device lengths made anew at every reallocation (before) differ."""
    target, _ = models

    def buffers(slots):
        return slots._lengths.data_ptr(), slots._cache.layers[0].k.data_ptr(), slots.runner(2).cache.lengths.data_ptr()

    first = CompiledSlots(target, rows=2)
    before = buffers(first)
    assert before[0] == before[2]  # the bucket's view of the device lengths
    first._reallocate(8)
    assert buffers(first)[0] != before[0]
    first._reallocate(2)
    assert buffers(first) == before
    other = CompiledSlots(target, rows=2)  # while the first holds its cache: buffers of its own
    others = buffers(other)
    assert not set(others) & set(before)
    first.release()
    other.release()  # the pool keeps one cache a size: the last given back, with its device lengths
    assert buffers(CompiledSlots(target, rows=2)) == others


@pytest.mark.parametrize("policy", ["every_row", "priority_base", "priority_speculative"])
def test_compiled_passes_give_every_request_its_solo_output(models, passes, policy):
    """The mixed plan (base and speculative rows, gammas 2 and 3, every sampling, arrivals over ten rounds) with
    compiled passes up to 4 rows and eager ones beyond, on the same buffers. With priority the fast lane (3 rows)
    runs in a bucket of 4 whose last row is a live slow-lane row (in base decoding, and in speculative decoding's
    draft and verify passes)."""
    target, draft = models
    knobs = {"short_tokens": 0} if policy == "every_row" else {"short_tokens": 12, "fast_rows": 3, "long_every": 2,
                                                                  "short_slowdown": 0}
    scheduler = Scheduler(target, draft, max_rows=8, compile="on", compile_rows=4, **knobs)
    assert isinstance(scheduler.base.slots[0], CompiledSlots)
    if policy == "every_row":  # more base rows than compile_rows at once
        plan = MIXED + [(1, [3, 3], 16, HOT, 21, None), (1, [4], 16, GREEDY, 22, None), (2, [5, 6], 14, HOT, 23, None)]
    else:  # four long rows of one mode (three in the fast lane, one in the slow one), then short ones arrive
        gamma = 2 if policy == "priority_speculative" else None
        plan = [(0, [5, 6, 7], 30, HOT, 31, gamma), (0, [9] * 5, 30, GREEDY, 32, gamma), (0, [1, 2], 30, HOT, 33, gamma),
                (0, [4, 4], 30, HOT, 34, gamma), (3, [7], 6, HOT, 35, gamma), (4, [8, 9], 8, HOT, 36, gamma)]
    jobs = run_rounds(scheduler, plan)
    assert_alone(target, draft, jobs)
    assert set(passes["compiled"]) <= {1, 2, 4} and passes["compiled"].get(4)  # 5..8 rows: eager
    if policy == "every_row":
        assert max(j.batch_size for j in jobs) > 4  # some passes were past compile_rows
    else:
        assert passes["live_padding"] > 0


def test_short_prompts_prefill_compiled_and_every_request_gets_its_solo_output(models, monkeypatch):
    """Prefills of up to PREFILL_ROWS prompts of up to PREFILL_TOKENS tokens run compiled, rows and tokens padded
    to buckets (the speculative engines' prompt prefixes in both models; an empty prefix too), over a buffer per
    shape reused by the next prefill of that shape; a longer prompt, or a burst of three, prefills eagerly; every
    request gets its solo tokens and acceptance."""
    target, draft = models
    shapes, eager, users = [], [], []
    real_runner, real_eager = CompiledSlots._prefill_runner, Slots.prefill

    def runner(self, size, length):
        shapes.append((self.model is target, size, length))
        users.append((self, size, length))
        return real_runner(self, size, length)

    def eager_prefill(self, prompts, capacity, compiled=True):
        eager.append((len(prompts), max(map(len, prompts))))
        return real_eager(self, prompts, capacity, compiled)

    monkeypatch.setattr(CompiledSlots, "_prefill_runner", runner)
    monkeypatch.setattr(Slots, "prefill", eager_prefill)
    long = list(range(1, device_slots.PREFILL_TOKENS + 6))
    plan = [(0, [5, 6, 7], 9, HOT, 1, None), (0, [9] * 20, 8, GREEDY, 2, None), (0, [1, 2], 9, HOT, 3, 3),
            (1, [42], 7, HOT, 4, 3), (1, [3] * 17, 6, HOT, 5, 3), (2, long, 5, HOT, 6, None),
            (3, [8, 8, 1], 6, GREEDY, 7, None), (5, [2, 7], 5, HOT, 8, None)]
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, prefill_rows=2, compile="on")
    jobs = run_rounds(scheduler, plan)
    assert_alone(target, draft, jobs)
    # base: [5, 6, 7] + 20 tokens (2 rows, 32 tokens), [8, 8, 1] and [2, 7] (1 row, 16); speculative prefixes:
    # [1] and [] (2 rows, 16), then 16 tokens (1 row, 16), in both models
    assert (True, 2, 32) in shapes and (True, 1, 16) in shapes and (False, 1, 16) in shapes, shapes
    # past PREFILL_TOKENS, or more than PREFILL_ROWS prompts at once: eager; no other prompt prefilled eagerly,
    # though base decoding's (1, 16) buffer served two prefills (its lengths start from 0 each time)
    assert [(n, t) for n, t in eager if t] == [(1, len(long))], eager
    assert users.count((scheduler.base.slots[0], 1, 16)) == 2, users
    rows, logits = scheduler.base.slots[0].prefill([[1, 1], [2, 2, 2], [3]], 3)
    assert eager[-1] == (3, 3) and rows.lengths == [2, 3, 1] and logits.shape[0] == 3


def test_a_failed_batch_prefill_retries_its_rows_eagerly(models, monkeypatch):
    """A batch's prefill raises (once): its rows are prefilled one by one before any joins its slot, eagerly (one
    compiled buffer per shape would hold only the last of them), and each gets its solo tokens."""
    target, draft = models
    failed, eager = [], []
    real_eager = Slots.prefill

    def eager_prefill(self, prompts, capacity, compiled=True):
        eager.append((len(prompts), compiled))
        return real_eager(self, prompts, capacity, compiled)

    def hook(kind, jobs):
        if len(jobs) == 2 and not failed and not any(j.out for j in jobs):
            failed.append(kind)
            raise RuntimeError("injected prefill fault")

    monkeypatch.setattr(Slots, "prefill", eager_prefill)
    scheduler = Scheduler(target, draft, max_rows=4, short_tokens=0, prefill_rows=2, compile="on", hook=hook)
    jobs = run_rounds(scheduler, [(0, [5, 6, 7], 6, HOT, 1, None), (0, [9, 1, 4, 4], 6, HOT, 2, None)])
    assert_alone(target, draft, jobs)
    assert failed == ["base"] and eager == [(1, False), (1, False)]


def test_the_compiled_warm_up_compiles_every_compiled_prefill_shape(models, monkeypatch):
    """Base decoding's target and speculative decoding's target and draft: 1 and 2 prompts of 16 and of 32 tokens."""
    target, draft = models
    shapes: dict[bool, set] = {}
    real = CompiledSlots._prefill_runner

    def runner(self, size, length):
        shapes.setdefault((self.model is target), set()).add((size, length))
        return real(self, size, length)

    monkeypatch.setattr(CompiledSlots, "_prefill_runner", runner)
    continuous.warm_up(target, draft, rows=2, gamma=3, compile="on", compile_rows=2)
    assert shapes == {True: {(1, 16), (2, 16), (1, 32), (2, 32)}, False: {(1, 16), (2, 16), (1, 32), (2, 32)}}


def test_compiled_prefills_outside_no_grad_leave_no_autograd_state(models):
    """A caller in grad mode (bench/serve_load.py's cost runs): a compiled prefill must not record an autograd graph
    in its buffers, which the slots then copy (a slots cache that requires grad makes dynamo refuse the compiled
    views of it that were made under no_grad: batches then fall back to their rows one by one)."""
    target, draft = models
    scheduler = Scheduler(target, draft, max_rows=4, short_tokens=0, prefill_rows=0, compile="on")
    plan = [(0, [5, 6, 7, i], 5, HOT, i, 2 if i % 2 else None) for i in range(4)]
    jobs = [scheduler.submit(Job(*p[1:], tag=p)) for p in plan]
    assert torch.is_grad_enabled()
    scheduler.run_once()  # the prefills (compiled) and a first step
    engines = [scheduler.base, *scheduler.spec.values()]
    assert len(engines) == 2 and all(len(e) == 2 for e in engines)
    assert not any(layer.k.requires_grad or layer.v.requires_grad
                   for e in engines for s in e.slots for layer in s._cache.layers)
    scheduler.drain()
    assert_alone(target, draft, jobs)


def test_adaptive_rows_verify_in_one_compiled_shape_and_get_their_solo_output(models, monkeypatch):
    """Rows with an adaptive gamma draft 1..cap tokens a step: a compiled verify pass feeds cap + 1 tokens whatever
    the step's longest draft (padding after the drafts, rewound), so an engine has one verify graph per bucket, not
    one per draft length; tokens, acceptance and per-step draft lengths stay the solo ones."""
    target, draft = models
    shapes: dict[int, set[int]] = {}  # target passes: tokens per row
    real = device_slots._CompiledRows.forward

    def forward(self, tokens):
        if self.model is target and self.compiles(tokens.shape[0]):
            shapes.setdefault(tokens.shape[0], set()).add(tokens.shape[1])
        return real(self, tokens)

    monkeypatch.setattr(device_slots._CompiledRows, "forward", forward)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, compile="on", compile_rows=2)
    jobs = run_rounds(scheduler, ADAPTIVE)
    assert_alone(target, draft, jobs)
    assert any(len(set(j.stats.drafted)) > 1 for j in jobs)  # the draft lengths moved
    caps = {p[6] + 1 for p in ADAPTIVE if p[6]} | {p[5] + 1 for p in ADAPTIVE if not p[6]}
    assert shapes and all(ts <= caps for ts in shapes.values()), shapes  # per engine its cap + 1 only


def test_a_compiled_warm_up_runs_adaptive_requests_through_their_verify_shape(models, monkeypatch):
    target, draft = models
    seen = []
    real = device_slots._CompiledRows.forward

    def forward(self, tokens):
        if self.model is target:
            seen.append(tokens.shape[1])
        return real(self, tokens)

    monkeypatch.setattr(device_slots._CompiledRows, "forward", forward)
    out = continuous.warm_up(target, draft, rows=2, gamma=3, max_gamma=5, compile="on", compile_rows=2)
    assert out["rows"] == 3 * 2 * (2 + 1)  # base, gamma 3, gamma 3 adaptive up to 5; prompts to 16 and of 32
    assert {1, 4, 6} <= set(seen)  # base steps, gamma 3's verify, the adaptive verify (cap + 1)


def test_a_failing_row_fails_alone_in_compiled_passes(models, monkeypatch):
    """A fault raised before the passes (the step hook) and one raised after a compiled pass wrote the caches (in
    base decoding's draw): the culprits fail alone (their rows retried one by one: slot 0 compiled, the others
    eagerly), the other rows get their solo output."""
    target, draft = models
    culprits: dict[str, Job] = {}

    def hook(kind, jobs):
        if any(j.tag[0] == "hook" for j in jobs):
            raise RuntimeError("injected fault")

    real_draw = batches.draw

    def faulty_draw(probs, gens):
        late = culprits.get("draw")
        if late is not None and late.generator in gens and late.steps == 3:
            raise RuntimeError("late fault in base decoding")
        return real_draw(probs, gens)

    monkeypatch.setattr(batches, "draw", faulty_draw)
    scheduler = Scheduler(target, draft, max_rows=4, short_tokens=0, compile="on", hook=hook)
    valid = [p for p in MIXED if p[0] <= 2]
    bad = [(1, [4, 5], 9, HOT, 1, 3, "hook"), (1, [6, 6, 6], 12, HOT, 11, None, "draw")]

    def make(p):
        if len(p) == 7:
            culprits[p[6]] = Job(p[1], p[2], p[3], p[4], p[5], tag=(p[6],))
            return culprits[p[6]]
        return Job(p[1], p[2], p[3], p[4], p[5], tag=p)

    jobs = run_rounds(scheduler, valid + bad, make)
    assert culprits["hook"].error is not None and culprits["draw"].error is not None
    assert culprits["draw"].steps == 3
    monkeypatch.setattr(batches, "draw", real_draw)
    assert_alone(target, draft, [j for j in jobs if len(j.tag) != 1])


def test_compile_on_refuses_a_model_it_cannot_compile_and_auto_decodes_it_eagerly(models, caplog):
    target, draft = models
    performer = lm(2, 1, "performer")
    with pytest.raises(CompileUnavailable, match="attention.kind='performer'"):
        Scheduler(performer, compile="on")
    with pytest.raises(CompileUnavailable, match="the draft.*performer"):  # at once, not at the first request
        Scheduler(target, performer, compile="on")
    with caplog.at_level(logging.INFO, logger="efftx.generation.compiled"):
        scheduler = Scheduler(performer, compile="auto")
    assert type(scheduler.base.slots[0]) is Slots and "performer" in caplog.text
    with pytest.raises(ValueError, match="compile_rows"):
        Scheduler(target, compile="on", compile_rows=0)
    with pytest.raises(Exception, match="compile='fast'"):
        Scheduler(target, compile="fast")


def test_auto_decodes_eagerly_over_the_same_buffers_when_compiling_fails(models, monkeypatch, caplog):
    """The first pass's compile fails: that pass runs eagerly over the bucket's view, every later one through the
    eager path of :class:`~efftx.generation.decode.Slots` (its attention kernel), the tokens unchanged."""
    target, draft = models
    monkeypatch.setattr(compiled, "_BROKEN", {})

    tries = []

    def broken(fn, device_type):
        tries.append(fn)
        raise RuntimeError("no compiler today")

    monkeypatch.setattr(compiled, "compiled_function", broken)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, compile="auto")
    with caplog.at_level(logging.WARNING, logger="efftx.generation.compiled"):
        jobs = run_rounds(scheduler, MIXED[:6])
    assert_alone(target, draft, jobs)
    assert "no compiler today" in caplog.text and compiled._BROKEN
    assert len(tries) == 1  # after the first failure every pass takes the eager path, no bucket tries again


# ---------------------------------------------------------------------------------------------- over HTTP
def test_a_compiled_app_answers_as_the_library_decodes(ray_cluster, debug_exports):
    """``compile=on``: the replica compiles as it warms up, /models/info says so, and requests of both modes
    (plain, streamed and concurrent: passes of one to three rows, compiled up to ``compile_rows`` 1, the others
    eager over the same slots; the default gamma; up to four steps a round, ``steps_per_round=4``) get the
    library's eager tokens and acceptance. One compiled row
    keeps the replica's graphs few (each takes seconds to compile on a CPU); the tests above run buckets of more
    rows in-process."""
    import json

    import requests
    from ray import serve

    from efftx.serving.text import build
    from netutil import concurrent_requests_decode_as_the_library, free_port

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build({"target": debug_exports["target"], "draft": debug_exports["draft"], "name": "tiny",
                         "compile": "on", "compile_rows": 1, "warm_up_rows": 1, "steps_per_round": "4"}),
                  name="compiled", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        info = requests.get(f"{url}/models/info", timeout=30).json()["batching"]
        # base, speculative (gamma 5), adaptive speculative (cap: the limits' max_gamma) and coupled speculative: a
        # row each with a prompt of up to 16 tokens and one with 32 (the compiled prefills' shapes)
        assert (info["compile"], info["compile_rows"], info["warm_up_rows"]) == ("on", 1, 4 * 2 * 1)
        assert info["steps_per_round"] == 4  # rows take up to four steps a round while nothing waits
        # gamma 5, as the warm-up: no new graph
        bodies, answers = concurrent_requests_decode_as_the_library(url, debug_exports, 12)
        with requests.post(f"{url}/generate/stream", json={**bodies[0], "mode": "speculative"}, stream=True,
                           timeout=120) as r:
            blocks = [b for b in "\n".join(r.iter_lines(decode_unicode=True)).split("\n\n") if b.strip()]
        done = json.loads(blocks[-1].split("data: ", 1)[1])
        assert done["text"] == answers[0].json()["results"]["speculative"]["text"]
        with requests.post(f"{url}/generate/stream", json={**bodies[1], "mode": "base"}, stream=True,
                           timeout=120) as r:  # alone: several steps a round, each token still a step event
            blocks = [b for b in "\n".join(r.iter_lines(decode_unicode=True)).split("\n\n") if b.strip()]
        done = json.loads(blocks[-1].split("data: ", 1)[1])
        assert done["text"] == answers[1].json()["results"]["base"]["text"] and done["steps"] == 12
        assert sum(b.startswith("event: step") for b in blocks) == 12
    finally:
        serve.shutdown()


@pytest.mark.parametrize("pipeline", [False, True])
def test_several_steps_a_round_run_compiled_and_give_every_request_its_solo_output(models, passes, monkeypatch,
                                                                                   pipeline):
    """``steps_per_round=4`` with compiled passes: a base batch's steps back to back through the compiled graphs
    (each step's tokens fed to the next on the device), and speculative batches' steps (each fed the one before's
    pending tokens and kept drafts) beside it; every request gets its solo output. Pipelined too: a round's base
    steps fed the tokens of the round before on the device, read after them."""
    target, draft = models
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, compile="on", compile_rows=4, steps_per_round=4,
                          pipeline=pipeline)
    seen = record_base_steps(monkeypatch)
    seen_spec = record_base_steps(monkeypatch, engine=batches.SpeculativeEngine)
    jobs = run_rounds(scheduler, MIXED)
    monkeypatch.undo()
    assert_alone(target, draft, jobs)
    assert max(steps for steps, _, _ in seen) == max(steps for steps, _, _ in seen_spec) == 4 and passes["compiled"]


def test_chunked_prefills_join_compiled_slots_with_their_eager_tokens(models):
    """``prefill_chunk=8`` with compiled passes: long prompts' chunks go into eager rows of their own and their last
    chunk joins the compiled slots; every request gets the tokens (and acceptance) it gets on an eager scheduler
    with the same chunks."""
    target, draft = models
    plan = [(0, [5, 6, 7], 8, HOT, 21, None), (0, [(3 * i) % 40 + 1 for i in range(27)], 6, HOT, 22, None),
            (1, [(5 * i) % 30 + 2 for i in range(21)], 6, HOT, 23, 3), (1, [1, 2], 7, HOT, 24, 3)]
    jobs = run_rounds(Scheduler(target, draft, max_rows=4, short_tokens=0, prefill_chunk=8, compile="on"), plan)
    eager = run_rounds(Scheduler(target, draft, max_rows=4, short_tokens=0, prefill_chunk=8), plan)
    assert [j.out for j in jobs] == [j.out for j in eager]
    assert [j.stats.accepted for j in jobs if j.stats] == [j.stats.accepted for j in eager if j.stats]
    assert all(j.failure is None for j in jobs)


@pytest.mark.parametrize("seed, pipeline", [(1, False), (8, True)])
def test_random_load_with_compiled_passes_gets_every_request_its_solo_output(models, seed, pipeline):
    """tests/test_serve_random.py's load and checks with compiled passes, under a cache budget of one speculative
    row (these seeds' draws); seed 8's base steps pipelined. Power: both fail with device_slots.py as it was
    (61798ab; run and seen): drained compiled slots kept a bucket of one slot, and idle replicas answered speculative
    requests with a 503."""
    from test_serve_random import soak

    target, draft = models
    settings, _ = soak(target, draft, seed, compile="on", pipeline=pipeline)
    assert settings["cache_budget"] is not None


def test_coupled_rows_always_draft_under_compiled_passes_and_get_their_base_tokens(models, monkeypatch):
    """Coupled requests with compiled passes: every step drafts (a compiled draft catches up one kept token a pass,
    never the several a step without drafts would leave), the draft's compiled passes feed at most two tokens a row,
    and every row's tokens are base decoding's with its seed."""
    from test_serve_coupled import PLAN, base_tokens, coupled_job

    target, draft = models
    widths = set()  # the draft's compiled passes: tokens per row
    real = device_slots._CompiledRows.forward

    def forward(self, tokens):
        if self.model is draft and self.compiles(tokens.shape[0]):
            widths.add(tokens.shape[1])
        return real(self, tokens)

    monkeypatch.setattr(device_slots._CompiledRows, "forward", forward)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, compile="on", compile_rows=2)
    jobs = run_rounds(scheduler, PLAN, coupled_job)
    for job in jobs:
        assert job.failure is None and job.out == base_tokens(target, job.tag), job.tag
        assert 0 not in job.stats.drafted, job.tag
    assert widths and max(widths) <= 2, widths

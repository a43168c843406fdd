"""Continuous batching at library level (fast, no Ray): :class:`efftx.serving.continuous.Scheduler`.

Requests arrive at different decoding steps, with different prompt and output lengths, seeds, sampling settings,
modes and ``gamma``; each must get exactly the tokens (and, in speculative decoding, the acceptance and pass
counts) it gets decoded alone by the library's own entry points (``generate`` / ``speculative_generate``). Also:
rows leave the moment they are done and stream their tokens step by step, a failing row fails alone (even when
the failure comes after the batched pass has written the caches), and non-ragged backends fall back to row by
row.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import torch

from efftx import recipes
from efftx.generation import decode
from efftx.generation.decode import Rows, generate, splittable
from efftx.generation.speculative import speculative_generate
from efftx.models import build as build_model
from efftx.models.lm import LM
from efftx.serving import batches, continuous
from efftx.serving.continuous import Job, Sampling, Scheduler, StepCosts, warm_up
from efftx.generation.cost_table import CostTable

from cores import cores_used, needs_two_cores

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/conftest.py

CONTRACT = {  # small blocks / buckets, so that the short sequences cross several (as tests/test_speculative.py)
    "sinkhorn": {"attention.sinkhorn.bucket_size": 8, "attention.sinkhorn.n_local_attn_heads": 2},
    "performer": {"attention.performer.nb_features": 32, "attention.performer.chunk_size": 8},
    "nsa": {"attention.nsa.compress_block_size": 4, "attention.nsa.compress_stride": 2,
            "attention.nsa.selection_block_size": 4, "attention.nsa.num_selected_blocks": 2,
            "attention.nsa.sliding_window_size": 6, "attention.nsa.compress_mlp_mult": 0.5},
}


def lm(seed: int, depth: int = 2, kind: str = "full") -> LM:
    cfg = recipes.get("lm_debug").override({"model.depth": depth, "attention.kind": kind, **CONTRACT.get(kind, {})})
    torch.manual_seed(seed)
    model = build_model(cfg).eval()
    with torch.no_grad():  # sharper weights: each token's distribution depends on its context, so a row decoded
        for param in model.parameters():  # over a wrong cache (another row's, a stale one) gets other tokens
            param.mul_(SHARPEN)
    return model


@pytest.fixture(scope="module")
def pairs():
    return {}


def pair(pairs, kind: str):
    if kind not in pairs:
        pairs[kind] = (lm(0, 2, kind), lm(1, 1, kind))
    return pairs[kind]


GREEDY, HOT, NUCLEUS = Sampling(0.0), Sampling(1.0, 20, 1.0), Sampling(0.8, 0, 0.9)
SHARPEN = 5  # weights scaled up: the tiny models' predictions then depend on their context (see its test)

# (arrival round, prompt, max_new_tokens, sampling, seed, gamma or None for base decoding)
MIXED = [
    (0, [5, 6, 7], 14, HOT, 1, None),
    (0, [9] * 12, 20, GREEDY, 2, None),
    (0, [1, 2], 9, NUCLEUS, 3, 3),
    (1, [42], 15, HOT, 4, 3),
    (2, [3, 1, 4, 1, 5], 12, HOT, 5, 2),
    (2, [8, 8], 6, GREEDY, 6, 3),
    (4, [7, 7, 7, 7], 25, NUCLEUS, 7, None),
    (5, [2], 1, HOT, 8, None),
    (5, [2, 4, 6, 8, 10, 12, 14], 18, HOT, 9, 3),
    (9, [11, 13], 5, HOT, 10, None),
]


def run_rounds(scheduler: Scheduler, plan, make_job=None) -> list[Job]:
    """Submit each planned request at its round; run rounds until everything is done."""
    make_job = make_job or (lambda p: Job(p[1], p[2], p[3], p[4], p[5], max_gamma=p[6] if len(p) > 6 else None,
                                          tag=p))
    jobs, r = [], 0
    last = max(p[0] for p in plan)
    with torch.no_grad():
        while r <= last or scheduler.running or scheduler._queue:
            jobs += [scheduler.submit(make_job(p)) for p in plan if p[0] == r]
            scheduler.run_once()
            r += 1
            assert r < 1000
    return jobs


def solo(target, draft, p):
    """(tokens, stats or None) of one planned request decoded alone by the library."""
    _, prompt, n, s, seed, gamma = p[:6]
    sampling = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "seed": seed}
    if gamma is None:
        return generate(target, [prompt], n, **sampling)[0].tolist(), None
    adaptive = {"adaptive_gamma": True, "max_gamma": p[6]} if len(p) > 6 and p[6] is not None else {}
    out, stats = speculative_generate(target, draft, [prompt], n, gamma=gamma, **sampling, **adaptive)
    return out[0], stats


def assert_alone(target, draft, jobs):
    for job in jobs:
        assert job.done and job.failure is None, (job.tag, job.failure)
        tokens, stats = solo(target, draft, job.tag)
        assert job.out == tokens, job.tag
        if stats is not None:  # the same acceptance, step for step, and the passes it would take alone
            assert job.stats.accepted == stats.accepted, job.tag
            assert job.stats.drafted == stats.drafted, job.tag  # each step's own draft length
            assert job.stats.histogram == stats.histogram
            assert (job.stats.target_calls, job.stats.draft_calls) == (stats.target_calls, stats.draft_calls)


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn", "nsa"])
def test_requests_joining_at_different_steps_get_their_solo_output(pairs, kind):
    target, draft = pair(pairs, kind)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0)  # every row every round (priority: below)
    jobs = run_rounds(scheduler, MIXED)
    assert_alone(target, draft, jobs)
    batched = scheduler.base.batched
    assert batched == splittable(target)  # non-splittable caches: row by row
    # rows really shared steps: more than one row in a running batch, and fewer steps than rows decoded alone
    assert max(j.batch_size for j in jobs if j.gamma is None) >= 3
    assert max(j.batch_size for j in jobs if j.gamma == 3) >= 2


CHUNKED = [  # long prompts (prefill_chunk=8: four or five chunks) beside running rows of short prompts
    (0, [5, 6, 7], 18, HOT, 11, None),
    (0, [1, 2], 16, NUCLEUS, 12, 3),
    (1, [(7 * i) % 50 + 1 for i in range(33)], 6, GREEDY, 13, None),
    (1, [(5 * i) % 40 + 2 for i in range(30)], 7, GREEDY, 14, 3),
    (2, [(3 * i) % 60 + 1 for i in range(37)], 9, HOT, 15, None),
    (3, [(11 * i) % 70 + 3 for i in range(26)], 8, NUCLEUS, 16, 2),
    (3, [4, 4, 4], 5, HOT, 17, None),
]


@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn", "nsa"])
def test_long_prompts_prefill_in_chunks_beside_the_running_rows_and_decode_as_alone(pairs, kind, monkeypatch):
    """With ``prefill_chunk=8``, prompts of 26-37 tokens are prefilled eight tokens a round (their last chunk joins
    the batch) while the rows already running step every round: no round feeds more than eight tokens of one
    prompt, and each long prompt takes as many rounds as it has chunks. Every request gets exactly its tokens (and
    acceptance) alone with the same chunks, and the greedy ones the library's unchunked tokens. Power: without
    chunks a round feeds a whole prompt; a chunk fed twice or skipped changes the greedy tokens."""
    target, draft = pair(pairs, kind)
    fed: dict[Rows, list[tuple[int, int]]] = {}  # rows (kept alive: no id reused) -> [(round, tokens)]
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, prefill_rows=0, prefill_chunk=8)
    real = Rows.prefill

    def prefill(self, rows):
        if len(rows) == 1:
            fed.setdefault(self, []).append((scheduler.rounds, len(rows[0])))
        return real(self, rows)

    monkeypatch.setattr(Rows, "prefill", prefill)
    jobs = run_rounds(scheduler, CHUNKED)
    monkeypatch.undo()
    for job in jobs:
        if job.feed_tokens > 8:  # chunked: one piece a round, at most eight tokens each, then its last
            pieces = [p for p in fed.values() if sum(n for _, n in p) == job.feed_tokens and len(p) > 1]
            assert pieces, job.tag
            assert all(n <= 8 for p in pieces for _, n in p)
            assert any(len({r for r, _ in p}) == len(p) == -(-job.feed_tokens // 8) for p in pieces), job.tag
    assert max(j.batch_size for j in jobs) >= 3
    for job in jobs:  # alone, with the same chunks
        alone = Scheduler(target, draft, short_tokens=0, prefill_chunk=8)
        (solo_job,) = run_rounds(alone, [job.tag])
        assert job.failure is None and job.out == solo_job.out, job.tag
        if job.stats is not None:
            assert (job.stats.accepted, job.stats.drafted) == (solo_job.stats.accepted, solo_job.stats.drafted)
    assert_alone(target, draft, [j for j in jobs if j.tag[3] is GREEDY])  # the library's whole-prompt prefill
    whole = Scheduler(target, draft, max_rows=8, short_tokens=0, prefill_rows=0, prefill_chunk=0)
    fed.clear()
    monkeypatch.setattr(Rows, "prefill", prefill)
    run_rounds(whole, CHUNKED)
    assert max(n for p in fed.values() for _, n in p) >= 30  # the control: whole prompts in one round


def test_a_chunked_prefill_checks_the_request_first_and_a_failing_chunk_fails_only_its_request(pairs):
    """A long prompt that cannot fit the context fails at its first chunk with the error it gets unchunked (a
    422), a chunk that raises fails its request alone, and the other rows decode as alone."""
    target, draft = pair(pairs, "full")

    def hook(kind, jobs):
        if any(j.tag == "poisoned" for j in jobs) and scheduler.rounds == 3:
            raise RuntimeError("poisoned chunk")

    scheduler = Scheduler(target, draft, short_tokens=0, prefill_chunk=8, hook=hook)
    too_long = scheduler.submit(Job([3] * 120, 20, HOT, 1))
    poisoned = scheduler.submit(Job([4] * 40, 5, HOT, 2, tag="poisoned"))
    ok = [(0, [5, 6, 7], 12, HOT, 3, None), (0, [(2 * i) % 30 + 1 for i in range(20)], 6, HOT, 4, 2)]
    jobs = run_rounds(scheduler, ok)
    assert too_long.failure.status == 422 and "exceeds the model's max_seq_len" in str(too_long.failure.detail)
    assert poisoned.failure.status == 500 and poisoned.partial is None
    for job in jobs:
        (solo_job,) = run_rounds(Scheduler(target, draft, short_tokens=0, prefill_chunk=8), [job.tag])
        assert job.out == solo_job.out


def record_base_steps(monkeypatch, scheduler=None, engine=batches.BaseEngine) -> list[tuple[int, int, list[int]]]:
    """Every base (or ``engine``) compute's (steps, queued requests, the rows' tokens left), as it starts."""
    seen: list[tuple[int, int, list[int]]] = []
    real = engine.compute

    def compute(self, state):
        queued = len(scheduler._queue) if scheduler is not None else 0
        seen.append((state.steps, queued, [j.max_new - len(j.out) for j in state.jobs]))
        return real(self, state)

    monkeypatch.setattr(engine, "compute", compute)
    return seen


def record_computes(monkeypatch, engine, arrive=None) -> list[tuple[int, int]]:
    """Every ``engine`` compute's steps: (planned, run); ``arrive()`` is called as the second compute starts."""
    ran: list[tuple[int, int]] = []
    real = engine.compute

    def compute(self, state):
        planned = state.steps
        if arrive is not None and len(ran) == 1:
            arrive()
        out = real(self, state)
        ran.append((planned, state.steps))
        return out

    monkeypatch.setattr(engine, "compute", compute)
    return ran


SPECULATIVE = [  # speculative rows only, fixed and adaptive gammas, arriving at different rounds
    (0, [5, 6, 7], 30, HOT, 1, 3),
    (0, [9] * 12, 26, GREEDY, 2, 3),
    (1, [1, 2], 21, NUCLEUS, 3, 3),
    (2, [42], 17, HOT, 4, 2, 4),
    (2, [3, 1, 4, 1, 5], 25, HOT, 5, 2, 4),
    (6, [8, 8], 9, GREEDY, 6, 3),
]


@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn", "nsa", "full-self"])
def test_speculative_rows_taking_several_steps_a_round_get_their_solo_output(pairs, kind, monkeypatch):
    """``steps_per_round=4`` for speculative batches: up to four steps in one compute, each reading its acceptance
    and feeding the next its pending tokens, drafts per row (adaptive gammas) and kept drafts; the compute stops
    after the step in which a row got its last token. Every request gets its solo tokens, acceptance and passes.
    ``full-self``: the target drafts for itself, so every row keeps every draft and feeds it in the next step."""
    target, draft = pair(pairs, kind.removesuffix("-self"))
    if kind.endswith("-self"):
        draft = target
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, steps_per_round=4)
    ran = record_computes(monkeypatch, batches.SpeculativeEngine)
    jobs = run_rounds(scheduler, SPECULATIVE)
    monkeypatch.undo()
    assert_alone(target, draft, jobs)
    assert max(r for _, r in ran) == 4  # several steps at once really ran
    assert any(r < p for p, r in ran)  # ... and stopped early where a row got its last token
    assert scheduler.steps == sum(r for _, r in ran) > scheduler.rounds


@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn", "nsa"])
def test_base_rows_taking_several_steps_a_round_get_their_solo_output(pairs, kind, monkeypatch):
    """``steps_per_round=4``: a base batch with nothing queued runs up to four steps in one compute, each feeding the
    last one's tokens on the device (the host reads them once). Rows joining at different rounds (speculative ones
    beside them, one step a round), every backend: each request gets exactly its solo tokens, and no row ever
    computes past its own tokens."""
    target, draft = pair(pairs, kind)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, steps_per_round=4)
    seen = record_base_steps(monkeypatch)
    jobs = run_rounds(scheduler, MIXED)
    monkeypatch.undo()
    assert_alone(target, draft, jobs)
    assert max(steps for steps, _, _ in seen) == 4  # several steps at once really ran
    assert any(steps > 1 and len(left) >= 2 for steps, _, left in seen)  # with several rows
    assert all(steps <= min(left) for steps, _, left in seen)
    assert all(job.steps == len(job.out) for job in jobs if job.gamma is None)  # every token a step of its own
    assert scheduler.steps > scheduler.rounds  # counted as steps, not rounds


def test_several_steps_a_round_only_while_nothing_waits(pairs, monkeypatch):
    """While requests wait in the queue (one row at a time here), the running batch takes one step a round, so
    an arrival is admitted as soon as it would be without ``steps_per_round``; once the queue is empty, several."""
    target, draft = pair(pairs, "full")
    scheduler = Scheduler(target, draft, max_rows=1, short_tokens=0, steps_per_round=3)
    seen = record_base_steps(monkeypatch, scheduler)
    plan = [(0, [3, 4], 7, HOT, 1, None), (0, [5], 9, GREEDY, 2, None), (0, [6, 6], 8, NUCLEUS, 3, None)]
    jobs = run_rounds(scheduler, plan)
    monkeypatch.undo()
    assert_alone(target, draft, jobs)
    assert all(steps == 1 for steps, queued, _ in seen if queued)
    assert max(steps for steps, queued, _ in seen if not queued) == 3
    with pytest.raises(ValueError, match="steps_per_round must be an integer >= 1"):
        Scheduler(target, draft, steps_per_round=0)
    with pytest.raises(ValueError, match="exceed what the base rows allow"):  # never past a row's tokens
        engine = batches.BaseEngine(target)
        engine.admit([Job([1, 2], 2, GREEDY)])
        engine.step("fast", 3)


def test_an_arrival_ends_a_rounds_several_steps_after_the_one_running(pairs, monkeypatch):
    """A request submitted while a base batch is about to run four steps (planned with nothing queued): the batch
    stops after its first step, the arrival joins in the next round, and every request gets its solo tokens; the
    scheduler counts the steps that ran."""
    target, draft = pair(pairs, "full")
    late = Job([7, 8], 6, HOT, 5, tag=(0, [7, 8], 6, HOT, 5, None))
    ran = record_computes(monkeypatch, batches.BaseEngine, lambda: scheduler.submit(late))  # each compute's steps
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, steps_per_round=4)
    plan = [(0, [5, 6, 7], 20, HOT, 1, None), (0, [9] * 4, 18, NUCLEUS, 2, None)]
    jobs = run_rounds(scheduler, plan)
    monkeypatch.undo()
    assert ran[0] == (4, 4) and ran[1] == (4, 1)  # the arrival stopped the second compute after one step
    assert late.done and late.batch_size == 3  # it shared steps with both
    assert_alone(target, draft, [*jobs, late])
    assert scheduler.steps == sum(r for _, r in ran)


def test_a_fault_inside_several_steps_rewinds_all_of_them(pairs, monkeypatch):
    """A fault raised at the second of four steps of one compute, after the first wrote the caches and drew from
    every stream: the caches and streams are rewound to before the first, the rows run alone (each its four
    steps), only the culprit fails, and the others keep their solo tokens."""
    target, draft = pair(pairs, "full")
    real_draw = batches.draw
    culprit: list[Job] = []

    def faulty_draw(probs, gens, **kw):
        # the culprit's seventh draw (its stream's count: the prefill's, four of its first compute, one of its
        # second): the second step of a compute of four, in the batch and again alone
        if culprit and culprit[0].generator in gens and culprit[0].generator.get_state() == 6:
            raise RuntimeError("late fault inside several steps")
        return real_draw(probs, gens, **kw)

    monkeypatch.setattr(batches, "draw", faulty_draw)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, steps_per_round=4)
    seen = record_base_steps(monkeypatch)
    valid = [(0, [5, 6, 7], 14, HOT, 1, None), (0, [9] * 5, 11, NUCLEUS, 2, None), (0, [4], 9, GREEDY, 3, None)]

    def make(p):
        job = Job(p[1], p[2], p[3], p[4], p[5], tag=p)
        if p[4] == 9:
            culprit.append(job)
        return job

    jobs = run_rounds(scheduler, [*valid, (0, [6, 6, 6], 12, HOT, 9, None)], make)
    monkeypatch.undo()
    assert culprit[0].failure.status == 500 and "late fault" in str(culprit[0].error)
    assert len(culprit[0].out) == 5  # its prefill's token and the four steps of its first compute
    assert max(steps for steps, _, _ in seen) == 4
    assert_alone(target, draft, [j for j in jobs if j is not culprit[0]])


@pytest.mark.parametrize("drafter", ["draft", "target"])
def test_an_arrival_or_a_fault_inside_a_speculative_batchs_several_steps(pairs, drafter, monkeypatch):
    """Speculative batches with ``steps_per_round=4``: a request submitted as the second compute starts stops it
    after its first step (the arrival joins next round, and shares steps with the others); a fault at the second
    step of the third compute, after the first step wrote the caches and drew from every stream, rewinds the
    caches and streams to before the first, the rows run alone (each its steps), only the culprit fails, and every
    other request keeps its solo tokens and acceptance. With the target as its own draft every step keeps every
    draft: the rerun starts from each row's kept draft as it was before the failed compute."""
    target, draft = pair(pairs, "full")
    draft = target if drafter == "target" else draft
    late = Job([7, 8], 12, HOT, 5, gamma=3, tag=(0, [7, 8], 12, HOT, 5, 3))
    ran = record_computes(monkeypatch, batches.SpeculativeEngine, lambda: scheduler.submit(late))
    real_noise = batches.step_noise
    culprit: list[Job] = []

    def faulty_noise(gens, own, *args):
        # one draw per row and step: the culprit's seventh is the second step of the third compute (4 + 1 + 1
        # steps before it), in the batch and again alone
        if culprit and culprit[0].generator in gens and culprit[0].generator.get_state() == 6:
            raise RuntimeError("late fault inside several speculative steps")
        return real_noise(gens, own, *args)

    def make(p):
        job = Job(p[1], p[2], p[3], p[4], p[5], tag=p)
        if p[4] == 9:
            culprit.append(job)
        return job

    monkeypatch.setattr(batches, "step_noise", faulty_noise)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, prefill_rows=0, steps_per_round=4)
    valid = [(0, [5, 6, 7], 40, HOT, 1, 3), (0, [9] * 4, 36, NUCLEUS, 2, 3), (0, [4], 38, GREEDY, 3, 3)]
    jobs = run_rounds(scheduler, [*valid, (0, [6, 6, 6], 40, HOT, 9, 3)], make)
    monkeypatch.undo()
    assert ran[0] == (4, 4) and ran[1] == (4, 1)  # the arrival stopped the second compute after one step
    assert late.done and late.batch_size == 5  # it shared steps with all four
    assert culprit[0].failure.status == 500 and "late fault" in str(culprit[0].error)
    assert len(culprit[0].stats.accepted) == 5  # its steps of the computes before: four, one (it failed in the third)
    assert_alone(target, draft, [*(j for j in jobs if j is not culprit[0]), late])


def test_a_draft_equal_to_the_target_keeps_every_draft_and_feeds_the_last_in_the_next_first_pass():
    """With the target's own weights as the draft every draft is accepted, so after every step each row lacks its
    last draft in the draft's cache: the next step's first draft pass feeds it (one pass, no extra one), and the
    rows still get exactly their solo tokens and acceptance. A wrong draft context would show as rejections."""
    target, draft = lm(0), lm(0)  # sharpened (lm): a wrong context in the draft's cache changes its drafts
    spec_steps, draft_calls = [0], [0]
    real_forward = draft.forward

    def counted(*args, **kwargs):
        draft_calls[0] += 1
        return real_forward(*args, **kwargs)

    draft.forward = counted
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0,  # three arrivals: one batched prefill
                          observe=lambda kind, rows: spec_steps.__setitem__(0, spec_steps[0] + (kind != "base")))
    plan = [(0, [5, 6, 7], 17, GREEDY, 1, 3), (0, [9, 9], 23, HOT, 2, 3), (0, [1, 2, 3, 4], 11, NUCLEUS, 3, 3)]
    jobs = run_rounds(scheduler, plan)
    assert draft_calls[0] == 1 + 3 * spec_steps[0]  # the batched prefill, then gamma passes a step
    draft.forward = real_forward
    assert_alone(target, draft, jobs)
    for job in jobs:
        assert all(n == 3 for n in job.stats.accepted[:-1]), job.stats.accepted


def test_a_dense_models_slot_ranges_are_kept_for_the_next_pass_with_their_lengths_taken_again():
    """A range of a dense model's slots is built once (its views of the slots' tensors) and kept while the slots
    keep their cache; each later pass takes the rows' lengths again (steps, swaps, rows leaving moved them). Slots
    given a new cache (grown), and models with other caches, build their ranges anew."""
    model = lm(0)
    with torch.no_grad():
        slots = decode.Slots(model, model.max_seq_len, rows=2)
        prefilled = Rows(model, 2, model.max_seq_len)
        prefilled.prefill([[1, 2, 3], [4, 5]])
        slots.put(prefilled, 0, 0)
        slots.put(prefilled, 1, 1)
        first = slots.rows(0, 2)
        first.forward(torch.tensor([[7], [8]]))
        again = slots.rows(0, 2)
        assert again is first and again.caches[0].layers[0].lengths == [4, 3] == slots.lengths()[:2]
        slots.swap(0, 1)
        assert slots.rows(0, 2) is first and first.caches[0].layers[-1].lengths == [3, 4]
        assert slots.rows(1, 2) is not first and slots.rows(1, 2).caches[0].layers[0].lengths == [4]
        slots.reserve(8)  # a new cache of 8 slots: the kept range's views are of the old one
        grown = slots.rows(0, 2)
        assert grown is not first and grown.caches[0].layers[0].k.data_ptr() != first.caches[0].layers[0].k.data_ptr()
        other = decode.Slots(pair({}, "performer")[0], 64, rows=2)
        other.put(Rows(other.model, 1, 64), 0, 0)
        assert other.rows(0, 1) is not other.rows(0, 1)  # not only key/value caches: built every time


def test_rows_leave_at_once_and_stream_their_tokens():
    target, draft = lm(0), lm(1, 1)
    # no priority: every row steps every round; the three arrivals of round 0 start together
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0)
    seen: dict[str, list] = {"long": [], "short": [], "spec": []}
    finished_at: dict[str, int] = {}
    rounds = [0]

    def job(name, n, gamma=None):
        return Job([1, 2, 3], n, HOT, 7, gamma, tag=name,
                   on_step=lambda toks, acc: seen[name].append((rounds[0], list(toks), acc)),
                   on_done=lambda j: finished_at.setdefault(name, rounds[0]))

    jobs = [scheduler.submit(job("long", 40)), scheduler.submit(job("short", 4)), scheduler.submit(job("spec", 10, 4))]
    with torch.no_grad():
        while scheduler.running or scheduler._queue:
            scheduler.run_once()
            rounds[0] += 1
    # round 0 prefills (the first token) and runs a step (the second); the short request's result is handed back
    # in the round that produced its 4th token, long before the long one is done
    assert finished_at["short"] == 2 and finished_at["long"] == 38
    # one step per round, its tokens pushed as produced; base steps carry no acceptance
    assert [r for r, _, _ in seen["long"]] == [0] + list(range(39)) and all(a is None for *_, a in seen["long"])
    assert [t for _, toks, _ in seen["long"] for t in toks] == jobs[0].out
    spec = seen["spec"]
    assert all(acc is not None and len(toks) <= acc + 1 for _, toks, acc in spec)
    assert [t for _, toks, _ in spec for t in toks] == jobs[2].out and len(jobs[2].out) == 10
    assert jobs[1].first_token_s is not None and jobs[1].first_token_s <= jobs[1].latency_s
    for j in jobs:
        j.tag = (0, [1, 2, 3], j.max_new, HOT, 7, j.gamma)
    assert_alone(target, draft, jobs)


def test_the_batch_cap_queues_the_rest_in_order():
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, max_rows=2)
    plan = [(0, [i + 1, i + 2], 5 + i, HOT, i, None) for i in range(5)]
    jobs = run_rounds(scheduler, plan)
    assert max(j.batch_size for j in jobs) == 2
    assert_alone(target, draft, jobs)


def test_the_scheduler_thread_serves_concurrent_submitters():
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, max_rows=8).start()
    try:
        done = []
        events = []

        def submit(p):
            ev = threading.Event()
            events.append(ev)
            done.append(scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p, on_done=lambda j: ev.set())))

        threads = [threading.Thread(target=submit, args=(p,)) for p in MIXED]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(ev.wait(60) for ev in events)
        assert_alone(target, draft, done)
    finally:
        scheduler.close()


def test_rows_taken_apart_and_joined_decode_as_before():
    """Rows.select / Rows.concat (the cache surgery behind joining and leaving) keep each row's own history."""
    for kind in ("full", "performer"):
        model = lm(0, 2, kind)
        prompts = [[5, 6, 7, 8, 9], [42], [1, 2, 3]]
        a = Rows(model, 2, model.max_seq_len, True)
        a.prefill(prompts[:2])
        b = Rows(model, 1, model.max_seq_len, True)
        b.prefill(prompts[2:])
        joined = Rows.concat([a, b]).select([2, 0])  # row 1 leaves; the others swap places
        logits = joined.forward(torch.tensor([[4], [10]]))[:, -1]
        for row, prompt in zip(logits, ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10])):
            alone = model(torch.tensor([prompt]))[0, -1]
            torch.testing.assert_close(row, alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,batched", [("full", True), ("full", False), ("performer", True), ("sinkhorn", True),
                                          ("nsa", True)])
def test_rows_in_slots_step_as_ranges_and_decode_as_alone(kind, batched):
    """Slots (continuous batching's cache: ranges stepped in place, rows joining, swapping places and leaving by
    single-row copies) keep each row's own history, for every backend (and row by row)."""
    from rows_check import check_slots  # tests/rows_check.py

    check_slots(lm(0, 2, kind), batched=batched, tol=1e-3)  # logits up to ~80 (sharpened): float32 rounding


@pytest.mark.parametrize("kind", ["full", "performer"])
def test_a_prefill_caches_only_its_prompts_room_where_every_layer_keeps_keys_and_values(pairs, kind, monkeypatch):
    """Full attention's prefills allocate their prompts' room, not the model's max_seq_len (their rows fill a slot's
    first positions); a backend with other decoding state (Performer's running sums) keeps the full capacity.
    Either way each request gets its solo tokens."""
    target, draft = pair(pairs, kind)
    made = []
    real = decode.Slots.prefill

    def spy(self, prompts, capacity, compiled=True):
        made.append((self.model is target, len(prompts), capacity))
        return real(self, prompts, capacity, compiled)

    monkeypatch.setattr(decode.Slots, "prefill", spy)  # the slots prefill a batch's rows apart
    scheduler = Scheduler(target, draft, prefill_rows=0)
    plan = [(0, [5, 6, 7], 9, HOT, 1, None), (0, [1] * 7, 6, GREEDY, 2, None), (1, [2, 4, 6, 8], 8, HOT, 3, 3)]
    jobs = run_rounds(scheduler, plan)
    assert_alone(target, draft, jobs)
    if kind == "full":  # base: the longest prompt; speculative: every prompt token but the last, in both models
        assert made == [(True, 2, 7), (True, 1, 3), (False, 1, 3)]
    else:
        assert made == [(True, 2, target.max_seq_len), (True, 1, target.max_seq_len), (False, 1, draft.max_seq_len)]


def test_the_slots_grow_for_a_burst_and_give_memory_back_when_it_is_gone():
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, max_rows=16, short_tokens=0, prefill_rows=0)  # the burst joins at once
    plan = [(0, [i + 1, 7], 3 + i, HOT, 40 + i, None) for i in range(12)]
    jobs = [scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p)) for p in plan]
    slots = scheduler.base.slots[0]
    least = slots.slots
    with torch.no_grad():
        scheduler.run_once()
        assert len(slots) == 12 and slots.slots >= 12
        scheduler.drain()
    assert len(slots) == 0 and slots.slots == least
    assert_alone(target, draft, jobs)


def test_rows_leaving_work_out_the_slots_needs_only_after_a_change(monkeypatch):
    """An engine's ``_leave`` (three calls a round) gives memory back only after rows joined, moved, left or were
    reserved since it last ran; in between it does nothing (the rows' needs are not worked out again)."""
    target = lm(0)
    shrinks = []
    real = decode.Slots.shrink
    monkeypatch.setattr(decode.Slots, "shrink", lambda self, positions=None: shrinks.append(positions) or
                        real(self, positions))
    engine = batches.BaseEngine(target)
    with torch.no_grad():
        engine.admit([Job([1, 2, 3], 6, GREEDY), Job([4], 9, GREEDY)])
        engine.drop_cancelled()  # rows joined since: worked out once
        settled = len(shrinks)
        assert settled == 1
        engine.step("all")  # nothing changed: its _leave calls (cancelled rows, then finished ones) do nothing
        engine.drop_cancelled()
        assert len(shrinks) == settled
        engine.move(engine.order[0], "slow")  # rows swapped: the next call works it out again
        engine.drop_cancelled()
        assert len(shrinks) == settled + 1
        while len(engine):
            engine.step("all")
    assert len(shrinks) == settled + 3  # once for each row that left (the first, then the second)


def test_slots_shrink_into_a_size_they_grew_through():
    """Twelve rows in slots grown 4 -> 8 -> 16; three stay: the slots shrink to eight (a power of two at least
    twice the rows), taking the eight-slot cache given back on the way up, not a new six-slot one."""
    from efftx.generation.decode import Slots

    model = lm(3)
    slots = Slots(model, model.max_seq_len)
    slots.reserve(8)
    eight = slots._cache
    slots.reserve(12)
    assert slots.slots == 16 and decode._FREE_CACHES[model][(8, slots.capacity)] is eight
    slots.n = 3
    slots.shrink()
    assert slots.slots == 8 and slots._cache is eight


def test_a_burst_takes_the_slot_caches_an_earlier_one_gave_back_zeroed():
    """The slots of a burst's batch grow into the caches an earlier batch gave back as it shrank (no new memory),
    zeroed and empty; a speculative batch dropped when its rows are done gives its target's and draft's caches
    back too, and the next one decodes in them with every row's solo output. Power: a reused cache not zeroed
    (its stale NaNs left in place) fails the checks."""
    from efftx.generation import decode

    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, max_rows=16, short_tokens=0, prefill_rows=0)
    burst = [(0, [i + 1, 7], 3 + i, HOT, 60 + i, None) for i in range(12)]
    for p in burst:
        scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p))
    slots = scheduler.base.slots[0]
    with torch.no_grad():
        scheduler.drain()
    kept = decode._FREE_CACHES[target]
    assert (16, slots.capacity) in kept  # the 16-slot cache the burst grew into, given back as the rows left
    stale = kept[(16, slots.capacity)]
    for layer in stale.layers:
        layer.k.fill_(float("nan"))  # what a reused cache must not show
    reused = decode.slots_cache(target, 16, slots.capacity)
    assert reused is stale and all(torch.count_nonzero(t) == 0 for layer in reused.layers for t in (layer.k, layer.v))
    assert all(layer.lengths == [0] * 16 for layer in reused.layers)
    decode.give_back(target, reused, slots.capacity)
    plan = [(0, [i + 2, 5], 4 + i, HOT, 80 + i, 2) for i in range(10)]
    jobs = [scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p)) for p in plan]
    with torch.no_grad():
        scheduler.run_once()
        engine = next(iter(scheduler.spec.values()))
        assert engine.slots[0]._cache is stale  # the target's slots grew into the kept cache
        scheduler.drain()
    assert not scheduler.spec and (16, slots.capacity) in decode._FREE_CACHES[draft]  # dropped: given back
    assert_alone(target, draft, jobs)


# ---------------------------------------------------------------------------------------------- containment
def device_rows(monkeypatch, limit: int, models=None) -> list[int]:
    """A device with memory for ``limit`` slots of a cache (per model, or only for ``models``): a larger slot cache
    raises torch's out-of-memory error. Returns the sizes refused."""
    real, refused = decode.slots_cache, []

    def slots_cache(model, slots, capacity):
        if slots > limit and (models is None or model in models):
            refused.append(slots)
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated): {slots} slots")
        return real(model, slots, capacity)

    monkeypatch.setattr(decode, "slots_cache", slots_cache)
    return refused


def test_a_burst_the_device_has_no_memory_for_waits_and_the_running_rows_go_on(monkeypatch, pairs):
    """Three rows decode in slots for four; four more arrive at once and the device has no memory for more slots:
    one joins in the free slot, the others wait until rows leave. Every request gets its solo tokens, none shares
    a step with more than four rows, and the batch may grow again once it drained. Power: before, the failed
    growth failed the whole batch, running rows included (each with a 500)."""
    target, draft = pair(pairs, "full")
    refused = device_rows(monkeypatch, 4)
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0)
    plan = [(0, [5, 6, 7], 10, HOT, 1, None), (0, [9, 9], 12, GREEDY, 2, None), (0, [1, 2, 3, 4], 8, HOT, 3, None)]
    plan += [(2, [7, i + 2], 9, HOT, 10 + i, None) for i in range(4)]
    jobs = run_rounds(scheduler, plan)
    assert refused  # the growth was tried, and refused
    assert_alone(target, draft, jobs)
    assert max(j.batch_size for j in jobs) == 4
    assert scheduler.base.row_limit is None  # drained: the next burst may try again
    monkeypatch.undo()
    later = run_rounds(scheduler, [(0, [3, i], 4, HOT, 20 + i, None) for i in range(6)])
    assert_alone(target, draft, later) and max(j.batch_size for j in later) == 6


def test_a_batch_held_to_its_slots_tries_to_grow_again_after_max_wait_rounds(monkeypatch, pairs):
    """A batch that never drains (long rows, arrivals beyond its four slots) tries to grow again once
    ``max_wait_rounds`` rounds have passed since the device refused: memory may have come free meanwhile. Power:
    a limit kept until the batch drains holds it to four rows."""
    target, draft = pair(pairs, "full")
    device_rows(monkeypatch, 4)
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, max_wait_rounds=5)
    plan = [(0, [i + 1, 2], 40, HOT, 70 + i, None) for i in range(6)]
    jobs = []
    with torch.no_grad():
        jobs += [scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p)) for p in plan]
        scheduler.run_once()
        assert len(scheduler.base) == 4 and scheduler.base.row_limit == 4
        assert scheduler.measured()["base"]["row_limit"] == 4  # what GET /models/info shows an operator
        monkeypatch.undo()  # the device has memory again
        for _ in range(3):
            scheduler.run_once()
        assert len(scheduler.base) == 4  # still held
        for _ in range(4):
            scheduler.run_once()
        assert len(scheduler.base) == 6 and scheduler.base.row_limit is None
        assert "row_limit" not in scheduler.measured()["base"]
        scheduler.drain()
    assert_alone(target, draft, jobs)


def test_no_memory_for_twice_the_slots_grows_them_to_what_is_needed(monkeypatch, pairs):
    """Doubling four slots to eight finds no memory, five fit: the five requests decode together."""
    target, draft = pair(pairs, "full")
    refused = device_rows(monkeypatch, 5)
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0)
    jobs = run_rounds(scheduler, [(0, [4, i + 1], 6, HOT, 30 + i, None) for i in range(5)])
    assert refused == [8]
    assert_alone(target, draft, jobs)
    assert all(j.batch_size == 5 for j in jobs)


def test_a_new_batch_without_device_memory_waits_for_running_rows_or_fails_with_503(monkeypatch, pairs):
    """The draft's slots for a new speculative batch find no memory: while base rows run, the speculative
    request waits for them (and then decodes as alone); with nothing running, it fails with a 503 that names the
    problem, and a base request still decodes."""
    target, draft = pair(pairs, "full")
    device_rows(monkeypatch, 0, models=[draft])
    scheduler = Scheduler(target, draft, short_tokens=0)
    lonely = scheduler.submit(Job([1, 2, 3], 5, HOT, 4, 3))
    base = scheduler.submit(Job([1, 2, 3], 5, HOT, 4, tag=(0, [1, 2, 3], 5, HOT, 4, None)))
    scheduler.drain()
    assert lonely.failure is not None and lonely.failure.status == 503, lonely.failure
    assert "no memory for this request's cache" in lonely.failure.detail
    assert lonely.failure.exception().headers == {"Retry-After": "1"}  # the HTTP answer says when to retry
    assert_alone(target, draft, [base])
    # rows running: the speculative request waits for them, then finds memory (here: once the device has it)
    base = scheduler.submit(Job([2, 2], 6, HOT, 8, tag=(0, [2, 2], 6, HOT, 8, None)))
    with torch.no_grad():
        scheduler.run_once()
        spec = scheduler.submit(Job([5, 6], 6, HOT, 7, 3, tag=(0, [5, 6], 6, HOT, 7, 3)))
        scheduler.run_once()
    assert not spec.done and list(scheduler._queue) == [spec]  # waiting, not failed
    monkeypatch.undo()
    scheduler.drain()
    assert_alone(target, draft, [spec, base])


def row_bytes(model, capacity: int | None = None) -> int:
    return decode.cache_bytes(model.new_cache(1, capacity or model.max_seq_len))


def fitted(model) -> int:
    """The positions of a running batch's slots for short requests: the fewest that slots fitting their rows take
    (key/value caches), else the model's context."""
    return decode.Slots(model, model.max_seq_len, fit=True).capacity


@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn", "nsa"])
def test_a_cache_budget_holds_the_batches_to_its_rows_and_every_request_gets_its_solo_output(pairs, kind):
    """A budget of five target rows: a burst of eight base requests decodes at most five at a time; a mix of
    base and speculative requests then shares it (a speculative row holds the target's and the draft's caches, the
    speculative batch waits while the base rows hold the budget). At every prefill and step the slots and the
    pooled caches hold at most the budget, nothing fails, every request gets its solo tokens and acceptance, and
    idle batches hold nothing; on every backend. Power: the same requests without the budget decode eight rows at a
    time."""
    target, draft = pair(pairs, kind)
    limit = 5 * row_bytes(target, fitted(target))  # these requests' rows: the fewest positions the slots take
    seen = []
    decode.free_memory()  # no caches pooled by earlier tests' batches of these models

    def hook(kind, jobs):
        seen.append(scheduler.budget.held() + scheduler.budget.pooled())
        reported.append(scheduler.cache_memory())  # what GET /models/info shows: the last round's figures

    reported = []

    burst = [(0, [i + 1, 3], 6 + i, HOT, 90 + i, None) for i in range(8)]
    mix = [(0, [i + 2, 4], 5 + i, HOT, 100 + i, 2 if i % 2 else None) for i in range(8)]
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, cache_budget=limit, hook=hook)
    assert scheduler.cache_memory() == {"limit_mib": round(limit / 2**20, 3), "held_mib": 0.0, "pooled_mib": 0.0}
    first = run_rounds(scheduler, burst)
    assert max(j.batch_size for j in first) == 5
    mixed = run_rounds(scheduler, mix)
    assert seen and max(seen) <= limit
    assert 0 < max(r["held_mib"] for r in reported) <= round(limit / 2**20, 3)  # MiB, to 3 places
    assert_alone(target, draft, first + mixed)
    assert scheduler.budget.held() == 0 and scheduler.cache_memory()["held_mib"] == 0.0
    free = Scheduler(target, draft, short_tokens=0, prefill_rows=0)  # the control: no budget
    assert max(j.batch_size for j in run_rounds(free, burst)) == 8


def test_slots_fit_their_rows_positions_widening_and_narrowing_with_every_row_kept():
    """Key/value slots that fit (continuous batching's eager slots) start at the fewest positions, widen (rows
    copied) for a row that needs more, and narrow again when it is gone; a row's next logits are the same before and
    after each. Caches of other kinds keep the model's context. Power: a widening that does not copy the rows'
    positions changes the logits."""
    from efftx.generation.decode import MIN_FIT_CAPACITY, Slots

    model = lm(3)
    assert model.max_seq_len == 2 * MIN_FIT_CAPACITY  # one widening: 64 -> 128
    slots = Slots(model, model.max_seq_len, fit=True)
    control = Slots(model, model.max_seq_len)  # the model's whole context, as before
    assert (slots.capacity, control.capacity) == (MIN_FIT_CAPACITY, model.max_seq_len)
    prompts = [[4, 5, 6], [7, 8, 9, 10, 11]]
    for s in (slots, control):
        rows = Rows(model, 2, 8)
        rows.prefill(prompts)
        s.put(rows, 0, 0)
        s.put(rows, 1, 1)

    def step(s, token):
        with torch.no_grad():
            return s.rows(0, 2).forward(torch.tensor([[token], [token + 1]]))[:, -1]

    assert torch.equal(step(slots, 3), step(control, 3))
    slots.reserve(3, positions=MIN_FIT_CAPACITY + 1)
    assert slots.capacity == model.max_seq_len and slots.slots >= 3 and slots.lengths()[:2] == [4, 6]
    assert torch.equal(step(slots, 12), step(control, 12))
    slots.shrink(positions=20)
    assert slots.capacity == MIN_FIT_CAPACITY and slots.lengths()[:2] == [5, 7]
    assert torch.equal(step(slots, 30), step(control, 30))
    assert Slots(lm(3, kind="performer"), 128, fit=True).capacity == 128  # not key/value caches: the context


def test_a_batch_fits_its_rows_positions_so_a_budget_holds_more_short_rows_and_a_long_one_waits_for_room(pairs):
    """Full attention under a budget of five rows of the model's context (128 positions): ten short requests (under
    64 positions each) decode together in slots of 64; a long request (over 64) that arrives among them waits until
    few enough rows run for five of 128 positions, then joins (the slots widen); when it is done, the rows that
    remain narrow back to 64. At every prefill and step the caches hold at most the budget, and every request gets
    its solo tokens. Power: slots of the model's context (no fitting) decode five of the short requests at a time."""
    target, draft = pair(pairs, "full")
    limit = 5 * row_bytes(target)
    decode.free_memory()
    seen = []

    def hook(kind, jobs):
        seen.append((len(jobs), scheduler.base.slots[0].capacity, scheduler.budget.held() + scheduler.budget.pooled(),
                     any(j.tag[2] == 80 for j in jobs), any(j.tag[0] == 40 for j in jobs)))

    shorts = [(0, [i + 1, 3], 6 + i % 4, HOT, 200 + i, None) for i in range(10)]
    plan = shorts + [(1, [2, 7, 1], 80, HOT, 300, None)] + [(40, [5, i + 1], 60, HOT, 400 + i, None) for i in range(2)]
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, cache_budget=limit, hook=hook)
    jobs = run_rounds(scheduler, plan)
    assert_alone(target, draft, jobs)
    assert max(j.batch_size for j in jobs[:10]) == 10  # twice the rows of the model's context
    assert max(held for *_, held, _, _ in seen) <= limit
    with_long = [(rows, cap) for rows, cap, _, long, _ in seen if long]
    assert with_long and all(cap == 2 * fitted(target) and rows <= 5 for rows, cap in with_long)
    assert {cap for _, cap, _, long, late in seen if not long and not late} == {fitted(target)}
    after = [cap for _, cap, _, long, late in seen[max(i for i, h in enumerate(seen) if h[3]) + 1:]]
    assert after and set(after) == {fitted(target)}  # the late rows, once the long one is gone: narrowed
    assert scheduler.measured()["base"]["positions"] == fitted(target)  # what GET /models/info shows an operator
    control = Scheduler(target, draft, short_tokens=0, prefill_rows=0, cache_budget=limit, fit_positions=False)
    assert max(j.batch_size for j in run_rounds(control, shorts)) == 5


def test_a_speculative_batch_under_a_budget_fills_it_with_rows_of_both_models(pairs):
    """A budget of eight speculative rows (the target's and the draft's caches of each): a burst of 32 speculative
    requests decodes eight at a time, each as alone. Power: with each model's slots growing on their own to the
    budget's room (the target's first), the draft's were left fewer rows, and the batch decoded four at a time (the
    code before, run and seen)."""
    target, draft = pair(pairs, "full")
    positions = fitted(target)
    limit = 8 * (row_bytes(target, positions) + row_bytes(draft, positions))
    decode.free_memory()
    burst = [(0, [i + 1, 3], 6, HOT, 500 + i, 2) for i in range(32)]
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, cache_budget=limit)
    jobs = run_rounds(scheduler, burst)
    assert_alone(target, draft, jobs)
    assert max(j.batch_size for j in jobs) == 8


def test_a_speculative_request_waiting_for_the_budget_keeps_its_empty_batch_holding_nothing(pairs):
    """Five base rows hold the whole budget; three speculative requests that arrive wait for them. While they wait
    their batch stays the same object, round after round, and its slots hold nothing; then they decode together
    (the row limit of its refusals does not stay: an empty batch clears it) and as alone. Power: the empty batch
    was dropped at the end of each round and made anew at the next (its slots, its checks of the models' caches:
    0.25 ms a round for the small pair on a 2-core CPU, measured)."""
    target, draft = pair(pairs, "full")
    limit = 5 * row_bytes(target, fitted(target))
    decode.free_memory()
    base = [(0, [i + 1, 5], 12, HOT, 600 + i, None) for i in range(5)]
    spec_plans = [(1, [3, 4 + i], 6, HOT, 700 + i, 2) for i in range(3)]
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, cache_budget=limit)
    jobs, waited = [], []
    with torch.no_grad():
        jobs += [scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p)) for p in base]
        scheduler.run_once()
        specs = [scheduler.submit(Job(*p[1:6], tag=p)) for p in spec_plans]
        spec = specs[0]
        while not spec.out:
            scheduler.run_once()
            engine = scheduler.spec.get((2, None, False))
            if not spec.out:
                waited.append(engine)
                assert engine is not None and all(scheduler.budget._held.get(s, 0) == 0 for s in engine.slots)
        scheduler.drain()
    assert len(waited) >= 5 and all(b is waited[0] for b in waited)  # one batch while they waited
    assert max(j.batch_size for j in specs) == 3
    assert_alone(target, draft, jobs + specs)
    assert not scheduler.spec and scheduler.budget.held() == 0  # done: the batch is gone, nothing held


def test_an_idle_replica_under_a_budget_of_one_row_serves_long_requests_arriving_together_one_at_a_time(pairs):
    """A budget of one speculative row of the whole context, nothing running: two speculative requests that need
    more positions than the narrowest slots arrive together. The batch cannot hold both, and the rows its budget
    holds at the narrow width hold neither of them; but it holds one at the wide width: they decode one after the
    other, each as alone. Power: the code before filled the slots at the narrow width, took none, and failed both
    with a 503 (run and seen; found by tests/test_serve_random.py)."""
    target, draft = pair(pairs, "full")
    decode.free_memory()
    limit = row_bytes(target) + row_bytes(draft)
    plan = [(0, [6, 1, 4], fitted(target) + 10, HOT, 800 + i, 2) for i in range(2)]
    jobs = run_rounds(Scheduler(target, draft, short_tokens=0, prefill_rows=0, cache_budget=limit), plan)
    assert_alone(target, draft, jobs)
    assert [j.batch_size for j in jobs] == [1, 1]


def test_slots_reserved_for_a_request_refused_at_its_prefill_go_back_at_once(pairs):
    """A base request the model cannot hold (prompt + new tokens past the context) reserves its slots and fails at
    its prefill (422); what it reserved goes back in the same round, so the speculative request that comes next,
    with nothing running, finds the budget free. Power: the empty slots kept the reservation, and the next request
    failed with a 503 (run and seen)."""
    target, draft = pair(pairs, "full")
    decode.free_memory()
    scheduler = Scheduler(target, draft, short_tokens=0, cache_budget=row_bytes(target) + row_bytes(draft))
    with torch.no_grad():
        refused = scheduler.submit(Job([3] * 10, target.max_seq_len, HOT, 1))
        scheduler.run_once()
        assert isinstance(refused.error, ValueError) and "max_seq_len" in str(refused.error)
        assert scheduler.budget.held() == 0
    (job,) = run_rounds(scheduler, [(0, [5, 2], 9, HOT, 7, 2)])
    assert_alone(target, draft, [job])


def test_a_cache_budget_grows_slots_to_its_room_drops_pooled_caches_in_its_way_and_pools_none_past_it():
    """Slots under a budget of six rows: growth past it raises CacheBudgetFull, with the slots grown to the rows it
    has room for and their rows unchanged; a pooled cache that stands in the way of a growth is dropped; a cache
    given back past the budget is not pooled; row-by-row slots (one cache per row) are held to it as well."""
    from efftx.generation.decode import CacheBudget, CacheBudgetFull, Slots

    model = lm(3)
    one = row_bytes(model)
    budget = CacheBudget(6 * one)
    a = Slots(model, model.max_seq_len, budget=budget)
    assert a.slots == 0 and budget.held() == 0  # nothing held before a row joins
    a.reserve(4)
    assert a.slots == 4 and budget.held() == 4 * one
    a.release()
    assert budget.held() == 0 and budget.pooled() == 4 * one  # room for it: kept for reuse
    b = Slots(model, model.max_seq_len, budget=budget)
    b.reserve(5)  # twice four (eight) has no room; five has, once the pooled four-slot cache is dropped
    assert b.slots == 5 and budget.pooled() == 0 and budget.held() == 5 * one
    b.reserve(6)  # the five-slot cache it leaves would pass the budget beside six: not kept
    assert b.slots == 6 and budget.pooled() == 0 and budget.held() == 6 * one
    b.release()
    c = Slots(model, model.max_seq_len, budget=budget)
    c.reserve(1)
    d = Slots(model, model.max_seq_len, budget=budget)
    d.reserve(4)
    assert budget.held() == 5 * one and budget.pooled() == 0
    prompt_rows = Rows(model, 1, model.max_seq_len)
    prompt_rows.prefill([[4, 5, 6]])
    c.put(prompt_rows, 0, 0)
    kept = [t.clone() for t in (c._cache.layers[0].k[0], c._cache.layers[0].v[0])]
    with pytest.raises(CacheBudgetFull, match="cache budget"):
        c.reserve(3)  # two rows beside d's four fit, not three: the slots grow to two
    assert (c.slots, len(c)) == (2, 1) and budget.held() == 6 * one and c.room == 2
    assert torch.equal(c._cache.layers[0].k[0], kept[0]) and torch.equal(c._cache.layers[0].v[0], kept[1])
    d.release()
    apart = Slots(model, model.max_seq_len, batched=False, budget=budget)
    apart.reserve(3)  # row by row: only the budget is asked
    with pytest.raises(CacheBudgetFull):
        apart.reserve(5)
    assert apart.room == 4


def test_compiled_slots_under_a_cache_budget_take_the_largest_bucket_it_holds():
    """Compiled slots come in power-of-two buckets: a budget of five rows holds four of them, and no growth past;
    drained, they hold nothing (an idle replica's budget is free for any batch). Power: drained compiled slots kept a
    bucket of one, and a speculative request on the idle replica failed with a 503 (tests/test_serve_random.py with
    compiled passes, run and seen)."""
    from efftx.generation.decode import CacheBudget, CacheBudgetFull
    from efftx.generation.device_slots import CompiledSlots

    model = lm(3)
    budget = CacheBudget(5 * row_bytes(model))
    slots = CompiledSlots(model, rows=4, mode="off", budget=budget)
    slots.reserve(1)
    assert slots.slots == 1
    with pytest.raises(CacheBudgetFull):
        slots.reserve(5)  # eight slots: past the budget; they grow to four
    assert slots.slots == slots.room == 4 and budget.held() == 4 * row_bytes(model)
    slots.shrink()  # no rows left
    assert slots.slots == 0 and budget.held() == 0


def test_a_cache_budget_must_hold_a_row_of_each_mode():
    target, draft = lm(0), lm(1, 1)
    with pytest.raises(ValueError, match=r"holds no row: a row takes .*\(the target's and the draft's caches"):
        Scheduler(target, draft, cache_budget=row_bytes(target))
    with pytest.raises(ValueError, match="holds no row"):
        Scheduler(target, cache_budget=row_bytes(target) - 1)
    for bad in (0, -5, True, 1.5):
        with pytest.raises(ValueError, match="cache_budget must be a positive number of bytes"):
            Scheduler(target, cache_budget=bad)
    assert Scheduler(target, cache_budget=row_bytes(target)).cache_memory()["limit_mib"] > 0


def test_passes_that_run_out_of_device_memory_are_split_and_every_row_keeps_its_tokens(monkeypatch, pairs):
    """Three base and three speculative rows decode; a pass of more than two rows runs out of device memory:
    each batch's first step runs row by row and its later passes take half as many rows (one), so the error is met
    once per batch, not at every step; every request gets its solo tokens and acceptance. Power: without the split
    every step of both batches runs out of memory again."""
    target, draft = pair(pairs, "full")
    real, failed = decode._SlotRows.forward, []

    def forward(self, tokens):
        if tokens.shape[0] > 2:
            failed.append(tokens.shape[0])
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated): a pass of {tokens.shape[0]} rows")
        return real(self, tokens)

    monkeypatch.setattr(decode._SlotRows, "forward", forward)
    plan = [(0, [i + 1, 5, 9], 12, HOT, 40 + i, None if i % 2 else 2) for i in range(6)]
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0)
    assert_alone(target, draft, run_rounds(scheduler, plan))
    assert failed == [3, 3]  # once per batch
    assert scheduler.base.step_rows is None  # drained: passes of any size again
    monkeypatch.setattr(batches._Engine, "step_rows", property(lambda self: None, lambda self, value: None),
                        raising=False)
    failed.clear()
    assert_alone(target, draft, run_rounds(Scheduler(target, draft, short_tokens=0, prefill_rows=0), plan))
    assert len(failed) > 8


@pytest.mark.parametrize("compile", ["on", "auto"])
def test_compiled_passes_that_run_out_of_device_memory_are_split_not_taken_for_a_compile_failure(monkeypatch, pairs,
                                                                                                  compile):
    """The same with compiled passes (run eagerly here: the compiled function stands in for its graphs): a compiled
    pass of more than two rows runs out of device memory (on a GPU: a CUDA graph's recording, inductor's buffers).
    That is the device's error, not the compiler's: it reaches the containment as it is (the batch's later passes
    halved, once per batch), compiling stays on, and every request gets its solo tokens. Power: taken for a compile
    failure, ``on`` raised CompileUnavailable at every step (never split) and ``auto`` turned compiling off for the
    process."""
    from efftx.generation import compiled

    target, draft = pair(pairs, "full")
    failed = []

    def factory(fn, device_type):
        def step(model, tokens, *args):
            if tokens.shape[0] > 2:
                failed.append(tokens.shape[0])
                raise torch.OutOfMemoryError(f"CUDA out of memory (simulated): a compiled pass of {tokens.shape[0]}")
            return fn(model, tokens, *args)
        return step

    monkeypatch.setattr(compiled, "compiled_function", factory)
    monkeypatch.setattr(compiled, "_BROKEN", {})
    plan = [(0, [i + 1, 5, 9], 12, HOT, 40 + i, None if i % 2 else 2) for i in range(6)]
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, compile=compile)
    assert_alone(target, draft, run_rounds(scheduler, plan))
    assert len(failed) == 2 and compiled._BROKEN == {}  # once per batch; compiling not given up


@pytest.mark.parametrize("compile", ["on", "auto"])
def test_a_device_fault_in_a_compiled_pass_is_the_devices_not_a_compile_failure(monkeypatch, pairs, compile):
    """A compiled pass meets a CUDA error that surfaces as a plain RuntimeError (a kernel launch's, say): the device
    failed, which :mod:`efftx.generation.faults` says for compiled decoding and serving alike. It reaches the
    scheduler as it is: every request fails with a 503 naming the device, and compiling is not given up (nor
    retried eagerly on the failed device). Power: with compiled decoding's own list of device errors (out of memory
    and AcceleratorError only), ``auto`` took it for a compile failure (compiling off for the process, the pass rerun
    eagerly: every request succeeded on a device that had failed). (``on`` fails them with the fault either way: its
    CompileUnavailable names the CUDA error.)"""
    from efftx.generation import compiled
    from efftx.generation.faults import DeviceFault

    target, draft = pair(pairs, "full")
    broken = []

    def factory(fn, device_type):
        def step(model, tokens, *args):
            if broken:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
            return fn(model, tokens, *args)
        return step

    monkeypatch.setattr(compiled, "compiled_function", factory)
    monkeypatch.setattr(compiled, "_BROKEN", {})
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, compile=compile)
    jobs = [scheduler.submit(Job([i + 1, 5, 9], 20, HOT, 40 + i, None if i % 2 else 2)) for i in range(4)]
    scheduler.run_once()
    broken.append(True)
    for _ in range(3):
        scheduler.run_once()
    assert all(j.done and isinstance(j.error, DeviceFault) for j in jobs), [repr(j.error) for j in jobs]
    assert {j.failure.status for j in jobs} == {503} and compiled._BROKEN == {}


@pytest.mark.parametrize("where", ["pass", "read", "chunk"])
def test_a_device_fault_fails_every_request_with_a_503_and_no_row_runs_again(monkeypatch, pairs, where, caplog):
    """A CUDA error (an illegal memory access, a device-side assert) is sticky: every later call on the device fails
    too. One surfaces in a batched pass, or (base steps pipelined) at a step's read, or in a prompt's prefill chunk,
    while base and speculative rows run and others wait: no row is rerun alone (each would touch the failed device
    again), every request, running or queued, fails with a 503 naming the device, a request submitted later fails
    at once, and the scheduler keeps the fault (the app's health check reports it: Serve replaces the replica). Power:
    taken for a request's own fault, the rows ran again one by one and failed with 500s, and later requests tried the
    device again."""
    from efftx.generation.faults import DeviceFault
    from efftx.serving.isolation import row_failure

    target, draft = pair(pairs, "full")
    fault = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    real_forward, real_read, real_chunk = decode._SlotRows.forward, batches.BaseEngine._read, \
        batches._Engine._prefill_chunk
    calls, broken = [], []

    def forward(self, tokens):
        calls.append(tokens.shape[0])
        if broken and where == "pass":
            raise fault
        return real_forward(self, tokens)

    def read(self, state, sent):
        if broken and where == "read":
            raise fault
        return real_read(self, state, sent)

    def chunk(self, job, tokens):
        if broken and where == "chunk":
            raise fault
        return real_chunk(self, job, tokens)

    monkeypatch.setattr(decode._SlotRows, "forward", forward)
    monkeypatch.setattr(batches.BaseEngine, "_read", read)
    monkeypatch.setattr(batches._Engine, "_prefill_chunk", chunk)
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, pipeline=where == "read",
                          prefill_chunk=4 if where == "chunk" else 0)
    jobs = [scheduler.submit(Job([i + 1, 5, 9], 30, HOT, 40 + i, None if i % 2 else 2)) for i in range(4)]
    for _ in range(3):
        scheduler.run_once()
    assert all(j.out and not j.done for j in jobs)
    jobs += [scheduler.submit(Job([9, 9, 9], 8, GREEDY, 1, gamma)) for gamma in (None, 2)]  # waiting for a round
    if where == "chunk":  # a long prompt being prefilled chunk by chunk when the device fails
        jobs.append(scheduler.submit(Job([7] * 40, 8, HOT, 50)))
    broken.append(True)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        scheduler.run_once()  # the round in which the device fails
    assert "one by one" not in caplog.text  # no row rerun alone
    before = len(calls)
    for _ in range(3):
        scheduler.run_once()
    assert len(calls) == before  # nothing touches the device after that round
    assert all(j.done and isinstance(j.error, DeviceFault) for j in jobs), [repr(j.error) for j in jobs]
    assert {j.failure.status for j in jobs} == {503} and "illegal memory access" in str(jobs[0].error)
    assert "the device failed" in row_failure(jobs[0].error, "base decoding").detail
    assert isinstance(scheduler.fault, DeviceFault) and not scheduler.running and not scheduler._queue
    late = scheduler.submit(Job([1, 2], 4, HOT, 1))
    assert late.done and late.error is scheduler.fault and late.failure.status == 503
    scheduler.run_once()
    assert len(calls) == before


def test_the_replica_reports_itself_unhealthy_after_a_device_fault(debug_exports, monkeypatch):
    """The text app (built as Serve builds it, outside Serve): its scheduler's batch meets a device fault while
    decoding a request; the request fails with a 503, and the replica's Serve health check (``check_health``:
    raising makes Serve replace the replica) and ``/healthz`` (a 503 naming the fault) report it; healthy before.
    Power: with the app reading static batching's latch only, it stayed healthy."""
    import json

    from efftx.serving.text import TextGenerator

    cls = TextGenerator.func_or_class.__bases__[0]  # the app's own class, under Serve's ingress wrapper
    replica = cls(debug_exports["target"], debug_exports["draft"], name="tiny", warm_up_rows=1)
    try:
        replica.check_health()
        assert asyncio.run(cls.healthz(replica))["status"] == "ok"

        def forward(self, tokens):
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")

        monkeypatch.setattr(decode._SlotRows, "forward", forward)
        finished = threading.Event()
        job = replica.scheduler.submit(Job([1, 2, 3], 8, HOT, 1, on_done=lambda job: finished.set()))
        assert finished.wait(60) and job.failure.status == 503
        with pytest.raises(RuntimeError, match=r"unhealthy: the device failed \(AcceleratorError: CUDA error: "
                                               r"device-side assert triggered\)"):
            replica.check_health()
        answer = asyncio.run(cls.healthz(replica))
        assert answer.status_code == 503 and answer.headers["Retry-After"] == "1"
        body = json.loads(answer.body)
        assert body["status"] == "failed" and "device-side assert" in body["detail"]
    finally:
        replica.scheduler.close()


def test_a_move_or_a_shrink_without_device_memory_changes_nothing(monkeypatch, pairs):
    """A long row moves to the slow lane for a short arrival through a free slot: on a device with no memory left
    at all (no copy, no cache) it still moves. With every slot holding a row, it moves through a one-row scratch:
    the slots do not grow (they did before: a whole new cache for one swap); where the device has no memory for the
    scratch either, the row stays where it is and the short request waits for a free slot. The slots shrinking
    after a burst find no memory for their smaller cache: they keep the larger one. Every request gets its solo
    tokens. Power: the swap through a copy of the row failed the whole batch on the full device."""
    target, draft = pair(pairs, "full")
    real_swap = decode.Slots.swap

    def no_copies(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated): a row copy")

    def swap(self, a, b):
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "clone", no_copies)
            device_rows(m, 0)
            real_swap(self, a, b)

    monkeypatch.setattr(decode.Slots, "swap", swap)
    longs = [(0, [5, 6, 7], 20, HOT, 1, None), (0, [9, 9], 20, HOT, 2, None), (0, [4, 1], 20, HOT, 3, None)]
    scheduler = Scheduler(target, draft, short_tokens=8, fast_rows=2, long_every=3, prefill_rows=0,
                          short_slowdown=0)
    jobs = run_rounds(scheduler, longs[:2] + [(2, [1, 2], 6, HOT, 4, None)])  # 3 rows in 4 slots
    assert scheduler.moves == 1
    assert_alone(target, draft, jobs)
    scheduler = Scheduler(target, draft, short_tokens=8, fast_rows=2, long_every=3, prefill_rows=0,
                          short_slowdown=0)
    device_rows(monkeypatch, 4)  # four slots, full when the short request comes
    plan = longs + [(0, [3, 3], 20, HOT, 5, None), (2, [1, 2], 6, HOT, 4, None)]
    jobs = run_rounds(scheduler, plan)
    assert scheduler.moves == 1 and scheduler.base.slots[0]._scratch is not None  # no growth: through the scratch
    assert_alone(target, draft, jobs)
    scheduler = Scheduler(target, draft, short_tokens=8, fast_rows=2, long_every=3, prefill_rows=0,
                          short_slowdown=0)
    monkeypatch.setattr(torch, "empty_like", no_copies)  # no memory for the scratch either
    jobs = run_rounds(scheduler, plan)
    assert scheduler.moves == 0
    assert_alone(target, draft, jobs)
    monkeypatch.undo()
    # a burst grows the slots to 16; then the device refuses every new cache as the rows leave
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0)
    burst = [(0, [i + 1, 3], 2 + i, HOT, 50 + i, None) for i in range(12)]
    with torch.no_grad():
        jobs = [scheduler.submit(Job(p[1], p[2], p[3], p[4], p[5], tag=p)) for p in burst]
        scheduler.run_once()
        assert scheduler.base.slots[0].slots == 16
        refused = device_rows(monkeypatch, 0)
        scheduler.drain()
    assert refused and scheduler.base.slots[0].slots == 16  # it tried to shrink; its smaller cache found no memory
    assert_alone(target, draft, jobs)


def test_every_rows_noise_of_a_step_is_one_call(monkeypatch):
    """Rows of mixed settings (greedy among them), base and speculative, joining at different rounds: each step's
    sampled rows draw their noise in one call of the row noise kernel (not a call per row), their settings go to
    the device once per step (every draft and verify pass of a speculative step reuses them), and they still get
    their solo tokens."""
    from efftx.generation import sampling

    calls: list[int] = []
    real_noise = sampling.row_noise

    def counted(keys, width):
        calls.append(keys.shape[0])
        return real_noise(keys, width)

    settings = [0]  # per step, how often the rows' settings were built (prefills count toward the last one)
    passes = [0]  # per step, how many distributions were taken from them
    real_distributions = batches.distributions

    def counted_distributions(samplings, device):
        settings[-1] += 1
        of = real_distributions(samplings, device)

        def counted_of(logits):
            passes[-1] += 1
            return of(logits)
        return counted_of

    monkeypatch.setattr(sampling, "row_noise", counted)
    monkeypatch.setattr(batches, "distributions", counted_distributions)
    steps = []
    for cls in (batches.BaseEngine, batches.SpeculativeEngine):
        def compute(self, state, real=cls.compute):
            before = len(calls)
            settings.append(0)
            passes.append(0)
            out = real(self, state)
            steps.append((self.kind, len(state.jobs), calls[before:],
                          any(not sampling.is_greedy(j.sampling.temperature) for j in state.jobs)))
            assert settings[-1] <= 1, (self.kind, settings[-1])
            return out

        monkeypatch.setattr(cls, "compute", compute)
    target, draft = lm(0), lm(1, 1)
    jobs = run_rounds(Scheduler(target, draft), MIXED)
    sampled = [(kind, rows, got) for kind, rows, got, any_sampled in steps if any_sampled]
    assert {kind for kind, _, _ in sampled} == {"base", "speculative"}
    assert max(rows for _, rows, _ in sampled) >= 3  # steps of several rows, or one call per row would pass too
    for kind, rows, got in sampled:
        assert got == [rows], (kind, rows, got)  # one call, every row of the step in it
    assert max(passes) >= 3  # a speculative step's draft and verify passes shared one build of the settings
    monkeypatch.undo()
    assert_alone(target, draft, jobs)


def test_a_failing_row_fails_alone_and_the_others_keep_their_tokens(monkeypatch):
    """Three culprits share the running batches with valid rows: a seed the generator refuses (422, at its
    prefill), a fault raised by the step hook (500), and faults raised *after* the batched forward passes wrote
    the caches (in the draw of base decoding and in the verification of speculative decoding: the caches are
    rewound and every generator restored before the rows run alone). The valid rows get exactly their solo
    output."""
    target, draft = lm(0), lm(1, 1)
    culprits: dict[str, Job] = {}

    stepping: list[Job] = []

    def hook(kind, jobs):
        stepping[:] = jobs
        if any(j.tag[0] == "hook" for j in jobs):
            raise RuntimeError("injected fault")

    real_draw, real_accept = batches.draw, batches.accept_sampled

    def faulty_draw(probs, gens):
        late = culprits.get("draw")
        if late is not None and late.generator in gens and late.steps == 3:
            raise RuntimeError("late fault in base decoding")
        return real_draw(probs, gens)

    def faulty_accept(p, q, drafted, u, noise, own):  # after both models' passes, before the tokens are read
        late = culprits.get("verify")
        if late is not None and late in stepping and late.steps == 2:
            raise RuntimeError("late fault in speculative decoding")
        return real_accept(p, q, drafted, u, noise, own)

    monkeypatch.setattr(batches, "draw", faulty_draw)
    monkeypatch.setattr(batches, "accept_sampled", faulty_accept)
    scheduler = Scheduler(target, draft, hook=hook)
    valid = [p for p in MIXED if p[0] <= 5]
    bad = [(1, [4, 4], 9, HOT, 2**64, None, "seed"), (2, [4, 5], 9, HOT, 1, 3, "hook"),
           (1, [6, 6, 6], 12, HOT, 11, None, "draw"), (1, [6, 1], 12, HOT, 12, 3, "verify")]

    def make(p):
        if len(p) == 7:
            job = Job(p[1], p[2], p[3], p[4], p[5], tag=(p[6],))
            culprits[p[6]] = job
            return job
        return Job(p[1], p[2], p[3], p[4], p[5], tag=p)

    jobs = run_rounds(scheduler, valid + bad, make)
    by_name = {j.tag[0]: j for j in jobs if len(j.tag) == 1}
    assert by_name["seed"].failure.status == 422
    assert "a seed must be an integer" in str(by_name["seed"].failure.detail)
    assert by_name["hook"].failure.status == 500 and "RuntimeError" in str(by_name["hook"].failure.detail)
    assert by_name["draw"].failure.status == 500 and by_name["draw"].steps == 3
    assert by_name["verify"].failure.status == 500 and by_name["verify"].steps == 2
    monkeypatch.setattr(batches, "draw", real_draw)
    monkeypatch.setattr(batches, "accept_sampled", real_accept)
    assert_alone(target, draft, [j for j in jobs if len(j.tag) != 1])


# (arrival round, prompt, max_new_tokens, sampling, seed, starting gamma, max_gamma: an adaptive gamma)
ADAPTIVE = [
    (0, [5, 6, 7], 24, HOT, 1, 3, 6),
    (0, [9] * 12, 20, GREEDY, 2, 3, 6),
    (1, [1, 2], 18, NUCLEUS, 3, 3, 6),
    (1, [42], 15, HOT, 4, 2, 4),
    (2, [3, 1, 4, 1, 5], 22, HOT, 5, 2, 4),
    (3, [8, 8], 16, HOT, 6, 3, None),  # a fixed gamma beside them
]


@pytest.mark.parametrize("kind", ["full", "nsa"])
def test_adaptive_gamma_rows_get_their_solo_tokens_acceptance_and_draft_lengths(pairs, kind):
    """Rows of one batch whose draft lengths follow their own acceptance (so they differ within a step): each row
    draws only for its own drafts, verifies only those, and gets the tokens, acceptance and draft lengths it gets
    decoded alone; rows of equal (gamma, max_gamma) share steps."""
    target, draft = pair(pairs, kind)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0)
    jobs = run_rounds(scheduler, ADAPTIVE)
    assert_alone(target, draft, jobs)
    adaptive = [j for j in jobs if j.max_gamma is not None]
    assert all(len(set(j.stats.drafted)) > 1 for j in adaptive)  # the lengths moved
    assert max(j.batch_size for j in adaptive) > 1
    assert all(j.stats.gamma == j.max_gamma for j in adaptive)  # the histogram runs to the cap
    bad = Scheduler(target, draft)
    refused = bad.submit(Job([1, 2], 4, HOT, 1, 4, max_gamma=3))
    room = target.max_seq_len - 2 - 3  # fits with gamma 3 alone, not with the cap of 6
    too_long = bad.submit(Job([1, 2], room, HOT, 1, 3, max_gamma=6))
    fits = bad.submit(Job([1, 2], room, HOT, 1, 3))
    bad.drain()
    assert refused.failure.status == 422 and "max_gamma" in str(refused.failure.detail)
    assert too_long.failure.status == 422 and "gamma (6)" in str(too_long.failure.detail)
    assert fits.failure is None and len(fits.out) == room


def test_requests_the_decoder_refuses_fail_alone():
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft)
    too_long = Job([1] * 100, target.max_seq_len, HOT, 1, tag="long")
    spec_too_long = Job([1] * 100, target.max_seq_len - 100, HOT, 1, 5, tag="spec")
    empty = Job([], 4, HOT, 1, tag="empty")
    fine = Job([1, 2], 6, HOT, 3, tag=(0, [1, 2], 6, HOT, 3, None))
    for job in (too_long, spec_too_long, empty, fine):
        scheduler.submit(job)
    scheduler.drain()
    for job in (too_long, spec_too_long, empty):
        assert job.failure.status == 422, job.tag
    assert "max_seq_len" in str(too_long.failure.detail) and "gamma" in str(spec_too_long.failure.detail)
    assert_alone(target, draft, [fine])


def test_a_refused_request_without_the_web_stack_fails_alone_with_its_error(monkeypatch):
    """The scheduler runs with torch alone (bench/serve_load.py --inprocess on a bare GPU image): where the HTTP
    answer cannot be made (FastAPI missing), a refused request still finishes with its error and the others
    decode."""
    import sys

    monkeypatch.setitem(sys.modules, "efftx.serving.isolation", None)  # its import now raises ImportError
    target = lm(0)
    scheduler = Scheduler(target)
    empty = scheduler.submit(Job([], 4, HOT, 1, tag="empty"))
    fine = scheduler.submit(Job([1, 2], 6, HOT, 3, tag=(0, [1, 2], 6, HOT, 3, None)))
    scheduler.drain()
    assert empty.done and empty.failure is None and "prompt is empty" in str(empty.error)
    assert fine.error is None and len(fine.out) == 6
    assert_alone(target, None, [fine])


def test_cancelled_rows_leave_the_batch():
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft)
    keep = scheduler.submit(Job([1, 2], 12, HOT, 3, tag=(0, [1, 2], 12, HOT, 3, None)))
    gone = scheduler.submit(Job([3, 4], 30, HOT, 4, 3, tag="gone"))
    queued = Job([5], 5, HOT, 5, tag="queued")
    with torch.no_grad():
        scheduler.run_once()
        scheduler.run_once()
        scheduler.cancel(gone)
        scheduler.submit(queued)
        scheduler.cancel(queued)
        scheduler.run_once()
    assert gone.done and gone.cancelled and len(gone.out) < 30 and queued.done and not queued.out
    assert not scheduler.spec  # its batch was emptied and dropped
    scheduler.drain()
    assert_alone(target, draft, [keep])


# ---------------------------------------------------------------------------------------------- priority
def rounds_of(scheduler: Scheduler, plan, knobs=None):
    """Run ``plan`` (entries as in MIXED, plus a name) and record, per name, the rounds in which it got tokens and
    the round it finished; returns (jobs by name, token rounds by name, finishing round by name)."""
    got: dict[str, list[int]] = {}
    finished: dict[str, int] = {}
    jobs: dict[str, Job] = {}
    now = [0]

    def make(p):
        name = p[6]
        job = Job(p[1], p[2], p[3], p[4], p[5], tag=p[:6],
                  on_step=lambda toks, acc: got.setdefault(name, []).append(now[0]) if toks else None,
                  on_done=lambda j: finished.setdefault(name, now[0]))
        jobs[name] = job
        return job

    last = max(p[0] for p in plan)
    with torch.no_grad():
        while now[0] <= last or scheduler.running or scheduler._queue:
            for p in plan:
                if p[0] == now[0]:
                    scheduler.submit(make(p))
            scheduler.run_once()
            now[0] += 1
            assert now[0] < 2000
    return jobs, got, finished


def test_short_requests_step_every_round_and_long_ones_every_long_every_rounds():
    """Two long rows fill the fast lane, a third starts in the slow lane. A short arrival takes the fast row of the
    long row with the most tokens left (the speculative one: it moves to the slow lane). While the short row runs,
    the slow lane steps one round in three and a long arrival waits for such a round to be prefilled; the short
    row and the long row left in the fast lane step every round. Once the short row is gone, every row steps every
    round again. Every row gets exactly its solo tokens and acceptance."""
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, short_tokens=8, fast_rows=2, long_every=3, prefill_rows=0, short_slowdown=0)
    plan = [(0, [5, 6, 7], 30, HOT, 1, None, "long"), (0, [9, 9], 60, GREEDY, 2, 3, "spec"),
            (0, [2, 7], 24, NUCLEUS, 5, None, "third"),
            (4, [1, 2, 3], 8, HOT, 3, None, "short"), (5, [4, 4], 20, HOT, 4, None, "late")]
    jobs, got, finished = rounds_of(scheduler, plan)
    # the short request: admitted at once, a token every round (two in its first: the prefill's and the step's)
    assert got["short"] == [4, 4, 5, 6, 7, 8, 9, 10] and finished["short"] == 10
    assert got["long"][:13] == [0] + list(range(12))  # the fast lane: every round
    # the slow lane (the third row from the start, the speculative one from round 4): every round before the short
    # one came and after it left, meanwhile one round in three
    assert got["third"][:9] == [0, 0, 1, 2, 3, 6, 9, 11, 12]
    assert got["spec"][:8] == [0, 1, 2, 3, 6, 9, 11, 12]
    # the long arrival of round 5 is prefilled (its first token) in the next round the slow lanes step
    assert got["late"][:4] == [6, 6, 9, 11]
    assert_alone(target, draft, list(jobs.values()))


def test_short_requests_beyond_the_fast_rows_join_it_and_long_arrivals_wait_for_the_slow_lanes_round():
    """Three short requests and a long one arrive together; one fast row, two prefills a round. The short ones are
    prefilled first, fewest tokens first, and the one beyond the fast row joins the fast lane rather than waiting
    for a short row to finish: all three step together. The long arrival, though the round's prefills had room
    for it, waits for the first round in which the slow lane steps (one in three while short requests run)."""
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, short_tokens=8, fast_rows=1, long_every=3, prefill_rows=2, short_slowdown=0)
    plan = [(0, [1, 2], 8, HOT, 1, None, "eight"), (0, [3, 4], 6, HOT, 2, None, "six"),
            (0, [5], 7, GREEDY, 3, 2, "seven"), (0, [6, 7], 12, HOT, 4, None, "long")]
    jobs, got, finished = rounds_of(scheduler, plan)
    assert got["six"][0] == 0 and got["seven"][0] == 0  # the round's two prefills: the fewest tokens first
    assert got["eight"][0] == 1 < finished["six"]  # the next round, beside the two running short rows
    assert jobs["six"].batch_size == jobs["eight"].batch_size == 3  # both base short rows (and the long one)
    assert got["long"][0] == 2  # prefilled in the first round the slow lane steps (rounds 3, 6, ... count from 1)
    # its prefill's token and a step's, then one round in three while short rows run, then every round
    assert got["long"][:6] == [2, 2, 5, 8, 9, 10]
    assert_alone(target, draft, list(jobs.values()))


def test_long_rows_do_not_starve_under_a_stream_of_short_requests():
    """A short request arrives every round for 120 rounds: the running long row still advances once every
    ``long_every`` rounds, and a long request queued behind full batches (``max_rows``) is admitted after
    ``max_wait_rounds``; both get their solo tokens."""
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, max_rows=3, short_tokens=4, fast_rows=2, long_every=4, max_wait_rounds=10,
                          short_slowdown=0)
    plan = [(0, [5, 6], 20, HOT, 1, None, "long"), (1, [7], 10, HOT, 2, None, "queued")]
    plan += [(r, [r % 50 + 1, 3], 4, HOT, 100 + r, None, f"s{r}") for r in range(1, 121)]
    jobs, got, finished = rounds_of(scheduler, plan)
    gaps = [b - a for a, b in zip(got["long"], got["long"][1:])]
    assert max(gaps) <= 4 and finished["long"] <= 4 * 20
    assert got["queued"][0] <= 1 + 10 + 1  # waited max_wait_rounds, then went ahead of the queued short requests
    assert finished["queued"] < 120  # long before the stream of short requests ends
    assert_alone(target, draft, [jobs["long"], jobs["queued"], jobs["s7"], jobs["s120"]])


@pytest.mark.parametrize("limit", [2, 0])
def test_a_burst_of_arrivals_is_prefilled_a_few_rows_per_round_short_ones_first(limit):
    """Five requests arrive in one round. The two short ones are prefilled at once; the long ones wait for the
    first round in which the slow lane steps (one in ``long_every=4`` while short requests run): with
    ``prefill_rows=2`` two of them then, in arrival order, and the third in the next such round; with 0, all three
    at once. The short rows step every round meanwhile, and each request gets its solo tokens."""
    target, draft = lm(0), lm(1, 1)
    scheduler = Scheduler(target, draft, short_tokens=8, long_every=4, prefill_rows=limit, short_slowdown=0)
    plan = [(0, [5, 6, 7], 20, HOT, 1, None, "long1"), (0, [9, 9], 18, GREEDY, 2, 3, "long2"),
            (0, [1, 2, 3], 8, HOT, 3, None, "short8"), (0, [2, 7], 24, NUCLEUS, 5, None, "long3"),
            (0, [4, 4], 5, HOT, 4, 2, "short5")]
    jobs, got, finished = rounds_of(scheduler, plan)
    first = {name: rounds[0] for name, rounds in got.items()}
    if limit:
        assert first == {"short5": 0, "short8": 0, "long1": 3, "long2": 3, "long3": 7}
    else:
        assert first == {"short5": 0, "short8": 0, "long1": 3, "long2": 3, "long3": 3}
    assert got["short8"][:4] == [0, 0, 1, 2]  # the prefill's token and the step's, then one a round: the later
    # prefills hold no row back
    assert_alone(target, draft, list(jobs.values()))


class FakeCosts:
    """A clock for the scheduler that its hook moves: a step of n rows takes ``step(n)``, a prefill of t prompt
    tokens ``prefill(t)`` (a GPU's flat costs or a CPU's steep ones, without timing anything; ``padded``: t is the
    pass's rows times its longest prompt, as a padded pass runs them). ``passes``: each prefill's prompt lengths."""

    def __init__(self, step, prefill, padded: bool = False):
        self.now, self.step, self.prefill, self.padded = 0.0, step, prefill, padded
        self.passes: list[list[int]] = []

    def clock(self) -> float:
        return self.now

    def hook(self, kind, jobs) -> None:
        if all(j.generator is None for j in jobs):  # a prefill: its rows have no generator yet
            lengths = [len(j.prompt) for j in jobs]
            self.passes.append(lengths)
            self.now += self.prefill(len(lengths) * max(lengths) if self.padded else sum(lengths))
        else:
            self.now += self.step(len(jobs))


def test_a_rounds_time_splits_into_its_passes_and_the_scheduling_besides():
    """Passes that take known times (prefills, prefill chunks, steps of base and speculative batches, the
    speculative batch released once it drained) and 0.25 of scheduling after every step (the ``observe`` callback,
    outside the passes), and a device that finishes each pass 0.125 after it returned (a GPU's kernels run after
    their launch: the pass waits for them): the scheduler counts every pass's time as its passes', the rest as the
    host's, and ``timing()`` gives both per round. Power: a prefill, a chunk or a released batch's passes counted
    as the host's, a batch timing its passes apart from the scheduler's, or the device's time left to the read
    back after the pass, would fail it."""
    target, draft = lm(0), lm(1, 1)
    fake = FakeCosts(lambda rows: 1.0 + rows, STEEP)
    passes = []  # each pass's cost, as its start (negated) and end on the fake clock

    def hook(kind, jobs):  # inside every pass: its cost
        passes.append(-fake.now)
        fake.hook(kind, jobs)
        passes.append(fake.now)

    def host(kind, rows):
        fake.now += 0.25

    scheduler = Scheduler(target, draft, clock=fake.clock, hook=hook, observe=host, prefill_chunk=8)
    assert scheduler.pass_time.sync is None  # a CPU's passes are done when they return; a GPU's are waited for:

    def device(seconds=0.125):  # as if each pass's kernels ran on after it returned
        fake.now += seconds
        passes.append(seconds)

    scheduler.pass_time.sync = device
    plan = [(0, prompt(3, 1), 6, HOT, 1, None), (0, prompt(20, 2), 20, HOT, 2, None),
            (2, prompt(5, 3), 4, HOT, 3, 2), (2, prompt(4, 4), 18, HOT, 4, None)]
    jobs = run_rounds(scheduler, plan)
    assert all(j.done and j.failure is None for j in jobs) and not scheduler.spec  # the speculative batch released
    assert scheduler.round_seconds == fake.now  # the rounds' time: all the clock moved
    assert scheduler.pass_seconds == pytest.approx(sum(passes)) and scheduler.pass_seconds > 0
    assert passes.count(0.125) == scheduler.pass_time.passes >= scheduler.steps + 4  # every pass synced
    assert scheduler.host_seconds == pytest.approx(0.25 * scheduler.steps)
    timing = scheduler.timing()
    assert timing["rounds"] == scheduler.rounds and timing["host_share"] == pytest.approx(
        0.25 * scheduler.steps / fake.now, abs=1e-4)
    assert timing["host_us"] == pytest.approx(0.25 * scheduler.steps / scheduler.rounds * 1e6, abs=0.1)
    assert Scheduler(target).timing() is None


STEEP = lambda tokens: 5.0 + tokens  # noqa: E731 - a CPU's prefill: its tokens' time and a little more per pass
FLAT = lambda tokens: 1.0  # noqa: E731 - a GPU's: a pass of a few short prompts takes one's time


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7 + i * 3) % 50 + 1 for i in range(n)]


@pytest.mark.parametrize("gamma", [None, 2])
@pytest.mark.parametrize("costs,passes", [(STEEP, [[3, 4], [38, 40]]), (FLAT, [[3, 4, 38, 40]])])
def test_arrivals_are_prefilled_in_the_passes_the_measured_costs_say_cost_least(costs, passes, gamma):
    """A prompt of 3 tokens and one of 40 are prefilled alone (the costs measured), then prompts of 40, 3, 38 and 4
    tokens arrive together. Where a prefill costs its padded tokens and a little more per pass (a CPU), the short
    prompts go in one pass and the long ones in another (87 token-times against 160 in one pass, padded to 40, and
    88 in four); where a pass costs the same at any size (a GPU), all four go in one. Every request gets its solo
    tokens (and acceptance). Power: with ``group_prefills=False`` the CPU's costs get one pass (below)."""
    target, draft = lm(0), lm(1, 1)
    for group in (True, False):
        fake = FakeCosts(lambda rows: 1.0, costs, padded=True)
        scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, clock=fake.clock, hook=fake.hook,
                              group_prefills=group)
        plan = [(0, prompt(3, 1), 2, HOT, 1, gamma), (3, prompt(40, 2), 2, HOT, 2, gamma)]
        plan += [(9, prompt(n, 3 + i), 6, HOT, 3 + i, gamma) for i, n in enumerate([40, 3, 38, 4])]
        jobs = run_rounds(scheduler, plan)
        arrivals = [sorted(p) if group else p for p in fake.passes[2:]]
        assert fake.passes[:2] == [[3], [40]] and arrivals == (passes if group else [[40, 3, 38, 4]])
        assert scheduler.prefills == len(fake.passes)
        (info,) = scheduler.measured().values()  # per batch: the passes, their prompts' tokens and padded ones
        assert (info["prefill_passes"], info["prompt_tokens"]) == (len(fake.passes), 3 + 40 + 40 + 3 + 38 + 4)
        assert info["padded_tokens"] == sum(len(p) * max(p) for p in fake.passes) == scheduler.prefill_tokens
        assert_alone(target, draft, jobs)


@pytest.mark.parametrize("step,prefill,slowdown,together", [
    (lambda rows: 1.0, FLAT, 1.5, True),  # a GPU: the burst joins in one round
    (lambda rows: float(rows), STEEP, 1.5, False),  # a CPU: prefill_rows a round
    (lambda rows: 1.0, FLAT, 0, False),  # the measured-cost priority off: the limit holds
    (lambda rows: float(rows), FLAT, 1.5, False),  # prefills cost nothing more, but steps of more rows do
], ids=["flat", "steep", "flat-priority-off", "steps-grow"])
def test_a_burst_joins_in_one_round_where_the_measured_costs_say_its_prefills_cost_next_to_nothing(
        step, prefill, slowdown, together):
    """Three long requests decode (their prefills and steps measured the costs), then six short ones arrive at
    once, two prefills a round (``prefill_rows=2``). Where a prefill and a step cost the same at any size (a GPU),
    the four past the limit cost next to nothing: all six join in that round. Where costs grow with tokens and rows
    (a CPU), or where only the steps grow with rows, or with ``short_slowdown=0``, they join two a round. Every
    request gets its solo tokens. Power: without the rule the flat case fails, and without its step condition the
    steps-grow case (run and seen)."""
    target = lm(0)
    fake = FakeCosts(step, prefill, padded=True)
    scheduler = Scheduler(target, short_tokens=8, prefill_rows=2, short_slowdown=slowdown, clock=fake.clock,
                          hook=fake.hook)
    plan = [(0, prompt(3, 1), 30, HOT, 1, None, "long1"), (1, prompt(3, 2), 30, HOT, 2, None, "long2"),
            (1, prompt(3, 3), 30, HOT, 3, None, "long3")]
    plan += [(4, prompt(3, 10 + i), 6, HOT, 10 + i, None, f"s{i}") for i in range(6)]
    jobs, got, finished = rounds_of(scheduler, plan)
    first = [got[f"s{i}"][0] for i in range(6)]
    assert first == ([4] * 6 if together else [4, 4, 5, 5, 6, 6])
    assert scheduler.free_joins == (4 if together else 0)
    assert_alone(target, None, list(jobs.values()))


@pytest.mark.parametrize("seeded", [True, False])
def test_a_scheduler_starts_from_the_warm_ups_costs_so_its_opening_burst_joins_at_once(seeded):
    """Flat costs measured before (as a replica's warm-up measures them) and handed to a new scheduler: six short
    requests arriving at once in its first round all join then, past ``prefill_rows=2``. Without the costs (power)
    nothing is measured yet, and they join two a round. Every request gets its solo tokens."""
    target = lm(0)
    flat = StepCosts()
    for rows in (1, 2, 4):
        flat.add_step(rows, 1.0, rows)
    for tokens in (3, 6):
        flat.add_prefill(tokens, tokens, 1.0)
    fake = FakeCosts(lambda rows: 1.0, FLAT, padded=True)
    scheduler = Scheduler(target, short_tokens=8, prefill_rows=2, clock=fake.clock, hook=fake.hook,
                          costs={"base": flat} if seeded else None)
    plan = [(0, prompt(3, 10 + i), 6, HOT, 10 + i, None, f"s{i}") for i in range(6)]
    jobs, got, finished = rounds_of(scheduler, plan)
    assert [got[f"s{i}"][0] for i in range(6)] == ([0] * 6 if seeded else [0, 0, 1, 1, 2, 2])
    assert scheduler.prefills == len(fake.passes)  # it counts its own passes, not those the costs came from
    assert_alone(target, None, list(jobs.values()))


def test_arrivals_the_slots_have_no_room_for_all_at_once_join_in_their_order(monkeypatch, pairs):
    """As above, with the CPU's costs, but the device holds four slots and two rows decode: the arrivals are not
    regrouped by length; the first two in arrival order (40 and 3 tokens) join in one pass, the others when rows
    have left. Power: regrouped first, the short prompts (3 and 4 tokens) took the two free slots, and the 40-token
    arrival was passed by one that arrived after it (run and seen)."""
    target, draft = pair(pairs, "full")
    refused = device_rows(monkeypatch, 4)
    fake = FakeCosts(lambda rows: 1.0, STEEP, padded=True)
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, fast_rows=1, clock=fake.clock,
                          hook=fake.hook)  # one fast row: the arrivals join one lane (each lane's are grouped)
    plan = [(0, prompt(3, 1), 1, HOT, 1, None), (1, prompt(40, 2), 1, HOT, 2, None)]
    plan += [(2, prompt(2, 9 + i), 20, HOT, 9 + i, None) for i in range(2)]
    plan += [(4, prompt(n, 3 + i), 5, HOT, 3 + i, None) for i, n in enumerate([40, 3, 38, 4])]
    jobs = run_rounds(scheduler, plan)
    assert refused and fake.passes[:5] == [[3], [40], [2], [2], [40, 3]]
    assert_alone(target, draft, jobs)


def measured_rounds(costs: FakeCosts, slowdown: float, long_every: int = 6, fast_rows: int = 1):
    """Three long requests decode; a short one arrives in round 3, a long one in round 4. Returns (the rounds in
    which each got tokens, the short request's latency on the fake clock, the scheduler)."""
    target = lm(0)
    scheduler = Scheduler(target, short_tokens=8, fast_rows=fast_rows, long_every=long_every, prefill_rows=2,
                          short_slowdown=slowdown, clock=costs.clock, hook=costs.hook)
    plan = {0: [("long1", [5, 6, 7], 30, 1), ("long2", [9, 9], 30, 2), ("long3", [2, 7], 30, 3)],
            3: [("short", [1, 2, 3], 8, 4)], 4: [("late", [4, 4], 20, 5)]}
    got: dict[str, list[int]] = {}
    jobs, done_at = {}, {}
    with torch.no_grad():
        for rnd in range(200):
            for name, prompt, new, seed in plan.get(rnd, []):
                jobs[name] = scheduler.submit(Job(prompt, new, HOT, seed, tag=(0, prompt, new, HOT, seed, None),
                                                  on_step=lambda t, a, name=name, rnd=rnd: got.setdefault(name, [])))
                jobs[name].on_step = lambda t, a, name=name: got.setdefault(name, []).append(scheduler.rounds)
                jobs[name].on_done = lambda j, name=name: done_at.setdefault(name, costs.now)
            scheduler.run_once()
            if rnd > 4 and not scheduler.running and not scheduler._queue:
                break
    assert_alone(target, None, list(jobs.values()))
    return got, done_at["short"] - jobs["short"].clocked, scheduler


def test_long_rows_step_beside_short_ones_where_a_step_costs_the_same_at_any_size():
    """Flat costs (a GPU: a step of any rows, and a prefill, take 1): the short request can afford the long work,
    so the slow lane steps with the fast one every round and the long arrival is prefilled as it comes, with every
    row's solo output. Power: with ``short_slowdown=0`` the slow lane waits for ``long_every``."""
    flat = FakeCosts(lambda rows: 1.0, lambda tokens: 1.0)
    got, latency, scheduler = measured_rounds(flat, 1.5)
    short = got["short"]
    gaps = [b - a for a, b in zip(got["long3"], got["long3"][1:]) if short[0] <= a <= short[-1]]
    assert gaps and max(gaps) == 1  # the slow-lane row: every round while the short one ran
    assert got["late"][0] <= 6  # arrived in round 5 (rounds count from 1): prefilled at once or in the next
    assert scheduler.long_rounds >= len(short) - 2
    assert latency <= 1.5 * (1 + 7)  # its latency alone: a prefill (its first token) and 7 one-row steps
    off, _, _ = measured_rounds(FakeCosts(lambda rows: 1.0, lambda tokens: 1.0), 0)
    assert max(b - a for a, b in zip(off["long3"], off["long3"][1:])) >= 5


def test_late_short_requests_do_not_hold_back_long_rows_when_stepping_every_row_costs_nothing_more():
    """Flat steps but prefills of ten steps' time, four short arrivals, one prefilled a round: the last ones are
    late from the start (no slack), yet stepping every row costs no more than the fast lane alone, so the slow
    lane still steps every round (the long arrival, whose prefill would cost them, waits). Power: without that
    exception the slow lane waits for ``long_every``."""
    target = lm(0)

    def run(negligible):
        costs = FakeCosts(lambda rows: 1.0, lambda tokens: 10.0)
        scheduler = Scheduler(target, short_tokens=8, fast_rows=1, long_every=8, prefill_rows=1,
                              short_slowdown=1.5, clock=costs.clock, hook=costs.hook)
        plan = {0: [("long1", [5, 6, 7], 30), ("long2", [9, 9], 30)], 2: [("long3", [2, 7], 30)],
                4: [(f"short{i}", [1, 2, i + 3], 8) for i in range(4)] + [("late", [4, 4], 20)]}
        got, jobs = {}, {}
        real = continuous.NEGLIGIBLE
        continuous.NEGLIGIBLE = negligible
        try:
            with torch.no_grad():
                for rnd in range(300):
                    for name, prompt, new in plan.get(rnd, []):
                        job = Job(prompt, new, HOT, len(jobs), tag=(0, prompt, new, HOT, len(jobs), None),
                                  on_step=lambda t, a, name=name: got.setdefault(name, []).append(scheduler.rounds))
                        jobs[name] = scheduler.submit(job)
                    scheduler.run_once()
                    if rnd > 4 and not scheduler.running and not scheduler._queue:
                        break
        finally:
            continuous.NEGLIGIBLE = real
        assert_alone(target, None, list(jobs.values()))
        shorts = [r for i in range(4) for r in got[f"short{i}"]]
        return [r for r in got["long3"] if min(shorts) <= r <= max(shorts)], got, (min(shorts), max(shorts))

    during, got, (first, last) = run(continuous.NEGLIGIBLE)
    assert len(during) >= last - first - 1  # the slow-lane row stepped (about) every round of the short ones
    assert got["late"][0] > first + 2  # the long arrival waited: its prefill would cost the late short ones
    held, _, (first, last) = run(-1.0)  # no extra cost negligible: the rule without the exception
    assert len(held) < (last - first) / 2


def test_long_work_waits_while_it_would_make_a_short_request_too_slow():
    """Steep costs (a CPU: a step costs 1 + rows, a prefill 1 + its tokens): the rounds with long work cost a
    short request more than its slack, so it gets few of them and finishes within ``short_slowdown`` times its
    latency alone (by the fake clock); the slow lane still steps every ``long_every`` rounds. Power: with a slack
    that never binds every round steps every row, and the bound fails."""
    def steep():
        return FakeCosts(lambda rows: 1.0 + rows, lambda tokens: 1.0 + tokens)

    alone = (1 + 3) + 7 * 2  # its prefill of 3 tokens (its first token), then 7 steps of one row
    got, latency, scheduler = measured_rounds(steep(), 1.5, long_every=8)
    short = got["short"]
    assert latency <= 1.5 * alone
    during = [r for r in got["long3"] if short[0] < r <= short[-1]]
    assert 1 <= len(during) < len(set(short)) - 1  # some long rounds, far from all
    gaps = [b - a for a, b in zip(got["long3"], got["long3"][1:])]
    assert max(gaps) <= 8
    # a slack that never binds (a latency alone taken as unbounded): long work every round, the short one too slow
    real = StepCosts.unloaded
    StepCosts.unloaded = lambda self, job: 1e9
    try:
        _, wrong, _ = measured_rounds(steep(), 1.5, long_every=8)
    finally:
        StepCosts.unloaded = real
    assert wrong > 1.5 * alone


def test_long_rows_leave_the_fast_lane_while_stepping_beside_a_short_request_would_make_it_too_slow(monkeypatch):
    """Steep costs and room for four rows in the fast lane: the three long rows are there when the short request
    arrives and joins them. Stepping them beside it costs it more than its slack, so they leave for the slow lane
    (which steps every ``long_every`` rounds or by the slack) and the short request finishes within
    ``short_slowdown`` times its latency alone, every row with its solo output. With flat costs they stay. Power:
    long rows kept in the fast lane make the short request too slow."""
    def steep():
        return FakeCosts(lambda rows: 1.0 + rows, lambda tokens: 1.0 + tokens)

    alone = (1 + 3) + 7 * 2
    got, latency, scheduler = measured_rounds(steep(), 1.5, long_every=8, fast_rows=4)
    assert latency <= 1.5 * alone
    assert scheduler.moves >= 3  # the fast lane's long rows left for the short one
    short = got["short"]
    gaps = [b - a for a, b in zip(got["long1"], got["long1"][1:])]
    assert max(gaps) <= 8 and len([r for r in got["long1"] if short[0] < r <= short[-1]]) < len(set(short)) - 1
    _, flat_latency, flat = measured_rounds(FakeCosts(lambda rows: 1.0, lambda tokens: 1.0), 1.5, fast_rows=4)
    assert flat.moves == 0 and flat_latency <= 1.5 * (1 + 7)
    # the same load with the long rows kept in the fast lane: the short request pays for them every round
    real = Scheduler._room
    monkeypatch.setattr(Scheduler, "_room", lambda self: real(self)._replace(fast_longs=True))
    _, kept, _ = measured_rounds(steep(), 1.5, long_every=8, fast_rows=4)
    assert kept > 1.5 * alone


def test_a_failing_cost_estimate_leaves_the_long_rows_to_long_every(monkeypatch, caplog):
    """The measured-cost rule raising (a bug, a clock gone wrong) costs only its rounds' long work: every request
    still gets its solo output, the slow lane steps every ``long_every`` rounds, and the log says why."""
    def broken(self):
        raise ArithmeticError("no estimate today")

    monkeypatch.setattr(Scheduler, "_room", broken)
    flat = FakeCosts(lambda rows: 1.0, lambda tokens: 1.0)
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        got, _, scheduler = measured_rounds(flat, 1.5)
    assert "no estimate today" in caplog.text and scheduler.long_rounds == 0
    short = got["short"]
    assert len([r for r in got["long3"] if short[0] < r <= short[-1]]) <= 2


def test_step_costs_estimate_between_and_beyond_what_was_measured():
    costs = StepCosts(weight=0.5)
    assert costs.steps.estimate(1) is None and costs.unloaded(Job([1, 2], 4)) is None
    costs.add_step(4, 3.0, 4)
    assert costs.steps.estimate(4) == 3.0
    assert costs.steps.estimate(2) == 1.5  # one size measured: at least proportional below it
    assert costs.steps.estimate(8) == 6.0  # ... and above it
    costs.add_step(8, 5.0, 8)
    assert costs.steps.estimate(6) == 4.0  # between two sizes: on their line
    assert costs.steps.estimate(1) == 1.5  # below: their line (3 - 0.5 * 3), at least 3 * 1 / 4 = 0.75
    assert costs.steps.estimate(16) == 9.0  # above: their line
    costs.add_step(4, 2.0, 4)  # a moving average: 3 + 0.5 * (2 - 3)
    assert costs.steps.estimate(4) == 2.5
    costs.prefills.add(10, 2.0)
    assert costs.unloaded(Job([1] * 10, 4)) == pytest.approx(2.0 + 3 * costs.steps.estimate(1))  # base: the
    # prefill gives the first token
    costs.add_step(2, 1.0, 6)  # speculative steps giving 3 tokens a row: a third of the steps
    assert costs.tokens_per_step == 2.0 and costs.steps_left(5) == 3
    # outliers: a first step that compiled its graph, then ordinary ones; a spike after them
    costs.add_step(16, 5.0, 16)
    costs.add_step(16, 0.002, 16)
    assert costs.steps.estimate(16) == 0.002  # under half the average: the average was the outlier
    costs.add_step(16, 1.0, 16)
    assert costs.steps.estimate(16) == pytest.approx(0.002 + 0.5 * 0.002)  # counted as twice the average


def naive_estimate(seconds: dict[int, float], size: int) -> float | None:
    """The estimate's reference: every measured size sorted, searched in full (what the scheduler's table does with
    its sizes kept in order)."""
    if not seconds:
        return None
    if size in seconds:
        return seconds[size]
    points = sorted(seconds.items())
    below, above = [p for p in points if p[0] < size], [p for p in points if p[0] > size]
    if below and above:
        (n1, c1), (n2, c2) = below[-1], above[0]
        return c1 + (c2 - c1) * (size - n1) / (n2 - n1)
    near = above[:2] if above else below[-2:]
    n1, c1 = near[0] if above else near[-1]
    slope = (near[1][1] - near[0][1]) / (near[1][0] - near[0][0]) if len(near) == 2 else c1 / n1
    line = c1 + max(slope, 0.0) * (size - n1)
    return max(line, c1 * size / n1) if above else max(line, c1)


def test_the_cost_tables_estimates_equal_their_reference_over_many_tables():
    """Tables of 1 to 300 measured sizes (repeats included: moving averages), each estimated below, between, at and
    above its sizes, as the reference searches them."""
    import random

    rng = random.Random(0)
    for trial in range(60):
        table = CostTable(0.25)
        for _ in range(rng.choice([1, 2, 3, 10, 300])):
            table.add(rng.randint(1, 400), rng.random() * 10)
        assert list(table._sizes) == sorted(table.seconds)
        for size in [1, 2, 401, 800, *rng.sample(range(1, 500), 40), *table.seconds]:
            assert table.estimate(size) == pytest.approx(naive_estimate(table.seconds, size), rel=1e-12), (trial, size)


def test_a_long_lived_prefill_table_stays_bounded_and_close():
    """Every padded length from 1 to 131,072 tokens (32 rows of 4,096), measured once at a cost linear in the
    tokens: the table keeps every size up to 64 and a few hundred in all, and estimates every length within 1/32 of
    its cost."""
    table = CostTable(0.25)
    cost = lambda n: 0.002 + 1e-5 * n  # noqa: E731
    top = 32 * 4096
    for n in range(1, top + 1):
        table.add(n, cost(n))
    assert all(n in table.seconds for n in range(1, 65))
    assert len(table.seconds) <= 64 + 16 * (top.bit_length() - 7) + 1  # 16 a power-of-two octave past 64
    for n in [*range(1, 300), *range(300, top, 997), top]:
        assert table.estimate(n) == pytest.approx(cost(n), rel=1 / 32), n


@pytest.mark.parametrize("kind", ["full", "nsa"])
def test_priority_keeps_every_requests_solo_output(pairs, kind):
    """The mixed plan (every mode, sampling and gamma, arrivals at different rounds) under a tight priority policy:
    a fast lane of three rows and long rows stepped one round in two."""
    target, draft = pair(pairs, kind)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=12, fast_rows=3, long_every=2)
    jobs = run_rounds(scheduler, MIXED)
    assert_alone(target, draft, jobs)
    # the policy had rows to order: short ones, long rows moved out of a fast lane of several rows
    assert sum(scheduler.short(j) for j in jobs) == 5 and scheduler.moves >= 1


def test_warm_up_decodes_throwaway_batches_and_leaves_nothing_behind():
    """A replica's warm-up decodes batches of 5, 2 and 1 requests in base and speculative decoding through the
    models themselves, each batch's prompts prefilled together, leaves the global random state as it was, and fails
    with the error a model gives."""
    target, draft = lm(0), lm(1, 1)
    shapes: list[tuple[int, ...]] = []
    real = target.forward

    def seen(tokens, *args, **kwargs):
        shapes.append(tuple(tokens.shape))
        return real(tokens, *args, **kwargs)

    target.forward = seen
    state = torch.get_rng_state()
    try:
        out = warm_up(target, draft, rows=5, gamma=3, tokens=2)
    finally:
        target.forward = real
    assert out["rows"] == 2 * (5 + 2 + 1) and out["seconds"] > 0
    assert torch.equal(torch.get_rng_state(), state)
    assert {5, 2, 1} <= {s[0] for s in shapes}  # every batch went through the target (rows leave as they finish)
    assert (5, 4) in shapes  # speculative: a verify pass of gamma + 1 tokens over 5 rows
    # each batch's prompts in one prefill (here base decoding's 2 prompts of 1 and 2 tokens), though the costs
    # measured by then would have cut them into two passes (power: with group_prefills on, no (2, 2) pass)
    assert (2, 2) in shapes
    # the costs it measured, for the replica's scheduler to start from: steps of every batch's rows, prefills
    assert {5, 2, 1} <= set(out["costs"]["base"].steps.seconds) and out["costs"]["base"].prefill_passes >= 3
    assert set(out["costs"]) == {"base", "speculative gamma=3"}
    assert warm_up(target, draft, rows=0) == {"rows": 0, "seconds": 0.0}
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match="warm-up rows"):
            warm_up(target, rows=bad)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    draft.forward = broken
    with pytest.raises(RuntimeError, match="no kernel for this device"):
        warm_up(target, draft, rows=2, gamma=3)


def test_warm_up_keeps_a_cache_of_every_width_so_the_first_long_requests_take_no_new_memory():
    """After a replica's warm-up (its requests need a batch's fewest positions), a burst of four speculative requests
    that need twice as many widens its slots into caches the warm-up kept: no slot cache is allocated anew, for the
    target and the draft alike. (The pool keeps one cache of a size: a second batch that widens to the same size
    takes new memory.) Power: without them, the widened slots were allocated (fresh memory: page faults on a CPU)."""
    target, draft = lm(0), lm(1, 1)
    decode.free_memory()
    warm_up(target, draft, rows=4, gamma=2, tokens=2)
    widths = decode.fit_widths(target)
    assert widths == [64, 128]
    made = []
    for model in (target, draft):
        real = model.new_cache
        model.new_cache = lambda b, n, _real=real, _m=model: made.append((_m, b, n)) or _real(b, n)
    try:
        plan = [(0, [i + 1, 2], 70, HOT, 800 + i, 2) for i in range(4)]  # one batch: the target's slots and the draft's
        scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0)
        jobs = run_rounds(scheduler, plan)
    finally:
        del target.new_cache, draft.new_cache
    assert [m[1:] for m in made if m[2] == 128] == []  # the widened slots: none made anew
    assert_alone(target, draft, jobs)


def test_warm_up_fits_its_requests_in_a_short_context():
    """A context of 8 tokens: base requests of 4 new tokens, speculative ones with gamma 5 get 2 (1 + 2 + 5 = 8);
    with gamma 7 no speculative request fits, and that warm-up is skipped rather than failing the replica."""
    cfg = recipes.get("lm_debug").override({"model.depth": 1, "model.max_seq_len": 8})
    target, draft = (build_model(cfg).eval() for _ in range(2))
    assert warm_up(target, draft, rows=2, gamma=5)["rows"] == 2 * (2 + 1)
    assert warm_up(target, draft, rows=2, gamma=7)["rows"] == 2 + 1


def test_priority_settings_are_checked_and_reach_the_scheduler(debug_exports):
    target = lm(0)
    for bad in ({"short_tokens": -1}, {"fast_rows": 0}, {"long_every": 0}, {"max_wait_rounds": -2},
                {"long_every": 2.5}, {"fast_rows": True}, {"prefill_rows": -1}, {"short_slowdown": 0.5},
                {"short_slowdown": True}, {"short_slowdown": float("nan")}, {"short_slowdown": float("inf")},
                {"short_slowdown": "2"}, {"group_prefills": 1}, {"group_prefills": "no"}):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            Scheduler(target, **bad)
    from efftx.serving.app_args import TextAppArgs
    from efftx.serving.text import build

    args = TextAppArgs(target="/nowhere/target", short_tokens="4", long_every=2, prefill_rows=0, short_slowdown="2.5",
                       group_prefills="false")
    assert args.priority() == {"short_tokens": 4, "long_every": 2, "prefill_rows": 0, "short_slowdown": 2.5,
                               "group_prefills": False}
    with pytest.raises(ValueError, match="group_prefills"):
        TextAppArgs(target="/nowhere/target", group_prefills="sometimes")
    for bad in ("0.5", "-1", "fast"):
        with pytest.raises(ValueError, match="short_slowdown"):
            TextAppArgs(target="/nowhere/target", short_slowdown=bad)
    assert TextAppArgs(target="/nowhere/target", short_slowdown=0).priority() == {"short_slowdown": 0}
    assert build(args)._bound_deployment.init_kwargs["priority"] == args.priority()
    assert "priority" not in build(TextAppArgs(target="/nowhere/target"))._bound_deployment.init_kwargs
    from efftx.serving.text import TextGenerator

    cls = TextGenerator.func_or_class.__bases__[0]  # the app's own class (Serve's ingress wrapper left un-awaited
    # coroutines behind when built outside Serve)
    replica = cls(debug_exports["target"], priority={"short_tokens": 4, "long_every": 2, "short_slowdown": 2.5,
                                                     "group_prefills": False, "pipeline": True})
    try:  # the replica's scheduler (built outside Serve here) has the settings, the defaults for the others
        assert (replica.scheduler.short_tokens, replica.scheduler.long_every) == (4, 2)
        assert replica.scheduler.short_slowdown == 2.5 and replica.scheduler.group_prefills is False
        assert replica.scheduler.pipeline is True and replica.batching["pipeline"] is True  # on a CPU: as asked
        assert replica.scheduler.fast_rows == Scheduler(target).fast_rows
    finally:
        replica.scheduler.close()
    with pytest.raises(ValueError, match="fast_rows: only with batching=continuous"):
        TextAppArgs(target="/nowhere/target", batching="static", fast_rows=3)


def test_the_decoding_thread_keeps_the_builders_torch_threads():
    """torch.set_num_threads is per thread: a new thread starts with the process default (every core outside Ray,
    OMP_NUM_THREADS inside). The decoding thread takes the builder's count, so a replica that set 1 thread decodes
    on one core (the process's CPU time for a product in the decoding thread is that thread's own), and one that
    set 2 on two."""
    needs_two_cores()
    used = []
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            scheduler = Scheduler(lm(0), hook=lambda kind, jobs: used.append(cores_used())).start()
            done = threading.Event()
            scheduler.submit(Job([1, 2], 1, HOT, 1, on_done=lambda j: done.set()))
            assert done.wait(60)
            scheduler.close()
            assert (used[-1] < 1.3) if threads == 1 else (used[-1] > 1.3), (threads, used)
    finally:
        torch.set_num_threads(before)

"""Coupled speculative requests in continuous batching: each row's tokens are its base tokens (same seed, same
settings) whatever draft length each step takes (chosen by the load, forced at random here, or none: steps of the
target alone, after which the draft catches up), on every backend; the draft lengths are chosen by measured costs
and acceptance (checked against a brute-force reference); a warm-up measures every length."""

import copy
import random

import pytest
import torch

from efftx.generation.decode import generate
from efftx.serving.continuous import Job, Sampling, Scheduler, warm_up
from efftx.generation.draft_length import DraftLength

from test_serve_continuous import HOT, NUCLEUS, lm, run_rounds

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/conftest.py

# (arrival round, prompt, max_new_tokens, sampling, seed, gamma, max_gamma or None)
PLAN = [
    (0, [5, 6, 7], 14, HOT, 1, 3, None),
    (0, [9] * 12, 20, NUCLEUS, 2, 3, None),
    (0, [1, 2], 9, Sampling(0.0), 3, 3, None),
    (1, [42], 15, HOT, 4, 3, None),
    (2, [3, 1, 4, 1, 5], 12, HOT, 5, 3, None),
    (3, [8, 8], 6, NUCLEUS, 6, 3, None),
    (3, [2, 4, 6, 8, 10, 12, 14], 18, HOT, 9, 2, 5),
    (5, [7, 7, 7, 7], 25, HOT, 7, 2, 5),
]


@pytest.fixture(scope="module")
def pairs():
    return {}


def pair(pairs, kind: str, noise: float = 0.3):
    """A target and a noisy copy of it as the draft (coupled acceptance needs a draft close to its target: unrelated
    random models never agree), per backend."""
    if kind not in pairs:
        target = lm(0, 2, kind)
        draft = copy.deepcopy(target)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise * p.abs().mean().clamp_min(1e-3))
        pairs[kind] = (target, draft)
    return pairs[kind]


def coupled_job(p):
    return Job(p[1], p[2], p[3], p[4], p[5], max_gamma=p[6], coupled=True, tag=p)


def base_tokens(target, p):
    s = p[3]
    return generate(target, [p[1]], p[2], temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                    seed=p[4])[0].tolist()


def random_lengths(monkeypatch, seed=0):
    """Each step's draft length at random in [0, the rows' longest]: what a load-driven choice may do."""
    rng = random.Random(seed)
    monkeypatch.setattr(DraftLength, "choose", lambda self, own: rng.randint(0, max(own)))


@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn", "nsa"])
def test_coupled_rows_get_their_base_tokens_whatever_the_draft_lengths(pairs, kind, monkeypatch):
    """Requests joining at different rounds, fixed and adaptive gammas, three samplings (greedy among them), every
    step's draft length at random (0 included): each row's tokens are base decoding's alone; drafts were both
    accepted and rejected; steps without drafts ran."""
    target, draft = pair(pairs, kind)
    random_lengths(monkeypatch)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0)
    jobs = run_rounds(scheduler, PLAN, coupled_job)
    for job in jobs:
        assert job.failure is None, (job.tag, job.failure)
        assert job.out == base_tokens(target, job.tag), (kind, job.tag)
    drafted = [d for j in jobs for d in j.stats.drafted]
    accepted = sum(n for j in jobs for n in j.stats.accepted)
    assert 0 in drafted and 0 < accepted < sum(drafted)
    assert max(j.batch_size for j in jobs) >= 3


def test_the_ratio_test_with_changing_lengths_does_not_keep_base_tokens(pairs):
    """Why coupling: rows of the ratio test get the target's distribution, not the base tokens of their seed."""
    target, draft = pair(pairs, "full")
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0)
    jobs = run_rounds(scheduler, PLAN, lambda p: Job(p[1], p[2], p[3], p[4], p[5], max_gamma=p[6], tag=p))
    sampled = [j for j in jobs if j.tag[3].temperature > 0]
    assert any(j.out != base_tokens(target, j.tag) for j in sampled)


def test_the_draft_catches_up_after_steps_without_drafts(monkeypatch):
    """The target as its own draft, draft lengths 0, 0, 3, 0, 2, 0, 0, 0, 4, ... in turn: every drafting step
    accepts every draft, which it does only if the draft's cache holds every token of the steps that did not draft
    (fed in its first pass). A variant that loses the backlog but its last token accepts less."""
    target = lm(0, 2)
    cycle = [0, 0, 3, 0, 2, 0, 0, 0, 4]

    def run(hook=None):
        turn = iter(range(10 ** 6))
        monkeypatch.setattr(DraftLength, "choose", lambda self, own: min(cycle[next(turn) % len(cycle)], max(own)))
        scheduler = Scheduler(target, target, max_rows=4, short_tokens=0, hook=hook)
        jobs = [scheduler.submit(Job([3 + i, 1, 4], 30 + 3 * i, HOT, 20 + i, 4, coupled=True)) for i in range(3)]
        scheduler.drain()
        for i, job in enumerate(jobs):
            assert job.out == base_tokens(target, (0, [3 + i, 1, 4], 30 + 3 * i, HOT, 20 + i))
        return jobs

    jobs = run()
    steps = [(d, n) for j in jobs for d, n in zip(j.stats.drafted, j.stats.accepted)]
    assert any(d == 0 for d, _ in steps) and any(d > 0 for d, _ in steps)
    assert all(n == d for d, n in steps)

    def lose_backlog(kind, jobs):
        for job in jobs:
            job.draft_tail = job.draft_tail[-1:]

    broken = run(lose_backlog)
    assert any(n < d for j in broken for d, n in zip(j.stats.drafted, j.stats.accepted))


def reference_choice(costs: dict[int, float], a: float, own: list[int]) -> int:
    """The best length by brute force: most expected tokens a second, ties to the longer draft."""
    best, pick = -1.0, None
    for g in range(max(own), -1, -1):
        tokens = sum(sum(a ** i for i in range(min(g, o) + 1)) for o in own)
        rate = tokens / costs[g]
        if rate > best * (1 + 1e-12):
            best, pick = rate, g
    return pick


def test_draft_lengths_are_chosen_as_a_brute_force_reference_chooses():
    """Random step costs per length and rows, random acceptances and rows' own gammas: the choice equals the brute
    force's (costs read at the step's row count)."""
    rng = random.Random(0)
    for trial in range(300):
        cap = rng.randint(1, 7)
        lengths = DraftLength(cap)
        rows = rng.randint(1, 12)
        costs = {g: rng.uniform(0.5, 5.0) for g in range(cap + 1)}
        for g, c in costs.items():
            lengths.costs[g].add(rows, c)
        a = rng.choice([0.0, 0.3, 0.7, 0.95, 1.0])
        lengths.accepted, lengths.tried = a * 10, 10.0
        own = [rng.randint(1, cap) for _ in range(rows)]
        assert lengths.choose(own) == reference_choice(costs, a, own), trial


def test_a_cost_blind_choice_fails_the_reference():
    """The check's power: always the longest draft (a fixed gamma) disagrees with the reference."""
    rng = random.Random(1)
    misses = 0
    for _ in range(50):
        costs = {g: 1.0 + g * rng.uniform(0.1, 1.5) for g in range(6)}
        own = [5] * rng.randint(1, 8)
        misses += reference_choice(costs, 0.6, own) != 5
    assert misses > 10


def test_draft_lengths_measure_before_they_choose_and_learn_acceptance():
    lengths = DraftLength(3)
    picks = []
    for _ in range(4):  # unmeasured lengths first, the longest first
        g = lengths.choose([3, 3])
        picks.append(g)
        lengths.record(g, 2, 0.001 * (g + 1), [g, g], [g, 0])
    assert picks == [3, 2, 1, 0]
    assert lengths.choose([1, 1]) in (0, 1)  # at most the rows' own gamma
    before = lengths.acceptance
    for _ in range(50):
        lengths.record(1, 2, 0.002, [1, 1], [1, 1])  # every draft accepted
    assert lengths.acceptance > max(before, 0.9)
    lengths.least = 1
    assert all(lengths.choose([3]) >= 1 for _ in range(5))
    lengths.sweep = True
    assert [lengths.choose([2, 2]) for _ in range(4)] == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="cap"):
        DraftLength(0)


def test_a_warm_up_measures_every_draft_length_and_the_scheduler_starts_from_it():
    """warm_up(coupled=True): steps at every length 0..gamma, at several row counts; the acceptance is not the
    warm-up's (its prompts are not the replica's); the scheduler given its costs chooses from them at once, and
    reports them (``measured``)."""
    target, draft = lm(0, 2), lm(1, 1)
    warmed = warm_up(target, draft, rows=4, gamma=3, coupled=True)
    lengths = warmed["costs"]["speculative gamma=3 coupled"].lengths
    assert all(lengths.costs[g].seconds for g in range(4))
    assert all(len(lengths.costs[g].seconds) >= 2 for g in range(4))  # several row counts
    assert lengths.acceptance == 0.5 and not lengths.sweep
    warm_steps = sum(lengths.chosen)
    scheduler = Scheduler(target, draft, short_tokens=0, costs=warmed["costs"])
    job = scheduler.submit(Job([1, 2, 3], 12, HOT, 1, 3, coupled=True))
    scheduler.drain()
    assert job.out == base_tokens(target, (0, [1, 2, 3], 12, HOT, 1))
    report = scheduler.measured()["speculative gamma=3 coupled"]["draft_lengths"]
    assert sum(report["steps"]) > warm_steps > 0  # counted on from the warm-up's
    assert set(report["step_ms"]) == {"0", "1", "2", "3"}


def test_coupled_and_ratio_test_requests_batch_apart(pairs, monkeypatch):
    """A coupled request and a ratio-test request of the same gamma run in batches of their own; each gets its own
    tokens (base tokens for the coupled one, its library tokens for the other)."""
    from efftx.generation.speculative import speculative_generate

    target, draft = pair(pairs, "full")
    scheduler = Scheduler(target, draft, short_tokens=0)
    a = scheduler.submit(Job([1, 2, 3], 10, HOT, 4, 3, coupled=True))
    b = scheduler.submit(Job([1, 2, 3], 10, HOT, 4, 3))
    scheduler.run_once()
    assert set(scheduler.spec) == {(3, None, True), (3, None, False)}
    scheduler.drain()
    assert a.out == base_tokens(target, (0, [1, 2, 3], 10, HOT, 4))
    assert b.out == speculative_generate(target, draft, [[1, 2, 3]], 10, gamma=3, temperature=1.0, top_k=20,
                                         seed=4)[0][0]


def test_a_coupled_batchs_unloaded_latency_is_a_row_alone_at_its_best_length():
    """The priority's estimate of a short request's latency alone: for a coupled batch, steps of the length one row
    would take (its measured cost and expected tokens), not the batch's steps of every length mixed."""
    from efftx.serving.continuous import StepCosts

    costs = StepCosts()
    lengths = costs.draft_length(3)
    assert lengths.alone() is None  # before every length was measured
    for g, ms in enumerate((1.0, 1.2, 1.3, 2.0)):
        lengths.costs[g].add(1, ms / 1e3)
    lengths.accepted, lengths.tried = 8.0, 10.0  # 0.8: length 2 pays best alone (2.44 tokens in 1.3 ms)
    assert lengths.alone() == pytest.approx((1.3e-3, 1 + 0.8 + 0.64))
    costs.add_prefill(3, 3, 2e-3)
    costs.add_step(1, 5e-3, 1)  # the batch's measured steps: mixed lengths, about a token each
    job = Job([1, 2, 3], 10, HOT, 1, 3, coupled=True)
    assert costs.unloaded(job) == pytest.approx(2e-3 + 5 * 1.3e-3)  # 10 tokens, 2 a step
    assert costs.steps_left(10) == 5


def test_lengths_are_measured_again_at_far_larger_batches():
    """Costs measured at one row do not decide a step of 16: each length is tried there first (largest first), then
    the choice goes by the costs measured at that size (here a base step pays best)."""
    lengths = DraftLength(2)
    for g in range(3):
        lengths.costs[g].add(1, 0.001 * (1 + g / 10))
    assert lengths.costs[0].near(2) and not lengths.costs[0].near(3)
    picks = []
    for _ in range(3):
        g = lengths.choose([2] * 16)
        picks.append(g)
        lengths.record(g, 16, 0.002 * (1 + 3 * g), [g] * 16, [g] * 16)
    assert picks == [2, 1, 0]
    assert lengths.choose([2] * 16) == 0 and lengths.choose([2]) == 2

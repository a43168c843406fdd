"""The library's coupled speculative decoding with each step's draft length chosen by cost
(``speculative_generate(..., coupled=True, lengths=DraftLength(...))``): whatever lengths the steps take, 0 (the
target alone, the draft left behind) included, every row's tokens are base decoding's with the same seed, on every
backend, batched or alone, greedy or sampled, fixed or adaptive gamma; the draft catches up the tokens it missed
(with the target as its own draft every draft is accepted); the chooser measures every length and then follows its
measured costs; bad combinations are refused by name."""

import random

import pytest
import torch

from efftx.generation.decode import generate
from efftx.generation.draft_length import DraftLength
from efftx.generation.speculative import speculative_generate

from test_speculative import DECODING_KINDS, noisy_pair

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/conftest.py

PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [42], [1, 2]]
SAMPLING = {"temperature": 1.0, "top_k": 40}


class RandomLengths(DraftLength):
    """Each step's length at random in 0..the rows' longest own gamma (a seeded sequence), costs still recorded."""

    def __init__(self, cap: int, seed: int):
        super().__init__(cap)
        self.rng = random.Random(seed)

    def choose(self, own):
        return self.rng.randint(0, max(own))


def base_rows(target, prompts, n, seed, sampling):
    return [generate(target, [p], n, seed=seed + r, **sampling)[0].tolist() for r, p in enumerate(prompts)]


@pytest.mark.parametrize("kind", DECODING_KINDS)
def test_any_draft_lengths_give_base_tokens(kind):
    """Random lengths (0 in about a quarter of the steps): sampled rows batched (fixed and adaptive gamma), a row
    alone, and greedy rows all get their base tokens; steps of every length ran."""
    target, draft = noisy_pair(kind, noise=0.5)
    expected = base_rows(target, PROMPTS, 20, 11, SAMPLING)
    for extra in ({"gamma": 3}, {"gamma": 2, "adaptive_gamma": True, "max_gamma": 4}):
        lengths = RandomLengths(4, 0)
        out, stats = speculative_generate(target, draft, PROMPTS, 20, seed=11, coupled=True, lengths=lengths,
                                          **extra, **SAMPLING)
        assert out == expected, (kind, extra)
        assert lengths.chosen[0] > 0 and sum(lengths.chosen[1:]) > 0, lengths.chosen
        assert 0 in stats.drafted and 0 < stats.acceptance_rate < 1, (kind, extra)
    alone, _ = speculative_generate(target, draft, [PROMPTS[1]], 20, seed=12, coupled=True, lengths=RandomLengths(3, 1),
                                    gamma=3, **SAMPLING)
    assert alone[0] == expected[1]
    greedy, _ = speculative_generate(target, draft, PROMPTS, 16, gamma=3, temperature=0, coupled=True,
                                     lengths=RandomLengths(3, 2))
    assert greedy == base_rows(target, PROMPTS, 16, 0, {"temperature": 0})


def test_the_target_as_its_own_draft_accepts_every_draft_whatever_the_lengths():
    """After steps of length 0 the draft feeds the tokens it missed before drafting again: with the target as its
    own draft, each draft is then the target's token and is accepted (a draft that skipped them would not be)."""
    target, _ = noisy_pair("full", noise=0.5)
    lengths = RandomLengths(3, 3)
    out, stats = speculative_generate(target, target, PROMPTS, 24, gamma=3, seed=4, coupled=True, lengths=lengths,
                                      **SAMPLING)
    assert out == base_rows(target, PROMPTS, 24, 4, SAMPLING)
    assert lengths.chosen[0] >= 2 and sum(lengths.chosen[1:]) >= 3, lengths.chosen
    assert all(n == d for n, d in zip(stats.accepted, stats.drafted)), list(zip(stats.drafted, stats.accepted))
    assert sum(stats.drafted) > 0


def test_the_chooser_measures_every_length_then_follows_its_costs():
    """A real DraftLength: it tries every length at the batch's size first (longest first), records each step's
    cost, and, carried to another call, chooses among measured lengths; the tokens stay base decoding's."""
    target, draft = noisy_pair("full", noise=0.5)
    lengths = DraftLength(3)
    out, _ = speculative_generate(target, draft, PROMPTS, 20, gamma=3, seed=11, coupled=True, lengths=lengths,
                                  **SAMPLING)
    assert out == base_rows(target, PROMPTS, 20, 11, SAMPLING)
    assert all(lengths.costs[g].seconds for g in range(4)), lengths.report()
    steps = sum(lengths.chosen)
    # length 0 made far cheaper than drafting: the next call takes it (almost) every step
    for g in range(4):
        for rows in lengths.costs[g].seconds:
            lengths.costs[g].seconds[rows] = 1.0 if g else 1e-6
    out2, stats = speculative_generate(target, draft, PROMPTS, 20, gamma=3, seed=11, coupled=True, lengths=lengths,
                                       **SAMPLING)
    assert out2 == out
    assert lengths.chosen[0] > 0 and sum(lengths.chosen) > steps
    assert stats.drafted.count(0) > len(stats.drafted) // 2


def test_bad_combinations_are_refused_by_name():
    target, draft = noisy_pair("full")
    with pytest.raises(ValueError, match="coupled=True"):
        speculative_generate(target, draft, PROMPTS, 4, gamma=3, lengths=DraftLength(3), **SAMPLING)
    with pytest.raises(ValueError, match="up to 2 drafts"):
        speculative_generate(target, draft, PROMPTS, 4, gamma=3, coupled=True, lengths=DraftLength(2), **SAMPLING)
    with pytest.raises(ValueError, match="compile='off'"):
        speculative_generate(target, draft, PROMPTS, 4, gamma=3, coupled=True, lengths=DraftLength(3),
                             compile="on", **SAMPLING)
    assert torch.is_grad_enabled()  # nothing left behind


def test_acceptance_per_step_is_the_serving_engines_under_the_same_lengths(monkeypatch):
    """The same rows, seeds and sequence of random lengths through the library's loop and through continuous
    batching's engine (:class:`~efftx.serving.batches.SpeculativeEngine`, its own catch-up code): every row accepts
    the same drafts at every step. A draft cache rewound wrong, or a first pass read at the padding, changes what
    the draft proposes after a rejection, and so the acceptance."""
    from efftx.generation.speculative import SpecStats, iter_speculative_rows
    from efftx.serving.batches import Job, Sampling
    from efftx.serving.continuous import Scheduler

    target, draft = noisy_pair("full", noise=0.3)  # right often enough that rows lag by different counts
    prompts = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6]]

    def lengths_from(seed):
        rng = random.Random(seed)
        monkeypatch.setattr(DraftLength, "choose", lambda self, own: rng.randint(0, max(own)))

    from efftx.generation import speculative

    lagged, first_pass = [], speculative.draft_with_tails

    def recording(d_rows, tails, *rest):
        lagged.append(len({len(t) for t in tails}) > 1 and rest[2] > 0)  # a drafting step, rows padded apart
        return first_pass(d_rows, tails, *rest)

    monkeypatch.setattr(speculative, "draft_with_tails", recording)
    lengths_from(7)
    row_stats = [SpecStats(gamma=4) for _ in prompts]
    out = [[] for _ in prompts]
    for step in iter_speculative_rows(target, draft, prompts, 24, gamma=4, seed=11, coupled=True,
                                      lengths=DraftLength(4), row_stats=row_stats, **SAMPLING):
        for o, t in zip(out, step):
            o.extend(t)
    lengths_from(7)
    scheduler = Scheduler(target, draft, max_rows=8, short_tokens=0, prefill_rows=0)
    jobs = [scheduler.submit(Job(p, 24, Sampling(1.0, 40), 11 + r, 4, coupled=True)) for r, p in enumerate(prompts)]
    scheduler.drain()
    assert [j.out for j in jobs] == out == base_rows(target, prompts, 24, 11, SAMPLING)
    assert max(j.batch_size for j in jobs) == len(prompts)
    for r, job in enumerate(jobs):
        assert job.stats.drafted == row_stats[r].drafted, r
        assert job.stats.accepted == row_stats[r].accepted, r
    drafted = [d for s in row_stats for d in s.drafted]
    assert 0 in drafted and 0 < sum(n for s in row_stats for n in s.accepted) < sum(drafted)
    assert any(lagged)  # the first draft pass had rows padded to a longer tail

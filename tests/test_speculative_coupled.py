"""Coupled speculative decoding: a row's sampled tokens are base decoding's with the same seed, token for token, on
every backend, whatever the draft, gamma or batch; the device-side acceptance equals its host reference; wrong
variants (a draft accepted past a disagreement, a stream moved on by a step instead of by its tokens, drafts raced
with the wrong position's noise) fail these checks."""

import random

import pytest
import torch

from efftx.generation import speculative
from efftx.generation.decode import generate
from efftx.generation.sampling import Stream, position_noise, stream_noise
from efftx.generation.speculative import agreed, agreed_row, speculative_generate

from test_speculative import COMPILE_PROMPTS, DECODING_KINDS, lm, noisy_pair, static_eager

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: tests/conftest.py

PROMPTS = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [42], [1, 2]]
SAMPLING = {"temperature": 1.0, "top_k": 40}


def base_rows(target, prompts, n, seed):
    """Each row's sampled base tokens alone, row r with seed ``seed + r``."""
    return [generate(target, [p], n, seed=seed + r, **SAMPLING)[0].tolist() for r, p in enumerate(prompts)]


@pytest.mark.parametrize("kind", DECODING_KINDS)
def test_coupled_sampled_speculative_equals_sampled_base(kind):
    """Ragged rows batched, fixed gammas 1 and 3 and an adaptive gamma: every row's tokens are its base tokens with
    the same seed; drafts are both accepted and rejected (every rewind path runs)."""
    target, draft = noisy_pair(kind, noise=0.5)
    expected = base_rows(target, PROMPTS, 20, 11)
    for extra in ({"gamma": 1}, {"gamma": 3}, {"gamma": 2, "adaptive_gamma": True, "max_gamma": 5}):
        out, stats = speculative_generate(target, draft, PROMPTS, 20, seed=11, coupled=True, **extra, **SAMPLING)
        assert out == expected, (kind, extra)
        assert 0 < stats.acceptance_rate < 1, (kind, extra)


def test_coupled_rows_alone_unseeded_and_greedy():
    """A row alone gets its batched tokens; rows without a seed follow torch's global RNG (repeatable by
    manual_seed); greedy coupled decoding is greedy base decoding."""
    target, draft = noisy_pair("full", noise=0.5)
    batch, _ = speculative_generate(target, draft, PROMPTS, 16, gamma=3, seed=5, coupled=True, **SAMPLING)
    for r, prompt in enumerate(PROMPTS):
        assert speculative_generate(target, draft, [prompt], 16, gamma=3, seed=5 + r, coupled=True,
                                    **SAMPLING)[0][0] == batch[r]
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(speculative_generate(target, draft, PROMPTS, 16, gamma=3, coupled=True, **SAMPLING)[0])
    assert runs[0] == runs[1]
    greedy, _ = speculative_generate(target, draft, PROMPTS, 16, gamma=3, temperature=0, coupled=True)
    assert greedy == [generate(target, [p], 16, temperature=0)[0].tolist() for p in PROMPTS]


def test_an_identical_draft_is_always_accepted():
    """A draft raced with the target's own noise at each position picks the target's token: with the target as its
    own draft every draft is accepted (a draft raced with another position's noise is not)."""
    target = lm(0)
    out, stats = speculative_generate(target, target, [[1, 2, 3]], 24, gamma=4, seed=3, coupled=True, **SAMPLING)
    assert stats.mean_accepted == 4 and stats.histogram[-1] == stats.steps
    assert out == base_rows(target, [[1, 2, 3]], 24, 3)


def _wrong_accepts_one_more(best, drafted, own):
    packed = agreed(best, drafted, own)
    packed[:, 0] = torch.minimum(packed[:, 0] + 1, own)  # a draft accepted past the first disagreement
    packed[:, 1] = best.gather(1, packed[:, 0:1])[:, 0]
    return packed


def _wrong_step_advance(original):
    def variant(streams, count, width, device=None):  # a stream moved on by a draw a step, not its tokens
        noise = original(streams, count, width, device)
        for s in streams:
            if s is not None:
                s.draws -= 1
        return noise
    return variant


def _wrong_draft_noise(original):
    def variant(streams, count, width, device=None):  # drafts raced with the next position's noise
        noise = original(streams, count + 1, width, device)
        return noise[:, 1:].contiguous()
    return variant


WRONG = {
    "accepts past a disagreement": lambda mp: mp.setattr(speculative, "agreed", _wrong_accepts_one_more),
    "stream moved by steps": lambda mp: mp.setattr(speculative, "position_noise",
                                                   _wrong_step_advance(speculative.position_noise)),
    "the next position's noise": lambda mp: mp.setattr(speculative, "position_noise",
                                                       _wrong_draft_noise(speculative.position_noise)),
}


@pytest.mark.parametrize("variant", sorted(WRONG))
def test_the_equality_check_rejects_a_wrong_variant(monkeypatch, variant):
    target, draft = noisy_pair("full", noise=0.5)
    expected = base_rows(target, PROMPTS, 20, 11)
    WRONG[variant](monkeypatch)
    out, _ = speculative_generate(target, draft, PROMPTS, 20, gamma=3, seed=11, coupled=True, **SAMPLING)
    assert out != expected


def test_the_ratio_test_does_not_give_base_tokens():
    """What coupling changes: the ratio test's sampled tokens are the target's distribution, not base decoding's
    tokens with the same seed."""
    target, draft = noisy_pair("full", noise=0.5)
    out, _ = speculative_generate(target, draft, PROMPTS, 20, gamma=3, seed=11, **SAMPLING)
    assert out != base_rows(target, PROMPTS, 20, 11)


@pytest.mark.parametrize("adaptive", [False, True])
def test_static_caches_give_the_coupled_eager_tokens(monkeypatch, adaptive):
    """compile="on" with the step left uncompiled (the verify pass padded to the cap): the eager coupled tokens and
    acceptance, which are base decoding's tokens."""
    static_eager(monkeypatch)
    target, draft = noisy_pair("full")
    extra = {"adaptive_gamma": True, "max_gamma": 5} if adaptive else {}
    eager, e_stats = speculative_generate(target, draft, COMPILE_PROMPTS, 24, gamma=3, seed=3, coupled=True, **extra,
                                          **SAMPLING)
    static, s_stats = speculative_generate(target, draft, COMPILE_PROMPTS, 24, gamma=3, seed=3, coupled=True,
                                           compile="on", **extra, **SAMPLING)
    assert static == eager == base_rows(target, COMPILE_PROMPTS, 24, 3)
    assert s_stats.accepted == e_stats.accepted and s_stats.drafted == e_stats.drafted
    assert 0 < s_stats.acceptance_rate < 1


def test_device_acceptance_equals_its_host_reference_over_many_shapes():
    """:func:`agreed` (tensors) against :func:`agreed_row` (the host's loop) over random rows, drafts agreeing for
    random runs, own counts from 0 to gamma."""
    rng = random.Random(0)
    for trial in range(300):
        b, g, v = rng.randint(1, 9), rng.randint(0, 7), rng.randint(2, 6)
        best = torch.randint(0, v, (b, g + 1), generator=torch.Generator().manual_seed(trial))
        drafted = best[:, :g].clone()
        for r in range(b):
            for i in range(g):
                if rng.random() < 0.3:
                    drafted[r, i] = (drafted[r, i] + rng.randint(1, v - 1)) % v
        own = torch.tensor([rng.randint(0, g) for _ in range(b)])
        got = agreed(best, drafted, own).tolist()
        assert got == [agreed_row(x, d, o) for x, d, o in zip(best.tolist(), drafted.tolist(), own.tolist())], trial


def test_position_noise_is_the_stream_draws_base_decoding_makes():
    """Position i's noise is the stream's draw ``draws + i``, and drawing it counts nothing."""
    streams = [Stream(7), None, Stream(9)]
    streams[2].draws = 5
    noise = position_noise(streams, 3, 50)
    assert [s.draws for s in streams if s] == [0, 5]
    later = [Stream(7), Stream(9)]
    later[1].draws = 5
    for i in range(3):
        drawn = stream_noise(later, 50)
        assert torch.equal(noise[0, i], drawn[0]) and torch.equal(noise[2, i], drawn[1])

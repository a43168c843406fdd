import pytest
import torch

from efftx import recipes
from efftx.generation.decode import generate
from efftx.generation.sampling import draw, filter_logits, probabilities, probabilities_per_row, sample
from efftx.models import build as build_model


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [[False, True, False, True, False]]


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = torch.isfinite(filter_logits(logits, top_p=0.7)).tolist()
    assert kept == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).sum() == 1


def test_temperature_zero_is_greedy_and_sampling_is_seeded():
    logits = torch.randn(4, 50)
    assert (sample(logits, temperature=0) == logits.argmax(-1)).all()
    p = probabilities(logits, temperature=0)
    assert (p.sum(-1) == 1).all() and (p.argmax(-1) == logits.argmax(-1)).all()
    draw = lambda s: sample(logits, 1.0, 10, 0.9, torch.Generator().manual_seed(s))  # noqa: E731
    assert (draw(3) == draw(3)).all()
    assert any((draw(3) != draw(s)).any() for s in range(4, 12))


@pytest.mark.parametrize("kernel", [True, False])
def test_a_top_k_at_or_past_the_vocabulary_keeps_every_token(kernel):
    """top_k >= V is no filter, whatever its size: a top_k past 64 bits was a TypeError from the C++ kernel's
    binding (a 500 over HTTP, found by the fuzz test)."""
    from contextlib import nullcontext

    from efftx.kernels import sampling_cpu

    logits = torch.randn(3, 40)
    with nullcontext() if kernel else sampling_cpu.disabled():
        for temperature, top_p in ((0.8, 1.0), (1.3, 0.9), (9.8e-126, 1.0)):
            free = probabilities(logits, temperature, 0, top_p)
            for k in (40, 41, 2**63 - 1, 2**63, 801822355082104390287360):
                assert torch.equal(probabilities(logits, temperature, k, top_p), free), (temperature, k)
        assert not torch.equal(probabilities(logits, 0.8, 39, 1.0), probabilities(logits, 0.8, 0, 1.0))


def test_sampled_tokens_follow_the_filtered_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).repeat(20000, 1)
    tokens = sample(logits, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    expected = torch.softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], expected, atol=0.015, rtol=0)


def _multinomial_rows(probs, generators):
    """The reference: torch.multinomial, one call per row with the row's generator."""
    return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(probs, generators)])


def _gens(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


# (temperature, top_k, top_p): greedy (0 and below the floor), plain, top-k (1, some, the vocabulary, past it),
# nucleus (some, tiny: the top token alone)
SETTINGS = [(t, k, p) for t in (0.0, 1e-5, 0.7, 1.0, 2.5) for k in (0, 1, 5, 64, 67) for p in (1.0, 0.9, 0.3, 1e-300)]


@pytest.mark.parametrize("trial", range(24))
def test_probabilities_per_row_are_each_rows_own_bit_for_bit(trial):
    """One pass over rows of different settings gives every row exactly the distribution :func:`probabilities`
    gives it alone (continuous batching's rows of mixed settings share this pass)."""
    import random

    rng = random.Random(trial)
    rows = rng.choice([1, 2, 5, 16])
    shape = (rows, 64) if trial % 2 else (rows, 3, 64)  # a speculative verify's (B, G + 1, V) too
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(trial)) * 3
    if trial % 6 == 0:
        logits = logits.to(torch.bfloat16)
    picked = [rng.choice(SETTINGS) for _ in range(rows)]
    t, k, p = (torch.tensor(col) for col in zip(*picked))
    for kmax, nucleus in ((max(k.tolist()), any(x < 1 for x in p.tolist())), (None, True)):
        got = probabilities_per_row(logits, t, k, p, kmax=kmax, nucleus=nucleus)
        assert got.shape == logits.shape and got.dtype == torch.float32
        for b, (tb, kb, pb) in enumerate(picked):
            assert torch.equal(got[b], probabilities(logits[b:b + 1], tb, kb, pb)[0].float()), (b, tb, kb, pb)


def test_probabilities_per_row_keep_each_rows_own_top_k_and_nucleus():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 4)
    got = probabilities_per_row(logits, torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([2, 0, 0, 0]),
                                torch.tensor([1.0, 1.0, 0.5, 1.0]))
    assert (got[0] > 0).tolist() == [True, True, False, False]  # top-2
    assert (got[1] > 0).all()  # nothing filtered
    assert (got[2] > 0).tolist() == [True, False, False, False]  # the nucleus of 0.5: the top token (p = 0.64)
    assert got[3].tolist() == [1.0, 0.0, 0.0, 0.0]  # greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows,vocab", [(1, 2), (5, 6), (3, 256), (16, 256), (2, 1000)])
def test_draw_is_multinomial_row_by_row_with_each_rows_generator(rows, vocab, dtype):
    """``draw`` (one noise row per generator, one batched race) picks exactly the tokens torch.multinomial draws
    with each row's generator, step after step (the generators stay in step), zeros (filtered tokens) never drawn."""
    probs = torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * 3, -1).to(dtype)
    if vocab > 2:
        probs[0, : vocab // 2] = 0
        probs = probs / probs.sum(-1, keepdim=True)
    seeds = [100 + r for r in range(rows)]
    mine, theirs = _gens(seeds), _gens(seeds)
    for _ in range(25):
        got = draw(probs, mine)
        assert torch.equal(got, _multinomial_rows(probs, theirs))
        if vocab > 2:
            assert int(got[0]) >= vocab // 2
    # a generator-less batch draws what one multinomial call over the batch draws from the global generator
    torch.manual_seed(7)
    ref = torch.multinomial(probs, 1).squeeze(-1)
    torch.manual_seed(7)
    assert torch.equal(draw(probs, [None] * rows), ref)


@pytest.mark.parametrize("rows,vocab", [(1, 3), (4, 256), (16, 100)])
def test_sample_is_multinomial_with_one_generator(rows, vocab):
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 2
    mine, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(10):
        ref = torch.multinomial(probabilities(logits, 0.8, 20, 0.9), 1, generator=theirs).squeeze(-1)
        assert torch.equal(sample(logits, 0.8, 20, 0.9, mine), ref)


def test_draw_leaves_the_generators_of_rows_that_need_no_draw_alone():
    probs = torch.softmax(torch.randn(5, 64, generator=torch.Generator().manual_seed(1)) * 2, -1)
    mine, theirs = _gens(range(5)), _gens(range(5))
    need = [True, False, True, False, True]
    got = draw(probs, mine, need)
    ref = _multinomial_rows(probs, theirs)
    assert [int(got[b]) for b in (0, 2, 4)] == [int(ref[b]) for b in (0, 2, 4)]
    assert [int(got[b]) for b in (1, 3)] == [int(probs[b].argmax()) for b in (1, 3)]
    # rows 1 and 3 drew nothing: their next draw is the one the reference (which drew) made before
    nxt = draw(probs, mine)
    assert [int(nxt[b]) for b in (1, 3)] == [int(ref[b]) for b in (1, 3)]


def test_greedy_generation_with_cache_matches_uncached_argmax():
    torch.manual_seed(0)
    model = build_model(recipes.get("lm_debug")).eval()
    prompt = torch.randint(0, 256, (2, 9))
    out = generate(model, prompt, 12, temperature=0)
    seq = prompt
    for _ in range(12):  # no cache: rerun the whole sequence each step
        nxt = model(seq)[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert (out == seq[:, 9:]).all()


def test_generation_is_reproducible_and_bounded():
    torch.manual_seed(0)
    model = build_model(recipes.get("lm_debug")).eval()
    prompt = torch.randint(0, 256, (1, 5))
    a = generate(model, prompt, 20, temperature=1.0, top_k=20, seed=7)
    b = generate(model, prompt, 20, temperature=1.0, top_k=20, seed=7)
    assert (a == b).all() and a.shape == (1, 20)
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        generate(model, prompt, model.max_seq_len, temperature=0)


@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn"])
def test_ragged_prompts_decode_like_each_prompt_alone(kind):
    """Prompts of different lengths in one batch: each row's tokens equal that prompt decoded alone,
    greedy and sampled (row r uses seed + r whatever the batch)."""
    options = {"performer": {"attention.performer.nb_features": 32, "attention.performer.chunk_size": 8},
               "sinkhorn": {"attention.sinkhorn.bucket_size": 8}}.get(kind, {})
    torch.manual_seed(0)
    model = build_model(recipes.get("lm_debug").override({"attention.kind": kind, **options})).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [42], [1, 2, 3]]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "top_k": 30, "seed": 5}):
        together = generate(model, prompts, 10, **sampling)
        for r, prompt in enumerate(prompts):
            solo = dict(sampling, seed=sampling["seed"] + r) if "seed" in sampling else sampling
            assert together[r].tolist() == generate(model, [prompt], 10, **solo)[0].tolist()


def test_ragged_cache_rewinds_rows_independently():
    """A per-row rewind followed by a batched step gives each row the logits of its own history."""
    torch.manual_seed(0)
    model = build_model(recipes.get("lm_debug")).eval()
    seqs = torch.randint(0, 256, (2, 12))
    cache = model.new_cache(2, 32)
    model(seqs[:, :10], cache=cache)
    cache.rewind([1, 4])  # row 0 keeps 9 tokens, row 1 keeps 6
    assert cache.lengths == [9, 6] and cache.end == 9
    nxt = torch.tensor([[seqs[0, 9]], [seqs[1, 6]]])
    logits = model(nxt, cache=cache)[:, -1]
    torch.testing.assert_close(logits[0], model(seqs[:1, :10])[0, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[1], model(seqs[1:, :7])[0, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot rewind"):
        cache.rewind([0, 8])

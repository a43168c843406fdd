"""Speculative decoding: exact with greedy decoding, distribution-exact with sampling (chi-square)."""

import pytest
import torch
from scipy.stats import chisquare

from efftx import recipes
from efftx.generation.decode import generate
from efftx.generation.speculative import residual, speculative_generate
from efftx.models.lm import LM

CONTRACT = {
    "sinkhorn": {"attention.sinkhorn.bucket_size": 8, "attention.sinkhorn.n_local_attn_heads": 2},
    "performer": {"attention.performer.nb_features": 32, "attention.performer.chunk_size": 8},
}


def lm(seed: int, depth: int = 2, kind: str = "full", **overrides) -> LM:
    cfg = recipes.get("lm_debug").override({"model.depth": depth, "attention.kind": kind, **CONTRACT.get(kind, {}),
                                            **overrides})
    torch.manual_seed(seed)
    return LM(cfg).eval()


@pytest.mark.parametrize("kind", ["full", "sinkhorn", "performer"])
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_speculative_equals_greedy_base(kind, gamma):
    target, draft = lm(0, 2, kind), lm(1, 1, kind)
    prompts = [[10, 20, 30, 40, 50], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    spec, stats = speculative_generate(target, draft, prompts, 30, gamma=gamma, temperature=0)
    for prompt, row in zip(prompts, spec):
        base = generate(target, torch.tensor([prompt]), 30, temperature=0)[0].tolist()
        assert row == base
    assert sum(stats.histogram) == stats.steps and len(stats.histogram) == gamma + 1
    # steps count rows' verify steps; calls count forward passes, batched over the rows where possible
    longest_row = -(-stats.steps // len(prompts))
    assert stats.target_calls >= longest_row


def test_identical_draft_accepts_everything():
    target = lm(0)
    out, stats = speculative_generate(target, target, [[1, 2, 3]], 24, gamma=4, temperature=0.8, top_k=20, seed=3)
    assert stats.mean_accepted == 4 and stats.histogram[-1] == stats.steps
    assert len(out[0]) == 24


@pytest.mark.parametrize("kind", ["full", "performer", "sinkhorn"])
def test_ragged_batch_equals_rows_run_alone(kind):
    """Rows of different prompt lengths decode together (one batched pass per draft token and per
    verification, where the backend has ragged caches) and each row gets exactly its solo tokens."""
    target, draft = lm(0, 2, kind), lm(1, 1, kind)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], [42], [1, 2]]
    batch, stats = speculative_generate(target, draft, prompts, 16, gamma=3, temperature=1.0, seed=11)
    solo_passes = 0
    for r, prompt in enumerate(prompts):
        alone, solo = speculative_generate(target, draft, [prompt], 16, gamma=3, temperature=1.0, seed=11 + r)
        assert batch[r] == alone[0]
        solo_passes += solo.target_calls
    assert stats.accepted and stats.steps == len(stats.accepted)
    if target.supports_ragged:  # truly batched: far fewer target passes than the rows alone
        assert stats.target_calls < solo_passes


def test_batched_and_row_by_row_modes_agree_with_greedy_decoding():
    target, draft = lm(0), lm(1, 1)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7], [1, 8, 2, 8, 1]]
    together, s1 = speculative_generate(target, draft, prompts, 20, gamma=4, temperature=0, batched=True)
    apart, s2 = speculative_generate(target, draft, prompts, 20, gamma=4, temperature=0, batched=False)
    assert together == apart
    assert s1.accepted != [] and sorted(s1.accepted) == sorted(s2.accepted)
    # rows advanced by different amounts within the batch, and each row got all of its tokens
    assert all(len(row) == 20 for row in together)


def test_residual_distribution():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    torch.testing.assert_close(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(residual(p, p), p)


def tiny_pair(vocab: int = 6):
    """Two small, peaky models over a small vocabulary that disagree: acceptance is far from 1."""
    def build(seed):
        model = lm(seed, 1, **{"model.vocab_size": vocab, "model.dim": 16, "model.heads": 2, "model.kv_heads": 1,
                               "model.max_seq_len": 16})
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(10.0)
        return model
    return build(0), build(1)


def joint_target(target, prompt, vocab):
    """Exact P(x1, x2 | prompt) under the target at temperature 1."""
    with torch.no_grad():
        p1 = target(torch.tensor([prompt])).softmax(-1)[0, -1]
        rows = [target(torch.tensor([prompt + [x]])).softmax(-1)[0, -1] * p1[x] for x in range(vocab)]
    joint = torch.stack(rows).flatten().double()
    return joint / joint.sum()


def test_sampled_tokens_follow_the_target_distribution(one_thread):
    vocab, n = 6, 3000
    target, draft = tiny_pair(vocab)
    prompt = [1, 4, 2]
    expected = joint_target(target, prompt, vocab) * n
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    accepted = []
    for seed in range(n):
        out, s = speculative_generate(target, draft, [prompt], 2, gamma=2, temperature=1.0, seed=seed)
        counts[out[0][0] * vocab + out[0][1]] += 1
        accepted += s.accepted
    assert 0.1 < sum(accepted) / len(accepted) < 1.9  # the draft is wrong often enough for rejections to matter
    keep = expected > 5  # chi-square needs enough expected counts per cell; pool the rest
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3

    # the test has power: the draft's own samples are rejected by it
    draft_counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for seed in range(n):
        tokens = generate(draft, torch.tensor([prompt]), 2, temperature=1.0, seed=seed)[0]
        draft_counts[tokens[0] * vocab + tokens[1]] += 1
    obs = torch.cat([draft_counts[keep], draft_counts[~keep].sum().view(1)])
    assert chisquare(obs.numpy(), exp.numpy()).pvalue < 1e-6


def test_bad_arguments():
    target, draft = lm(0), lm(1, 1)
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        speculative_generate(target, draft, [[1]], 4, gamma=0)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        speculative_generate(target, draft, [[]], 4)
    with pytest.raises(ValueError, match="exceeds the models' max_seq_len"):
        speculative_generate(target, draft, [[1] * 100], 40, gamma=5)
    other = lm(2, 1, **{"model.vocab_size": 100})
    with pytest.raises(ValueError, match="vocabularies differ"):
        speculative_generate(target, other, [[1]], 4)


def test_training_with_a_missing_or_mismatched_draft_is_a_clear_error(tmp_path):
    from efftx.errors import ConfigError, ExportError
    from efftx.train.checkpoint import export
    from efftx.train.tasks import LMTask

    cfg = recipes.get("spec_target_debug").override({"data.cache_dir": str(tmp_path / "cache"),
                                                     "speculative.draft": str(tmp_path / "nope")})
    with pytest.raises(ExportError, match="is not an efftx export"):
        LMTask.prepare(cfg)
    other = recipes.get("lm_debug").override({"model.vocab_size": 100})
    export(LM(other), other, tmp_path / "draft", {})
    cfg.speculative.draft = str(tmp_path / "draft")
    with pytest.raises(ConfigError, match="vocabulary of 100"):
        LMTask.prepare(cfg)


def test_rows_finishing_at_different_steps_stay_within_the_context():
    """A row that reaches its limit mid-step (its output cut) stops growing its caches, even while other
    rows go on, so prompt + max_new_tokens + gamma == max_seq_len is enough for every row."""
    target, draft = lm(0), lm(1, 1)
    gamma = 5
    prompts = [list(range(1, 44)), [7]]
    max_new = target.max_seq_len - len(prompts[0]) - gamma
    for d in (draft, target):  # the identical draft accepts everything, so outputs are cut mid-step
        out, stats = speculative_generate(target, d, prompts, [max_new, 3 * max_new // 4], gamma=gamma,
                                          temperature=0)
        assert [len(o) for o in out] == [max_new, 3 * max_new // 4]
        for prompt, row in zip(prompts, out):
            assert row == generate(target, [prompt], len(row), temperature=0)[0].tolist()

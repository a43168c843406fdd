"""The Sinkhorn attention backend: sort matrix, padding, causality, sorted and local heads, GQA, gradients,
the reference's causal top-k design (causal_mode=topk) and non-causal Gumbel noise."""

import math

import pytest
import torch

from efftx import attention, recipes
from efftx.attention.base import AttentionSpec
from efftx.attention.sinkhorn import SinkhornAttention, SinkhornOptions, sinkhorn, sort_mask, top_buckets
from efftx.errors import ConfigError

N = 4  # bucket size used throughout
MODES = [{}, {"causal_mode": "topk"}, {"causal_mode": "topk", "topk": 2}]  # causal designs: blend, reference
MODE_IDS = ["blend", "topk1", "topk2"]


def make(heads=4, kv_heads=2, head_dim=8, causal=True, n_local=1, iters=8, dropout=0.0, seed=0, **options):
    spec = AttentionSpec(kind="sinkhorn", dim=heads * head_dim, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, max_seq_len=64, causal=causal, dropout=dropout,
                         options=SinkhornOptions(bucket_size=N, n_local_attn_heads=n_local,
                                                 sinkhorn_iters=iters, **options))
    torch.manual_seed(seed)
    backend = attention.build(spec).eval()
    if backend.sort_net is not None:
        with torch.no_grad():  # random sort weights, so that buckets are scored differently
            backend.sort_net.weight.normal_(0, 1)
    return backend


def qkv(t, heads=4, kv_heads=2, head_dim=8, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, heads, head_dim, generator=g),
            torch.randn(b, t, kv_heads, head_dim, generator=g),
            torch.randn(b, t, kv_heads, head_dim, generator=g))


def test_registered():
    assert attention.get("sinkhorn") is SinkhornAttention


def test_noncausal_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0)) / 0.75
    for iters, atol in ((30, 1e-5), (8, 5e-3)):
        p = sinkhorn(logits, iters, causal=False)
        assert torch.isfinite(p).all() and (p >= 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(2, 3, 6), rtol=0, atol=1e-5)
        torch.testing.assert_close(p.sum(-2), torch.ones(2, 3, 6), rtol=0, atol=atol)
    # without column rounds only the rows are normalised: the columns are far from 1
    assert (sinkhorn(logits, 0, causal=False).sum(-2) - 1).abs().max() > 0.1


def test_causal_sinkhorn_is_row_stochastic_over_past_buckets():
    logits = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(0)).requires_grad_()
    p = sinkhorn(logits, 8, causal=True)
    assert torch.isfinite(p).all() and (p >= 0).all()
    assert (p[..., 0, :] == 0).all()  # bucket 0 has no past bucket
    assert (p.masked_select(~sort_mask(6, causal=True)) == 0).all()  # never the own or a future bucket
    torch.testing.assert_close(p[..., 1:, :].sum(-1), torch.ones(2, 3, 5), rtol=0, atol=1e-6)
    (p * torch.randn_like(p)).sum().backward()  # entirely masked row 0 and column 5: no NaN gradient
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


def test_causal_sort_row_ignores_later_rows():
    logits = torch.randn(1, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    changed = logits.clone()
    changed[..., 4:, :] += torch.randn(1, 1, 2, 6) * 3  # rows 4 and 5 read buckets 3 and 4
    a, b = sinkhorn(logits, 8, causal=True), sinkhorn(changed, 8, causal=True)
    torch.testing.assert_close(a[..., :4, :], b[..., :4, :], rtol=0, atol=0)


def test_backend_sort_matrix_rows_sum_to_one():
    k = qkv(22)[1]  # 6 buckets, the last one partial
    for causal in (True, False):
        p = make(causal=causal).sort_matrix(k)
        assert p.shape == (2, 3, 6, 6)  # 3 sorting heads (one local)
        rows = p[..., 1:, :] if causal else p
        torch.testing.assert_close(rows.sum(-1), torch.ones_like(rows.sum(-1)), rtol=0, atol=1e-5)


def test_padding_matches_running_the_padded_length():
    backend = make()
    q, k, v = qkv(16)
    full = backend(q, k, v)  # 16 = 4 whole buckets
    for t in (13, 14, 15):
        torch.testing.assert_close(backend(q[:, :t], k[:, :t], v[:, :t]), full[:, :t], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("n_local", [0, 1, 4])
def test_perturbing_position_j_leaves_earlier_outputs_unchanged(n_local, mode):
    backend = make(n_local=n_local, **mode)
    q, k, v = qkv(20)
    base = backend(q, k, v)
    # j mid-bucket: bucket 2's summary (which later sort rows use) changes, but queries of bucket 2
    # before j must not see it; j at a bucket start; j late
    for j in (9, 10, 12, 17):
        q2, k2, v2 = q.clone(), k.clone(), v.clone()
        q2[:, j:] += 1.0
        k2[:, j] += 2.0
        v2[:, j] -= 2.0
        out = backend(q2, k2, v2)
        torch.testing.assert_close(out[:, :j], base[:, :j], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, j], base[:, j])


def test_sorted_bucket_brings_in_an_earlier_bucket():
    backend = make(n_local=1)  # head 0 local, heads 1..3 sorting
    q, k, v = qkv(20)
    base = backend(q, k, v)
    k2, v2 = k.clone(), v.clone()
    k2[:, :N] += 1.0  # bucket 0: outside every window of bucket 3 (own bucket + previous bucket)
    v2[:, :N] += 1.0
    out = backend(q, k2, v2)
    bucket3 = slice(3 * N, 4 * N)
    assert (out[:, bucket3, 1:] - base[:, bucket3, 1:]).abs().amax() > 1e-3  # sorting heads see it
    torch.testing.assert_close(out[:, bucket3, :1], base[:, bucket3, :1], rtol=0, atol=0)  # the local one not


@pytest.mark.parametrize("causal", [True, False])
def test_local_heads_see_only_the_neighbouring_buckets(causal):
    backend = make(n_local=2, causal=causal)  # heads 0, 1 local (kv head 0), heads 2, 3 sorting (kv head 1)
    q, k, v = qkv(24)
    base = backend(q, k, v)
    p = 3 * N + 1  # a query in bucket 3
    k2, v2 = k.clone(), v.clone()
    k2[:, :2 * N] += 3.0  # buckets 0 and 1: earlier than the previous bucket
    v2[:, :2 * N] += 3.0
    if not causal:
        k2[:, 5 * N:] += 3.0  # bucket 5: later than the next bucket
        v2[:, 5 * N:] += 3.0
    out = backend(q, k2, v2)
    torch.testing.assert_close(out[:, p, :2], base[:, p, :2], rtol=0, atol=0)
    # ... while the previous bucket (and, non-causal, the next one) is seen
    k3 = k.clone()
    k3[:, 2 * N:3 * N] += 3.0
    if not causal:
        k3[:, 4 * N:5 * N] += 3.0
    assert (backend(q, k3, v)[:, p, :2] - base[:, p, :2]).abs().amax() > 1e-3


@pytest.mark.parametrize("causal, mode", [(True, {}), (False, {}), *((True, m) for m in MODES[1:])],
                         ids=["causal", "noncausal", *MODE_IDS[1:]])
@pytest.mark.parametrize("n_local", [0, 1, 2])
def test_gqa_equals_kv_repeated_to_every_head(causal, n_local, mode):
    gqa = make(kv_heads=2, causal=causal, n_local=n_local, **mode)
    mha = make(kv_heads=4, causal=causal, n_local=n_local, **mode)
    mha.load_state_dict(gqa.state_dict())
    q, k, v = qkv(18)
    expected = mha(q, k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(gqa(q, k, v), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_cached_decoding_equals_full_forward(mode):
    backend = make(n_local=1, **mode)  # the local/sorting split falls inside kv group 0
    q, k, v = qkv(19)
    full = backend(q, k, v)
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    parts, a = [], 0
    for step in (5, 1, 1, 4, 3, 1, 1, 1, 2):
        parts.append(backend(q[:, a:a + step], k[:, a:a + step], v[:, a:a + step], cache=cache))
        a += step
    assert cache.length == a == 19
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-6)


def test_noncausal_short_and_padded_inputs_are_finite():
    backend = make(causal=False)
    for t in (1, 3, 9):  # a single partial bucket, and a partial last bucket
        out = backend(*qkv(t))
        assert out.shape == (2, t, 4, 8) and torch.isfinite(out).all()


def test_gradients_reach_the_sort_net():
    for causal in (True, False):
        backend = make(causal=causal).train()
        q, k, v = (t.requires_grad_() for t in qkv(15))
        backend(q, k, v).square().sum().backward()
        grad = backend.sort_net.weight.grad
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
        for t in (q, k, v):
            assert torch.isfinite(t.grad).all()


def test_attention_dropout_only_in_training():
    backend = make(dropout=0.5)
    q, k, v = qkv(12)
    torch.testing.assert_close(backend(q, k, v), backend(q, k, v), rtol=0, atol=0)
    backend.train()
    assert not torch.allclose(backend(q, k, v), backend.eval()(q, k, v))


# ------------------------------------------------------------------ causal_mode=topk: the reference's design

def one_head(topk=1, weight=1.0):
    """One sorting head, keys of width 2, buckets of 2, sort weight ``weight`` x identity."""
    spec = AttentionSpec(kind="sinkhorn", dim=2, heads=1, kv_heads=1, head_dim=2, max_seq_len=64,
                         options=SinkhornOptions(bucket_size=2, causal_mode="topk", topk=topk))
    backend = attention.build(spec).eval()
    with torch.no_grad():
        backend.sort_net.weight.copy_(torch.eye(2) * weight)
    return backend


# buckets of 2 keys: summaries s0 = (1, 0), s1 = (0, 1), s2 = (-1, 0), s3 = (-1, -1.5); bucket 4 = position 8
HAND_KEYS = torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1], [-1, 0], [-1, 0], [3, -3], [-5, 0], [0, 0]],
                         dtype=torch.float32)[None, :, None, :]


def test_topk_picks_the_best_scored_past_bucket_by_hand():
    backend = one_head()
    picks, weights = backend.select_buckets(HAND_KEYS)
    # Query side of bucket i: mean of keys 0 .. 2i. Bucket 1: (2/3, 1/3): s0 scores 2/3 > 0 (the null bucket).
    # Bucket 2: (1, 2)/5: s0 0.2, s1 0.4 -> bucket 1. Bucket 3: (2, -1)/7: s0 2/7, s1 -1/7, s2 -2/7 -> bucket 0
    # (not the previous bucket). Bucket 4: (-3, -1)/9: s0 -3/9, s1 -1/9, s2 3/9, s3 4.5/9 -> bucket 3.
    assert picks[0, 0, :, 0].tolist() == [-1, 0, 1, 0, 3]  # bucket 0 gets the null bucket
    scale = 1 / (math.sqrt(2) * 0.75)  # 1/sqrt(D), 1/temperature
    l0 = 2 / 3 * scale
    torch.testing.assert_close(weights[0, 0, 1, 0], torch.tensor(math.exp(l0) / (1 + math.exp(l0))))
    assert weights[0, 0, 0, 0] == 1  # the null bucket is bucket 0's only candidate


def test_topk_picks_the_null_bucket_when_it_outscores_the_past():
    picks, _ = one_head(weight=-1.0).select_buckets(HAND_KEYS)  # every score flips sign
    # bucket 1: s0 scores -2/3 < 0 = the null bucket's score; bucket 2: s0 -0.2, s1 -0.4: both below 0
    assert picks[0, 0, 1:3, 0].tolist() == [-1, -1]
    assert picks[0, 0, 3, 0] == 2 and picks[0, 0, 4, 0] == 0  # s0 -2/7, s1 1/7, s2 2/7; s0 3/9, s1 1/9


def test_top2_picks_in_order_renormalising_over_the_rest():
    picks, weights = one_head(topk=2).select_buckets(HAND_KEYS)
    assert picks[0, 0, 0].tolist() == [-1, -1]  # two null buckets
    assert picks[0, 0, 1].tolist() == [0, -1]  # one past bucket, then a null one
    assert picks[0, 0, 2].tolist() == [1, 0]
    scale = 1 / (math.sqrt(2) * 0.75)
    e0, e1 = math.exp(0.2 * scale), math.exp(0.4 * scale)  # candidates: null, null, s0, s1
    torch.testing.assert_close(weights[0, 0, 2], torch.tensor([e1 / (2 + e0 + e1), e0 / (2 + e0)]))


def test_top_buckets_never_picks_an_excluded_candidate():
    logits = torch.tensor([[0.0, -1e9, 5.0, -1e9, 1.0]])
    picks, weights = top_buckets(logits, 3)
    assert picks.tolist() == [[2, 4, 0]]
    assert torch.all(weights > 0) and torch.all(weights <= 1)


@pytest.mark.parametrize("topk", [1, 2])
def test_topk_attention_matches_a_per_query_reference(topk):
    backend = make(n_local=1, causal_mode="topk", topk=topk)  # head 0 local; heads 1..3 sort, kv groups 0, 1, 1
    with torch.no_grad():
        backend.null_key.normal_()
        backend.null_value.normal_()
    q, k, v = qkv(18)
    out = backend(q, k, v)
    picks, weights = backend.select_buckets(k)  # (B, 3, nb, topk)
    for b in range(2):
        for hs in range(3):
            h, g = hs + 1, (hs + 1) // 2
            for p in range(18):
                i = p // N
                keys, vals = [k[b, i * N:p + 1, g]], [v[b, i * N:p + 1, g]]  # own bucket up to p
                for j, w in zip(picks[b, hs, i].tolist(), weights[b, hs, i]):
                    if j < 0:
                        keys.append(w * backend.null_key[hs].expand(N, -1))
                        vals.append(w * backend.null_value[hs].expand(N, -1))
                    else:
                        assert j < i  # a complete past bucket
                        keys.append(w * k[b, j * N:(j + 1) * N, g])
                        vals.append(w * v[b, j * N:(j + 1) * N, g])
                keys, vals = torch.cat(keys), torch.cat(vals)
                expected = ((keys @ q[b, p, h]) / math.sqrt(8)).softmax(-1) @ vals
                torch.testing.assert_close(out[b, p, h], expected, rtol=1e-5, atol=1e-5)


def test_first_bucket_reads_the_learned_null_bucket():
    backend = make(n_local=1, causal_mode="topk")
    q, k, v = qkv(12)
    base = backend(q, k, v)
    with torch.no_grad():
        backend.null_value.add_(1.0)
    out = backend(q, k, v)
    assert (out[:, :N, 1:] - base[:, :N, 1:]).abs().amax() > 1e-3  # bucket 0's sorting heads see it
    torch.testing.assert_close(out[:, :, :1], base[:, :, :1], rtol=0, atol=0)  # the local head not


def test_topk_gradients_reach_the_sort_net_and_the_null_bucket():
    backend = make(causal_mode="topk", topk=2).train()
    q, k, v = (t.requires_grad_() for t in qkv(15))
    backend(q, k, v).square().sum().backward()
    for p in (backend.sort_net.weight, backend.null_key, backend.null_value):
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()


# ------------------------------------------------------------------ non-causal Gumbel noise

def test_gumbel_noise_only_in_training():
    noisy = make(causal=False, gumbel_noise=True)
    plain = make(causal=False)
    plain.load_state_dict(noisy.state_dict())
    q, k, v = qkv(16)
    torch.testing.assert_close(noisy(q, k, v), plain(q, k, v), rtol=0, atol=0)  # evaluation: no noise
    torch.testing.assert_close(noisy.sort_matrix(k), plain.sort_matrix(k), rtol=0, atol=0)
    noisy.train()
    plain.train()
    torch.testing.assert_close(plain.sort_matrix(k), plain.sort_matrix(k), rtol=0, atol=0)  # no dropout here
    a, b = noisy.sort_matrix(k), noisy.sort_matrix(k)
    assert (a - b).abs().amax() > 1e-2 and (a - plain.sort_matrix(k)).abs().amax() > 1e-2
    torch.testing.assert_close(a.sum(-1), torch.ones_like(a.sum(-1)), rtol=0, atol=1e-5)  # still row-stochastic
    q.requires_grad_()
    noisy(q, k, v).sum().backward()
    assert torch.isfinite(noisy.sort_net.weight.grad).all() and noisy.sort_net.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("options, key", [
    ({"causal_mode": "sorted"}, "attention.sinkhorn.causal_mode='sorted' is not one of blend, topk"),
    ({"causal_mode": "topk", "topk": 0}, "attention.sinkhorn.topk=0 must be an integer >= 1"),
    ({"topk": 2}, "attention.sinkhorn.topk=2 has no effect unless attention.sinkhorn.causal_mode=topk"),
    ({"gumbel_noise": True}, "attention.sinkhorn.gumbel_noise applies to non-causal attention only"),
    ({"gumbel_noise": "yes"}, "attention.sinkhorn.gumbel_noise='yes' must be true or false"),
])
def test_bad_mode_options_are_config_errors(options, key):
    causal = options != {"gumbel_noise": "yes"}
    with pytest.raises(ConfigError, match=key):
        make(causal=causal, **options)


def test_topk_needs_causal_attention():
    with pytest.raises(ConfigError, match="causal_mode=topk chooses the causal design"):
        make(causal=False, causal_mode="topk")


def test_recipe_keys_select_the_mode():
    cfg = recipes.get("sinkhorn_debug").override({"name": "x", "attention.sinkhorn.causal_mode": "topk",
                                                   "attention.sinkhorn.topk": "2"})
    cfg.validate()
    assert (cfg.attention.sinkhorn.causal_mode, cfg.attention.sinkhorn.topk) == ("topk", 2)
    with pytest.raises(ConfigError, match="attention.sinkhorn.causal_mode='soft'"):
        recipes.get("sinkhorn_debug").override({"name": "x", "attention.sinkhorn.causal_mode": "soft"}).validate()


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="n_local_attn_heads"):
        make(n_local=5)
    spec = AttentionSpec(kind="sinkhorn", dim=32, heads=4, kv_heads=4, head_dim=8, max_seq_len=64,
                         options=SinkhornOptions(bucket_size=0))
    with pytest.raises(ConfigError, match="bucket_size"):
        attention.build(spec)


# ------------------------------------------------------------------ against a float64 per-query reference

def reference(backend, q, k, v):
    """Sinkhorn attention computed query by query in float64, straight from the module docstring: the oracle
    of the backend's bucketed (SDPA) forward and of its gradients. Reads the backend's sort weights, null
    bucket and options only."""
    n, nl, causal = backend.bucket_size, backend.n_local, backend.spec.causal
    b_, t, h, d = q.shape
    rep = h // k.shape[2]
    nb = -(-t // n)
    topk_mode, top, temp = backend.topk_mode, backend.topk, backend.temperature
    w = backend.sort_net.weight.double() if backend.sort_net is not None else None

    def score(x, y, hs):  # bilinear sort score / sqrt(D) / temperature
        return x @ w[hs] @ y / math.sqrt(d) / temp

    out = torch.zeros(b_, t, h, d, dtype=torch.float64)
    for b in range(b_):
        for hh in range(h):
            g, hs = hh // rep, hh - nl
            kk, vv = k[b, :, g], v[b, :, g]
            bucket = [slice(j * n, min((j + 1) * n, t)) for j in range(nb)]
            mean = [kk[s].mean(0) for s in bucket]
            if hh >= nl and not causal:  # Sinkhorn: row/column rounds in log space, then rows
                x = torch.stack([torch.stack([score(mean[i], mean[j], hs) for j in range(nb)]) for i in range(nb)])
                for _ in range(backend.iters):
                    x = x - torch.logsumexp(x, 1, keepdim=True)
                    x = x - torch.logsumexp(x, 0, keepdim=True)
                p_mat = (x - torch.logsumexp(x, 1, keepdim=True)).exp()
            for p in range(t):
                i = p // n
                own = slice(i * n, p + 1) if causal else bucket[i]
                keys, vals = [kk[own]], [vv[own]]
                if hh < nl:  # local: previous (+ next) bucket
                    for j in ([i - 1] if causal else [i - 1, i + 1]):
                        if 0 <= j < nb:
                            keys.append(kk[bucket[j]])
                            vals.append(vv[bucket[j]])
                elif not causal:  # slot s: P-weighted mix of the buckets real at slot s
                    for s in range(n):
                        real = [j for j in range(nb) if j * n + s < t]
                        mass = sum(p_mat[i, j] for j in real)
                        if mass > 1e-6:
                            keys.append((sum(p_mat[i, j] * kk[j * n + s] for j in real) / mass)[None])
                            vals.append((sum(p_mat[i, j] * vv[j * n + s] for j in real) / mass)[None])
                elif not topk_mode:  # blend: softmax over the past buckets, scored from bucket i - 1
                    if i >= 1:
                        pr = torch.stack([score(mean[i - 1], mean[j], hs) for j in range(i)]).softmax(0)
                        keys.append(sum(pr[j] * kk[bucket[j]] for j in range(i)))
                        vals.append(sum(pr[j] * vv[bucket[j]] for j in range(i)))
                else:  # topk: null candidates (score 0) and past buckets, scored from the mean of keys 0 .. i*n
                    qside = kk[:i * n + 1].mean(0)
                    cand = [torch.zeros((), dtype=torch.float64)] * top + [score(qside, mean[j], hs) for j in range(i)]
                    x, taken = torch.stack(cand), []
                    for _ in range(top):
                        probs = x.softmax(0)
                        c = max((c for c in range(len(cand)) if c not in taken), key=lambda c: probs[c].item())
                        taken.append(c)
                        if c < top:
                            keys.append(probs[c] * backend.null_key[hs].double().expand(n, d))
                            vals.append(probs[c] * backend.null_value[hs].double().expand(n, d))
                        else:
                            keys.append(probs[c] * kk[bucket[c - top]])
                            vals.append(probs[c] * vv[bucket[c - top]])
                        x = x.clone()
                        x[c] = -1e9
                kc, vc = torch.cat(keys), torch.cat(vals)
                out[b, p, hh] = ((kc @ q[b, p, hh]) / math.sqrt(d)).softmax(0) @ vc
    return out


REF_CASES = [  # (causal, mode, n_local, kv_heads)
    (True, {}, 1, 2), (True, {}, 0, 4), (True, {}, 2, 1), (True, {}, 4, 2),
    (True, {"causal_mode": "topk"}, 1, 2), (True, {"causal_mode": "topk", "topk": 2}, 2, 4),
    (False, {}, 1, 2), (False, {}, 0, 1),
]


@pytest.mark.parametrize("causal, mode, n_local, kv_heads", REF_CASES)
@pytest.mark.parametrize("t", [3, 13, 16])  # one partial bucket; a partial last bucket; whole buckets
def test_forward_and_gradients_match_a_float64_reference(causal, mode, n_local, kv_heads, t):
    backend = make(kv_heads=kv_heads, causal=causal, n_local=n_local, **mode).double()
    if backend.topk_mode:
        with torch.no_grad():
            backend.null_key.normal_()
            backend.null_value.normal_()
    q, k, v = (x.double().requires_grad_() for x in qkv(t, kv_heads=kv_heads))
    params = [p for p in backend.parameters()]
    g = torch.randn(2, t, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out = backend(q, k, v)
    expected = reference(backend, q, k, v)
    # the sort net scores in float32 (SortNet): agreement to float32 precision
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad((out * g).sum(), [q, k, v, *params], allow_unused=True)
    want = torch.autograd.grad((expected * g).sum(), [q, k, v, *params], allow_unused=True)
    for a, e in zip(got, want):
        if e is None:
            assert a is None or a.abs().max() == 0
        else:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the decoding cache's own state

def feed(backend, cache, q, k, v, steps):
    """Feeds q, k, v[a:b] for consecutive chunk sizes ``steps`` through ``cache``; the outputs, concatenated."""
    parts, a = [], cache.length
    for step in steps:
        parts.append(backend(q[:, a:a + step], k[:, a:a + step], v[:, a:a + step], cache=cache))
        a += step
    return torch.cat(parts, 1)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_decode_step_reads_its_own_buckets_and_the_kept_selection_only(mode):
    backend = make(n_local=1, **mode)
    q, k, v = qkv(15)
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    feed(backend, cache, q, k, v, [13])  # buckets 0..3; position 12 starts bucket 3, whose selection is kept
    assert cache.sel_bucket.tolist() == [3, 3]  # the complete buckets 0..2 summed:
    torch.testing.assert_close(cache.sums[:, :3], k[:, :12].unflatten(1, (3, N)).sum(2))
    expected = backend(q[:, 13:14], k[:, 13:14], v[:, 13:14], cache=cache)
    cache.rewind(1)
    cache.k[:, :2 * N] += 5.0  # buckets 0 and 1: neither the local window (2, 3) nor the own bucket
    cache.v[:, :2 * N] -= 5.0
    step = backend(q[:, 13:14], k[:, 13:14], v[:, 13:14], cache=cache)
    torch.testing.assert_close(step, expected, rtol=0, atol=0)  # the step did not re-sort the cache
    # ... while recomputing from the keys would have seen the change (the sorting heads read buckets 0, 1)
    k2, v2 = k.clone(), v.clone()
    k2[:, :2 * N] += 5.0
    v2[:, :2 * N] -= 5.0
    assert (backend(q[:, :14], k2[:, :14], v2[:, :14])[:, 13] - expected[:, 0]).abs().amax() > 1e-3


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("keep, steps", [(12, [1, 1, 2, 1, 3]), (6, [1, 3, 1, 1, 4, 2]), (8, [5, 1, 1, 1])])
def test_rewound_cache_state_matches_the_new_tokens(mode, keep, steps):
    # 12: bucket 3's first token is replaced (topk's selection of bucket 3 reads it); 6: bucket 1 is no longer
    # complete (its kept key sum must go); 8: a rewind to a bucket boundary
    backend = make(n_local=1, **mode)
    q, k, v = qkv(20)
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    feed(backend, cache, q, k, v, [9, 1, 1, 1, 1])
    cache.rewind(13 - keep)
    q2, k2, v2 = (torch.cat([x[:, :keep], x[:, keep:].flip(1) * 1.5], 1) for x in (q, k, v))  # other tokens
    out = feed(backend, cache, q2, k2, v2, steps)
    torch.testing.assert_close(out, backend(q2, k2, v2)[:, keep:keep + sum(steps)], rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_prefill_through_the_cache_has_the_full_forwards_gradients(mode):
    backend = make(**mode)
    q, k, v = (x.requires_grad_() for x in qkv(14))
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    g = torch.randn(2, 14, 4, 8)
    params = [q, k, v, backend.sort_net.weight]
    got = torch.autograd.grad((backend(q, k, v, cache=cache) * g).sum(), params)
    want = torch.autograd.grad((backend(q, k, v) * g).sum(), params)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)



# ------------------------------------------------------------------ ragged rows (issue 15)

CPU = torch.device("cpu")


def decode_ragged(backend, seqs, prompts, steps, rewind_after=None, counts=None, other=None):
    """Row r of ``seqs`` (q, k, v) through one cache: its first prompts[r] tokens in one padded prefill (the padding
    random, then rewound, as Rows.prefill does), then a call per entry of ``steps`` (tokens per row) at each row's
    own position. After call ``rewind_after`` the rows are rewound by ``counts`` and continue with ``other``'s tokens
    from their new lengths on. Returns each row's outputs (position -> (H, D)), the cache and the final sequences."""
    q = seqs[0]
    b = q.shape[0]
    cache = backend.new_cache(b, 48, CPU, q.dtype)
    longest = max(prompts)
    g = torch.Generator().manual_seed(7)
    real = (torch.arange(longest)[None, :] < torch.tensor(prompts)[:, None])[:, :, None, None]
    padded = [torch.where(real, z[:, :longest], 3 * torch.randn(z[:, :longest].shape, generator=g, dtype=z.dtype))
              for z in seqs]
    out = backend(*padded, cache=cache)
    got = [{p: out[r, p] for p in range(n)} for r, n in enumerate(prompts)]
    cache.rewind([longest - n for n in prompts])
    assert cache.lengths == list(prompts)
    for i, n in enumerate(steps):
        start = list(cache.lengths)
        out = backend(*(torch.stack([z[r, s:s + n] for r, s in enumerate(start)]) for z in seqs), cache=cache)
        for r, s in enumerate(start):
            got[r].update({s + j: out[r, j] for j in range(n)})
        if i == rewind_after:
            cache.rewind(counts)
            keep = torch.tensor(cache.lengths)
            new = (torch.arange(q.shape[1])[None, :] >= keep[:, None])[:, :, None, None]
            seqs = [torch.where(new, o, z) for z, o in zip(seqs, other)]
            got = [{p: o for p, o in row.items() if p < int(keep[r])} for r, row in enumerate(got)]
    return got, cache, seqs


def assert_rows_alone(backend, seqs, got, **tol):
    """Every row's outputs equal the uncached forward of that row alone."""
    for r, row in enumerate(got):
        want = backend(*(z[r:r + 1] for z in seqs))[0]
        pos = sorted(row)
        torch.testing.assert_close(torch.stack([row[p] for p in pos]), want[pos], **tol,
                                   msg=lambda m: f"row {r}: {m}")


RAGGED_CASES = [dict(n_local=1, **m) for m in MODES] + [dict(n_local=0), dict(n_local=3, kv_heads=4),
                                                         dict(n_local=4)]
RAGGED_IDS = MODE_IDS + ["no_local", "mha_3local", "all_local"]


@pytest.mark.parametrize("case", RAGGED_CASES, ids=RAGGED_IDS)
def test_ragged_rows_decode_as_each_row_alone(case):
    """Prompts of 5, 5, 11 and 2 tokens (bucket phases 1, 1, 3, 2: rows 0 and 1 decode as one group of equal
    length, the others cross bucket boundaries at other steps), steps of 1, 2 and 3 tokens, per-row rewinds (row 0
    not at all, row 1 removing its bucket's first token (which topk's selection reads), row 2 back across two
    buckets, row 3 within its bucket), other tokens fed after them."""
    kv_heads = case.pop("kv_heads", 2)
    backend = make(kv_heads=kv_heads, **case)
    seqs = qkv(30, kv_heads=kv_heads, b=4)
    other = qkv(30, kv_heads=kv_heads, b=4, seed=5)
    got, cache, seqs = decode_ragged(backend, seqs, [5, 5, 11, 2], [1, 1, 3, 1, 1, 1, 2, 1, 1, 1, 3, 1],
                                     rewind_after=6, counts=[0, 3, 8, 2], other=other)
    assert cache.lengths == [22, 19, 20, 17]
    assert_rows_alone(backend, seqs, got, rtol=1e-5, atol=1e-5)


def test_ragged_rows_in_float64_equal_each_row_alone_cached():
    """In float64 the batched ragged cache gives each row what a batch-1 cache of that row alone gives (to rounding
    of float64; the uncached forward only to float32's, as the sort net and the few-row products of a decode step
    compute in float32)."""
    backend = make(n_local=1).double()
    seqs = [z.double() for z in qkv(24, b=3)]
    steps = [1, 2, 1, 1, 1, 1, 3, 1]
    got, _, _ = decode_ragged(backend, seqs, [6, 3, 9], steps)
    for r, n in enumerate([6, 3, 9]):
        alone, _, _ = decode_ragged(backend, [z[r:r + 1] for z in seqs], [n], steps)
        pos = sorted(alone[0])
        assert sorted(got[r]) == pos
        torch.testing.assert_close(torch.stack([got[r][p] for p in pos]), torch.stack([alone[0][p] for p in pos]),
                                   rtol=1e-12, atol=1e-12)
    assert_rows_alone(backend, seqs, got, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_ragged_cache_keeps_each_rows_bucket_state(mode):
    """Each row keeps the key sums of its complete buckets; a step of rows at different bucket phases reads each
    row's own kept selection (changing the keys of a bucket only their sorting heads read does not change the
    step, while recomputing would); per-row rewinds drop exactly the selections of rows whose bucket lost its
    first token."""
    backend = make(n_local=1, **mode)
    seqs = qkv(20, b=3)
    _, cache, _ = decode_ragged(backend, seqs, [13, 10, 9], [1])
    assert cache.lengths == [14, 11, 10] and cache.sel_bucket.tolist() == [3, 2, 2]
    for r, n in enumerate(cache.lengths):  # the complete buckets before each row's own are summed
        j = cache.summed(n)
        assert j == (n - 1) // N
        torch.testing.assert_close(cache.sums[r, :j], seqs[1][r, :j * N].unflatten(0, (j, N)).sum(1))
    pos = cache.lengths
    new = [torch.stack([z[r, p] for r, p in enumerate(pos)])[:, None] for z in seqs]
    expected = torch.stack([backend(*(z[r:r + 1, :p + 1] for z in seqs))[0, -1] for r, p in enumerate(pos)])
    cache.k[:, :N] += 5.0  # bucket 0: neither own nor previous bucket of any row; their sorting heads read it
    cache.v[:, :N] -= 5.0
    cache.sums[:, :1] += 5.0 * N
    step = backend(*new, cache=cache)[:, 0]
    torch.testing.assert_close(step, expected, rtol=1e-5, atol=1e-5)  # no row re-sorted its cache
    changed = [z.clone() for z in seqs]
    changed[1][:, :N] += 5.0
    changed[2][:, :N] -= 5.0
    resorted = torch.stack([backend(*(z[r:r + 1, :p + 1] for z in changed))[0, -1] for r, p in enumerate(pos)])
    assert (resorted - expected).abs().amax() > 1e-3
    assert cache.lengths == [15, 12, 11]
    cache.rewind([2, 3, 1])  # to 13, 9, 10: the first tokens of buckets 3 (12), 2 (8) and 2 stay
    assert cache.sel_bucket.tolist() == [3, 2, 2]
    cache.rewind([1, 0, 2])  # to 12 and 8: the first tokens of buckets 3 and 2 go; 9 keeps bucket 2's
    assert cache.sel_bucket.tolist() == [-1, 2, -1]
    cache.rewind([0, 1, 0])  # to 8
    assert cache.sel_bucket.tolist() == [-1, -1, -1]


def sinkhorn_lm(**options):
    from efftx.models import build as build_model

    small = {"attention.sinkhorn.bucket_size": N, "attention.sinkhorn.n_local_attn_heads": 1,
             **{f"attention.sinkhorn.{k}": v for k, v in options.items()}}
    cfg = recipes.get("lm_debug").override({"attention.kind": "sinkhorn", "model.max_seq_len": 64, **small})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():  # random sort weights, so that buckets are scored differently
        for blk in model.blocks:
            blk.attention.inner.sort_net.weight.normal_(0, 1)
    return model


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
def test_lm_rows_batched_split_and_joined_decode_as_the_rows_alone(mode):
    """A Sinkhorn LM is splittable and decodes in one batched forward pass per step; rows prefilled together
    (prompts of different lengths), taken out (Rows.select), joined with another batch (Rows.concat, bucket phases
    2, 0, 1 after the join) and rewound per row give the logits of each row decoding alone (batch 1) and of the full
    uncached forward."""
    from rows_check import check_split_and_join  # tests/rows_check.py

    check_split_and_join(sinkhorn_lm(**mode), before=(3, 3))

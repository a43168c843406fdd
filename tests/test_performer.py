"""The Performer (FAVOR+) backend: chunked maths, softmax approximation, features, cache, GQA."""

import math

import pytest
import torch

from efftx.attention import performer
from efftx.attention.base import AttentionSpec, recomputing
from efftx.attention.performer import PerformerAttention, PerformerCache, PerformerOptions, feature_map


def make(heads=4, kv_heads=2, head_dim=8, nb_features=16, chunk_size=4, redraw=0, causal=True,
         layer_index=0, seed=0) -> PerformerAttention:
    spec = AttentionSpec(kind="performer", dim=heads * head_dim, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, max_seq_len=128, causal=causal, layer_index=layer_index,
                         options=PerformerOptions(nb_features=nb_features, feature_redraw_interval=redraw,
                                                  chunk_size=chunk_size),
                         seed=seed)
    return PerformerAttention(spec).eval()


def qkv(b=2, t=13, h=4, hkv=2, d=8, scale=1.0, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, d, generator=g, dtype=dtype) * scale
    k = torch.randn(b, t, hkv, d, generator=g, dtype=dtype) * scale
    v = torch.randn(b, t, hkv, d, generator=g, dtype=dtype)
    return q, k, v


def naive_favor(q, k, v, w, causal=True):
    """Quadratic reference in float64: the explicit T x T matrix phi(q) phi(k)ᵀ, masked, no stabiliser."""
    d, m = q.shape[-1], w.shape[0]
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2).double(), v.repeat_interleave(rep, dim=2).double()
    w = w.double()

    def phi(x):
        x = x.double() * d ** -0.25
        return torch.exp(x @ w.T - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(m)

    a = torch.einsum("bihm,bjhm->bhij", phi(q), phi(k))  # (B, H, T, T)
    if causal:
        t = q.shape[1]
        a = a * torch.ones(t, t, dtype=torch.float64).tril()
    return torch.einsum("bhij,bjhd->bihd", a, v) / a.sum(-1).transpose(1, 2)[..., None]


def softmax_attention(q, k, v):
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double())


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 13, 64])
def test_causal_chunked_matches_naive_quadratic_reference(chunk_size):
    backend = make(chunk_size=chunk_size)
    q, k, v = qkv(t=13, dtype=torch.float64)
    out = backend(q, k, v)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, naive_favor(q, k, v, backend.projection), rtol=1e-9, atol=1e-10)


def test_non_causal_matches_naive_reference():
    backend = make(causal=False)
    q, k, v = qkv(t=11, dtype=torch.float64)
    torch.testing.assert_close(backend(q, k, v), naive_favor(q, k, v, backend.projection, causal=False),
                               rtol=1e-9, atol=1e-10)


def test_result_does_not_depend_on_chunk_size():
    q, k, v = qkv(t=29)
    outs = [make(chunk_size=c)(q, k, v) for c in (1, 4, 7, 29, 128)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_favor_approximates_softmax_and_improves_with_more_features():
    q, k, v = qkv(b=2, t=32, h=2, hkv=2, d=16, scale=0.5, seed=3)
    exact = softmax_attention(q, k, v)

    def error(m):  # mean over three feature draws (seeds), non-causal
        errs = [(make(heads=2, kv_heads=2, head_dim=16, nb_features=m, causal=False, seed=s)(q, k, v).double()
                 - exact).abs().mean() for s in range(3)]
        return float(sum(errs) / len(errs))

    coarse, fine = error(16), error(1024)
    assert fine < coarse / 2
    assert fine < 0.025  # outputs are O(0.15) here
    assert fine / float(exact.abs().mean()) < 0.15


def test_large_inputs_stay_finite():
    backend = make()
    q, k, v = qkv(t=20, scale=30.0)
    assert torch.isfinite(backend(q, k, v)).all()
    # The worst key for head_dim 256: aligned with the longest feature row, where exp(w·k̂ - |k̂|²/2)
    # peaks at exp(|w|²/2) ~ exp(128), beyond float32; the key exponent cap keeps it finite.
    backend = make(heads=1, kv_heads=1, head_dim=256, nb_features=32)
    w = backend.projection
    worst = w[w.norm(dim=1).argmax()] * 256 ** 0.25
    k = worst.expand(1, 16, 1, 256).contiguous()
    q, v = torch.randn(1, 16, 1, 256), torch.randn(1, 16, 1, 256)
    assert torch.isfinite(feature_map(k, w, is_query=False)).all()
    assert torch.isfinite(backend(q, k, v)).all()


def test_bfloat16_inputs_give_bfloat16_output():
    q, k, v = qkv(dtype=torch.bfloat16)
    out = make()(q, k, v)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), make()(q.float(), k.float(), v.float()), rtol=0.05, atol=0.05)


# --- features ------------------------------------------------------------------------------------


def test_features_are_deterministic_per_layer_and_seed():
    a, b = make(nb_features=24), make(nb_features=24)
    assert torch.equal(a.projection, b.projection)
    assert not torch.allclose(a.projection, make(nb_features=24, layer_index=1).projection)
    assert not torch.allclose(a.projection, make(nb_features=24, seed=1).projection)


def test_features_are_orthogonal_within_blocks():
    w = make(head_dim=8, nb_features=20).projection.double()  # blocks of 8, 8, 4 rows
    assert w.shape == (20, 8)
    for block in (w[:8], w[8:16], w[16:]):
        gram = block @ block.T
        off_diag = gram - torch.diag(torch.diagonal(gram))
        assert off_diag.abs().max() < 1e-4 * gram.diagonal().max()


def test_redraw_after_interval_training_passes_only():
    backend = make(redraw=3)
    q, k, v = qkv(b=1, t=5)
    first = backend.projection.clone()
    for _ in range(5):  # eval passes neither count nor redraw
        backend(q, k, v)
    assert torch.equal(backend.projection, first) and int(backend.calls) == 0
    backend.train()
    for _ in range(3):
        backend(q, k, v)
    assert torch.equal(backend.projection, first) and int(backend.calls) == 3
    with recomputing():  # a reversible/checkpoint recompute neither counts nor redraws
        backend(q, k, v)
    assert torch.equal(backend.projection, first) and int(backend.calls) == 3
    backend(q, k, v)  # pass number 3 (from 0) starts interval 1: fresh features
    assert int(backend.calls) == 4
    assert not torch.allclose(backend.projection, first)
    assert torch.equal(backend.projection, backend.draw(1))
    backend.eval()
    second = backend.projection.clone()
    for _ in range(4):
        backend(q, k, v)
    assert torch.equal(backend.projection, second)


def test_no_redraw_when_interval_is_zero():
    backend = make(redraw=0).train()
    first = backend.projection.clone()
    q, k, v = qkv(b=1, t=5)
    for _ in range(4):
        backend(q, k, v)
    assert torch.equal(backend.projection, first)


def test_features_and_counter_survive_state_dict_and_resume_on_schedule():
    trained = make(redraw=2).train()
    q, k, v = qkv(b=1, t=5)
    for _ in range(4):  # passes 0..3: redraw 1 happened at pass 2; pass 4 will redraw again
        trained(q, k, v)
    state = trained.state_dict()
    assert {"projection", "calls"} <= set(state)

    resumed = make(redraw=2).train()  # a fresh instance holds draw 0; the checkpoint holds draw 1
    assert not torch.equal(resumed.projection, trained.projection)
    resumed.load_state_dict(state)
    assert torch.equal(resumed.projection, trained.projection)
    assert int(resumed.calls) == 4
    resumed.eval()
    torch.testing.assert_close(resumed(q, k, v), trained.eval()(q, k, v), rtol=0, atol=0)
    resumed.train(), trained.train()
    resumed(q, k, v), trained(q, k, v)  # pass 4: both redraw to draw 2 of the same seed
    assert int(resumed.calls) == 5
    assert torch.equal(resumed.projection, trained.projection)


# --- cache ---------------------------------------------------------------------------------------


def test_decode_step_uses_only_running_sums():
    backend = make(chunk_size=4)
    q, k, v = qkv(b=2, t=20)
    full = backend(q, k, v)
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    assert isinstance(cache, PerformerCache)
    parts = [backend(q[:, :9], k[:, :9], v[:, :9], cache=cache)]
    s_shape, z_shape = cache.s.shape, cache.z.shape
    assert s_shape == (2, 2, 16, 8) and z_shape == (2, 2, 16)
    for i in range(9, 20):
        cache.phi_k[:, :i] = float("nan")  # a decode step must not read the per-token history
        cache.v[:, :i] = float("nan")
        parts.append(backend(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache=cache))
        assert cache.s.shape == s_shape and cache.z.shape == z_shape
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)


def test_cache_sums_are_the_feature_sums_and_rewind_restores_them():
    backend = make()
    q, k, v = qkv(b=2, t=12)
    cache = backend.new_cache(2, 16, torch.device("cpu"), torch.float32)
    backend(q[:, :7], k[:, :7], v[:, :7], cache=cache)
    s7, z7 = cache.s.clone(), cache.z.clone()
    assert cache.state.dtype == torch.float64
    torch.testing.assert_close(cache.z, cache.phi_k[:, :7].double().sum(1))
    torch.testing.assert_close(cache.s, torch.einsum("bthm,bthd->bhmd", cache.phi_k[:, :7].double(),
                                                     cache.v[:, :7].double()))
    backend(q[:, 7:], k[:, 7:], v[:, 7:], cache=cache)
    assert cache.length == 12
    cache.rewind(5)
    assert cache.length == 7
    # the removed tokens' float64 contributions are subtracted: back to s7 up to float64 rounding of the sums
    torch.testing.assert_close(cache.s, s7, rtol=1e-12, atol=1e-12 * float(s7.abs().max()))
    torch.testing.assert_close(cache.z, z7, rtol=1e-12, atol=1e-12 * float(z7.abs().max()))
    with pytest.raises(ValueError):
        cache.rewind(8)
    with pytest.raises(ValueError):
        cache.rewind(-1)
    with pytest.raises(ValueError):  # capacity 16: 7 + 12 overflows
        backend(q, k, v, cache=cache)


def decode(backend, cache, q, k, v, a, e, step=1):
    """Feed tokens [a, e) of (q, k, v) through ``cache`` ``step`` tokens at a time; the outputs."""
    return torch.cat([backend(q[:, i:min(i + step, e)], k[:, i:min(i + step, e)], v[:, i:min(i + step, e)],
                              cache=cache) for i in range(a, e, step)], 1)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("step", [1, 3])  # decode steps (the O(1) path) and speculative-verify blocks
def test_cached_steps_after_a_prefill_equal_the_full_forward(causal, step):
    """A prefill of 9 tokens (chunks of 4: the last partial), then 11 more tokens one (or three) at a time:
    the same outputs as one forward over the 20 tokens (causal) / over each prefix (non-causal)."""
    backend = make(chunk_size=4, causal=causal)
    q, k, v = qkv(b=2, t=20)
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    got = torch.cat([backend(q[:, :9], k[:, :9], v[:, :9], cache=cache), decode(backend, cache, q, k, v, 9, 20, step)], 1)
    if causal:
        want = naive_favor(q, k, v, backend.projection).float()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    else:  # a block sees every cached token and all of its own
        ends = [9] + [min(i + step, 20) for i in range(9, 20, step)]
        for a, e in zip([0] + ends[:-1], ends):
            want = naive_favor(q[:, :e], k[:, :e], v[:, :e], backend.projection, causal=False)[:, a:e].float()
            torch.testing.assert_close(got[:, a:e], want, rtol=1e-4, atol=1e-5)


def record_sum(cache, row, n):
    """float64 Σ phi(k) [v, 1] over the first n records of one row: (1, Hkv, m, D + 1)."""
    kf, v = cache.phi_k[row:row + 1, :n].double(), cache.v[row:row + 1, :n].double()
    return torch.einsum("bthm,bthd->bhmd", kf, torch.cat((v, torch.ones_like(v[..., :1])), -1))


@pytest.mark.parametrize("rewind", [4, [2, 5]])  # every row alike, or ragged (a subtraction per row)
def test_rewind_equals_never_having_decoded_the_tokens(rewind):
    """Prefill 9, decode 6, rewind, decode 5 more. After the rewind the state is the float64 sum of the kept
    tokens' records to float64 rounding (1e-12 of its size: the same float64 products added, then subtracted),
    and the cache equals one that never saw the removed tokens; that one is fed in other batch shapes, so its
    float32 features differ by rounding (the state by ~1e-6 relative), hence 1e-5 on its state and outputs."""
    backend = make(chunk_size=4)
    q, k, v = qkv(b=2, t=20)
    counts = [rewind] * 2 if isinstance(rewind, int) else rewind
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    backend(q[:, :9], k[:, :9], v[:, :9], cache=cache)
    decode(backend, cache, q, k, v, 9, 15)
    cache.rewind(rewind)
    assert cache.lengths == [15 - c for c in counts]
    for row, c in enumerate(counts):
        exact = record_sum(cache, row, 15 - c)
        torch.testing.assert_close(cache.state[row:row + 1], exact, rtol=1e-12, atol=1e-12 * float(exact.abs().max()))
        # the same as a cache that never decoded the removed tokens, and so are the next outputs
        clean = backend.new_cache(1, 32, torch.device("cpu"), torch.float32)
        rq, rk, rv = q[row:row + 1], k[row:row + 1], v[row:row + 1]
        backend(rq[:, :9], rk[:, :9], rv[:, :9], cache=clean)
        decode(backend, clean, rq, rk, rv, 9, 15 - c)
        torch.testing.assert_close(cache.state[row:row + 1], clean.state, rtol=1e-5,
                                   atol=1e-6 * float(exact.abs().max()))
        one = backend.new_cache(1, 32, torch.device("cpu"), torch.float32)
        one.state.copy_(cache.state[row:row + 1])
        one.lengths = [cache.lengths[row]]
        torch.testing.assert_close(decode(backend, one, rq, rk, rv, 15, 20), decode(backend, clean, rq, rk, rv, 15, 20),
                                   rtol=1e-5, atol=1e-6)


def test_cached_steps_record_a_graph_when_inputs_require_grad():
    """The decode step and the cached prefill run under autograd too (no in-place update breaks the graph). The
    cache's state is a constant: a decode step's gradient reaches its query, not the keys and values it adds."""
    backend = make(chunk_size=4)
    q, k, v = (z.requires_grad_() for z in qkv(b=2, t=12))
    cache = backend.new_cache(2, 16, torch.device("cpu"), torch.float32)
    out = torch.cat([backend(q[:, :9], k[:, :9], v[:, :9], cache=cache), decode(backend, cache, q, k, v, 9, 12)], 1)
    out.sum().backward()
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all() and g[:, :9].abs().sum() > 0
    assert q.grad[:, 9:].abs().sum() > 0


def test_rewind_reads_only_the_removed_tokens():
    """Rewind costs O(tokens removed): the kept tokens' records are never read (NaN there changes nothing)."""
    backend = make(chunk_size=4)
    q, k, v = qkv(b=2, t=20)
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    backend(q[:, :12], k[:, :12], v[:, :12], cache=cache)
    s8 = cache.state.clone() - torch.einsum("bthm,bthd->bhmd", cache.phi_k[:, 8:12].double(),
                                             torch.cat((cache.v[:, 8:12], torch.ones(2, 4, 2, 1)), -1).double())
    cache.phi_k[:, :7] = float("nan")
    cache.v[:, :7] = float("nan")
    cache.rewind(4)
    torch.testing.assert_close(cache.state, s8, rtol=1e-12, atol=1e-12)
    cache.rewind([1, 0])  # ragged: row 0 loses slot 7 alone
    assert torch.isfinite(cache.state).all() and cache.lengths == [7, 8]
    torch.testing.assert_close(cache.state[1], s8[1], rtol=0, atol=0)


def test_many_speculative_cycles_do_not_drift():
    """300 rounds of 'append 5 tokens, rewind 1 to 5 of them' (a speculative decoder's pattern): the state stays
    the float64 sum of the records it holds, to float64 rounding."""
    backend = make(chunk_size=4)
    q, k, v = qkv(b=1, t=320)
    cache = backend.new_cache(1, 640, torch.device("cpu"), torch.float32)
    backend(q[:, :16], k[:, :16], v[:, :16], cache=cache)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        if cache.length + 5 > 320:
            break
        a = cache.length
        decode(backend, cache, q, k, v, a, a + 5, step=int(torch.randint(1, 6, (1,), generator=g)))
        cache.rewind(int(torch.randint(1, 6, (1,), generator=g)))
    n = cache.length
    assert n > 100
    want = record_sum(cache, 0, n)
    torch.testing.assert_close(cache.state, want, rtol=1e-11, atol=1e-11 * float(want.abs().max()))


# --- GQA -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_gqa_equals_repeated_kv_heads(causal):
    q, k, v = qkv(b=2, t=11, h=4, hkv=2)
    grouped = make(heads=4, kv_heads=2, causal=causal)(q, k, v)
    repeated = make(heads=4, kv_heads=4, causal=causal)(q, k.repeat_interleave(2, dim=2),
                                                         v.repeat_interleave(2, dim=2))
    torch.testing.assert_close(grouped, repeated, rtol=1e-5, atol=1e-6)


# --- the chunked CPU autograd.Function -----------------------------------------------------------


def favor_grads(fn, q, k, v, seed=5):
    """Output and (dq, dk, dv) of ``fn(q, k, v)`` under a fixed random output gradient (drawn in float64)."""
    q, k, v = (z.detach().requires_grad_() for z in (q, k, v))
    out = fn(q, k, v)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (out * weight.to(out.dtype)).sum().backward()
    return out, (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("segment_budget", [None, 1, 768])  # default: one segment; 1: a chunk per segment
@pytest.mark.parametrize("chunk_size", [1, 3, 4, 5, 13, 64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (4, 4)])
def test_chunked_function_equals_naive_reference_forward_and_gradients(chunk_size, heads, kv_heads, segment_budget,
                                                                       monkeypatch):
    """T = 13 is no multiple of the chunk (nor, with a budget of 768 = segments of 2 chunks at chunk 3, of the
    segment); float64 throughout, so equal to rounding."""
    if segment_budget is not None:
        monkeypatch.setattr(performer, "SEGMENT_BUDGET", segment_budget)
    backend = make(heads=heads, kv_heads=kv_heads, chunk_size=chunk_size).train()
    assert backend.uses_chunked_path(torch.zeros(1))
    q, k, v = qkv(t=13, h=heads, hkv=kv_heads, dtype=torch.float64)
    got, got_grads = favor_grads(lambda *a: backend(*a), q, k, v)
    want, want_grads = favor_grads(lambda *a: naive_favor(*a, backend.projection), q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert w.abs().sum() > 0
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10, msg=name)


@pytest.mark.parametrize("chunk_size, segment_budget, segment", [(64, None, 256), (64, 1 << 20, 512), (64, 1, 64),
                                                                  (128, None, 256)])
def test_chunked_function_float32_at_bench_settings_equals_float64_reference(chunk_size, segment_budget, segment,
                                                                             monkeypatch):
    """256 features, chunks of 64 (the bench's settings) or 128, T = 300: the last chunk partial; by default in
    segments of 256 tokens (the second partial), with a budget of 1 << 20 in one partial segment, with a budget
    of 1 one chunk per segment."""
    if segment_budget is not None:
        monkeypatch.setattr(performer, "SEGMENT_BUDGET", segment_budget)
    backend = make(heads=4, kv_heads=2, head_dim=16, nb_features=256, chunk_size=chunk_size).train()
    q, k, v = qkv(b=2, t=300, h=4, hkv=2, d=16, scale=0.7)
    assert performer.segment_length(2, 4, 256, chunk_size) == segment
    got, got_grads = favor_grads(lambda *a: backend(*a), q, k, v)
    want, want_grads = favor_grads(lambda *a: naive_favor(*a, backend.projection), *(z.double() for z in (q, k, v)))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, rtol=1e-3, atol=1e-4, msg=name)


def test_chunked_function_equals_the_autograd_composition_with_clamped_keys():
    """Keys whose feature exponent hits KEY_EXP_MAX pass no gradient through it, as with autograd's clamp."""
    backend = make(heads=1, kv_heads=1, head_dim=256, nb_features=32, chunk_size=4).train()
    w = backend.projection
    k = torch.randn(1, 10, 1, 256, dtype=torch.float64)
    k[:, 3] = w[w.norm(dim=1).argmax()].double() * 256 ** 0.25  # the worst key: a clamped exponent
    q, v = torch.randn(1, 10, 1, 256, dtype=torch.float64), torch.randn(1, 10, 1, 256, dtype=torch.float64)
    assert (feature_map(k, w.double(), is_query=False) * math.sqrt(32)).max() == pytest.approx(math.exp(50))
    got, got_grads = favor_grads(lambda *a: backend(*a), q, k, v)
    backend.chunked = False
    assert not backend.uses_chunked_path(q)
    want, want_grads = favor_grads(lambda *a: backend(*a), q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    for g, wg in zip(got_grads, want_grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, wg, rtol=1e-8, atol=1e-10)


def test_chunked_function_saves_only_its_inputs_output_denominators_and_segment_states(monkeypatch):
    """No feature of any token is kept for the backward: it recomputes them from q and k and the state entering
    each segment. Besides the inputs it keeps its own output (the same storage as the tensor it returns, which
    the output projection keeps anyway) and one denominator per query."""
    monkeypatch.setattr(performer, "SEGMENT_BUDGET", 2 * 4 * 64 * 8)  # segments of 8 tokens (2 chunks)
    backend = make(nb_features=64, chunk_size=4).train()
    q, k, v = (z.requires_grad_() for z in qkv(t=40))
    out = backend(q, k, v)
    node = out.grad_fn
    assert type(node).__name__ == "_CausalFavorBackward"
    segments = 40 // performer.segment_length(2, 4, 64, 4)
    assert segments == 5
    saved = node.saved_tensors
    assert sorted(tuple(z.shape) for z in saved) == sorted(
        [tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(backend.projection.shape), (segments, 2, 2, 64, 9),
         tuple(out.shape), (2, 2, 10, 8, 1)])
    assert any(z.data_ptr() == out.data_ptr() for z in saved)


def test_key_feature_backward_drops_clamped_exponents_as_autograd_does():
    """The chunked backward's key-feature gradient (from :func:`performer._features` with its clamp mask) equals
    autograd's through :func:`feature_map` for keys with clamped exponents (1.1 x̂ = w_j: not the stationary point
    of the exponent, so a gradient leaking through the clamp would show); the forward's ``mask=False`` skips the
    mask and nothing else."""
    g = torch.Generator().manual_seed(3)
    w = performer.orthogonal_features(32, 256, g).double()
    x = torch.randn(3, 5, 256, generator=g, dtype=torch.float64)
    x[0, 1] = w[w.norm(dim=1).argmax()] * 1.1 * 256 ** 0.25
    x[2, 4] = w[w.norm(dim=1).argmin()] * 1.3 * 256 ** 0.25
    dphi = torch.randn(3, 5, 32, generator=g, dtype=torch.float64)
    x.requires_grad_()
    (performer.feature_map(x, w, is_query=False) * dphi).sum().backward()
    with torch.no_grad():
        phi, xh, clamped = performer._features(x.detach(), w, is_query=False)
        assert clamped is not None and clamped.any()
        phi2, _, none = performer._features(x.detach(), w, is_query=False, mask=False)
        assert none is None and torch.equal(phi, phi2)
        got = performer._features_backward(dphi.clone(), phi, xh, w, clamped) * 256 ** -0.25
    torch.testing.assert_close(got, x.grad, rtol=1e-10, atol=1e-12)

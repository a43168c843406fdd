"""Sinkhorn attention's training path without a cache (issue 17: fwd+bwd memory): ``_BucketAttention`` computes
every head chunk by chunk of buckets and keeps no block (local window, own bucket + selection) for backward.

It must be the same attention as the module docstring's (the float64 per-query oracle of test_sinkhorn.py) and as
the bucketed SDPA path that a cache or no gradient takes, forward and every gradient (q, k, v, sort weights, the
null bucket), for blend / topk / non-causal, lengths that are not a multiple of the bucket, GQA, one or several
buckets per chunk, with the CPU flash kernel's own ops and with SDPA (backward recomputing the attention); and it
must keep for backward no more than the queries, keys, values, output and the small selection weights."""

import pytest
import torch

import efftx.attention.sinkhorn as sk
from efftx import attention
from efftx.attention.base import AttentionSpec
from efftx.attention.sinkhorn import SinkhornAttention, SinkhornOptions
from test_sinkhorn import qkv, reference  # tests/test_sinkhorn.py

CASES = [  # (causal, options, n_local, kv_heads): heads 4, head dim 8, bucket 4
    (True, {}, 1, 2), (True, {}, 0, 4), (True, {}, 2, 1), (True, {}, 4, 2),
    (True, {"causal_mode": "topk"}, 1, 2), (True, {"causal_mode": "topk", "topk": 2}, 2, 4),
    (False, {}, 1, 2), (False, {}, 0, 1), (False, {}, 3, 4),
]
IDS = ["blend", "blend-nolocal-mha", "blend-mqa", "all-local", "topk1", "topk2-mha", "noncausal",
       "noncausal-mqa", "noncausal-mha"]


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts the calls of _BucketAttention (so that a test knows which path it ran)."""
    calls = []
    forward = sk._BucketAttention.forward

    def counted(ctx, *args):
        calls.append(args[0])
        return forward(ctx, *args)

    monkeypatch.setattr(sk._BucketAttention, "forward", staticmethod(counted))
    return calls


def backend_for(causal, options, n_local, kv_heads, dtype=torch.float32, bucket=4, dropout=0.0, head_dim=8):
    """4 heads, random sort weights and null bucket (so that every gradient is non-trivial)."""
    spec = AttentionSpec(kind="sinkhorn", dim=4 * head_dim, heads=4, kv_heads=kv_heads, head_dim=head_dim,
                         max_seq_len=256,
                         causal=causal, dropout=dropout,
                         options=SinkhornOptions(bucket_size=bucket, n_local_attn_heads=n_local, **options))
    torch.manual_seed(0)
    backend = attention.build(spec).eval().to(dtype)
    with torch.no_grad():
        for p in backend.parameters():
            p.normal_()
    return backend


def grads(backend, q, k, v, out, g):
    """Gradients of (out * g).sum() with respect to q, k, v and every parameter of the backend."""
    return torch.autograd.grad((out * g).sum(), [q, k, v, *backend.parameters()], allow_unused=True)


def assert_same(got, want, rtol, atol):
    for a, e in zip(got, want):
        if e is None or a is None:  # a parameter that does not reach the output: no gradient on either side
            assert (a is None or a.abs().max() == 0) and (e is None or e.abs().max() == 0)
        else:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("t", [13, 16])  # a partial last bucket; whole buckets
@pytest.mark.parametrize("chunk_tokens, flash", [(4, True), (8, False), (2048, True)],
                         ids=["bucket-chunks-flash", "2bucket-chunks-sdpa", "one-chunk-flash"])
def test_lean_path_matches_the_float64_reference(case, t, chunk_tokens, flash, monkeypatch, lean_calls):
    monkeypatch.setattr(sk, "_CHUNKS", 1)  # chunks of chunk_tokens
    monkeypatch.setattr(sk, "_CHUNK_TOKENS", chunk_tokens)
    monkeypatch.setattr(sk, "_CPU_FLASH", flash)
    backend = backend_for(*case, dtype=torch.float64)
    q, k, v = (x.double().requires_grad_() for x in qkv(t, kv_heads=case[3]))
    g = torch.randn(2, t, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out = backend(q, k, v)
    assert len(lean_calls) == 1  # the path under test ran
    expected = reference(backend, q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)  # the sort net scores in float32
    assert_same(grads(backend, q, k, v, out, g), grads(backend, q, k, v, expected, g), 1e-5, 1e-6)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("t, bucket", [(23, 4), (32, 4), (21, 3), (40, 8)])
def test_lean_path_equals_the_bucketed_sdpa_path(case, t, bucket, monkeypatch, lean_calls):
    """Many shapes, float32: the lean path against the path a cache or no gradient takes (forced here)."""
    monkeypatch.setattr(sk, "_CHUNKS", 1)
    monkeypatch.setattr(sk, "_CHUNK_TOKENS", 2 * bucket)  # chunks of two buckets
    backend = backend_for(*case, bucket=bucket)
    q, k, v = (x.requires_grad_() for x in qkv(t, kv_heads=case[3], seed=t))
    g = torch.randn(2, t, 4, 8, generator=torch.Generator().manual_seed(t))
    out = backend(q, k, v)
    assert len(lean_calls) == 1
    got = grads(backend, q, k, v, out, g)
    monkeypatch.setattr(SinkhornAttention, "_lean", lambda self, q, k, v: False)
    want_out = backend(q, k, v)
    assert len(lean_calls) == 1
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert_same(got, grads(backend, q, k, v, want_out, g), 1e-4, 1e-5)


def test_the_lean_path_only_where_a_gradient_is_wanted(lean_calls):
    backend = backend_for(*CASES[0], dropout=0.5)
    q, k, v = qkv(16)
    with torch.no_grad():
        backend(q, k, v)  # evaluation
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    backend(q, k, v, cache=cache)  # a prefill through the cache keeps its state
    backend.train()
    backend(q.requires_grad_(), k, v)  # attention dropout: SDPA's own path
    assert lean_calls == []
    backend.eval()(q, k, v)
    assert len(lean_calls) == 1


def saved_bytes(backend, q, k, v) -> int:
    """Bytes of the distinct storages (parameters aside) autograd keeps for backward of ``backend(q, k, v)``."""
    params = {p.untyped_storage().data_ptr() for p in backend.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        backend(q, k, v)
    return sum(seen.values())


@pytest.mark.parametrize("case", [CASES[0], CASES[5], CASES[6]], ids=["blend", "topk2-mha", "noncausal"])
def test_lean_path_keeps_no_block_for_backward(case, monkeypatch):
    """What a training call keeps for backward: its (padded) queries, keys, values, output, log-sum-exp and
    the selection weights (with the sort net's small tensors), nothing the size of the blocks of keys."""
    # 8 buckets of 16, the last one partial; heads of 64, so that the sort net's (B, H, 8, 8) tensors are small
    backend = backend_for(*case, bucket=16, head_dim=64)
    q, k, v = (x.requires_grad_() for x in qkv(120, kv_heads=case[3], head_dim=64))
    size = q.numel() * 4 * 128 // 120  # the queries padded to whole buckets
    budget = size * 2 + (k.numel() + v.numel()) * 4 + size // 2  # queries, output, k, v; half a q to spare
    lean = saved_bytes(backend, q, k, v)
    assert lean <= budget, (lean, budget)
    # power: the bucketed SDPA path keeps the blocks (own + selected keys and values) and goes over the budget
    monkeypatch.setattr(SinkhornAttention, "_lean", lambda self, q, k, v: False)
    assert saved_bytes(backend, q, k, v) > budget

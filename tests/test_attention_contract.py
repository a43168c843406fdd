"""Contract tests every registered attention backend must pass (run over the whole registry)."""

import math

import pytest
import torch

from efftx import attention, recipes
from efftx.attention.base import AttentionSpec
from efftx.models import build as build_model
from efftx.models.lm import LM

# Every backend a language model can use; the DALL-E image patterns (efftx/attention/patterns.py) need a
# text/image layout and get the same checks inside the DALL-E model in tests/test_dalle.py.
BACKENDS = [n for n in attention.names() if not getattr(attention.get(n), "requires_image_layout", False)]
# Option values that change a backend's design get the same checks: "kind:key=value,key=value" (added to
# the backend's contract_options).
VARIANTS = [
    "sinkhorn:causal_mode=topk",  # the reference's causal design: top past bucket + learned null bucket
    "sinkhorn:causal_mode=topk,topk=2",
    "nsa:num_initial_blocks=1,num_local_blocks=2,num_selected_blocks=3",  # the paper's forced blocks
    "nsa:score_mapping=eq9",  # the paper's Eq. 9 (overlapping compressed blocks: stride 4 < block 8)
    "nsa:share_selection=false",  # per-query-head selection
    "nsa:diff_topk=true",  # straight-through top-k: gradients reach the block importances
    "nsa:compress=conv_linear",  # the seed's other compression networks
    "nsa:compress=attention_pool",
    "nsa:separate_kv=true",  # the paper's own key/value projections for the compressed and window branches
    "nsa:compress_mem_kv=2",  # the seed library's learned memory slots in the compressed branch
    "nsa:separate_kv=true,compress_mem_kv=1,share_selection=false,diff_topk=true",
    "nsa:importance=logits_softmax,diff_topk=true",  # the seed library's ranking (softmax of the mean logits)
    "nsa:min_importance=0.3",  # blocks below an importance threshold are left out (the seed library: 1e-10)
    # the seed library's choices together
    "nsa:importance=logits_softmax,min_importance=1e-10,compress_mem_kv=1,diff_topk=true,diff_topk_gate=keys",
    "nsa:diff_topk=true,diff_topk_gate=keys",  # the straight-through gate on the selected blocks' keys
]
BACKENDS += VARIANTS


def tiny_lm(kind: str, seed: int = 0) -> LM:
    kind, _, variant = kind.partition(":")
    # the backend's own small-size options (contract_options): several buckets, chunks, windows at these lengths
    options = {**attention.get(kind).contract_options, **dict(kv.split("=") for kv in variant.split(",") if kv)}
    small = {f"attention.{kind}.{key}": value for key, value in options.items()}
    cfg = recipes.get("lm_debug").override({"attention.kind": kind, "model.max_seq_len": 64, **small})
    torch.manual_seed(seed)
    return build_model(cfg).eval()


def tokens(b=2, t=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g)


@pytest.mark.parametrize("kind", BACKENDS)
def test_backend_shapes_with_gqa(kind):
    spec = AttentionSpec.from_config(tiny_lm(kind).model_cfg, tiny_lm(kind).attention_cfg, kind=kind.partition(":")[0])
    backend = attention.build(spec)
    h, hkv, d = spec.heads, spec.kv_heads, spec.head_dim
    assert hkv < h
    q = torch.randn(3, 10, h, d)
    k, v = torch.randn(3, 10, hkv, d), torch.randn(3, 10, hkv, d)
    out = backend(q, k, v, x=torch.randn(3, 10, spec.dim))
    assert out.shape == (3, 10, h, d)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kind", BACKENDS)
def test_causality(kind):
    model = tiny_lm(kind)
    x = tokens()
    base = model(x)
    for j in (5, 17, 23):
        y = x.clone()
        y[:, j] = (y[:, j] + 1) % 256
        out = model(y)
        torch.testing.assert_close(out[:, :j], base[:, :j], rtol=0, atol=1e-6)
        assert not torch.allclose(out[:, j:], base[:, j:])


@pytest.mark.parametrize("kind", BACKENDS)
@pytest.mark.parametrize("prefill", [1, 7, 16])
def test_cached_decoding_equals_full_forward(kind, prefill):
    model = tiny_lm(kind)
    x = tokens()
    full = model(x)
    cache = model.new_cache(x.shape[0], 64)
    parts = [model(x[:, :prefill], cache=cache)]
    for i in range(prefill, x.shape[1]):
        parts.append(model(x[:, i:i + 1], cache=cache))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)
    assert cache.length == x.shape[1]


@pytest.mark.parametrize("kind", BACKENDS)
def test_chunked_prefill_equals_full_forward(kind):
    model = tiny_lm(kind)
    x = tokens(t=30)
    cache = model.new_cache(2, 64)
    parts = [model(x[:, a:a + 10], cache=cache) for a in (0, 10, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", BACKENDS)
def test_rewind_forgets_tokens(kind):
    model = tiny_lm(kind)
    x = tokens(t=20)
    cache = model.new_cache(2, 64)
    model(x[:, :12], cache=cache)
    model(torch.randint(0, 256, (2, 5)), cache=cache)  # tokens that will be rejected
    cache.rewind(5)
    assert cache.length == 12
    rest = model(x[:, 12:], cache=cache)
    torch.testing.assert_close(rest, model(x)[:, 12:], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError):
        cache.rewind(cache.length + 1)


@pytest.mark.parametrize("kind", BACKENDS)
def test_gradients_are_finite_and_reach_every_parameter(kind):
    model = tiny_lm(kind).train()
    x = tokens()
    logits = model(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def naive_attention(q, k, v, causal=True):
    """Textbook softmax attention with GQA, in float64: the oracle for the SDPA backend."""
    b, t, h, d = q.shape
    rep = h // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double())


def test_full_backend_matches_naive_softmax_attention():
    spec = AttentionSpec(kind="full", dim=48, heads=6, kv_heads=2, head_dim=8, max_seq_len=32)
    backend = attention.build(spec)
    q, k, v = torch.randn(2, 13, 6, 8), torch.randn(2, 13, 2, 8), torch.randn(2, 13, 2, 8)
    torch.testing.assert_close(backend(q, k, v).double(), naive_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_registry_rejects_unknown_backend():
    from efftx.errors import ConfigError

    with pytest.raises(ConfigError, match="not a registered backend; choose from .*full"):
        attention.get("flashy")


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("t", [1, 2, 6, 16])
def test_few_query_attention_equals_sdpa_with_ragged_masks(heads, kv_heads, t):
    """The decoding path of full attention over a ragged cache (two matmuls around a masked softmax, query heads
    of a kv head stacked) against SDPA with the same (B, 1, T, L) mask, float64: MHA, GQA and MQA, one to sixteen
    queries per row, rows of different lengths (each query sees its own key and those before it)."""
    import torch.nn.functional as F

    from efftx.attention.full import few_query_attention

    g = torch.Generator().manual_seed(t * 10 + heads + kv_heads)
    b, length, d = 3, 40, 8
    q = torch.randn(b, heads, t, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, kv_heads, length, d, generator=g, dtype=torch.float64) for _ in range(2))
    ends = torch.tensor([length - 3, length - 17, length])  # each row's length after its t new tokens
    slots = ends[:, None] - t + torch.arange(t)  # (B, T) the new tokens' positions
    mask = (torch.arange(length)[None, None, :] <= slots[:, :, None])[:, None]  # (B, 1, T, L)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=heads != kv_heads)
    torch.testing.assert_close(few_query_attention(q, k, v, mask), want, rtol=1e-12, atol=1e-12)


def test_growing_masks_keep_sdpa_off_cudnn_on_cuda_only():
    """A decode step's mask grows by a key every step: on CUDA SDPA must not pick cuDNN (a graph per shape)."""
    from efftx.attention.full import growing_mask_backends

    backends = torch.backends.cuda
    with growing_mask_backends(torch.device("cuda")):
        assert not backends.cudnn_sdp_enabled() and not backends.flash_sdp_enabled()  # flash takes no mask anyway
        assert backends.mem_efficient_sdp_enabled() and backends.math_sdp_enabled()
    assert backends.cudnn_sdp_enabled()  # restored
    with growing_mask_backends(torch.device("cpu")):
        assert backends.cudnn_sdp_enabled() and backends.flash_sdp_enabled()  # nothing changes off CUDA


def test_full_attention_guards_its_ragged_decode_steps_only(monkeypatch):
    """The guard wraps SDPA in the cached steps of ragged rows (decode, verify), not in training passes or plain
    prefills. (On a CPU those steps take the C++ decode attention kernel: switched off here, to reach SDPA.)"""
    import contextlib

    from efftx.attention import full
    from efftx.generation.decode import generate
    from efftx.kernels import decode_attention_cpu

    monkeypatch.setitem(decode_attention_cpu._state, "enabled", False)

    calls = []
    monkeypatch.setattr(full, "growing_mask_backends", lambda device: calls.append(device) or contextlib.nullcontext())
    model = tiny_lm("full")
    model(tokens())  # a training-shaped pass: no cache, no mask
    assert calls == []
    generate(model, [[5, 6, 7, 8, 9], [42]], 4, temperature=0)  # ragged rows decoded together
    assert calls and all(device.type == "cpu" for device in calls)

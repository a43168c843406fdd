"""The MFU line's model FLOPs: attention FLOPs per backend against hand counts, and against the matmul FLOPs
torch's FlopCounterMode sees in the backend's forward pass (the backends whose algorithm is what they run)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from efftx import attention, models, recipes
from efftx.attention.base import AttentionSpec
from efftx.errors import ConfigError
from efftx.flops import attention_cost

B, T = 2, 64


def _spec(recipe: str, **overrides) -> AttentionSpec:
    cfg = recipes.get(recipe).override(overrides)
    return AttentionSpec.from_config(cfg.model, cfg.attention)


def _counted_forward_flops(spec: AttentionSpec) -> int:
    """Matmul FLOPs of one forward pass of the backend over (B, T) random inputs, as FlopCounterMode counts them."""
    torch.manual_seed(0)
    backend = attention.build(spec).train()
    q = torch.randn(B, T, spec.heads, spec.head_dim)
    k, v = torch.randn(B, T, spec.kv_heads, spec.head_dim), torch.randn(B, T, spec.kv_heads, spec.head_dim)
    with FlopCounterMode(display=False) as counter:
        backend(q, k, v, x=torch.randn(B, T, spec.dim))
    return counter.get_total_flops()


def test_full_attention_is_palm_12_lhdt_per_token():
    cfg = recipes.get("lm_debug")  # 2 layers, 4 heads of 16, GQA 2 kv heads, tied embedding
    model = models.build(cfg)
    spec = model.blocks[0].attention.spec
    assert attention_cost(spec, T).forward == 4 * T * T * 4 * 16  # QK^T and AV over every key
    t = cfg.data.seq_len
    assert model.flops_per_token(t) == 6 * model.num_params() + 12 * 2 * 4 * 16 * t


def test_performer_counts_features_states_and_chunk_blocks():
    spec = _spec("performer_debug")  # H = Hkv = 4, D = 16, m = 32 features, chunks of 16: 4 chunks of T = 64
    h, d, m, c = 4, 16, 32, 16
    per_token = (2 * h * d * m + 2 * h * d * m  # query and key features
                 + 2 * h * m * (d + 1) + 2 * h * m * (d + 1)  # chunk states phi(k)^T [v, 1] and their read-out
                 + 2 * h * c * m + 2 * h * c * (d + 1))  # the C x C intra-chunk block and its product with [v, 1]
    assert per_token == 23168
    assert attention_cost(spec, T).forward == T * per_token
    assert _counted_forward_flops(spec) == B * T * per_token  # exactly the matmuls the backend runs


def test_sinkhorn_counts_buckets_mixing_sort_net_and_local_heads():
    spec = _spec("sinkhorn_debug")  # H = 4 (2 local, 2 sorting), D = 16, buckets of 16: 4 buckets of T = 64
    d, n, nb = 16, 16, 4
    attend = 4 * T * 2 * (n + n) * d  # sorting heads: own bucket + the sorted one
    mix = 2 * 2 * 2 * nb * (nb - 1) * n * d  # keys and values of each bucket, mixed from the 3 past buckets
    sort_net = 2 * (2 * nb * d * d + 2 * nb * (nb - 1) * d)  # s_q W, then (s_q W) s^T, per sorting head
    local = 4 * T * 2 * (2 * n) * d  # local heads: previous + own bucket
    assert attend + mix + sort_net + local == 553728
    cost = attention_cost(spec, T)
    assert cost.forward == 553728 and cost.excluded == ("sort_net",)
    # (no FlopCounterMode check: part of its attention runs through SDPA, which the counter does not see on CPU)


def test_sinkhorn_topk_reads_topk_buckets():
    blend = attention_cost(_spec("sinkhorn_debug"), T).forward
    top2 = attention_cost(_spec("sinkhorn_debug", **{"attention.sinkhorn.causal_mode": "topk",
                                                      "attention.sinkhorn.topk": 2}), T).forward
    d, n, nb = 16, 16, 4
    # one more bucket of n keys per query of the 2 sorting heads, and twice the mixing
    assert top2 - blend == 4 * T * 2 * n * d + 2 * 2 * 2 * nb * (nb - 1) * n * d


def test_nsa_counts_its_three_branches_and_the_compression():
    spec = _spec("nsa_debug")  # H 4, Hkv 2, D 16; compress blocks l = d = 8, hidden 64; 2 + 1 blocks of 8; window 16
    blocks = (T - 8) // 8 + 1
    compress = 2 * 2 * blocks * 2 * (8 * 16 * 64 + 64 * 16)  # keys and values, per kv head and block
    compressed = 4 * T * 4 * (blocks + 1) * 16  # + the memory slot (nsa_* recipes: attention.nsa.compress_mem_kv=1)
    selected = 4 * T * 4 * (2 + 1) * 8 * 16
    window = 4 * T * 4 * 16 * 16
    cost = attention_cost(spec, T)
    assert cost.forward == compress + compressed + selected + window == 1392640
    # the CPU path computes more than the algorithm (windows in chunks of c against c + w keys, the importance
    # scores): what it runs is at least the count, and not wildly more
    gate = 2 * T * 64 * 3 * 4  # the per-token gate Linear, counted by the model's 6 x parameters term
    counted = _counted_forward_flops(spec) / B - gate
    assert cost.forward <= counted <= 2 * cost.forward


def test_per_block_parameters_leave_the_six_n_term():
    """Sinkhorn's sort net and NSA's compression run per bucket / compressed block, not per token: counting them
    as 6 x parameters overstated NSA's enwik8 model FLOPs by more than 3x."""
    for recipe, prefixes in (("sinkhorn_debug", ("sort_net",)), ("nsa_debug", ("compress_k", "compress_v", "mem_k", "mem_v"))):
        cfg = recipes.get(recipe)
        model = models.build(cfg)
        t = cfg.data.seq_len
        excluded = sum(p.numel() for blk in model.blocks for name, p in blk.attention.inner.named_parameters()
                       if name.startswith(prefixes))
        assert excluded > 0
        attn = sum(3 * attention_cost(blk.attention.spec, t).forward / t for blk in model.blocks)
        lookups = model.embed.weight.numel() if model.head is not None else 0
        assert model.flops_per_token(t) == pytest.approx(6 * (model.num_params() - lookups - excluded) + attn)
    nsa = models.build(recipes.get("nsa_enwik8"))
    assert nsa.flops_per_token(512) < 6 * nsa.num_params() / 3


def test_unknown_backend_is_a_clear_error():
    spec = _spec("lm_debug")
    import dataclasses

    with pytest.raises(ConfigError, match="attention.kind='nope' has no FLOP count"):
        attention_cost(dataclasses.replace(spec, kind="nope"), T)


@pytest.mark.parametrize("recipe", ["lm_debug", "nsa_debug", "dalle_shapes_debug"])
def test_parameter_counts_and_flops_hold_under_zero3_partitioning(recipe):
    """ZeRO-3 partitions every parameter: ``p.numel()`` is then 0 on each rank and DeepSpeed keeps the full size in
    ``ds_numel``. The logged parameter count and the FLOPs per token (MFU) are the model's whole, not 0 (a negative
    MFU for an LM, before)."""
    from efftx import models, recipes

    torch.manual_seed(0)
    model = models.build(recipes.get(recipe))
    seq = 64
    whole = model.num_params(), model.flops_per_token(seq)
    for p in model.parameters():  # as deepspeed.zero.Init leaves them on a rank
        p.ds_numel = p.numel()
        p.data = torch.empty(0, dtype=p.dtype)
    assert (model.num_params(), model.flops_per_token(seq)) == whole and whole[0] > 0 and whole[1] > 0

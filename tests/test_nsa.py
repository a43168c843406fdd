"""The NSA backend: its three branches against naive float64 references, block selection, the compression
network, gradients, the decoding cache, config errors; slow: nsa_debug through Ray Train, a tiny nsa_blocks sweep."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from device_waits import waits_of
from efftx import attention, recipes
from efftx.attention import nsa as nsa_module
from efftx.attention import nsa_cpu
from efftx.attention.base import AttentionSpec
from efftx.attention.cache import RaggedCacheError
from efftx.attention.nsa import (NativeSparseAttention, NSACache, NSAOptions, complete_blocks, eq9_to_selection,
                                 overlap_to_selection, sliding_window_attention)
from efftx.config import Config
from efftx.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]


def make(heads=4, kv_heads=2, head_dim=8, block=8, stride=4, sel=8, n_sel=2, window=6, seed=0, **extra):
    opts = NSAOptions(compress_block_size=block, compress_stride=stride, selection_block_size=sel,
                      num_selected_blocks=n_sel, sliding_window_size=window, compress_mlp_mult=0.5, **extra)
    spec = AttentionSpec(kind="nsa", dim=heads * head_dim, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                         max_seq_len=128, options=opts)
    torch.manual_seed(seed)
    backend = attention.build(spec).eval()
    with torch.no_grad():  # gates far from uniform, so that a branch mix-up would show
        backend.gate.weight.normal_(0, 0.5)
        backend.compress_k.pos.normal_(0, 0.5)
        backend.compress_v.pos.normal_(0, 0.5)
        if backend.mem:  # memory slots away from their zero start, so that what a query reads from them shows
            backend.mem_k.normal_(0, 1.0)
            backend.mem_v.normal_(0, 1.0)
    return backend


def inputs(t, heads=4, kv_heads=2, head_dim=8, b=2, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, heads, head_dim, generator=g, dtype=dtype),
            torch.randn(b, t, kv_heads, head_dim, generator=g, dtype=dtype),
            torch.randn(b, t, kv_heads, head_dim, generator=g, dtype=dtype),
            torch.randn(b, t, heads * head_dim, generator=g, dtype=dtype))


def masked_attention(q, k, v, allowed):
    """float64 softmax attention, q (B, T, H, D), k/v (B, L, H, D), allowed (B, H, T, L); empty rows -> 0."""
    scores = torch.einsum("bthd,blhd->bhtl", q.double(), k.double()) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhtl,blhd->bthd", probs, v.double()), probs


def naive_selection(importance, own, n_sel, initial=0, local=1, min_importance=0.0):
    """``own``, the forced past blocks (the first ``initial``, the ``local - 1`` before ``own``) and, in the
    slots of ``n_sel`` they leave, the top blocks before ``own`` by importance (ties: the later block), those of an
    importance below ``min_importance`` left out; a set."""
    forced = {s for s in range(own) if s < initial or s > own - local}
    ranked = sorted((s for s in range(own) if s not in forced and importance[s] >= min_importance),
                    key=lambda s: (-importance[s], -s))
    return set(ranked[:n_sel - len(forced)]) | forced | {own}


def naive_mapping(nc, n_blocks, cb, st, sb, mapping):
    """(Nc, n_blocks) weights of compressed block i in selection block s, written out from the definitions."""
    m = torch.zeros(nc, n_blocks, dtype=torch.float64)
    for i in range(nc):
        for s in range(n_blocks):
            if mapping == "overlap":  # the fraction of compressed block i's tokens inside selection block s
                m[i, s] = len(set(range(i * st, i * st + cb)) & set(range(s * sb, (s + 1) * sb))) / cb
            else:  # Eq. 9: p_slc[s] = sum_{a < l'/d} sum_{c < l/d} p_cmp[(l'/d) s - a - c]
                m[i, s] = sum(1 for a in range(sb // st) for c in range(cb // st) if (sb // st) * s - a - c == i)
    return m


def naive_nsa(backend, q, k, v, x):
    """Every branch with dense masks in float64, the selection by Python sorting; (output, selections).

    Differentiable (in q, k, v, x and the backend's parameters) when the inputs need gradients: the
    selection, as in the backend, is a discrete choice the gradients do not go through."""
    b, t, h, d = q.shape
    hkv = k.shape[2]
    rep = h // hkv
    cb, st, sb, w = backend.block, backend.stride, backend.sel_block, backend.window
    opts = backend.opts
    kc, vc, kw, vw = k, v, k, v  # the compressed and window branches' keys/values
    if opts.separate_kv:  # their own projections of x (the backend alone has no rotary: nothing rotated)
        kc, vc = backend.kv_cmp(x).view(b, t, 2, hkv, d).unbind(2)
        kw, vw = backend.kv_win(x).view(b, t, 2, hkv, d).unbind(2)
    ck, cv = backend.compress_k(kc), backend.compress_v(vc)
    nc, m = ck.shape[1], opts.compress_mem_kv
    pos = torch.arange(t)
    up = lambda z: z.repeat_interleave(rep, dim=2)  # noqa: E731  kv heads -> query heads
    seen = (torch.arange(nc)[None, :] * st + cb - 1) <= pos[:, None]  # (T, Nc)
    if m:  # memory slots in front of the blocks, seen by every query
        ck = torch.cat([backend.mem_k.transpose(0, 1).expand(b, m, hkv, d), ck], 1)
        cv = torch.cat([backend.mem_v.transpose(0, 1).expand(b, m, hkv, d), cv], 1)
        seen = torch.cat([torch.ones(t, m, dtype=torch.bool), seen], 1)
    out_cmp, probs = masked_attention(q, up(ck), up(cv), seen.expand(b, h, t, m + nc))
    probs = probs[..., m:]  # the blocks' probabilities (the memory slots share the softmax, are no block)
    # importance of selection blocks: compressed probabilities x mapping weights, summed per group (per head when
    # the heads of a group do not share their selection)
    n_blocks = -(-t // sb)
    weights = naive_mapping(nc, n_blocks, cb, st, sb, opts.score_mapping)
    per = rep if opts.share_selection else 1  # query heads per selection
    if opts.importance == "logits_softmax":  # softmax over the past blocks of the heads' mean logits, mapped
        logits = torch.einsum("bthd,bnhd->bhtn", q.double(), up(ck[:, m:]).double()) / math.sqrt(d)
        z = logits.masked_fill(~seen[:, m:], 0.0).view(b, h // per, per, t, nc).mean(2) @ weights
        past = torch.arange(n_blocks)[None, :] < (pos // sb)[:, None]  # (T, blocks)
        imp = torch.zeros_like(z)
        for p in range(t):
            if past[p].any():
                imp[:, :, p, past[p]] = z[:, :, p, past[p]].softmax(-1)
    else:
        imp = probs.view(b, h // per, per, t, nc).sum(2) @ weights  # (B, groups, T, blocks), differentiable
    importance = imp.detach().tolist()
    chosen = [[[naive_selection(importance[i][g][p], p // sb, backend.n_sel, opts.num_initial_blocks,
                                opts.num_local_blocks, opts.min_importance) for g in range(h // per)]
               for p in range(t)] for i in range(b)]
    key_block = torch.arange(t) // sb
    sel_mask = torch.zeros(b, h, t, t, dtype=torch.bool)
    for i in range(b):
        for p in range(t):
            for g in range(h // per):
                blocks = torch.tensor(sorted(chosen[i][p][g]))
                sel_mask[i, g * per:(g + 1) * per, p] = torch.isin(key_block, blocks) & (torch.arange(t) <= p)
    out_sel, p_sel = masked_attention(q, up(k), up(v), sel_mask)
    if opts.diff_topk:  # each selected past block's part of the output times 1 + s - s.detach(), s its importance
        part = torch.einsum("bhtl,lj,blhd->bhtjd", p_sel, torch.nn.functional.one_hot(key_block, n_blocks).double(),
                            up(v).double())
        picked = torch.zeros(b, h // per, t, n_blocks, dtype=torch.bool)
        for i in range(b):
            for p in range(t):
                for g in range(h // per):
                    picked[i, g, p, sorted(chosen[i][p][g] - {p // sb})] = True
        coef = ((imp - imp.detach()) * picked).repeat_interleave(per, dim=1)  # (B, H, T, blocks)
        if opts.diff_topk_gate == "keys":  # the seed library's: the selected blocks' keys times 1 + s - s.detach()
            gate = 1 + torch.einsum("bhtj,lj->bhtl", coef, torch.nn.functional.one_hot(key_block, n_blocks).double())
            raw = torch.einsum("bthd,blhd->bhtl", q.double(), up(k).double()) / math.sqrt(d)
            p_gated = (raw * gate).masked_fill(~sel_mask, float("-inf")).softmax(-1).nan_to_num(0.0)
            out_sel = torch.einsum("bhtl,blhd->bthd", p_gated, up(v).double())
        else:
            out_sel = out_sel + torch.einsum("bhtj,bhtjd->bthd", coef, part)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - w)
    out_win, _ = masked_attention(q, up(kw), up(vw), band.expand(b, h, t, t))
    gates = torch.sigmoid(backend.gate(x).double()).view(b, t, h, 3, 1)
    out = gates[..., 0, :] * out_cmp + gates[..., 1, :] * out_sel + gates[..., 2, :] * out_win
    return out, chosen


def selections(backend, q, k, t, x=None):
    """The backend's selections (B, T, groups, S) for a full forward of t tokens, as its forward makes them: per
    query head (k's compressed keys repeated per head) when the heads of a GQA group do not share them."""
    if backend.separate:
        k = backend.kv_cmp(x).view(*k.shape[:2], 2, *k.shape[2:]).unbind(2)[0]
    ck = backend.compress_k(k)
    ck = backend.with_memory(ck, ck)[0]
    if not backend.opts.share_selection:
        ck = ck.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return backend.select(q, ck, torch.arange(t), t)


def as_sets(idx):
    """(B, T, Hkv, S) selections -> nested lists of sets of block ids (-1 dropped)."""
    return [[[set(s) - {-1} for s in row] for row in batch] for batch in idx.tolist()]


# ------------------------------------------------------------------------------------------ registry, config

def test_registered_and_auto_falls_back_to_the_reference_off_kernel_sizes():
    assert attention.get("nsa") is NativeSparseAttention
    assert make(sel=8).impl == "reference"  # the Triton kernel needs selection blocks of 16k tokens
    assert make(sel=16, block=8, stride=8).impl == "auto"
    assert make(sel=16, block=8, stride=8, impl="reference").impl == "reference"


@pytest.mark.parametrize("overrides, message", [
    ({"attention.nsa.compress_stride": 16, "attention.nsa.compress_block_size": 8},
     "attention.nsa.compress_stride=16 exceeds attention.nsa.compress_block_size=8"),
    ({"attention.nsa.selection_block_size": 12}, "attention.nsa.selection_block_size=12 must be a multiple of"),
    ({"attention.nsa.compress_block_size": 12, "attention.nsa.compress_stride": 8},
     "attention.nsa.compress_block_size=12 must be a multiple of"),
    ({"attention.nsa.sliding_window_size": 0}, "attention.nsa.sliding_window_size must be > 0"),
    ({"attention.nsa.num_selected_blocks": -1}, "attention.nsa.num_selected_blocks must be >= 0"),
    ({"attention.nsa.impl": "cuda"}, "attention.nsa.impl must be one of auto, triton, reference"),
    ({"attention.nsa.impl": "triton"}, "attention.nsa.impl=triton needs attention.nsa.selection_block_size"),
])
def test_invalid_block_config_is_a_config_error_naming_the_keys(overrides, message):
    cfg = recipes.get("nsa_debug").override({"name": "x", **overrides})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        cfg.validate()
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):  # the backend checks the same
        NativeSparseAttention(AttentionSpec.from_config(cfg.model, cfg.attention))
    cfg.attention.kind = "full"  # the section is only checked when nsa is the attention
    cfg.validate()


def test_invalid_block_config_from_the_cli_fails_before_any_worker_starts():
    proc = subprocess.run([sys.executable, "jobs/train_nsa.py", "--recipe", "nsa_debug",
                           "--set", "attention.nsa.selection_block_size=12"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "attention.nsa.selection_block_size=12 must be a multiple of the compression stride" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Ray" not in proc.stdout + proc.stderr  # the config was refused before Ray was started


def test_recipes_reproduce_the_seed_and_full_baseline_differs_only_in_attention():
    nsa, full = recipes.get("nsa_enwik8").flat(), recipes.get("nsa_full_enwik8").flat()
    assert {k for k in nsa if nsa[k] != full[k]} == {"attention.kind", "recipe"}
    seed = {"model.dim": 512, "model.depth": 6, "model.heads": 8, "model.kv_heads": 4, "model.head_dim": 64,
            "data.seq_len": 512, "attention.nsa.sliding_window_size": 64, "attention.nsa.compress_block_size": 16,
            "attention.nsa.selection_block_size": 16, "attention.nsa.num_selected_blocks": 4,
            "train.micro_batch_size": 4, "train.grad_accum": 4, "scaling.num_workers": 1, "train.lr": 1e-4,
            "train.grad_clip": 0.5, "attention.kind": "nsa",
            # QUERY_HEADS_SHARE_SELECTION, USE_DIFF_TOPK, INTERPOLATED_IMPORTANCE_SCORE=False, GroupedMLP
            "attention.nsa.share_selection": True, "attention.nsa.diff_topk": True,
            "attention.nsa.score_mapping": "overlap", "attention.nsa.num_initial_blocks": 0,
            "attention.nsa.num_local_blocks": 1, "attention.nsa.compress": "mlp",
            "attention.nsa.compress_mlp_mult": 1.0,
            # the library's: num_compressed_mem_kv=1, softmax of the mean logits, 1e-10 mask, gated keys, one k/v projection
            "attention.nsa.compress_mem_kv": 1, "attention.nsa.importance": "logits_softmax",
            "attention.nsa.min_importance": 1e-10, "attention.nsa.diff_topk_gate": "keys",
            "attention.nsa.separate_kv": False}
    assert {k: nsa[k] for k in seed} == seed


# ------------------------------------------------------------------------------------------ pieces

@pytest.mark.parametrize("window", [1, 3, 8, 40])
@pytest.mark.parametrize("t_q", [1, 5, 21])
def test_sliding_window_matches_dense_band_mask(window, t_q):
    q, k, v, _ = inputs(21, heads=6, kv_heads=2)
    q = q[:, -t_q:]  # the last t_q queries over all 21 keys (cached decoding / chunked prefill)
    got = sliding_window_attention(q, k, v, window)
    pos_q, pos_k = torch.arange(21 - t_q, 21)[:, None], torch.arange(21)[None, :]
    band = (pos_k <= pos_q) & (pos_k > pos_q - window)
    want, _ = masked_attention(q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2), band.expand(2, 6, t_q, 21))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch,length,kv_heads,block,stride,head_dim,hidden", [
    (2, 37, 3, 4, 4, 5, 7),  # disjoint blocks, a partial block left over
    (1, 40, 2, 8, 4, 6, 11),  # overlapping blocks (stride < block)
    (3, 16, 1, 16, 16, 4, 3),  # one block, one head
])
def test_compression_mlp_function_equals_plain_autograd(batch, length, kv_heads, block, stride, head_dim, hidden):
    """The MLP compressor's autograd.Function (lean backward: rebuilds the flattened blocks, masks by the saved
    ReLU output) against the same MLP as plain autograd ops, float64: the output and the gradients of the keys
    (through the unfolded, possibly overlapping blocks), the position embedding and all four weights."""
    from efftx.attention.nsa import _GroupedMLP, grouped_mlp_reference

    gen = torch.Generator().manual_seed(length)
    new = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)  # noqa: E731
    k = new(batch, length, kv_heads, head_dim)
    params = [new(kv_heads, block, head_dim), new(kv_heads, block * head_dim, hidden), new(kv_heads, hidden),
              new(kv_heads, hidden, head_dim), new(kv_heads, head_dim)]
    blocks = k.unfold(1, block, stride).transpose(-1, -2)  # (B, N, Hkv, block, D), a view of k
    got, want = _GroupedMLP.apply(blocks, *params), grouped_mlp_reference(blocks, *params)
    assert (want > 0).any() and (want < 0).any()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    for g, r in zip(torch.autograd.grad(got, [k, *params], upstream), torch.autograd.grad(want, [k, *params], upstream)):
        assert r.abs().sum() > 0
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_compressor_maps_each_block_of_tokens_to_one_key():
    backend = make(block=8, stride=4)
    k = inputs(22)[1]
    assert complete_blocks(22, 8, 4) == 4 and complete_blocks(7, 8, 4) == 0
    ck = backend.compress_k(k)
    assert ck.shape == (2, 4, 2, 8)
    torch.testing.assert_close(backend.compress_k(k, 2, 2), ck[:, 2:4])  # a range = the same blocks
    changed = k.clone()
    changed[:, 9] += 1.0  # token 9 lies in blocks 1 ([4, 12)) and 2 ([8, 16)) only
    diff = (backend.compress_k(changed) - ck).abs().amax((0, 2, 3))
    assert diff[0] == 0 and diff[3] == 0 and diff[1] > 0 and diff[2] > 0
    # intra-block positions matter: the same tokens in another order compress differently
    swapped = k.clone()
    swapped[:, [0, 1]] = k[:, [1, 0]]
    assert not torch.allclose(backend.compress_k(swapped)[:, 0], ck[:, 0])


def test_overlap_mapping_onto_selection_blocks():
    scores = torch.tensor([[1.0, 10.0, 100.0]])
    # blocks of 8 every 4 tokens: [0, 8), [4, 12), [8, 16) onto selection blocks of 8
    got = overlap_to_selection(scores, block=8, stride=4, sel_block=8, n_sel=2)
    torch.testing.assert_close(got, torch.tensor([[1.0 + 5.0, 5.0 + 100.0]]))
    # blocks of 16 every 16 tokens onto selection blocks of 8: each splits in halves
    got = overlap_to_selection(scores, block=16, stride=16, sel_block=8, n_sel=6)
    torch.testing.assert_close(got, torch.tensor([[0.5, 0.5, 5.0, 5.0, 50.0, 50.0]]))
    # equal sizes: the identity
    torch.testing.assert_close(overlap_to_selection(scores, 8, 8, 8, 3), scores)


@pytest.mark.parametrize("block, stride, sel, n_sel", [(8, 4, 8, 2), (4, 4, 16, 3), (16, 8, 8, 2), (8, 8, 8, 10)])
@pytest.mark.parametrize("t_q", [37, 3])
def test_selection_has_own_block_and_never_a_future_block(block, stride, sel, n_sel, t_q):
    backend = make(block=block, stride=stride, sel=sel, n_sel=n_sel)
    q, k, _, _ = inputs(37)
    ck = backend.compress_k(k)
    pos = torch.arange(37 - t_q, 37)
    idx = backend.select(q[:, -t_q:], ck, pos, 37)
    assert idx.shape == (2, t_q, 2, n_sel + 1) and idx.dtype == torch.int64
    for batch in as_sets(idx):
        for p, row in zip(pos.tolist(), batch):
            own = p // sel
            for chosen in row:
                assert own in chosen
                assert max(chosen) == own  # nothing after the own block
                assert len(chosen) == min(n_sel, own) + 1  # as many past blocks as exist, up to n_sel
    assert (idx[:, :, :, 0] == (pos // sel)[None, :, None]).all()  # slot 0 is the own block


def test_selection_follows_the_compressed_attention():
    backend = make(block=4, stride=4, sel=4, n_sel=1)
    q, k, _, _ = inputs(32, head_dim=8)
    u = torch.nn.functional.normalize(torch.randn(8, generator=torch.Generator().manual_seed(3)), dim=0)
    q[:, :, :2] = 3 * u  # the query heads of kv group 0 all point along u
    ck = 0.01 * backend.compress_k(k)
    ck[:, 2, 0] = 5 * u  # kv group 0: compressed block 2 ([8, 12)) matches its queries
    idx = backend.select(q, ck, torch.arange(32), 32)
    late = idx[:, 16:, 0, 1]  # queries in blocks 4..7 pick one past block: block 2
    assert (late == 2).all()
    assert not (idx[:, 16:, 1, 1] == 2).all()  # kv group 1 has no such block


@pytest.mark.parametrize("block, stride, sel, n_sel, window", [(8, 4, 8, 2, 6), (4, 4, 8, 1, 3), (16, 8, 8, 3, 12)])
def test_backend_equals_naive_dense_reference(block, stride, sel, n_sel, window):
    backend = make(block=block, stride=stride, sel=sel, n_sel=n_sel, window=window)
    q, k, v, x = inputs(26)
    want, chosen = naive_nsa(backend, q, k, v, x)
    with torch.no_grad():
        got = backend(q, k, v, x=x)
        idx = selections(backend, q, k, 26, x)
    assert as_sets(idx) == chosen
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ options (issue 20)

def aligned(scores, t=32, heads=4, kv_heads=2, head_dim=8):
    """Queries all along one unit vector u and compressed keys ``scores[j] * u``: compressed block j's
    importance grows with ``scores[j]`` for every query and head (hand-workable rankings)."""
    u = torch.nn.functional.normalize(torch.randn(head_dim, generator=torch.Generator().manual_seed(3)), dim=0)
    q = (3 * u).expand(2, t, heads, head_dim).clone()
    ck = (torch.tensor(scores, dtype=torch.float32)[:, None, None] * u).expand(2, -1, kv_heads, -1).clone()
    return q, ck


def test_forced_initial_and_local_blocks_hand_worked():
    # 8 blocks of 4 tokens, compressed = selection blocks; importance order 5 > 3 > 2 > 4 > 1 > 0 > 6
    q, ck = aligned([1.0, 2.0, 4.0, 5.0, 3.0, 6.0, 0.0, 0.5])
    pos = torch.tensor([5, 9, 28, 31])
    sets = lambda bk: [row[0] for row in as_sets(bk.select(q[:, pos], ck, pos, 32))[0]]  # noqa: E731
    # today's selection: the own block plus the 3 best past blocks
    assert sets(make(block=4, stride=4, sel=4, n_sel=3)) == [{0, 1}, {0, 1, 2}, {5, 3, 2, 7}, {5, 3, 2, 7}]
    # the paper's: block 0 and the block before the own one always, in 2 of the 3 slots; the best other fills the 3rd
    paper = make(block=4, stride=4, sel=4, n_sel=3, num_initial_blocks=1, num_local_blocks=2)
    assert sets(paper) == [{0, 1}, {0, 1, 2}, {0, 6, 5, 7}, {0, 6, 5, 7}]
    # three local blocks, no initial one: blocks 5 and 6 forced, block 3 the best of the rest
    local = make(block=4, stride=4, sel=4, n_sel=3, num_local_blocks=3)
    assert sets(local) == [{0, 1}, {0, 1, 2}, {5, 6, 3, 7}, {5, 6, 3, 7}]


def test_eq9_mapping_hand_worked():
    scores = torch.tensor([[1.0, 10.0, 100.0, 1000.0, 10000.0]])
    # l = l' = 2d (blocks of 8 every 4 tokens, selection blocks of 8): p_slc[j] = p[2j] + 2 p[2j-1] + p[2j-2]
    torch.testing.assert_close(eq9_to_selection(scores, 8, 4, 8, 3), torch.tensor([[1.0, 121.0, 12100.0]]))
    # l = d, l' = 2d: p_slc[j] = p[2j] + p[2j-1] (token overlap would give p[2j] + p[2j+1])
    torch.testing.assert_close(eq9_to_selection(scores, 4, 4, 8, 3), torch.tensor([[1.0, 110.0, 11000.0]]))
    torch.testing.assert_close(overlap_to_selection(scores, 4, 4, 8, 3), torch.tensor([[11.0, 1100.0, 10000.0]]))
    # l = 2d, l' = d: p_slc[j] = p[j] + p[j-1]; equal sizes: the identity
    torch.testing.assert_close(eq9_to_selection(scores[:, :3], 16, 8, 8, 4), torch.tensor([[1.0, 11.0, 110.0, 100.0]]))
    torch.testing.assert_close(eq9_to_selection(scores, 8, 8, 8, 5), scores)
    # its terms out of range are skipped on the host: no read of the device (tests/device_waits.py)
    for args in ((8, 4, 8, 3), (4, 4, 8, 3), (8, 8, 8, 5), (16, 4, 8, 7)):
        assert waits_of(eq9_to_selection, scores * 1, *args)[1] == [], args
    # the attended blocks differ: compressed block 3 (tokens 12..15) dominates; a query in selection block 3 picks
    # selection block 1 (tokens 8..15, which hold it) by overlap, block 2 by Eq. 9 (2j - 1 = 3)
    q, ck = aligned([0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0])
    pos = torch.tensor([28, 31])
    for mapping, pick in (("overlap", 1), ("eq9", 2)):
        bk = make(block=4, stride=4, sel=8, n_sel=1, score_mapping=mapping)
        assert as_sets(bk.select(q[:, pos], ck, pos, 32))[0] == [[{3, pick}] * 2] * 2, mapping


def test_per_head_selection_hand_worked():
    # kv group 0's two heads look for different blocks: head 0 along u (block 2), head 1 along w (block 5)
    g = torch.Generator().manual_seed(4)
    u, w = (torch.nn.functional.normalize(torch.randn(8, generator=g), dim=0) for _ in range(2))
    q = torch.zeros(1, 32, 4, 8)
    q[:, :, 0], q[:, :, 1], q[:, :, 2:] = 4 * u, 4 * w, 4 * u
    ck = torch.zeros(1, 7, 2, 8)
    ck[:, 2, :] = 3 * u
    ck[:, 5, :] = 5 * w  # sharper: the group's summed importance prefers block 5
    pos = torch.tensor([28])
    shared = make(block=4, stride=4, sel=4, n_sel=1)
    assert as_sets(shared.select(q[:, pos], ck, pos, 32))[0][0] == [{5, 7}, {2, 7}]  # per kv group
    per_head = make(block=4, stride=4, sel=4, n_sel=1, share_selection=False)
    assert selections(per_head, q, torch.zeros(1, 32, 2, 8), 32).shape == (1, 32, 4, 2)  # one row per query head
    idx = per_head.select(q[:, pos], ck.repeat_interleave(2, dim=2), pos, 32)  # what its forward computes
    assert as_sets(idx)[0][0] == [{2, 7}, {5, 7}, {2, 7}, {2, 7}]  # per query head


def test_compression_networks_hand_worked():
    k = inputs(20)[1]  # blocks of 8 every 4 tokens: 4 complete blocks
    blocks = k.unfold(1, 8, 4).transpose(-1, -2)  # (B, 4, Hkv, 8, D): block j = tokens 4j .. 4j + 7
    conv = make(compress="conv_linear").compress_k
    assert {n for n, _ in conv.named_parameters()} == {"pos", "w", "b"}
    # one per-kv-head linear map of the flattened block: a grouped Conv1d of kernel 8, stride 4 over the tokens
    want = torch.stack([torch.stack([(blocks[:, j, h] + conv.pos[h]).reshape(2, -1) @ conv.w[h] + conv.b[h]
                                     for h in range(2)], 1) for j in range(4)], 1)
    torch.testing.assert_close(conv(k), want, rtol=1e-5, atol=1e-6)
    pool = make(compress="attention_pool").compress_k
    with torch.no_grad():
        pool.pos.zero_()
    torch.testing.assert_close(pool(k), blocks.mean(-2))  # zero logits at first: the block's mean
    with torch.no_grad():
        pool.w.copy_(torch.eye(8).expand(2, 8, 8) * 3)  # logits = 3 x the feature: a soft maximum per feature
    torch.testing.assert_close(pool(k), ((3 * blocks).softmax(-2) * blocks).sum(-2))
    for net in (conv, pool):  # a range of blocks = the same blocks (the decoding cache compresses by ranges)
        torch.testing.assert_close(net(k, 2, 2), net(k)[:, 2:4])


@pytest.mark.parametrize("chunked_path", [True, False])
def test_diff_topk_gradients_reach_the_importance_scores(chunked_path):
    """With the compressed branch gated off, only the block importances could carry gradients to the compression
    of the keys: none without diff_topk, some with it (their values are the float64 reference's, tested above)."""
    def compress_k_grad(diff_topk):
        backend = make(block=8, stride=4, sel=8, n_sel=2, diff_topk=diff_topk).train()
        backend.chunked = chunked_path
        with torch.no_grad():
            backend.gate.weight[0::3] = 0  # the compressed gate of each head: sigmoid(-inf) = 0
            backend.gate.bias[0::3] = float("-inf")
        q, k, v, x = (z.requires_grad_() for z in inputs(40))
        out = backend(q, k, v, x=x)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        return backend.compress_k.w1.grad
    assert (compress_k_grad(False) == 0).all()
    assert compress_k_grad(True).abs().sum() > 0


def only_gate(backend, branch):
    """Gates of every head off (sigmoid(-inf) = 0) but ``branch`` (0 compressed, 1 selected, 2 window), which is
    sigmoid(0) = 1/2 everywhere."""
    with torch.no_grad():
        backend.gate.weight.zero_()
        backend.gate.bias.fill_(float("-inf"))
        backend.gate.bias[branch::3] = 0.0
    return backend


@pytest.mark.parametrize("chunked_path", [True, False])
def test_separate_kv_window_branch_reads_its_own_projection_hand_worked(chunked_path):
    """Window of 1 token, the window gate alone on: each query reads its own token's value, which with separate_kv
    is the window branch's projection of x (not the layer's v); the layer's k, v still serve the selected branch."""
    q, k, v, x = inputs(20)
    for separate in (False, True):
        backend = only_gate(make(window=1, separate_kv=separate), 2)
        backend.chunked = chunked_path
        with torch.no_grad():
            out = backend(q, k, v, x=x)
            own = backend.kv_win(x).view(2, 20, 2, 2, 8)[:, :, 1] if separate else v  # (B, T, Hkv, D) values
            torch.testing.assert_close(out, 0.5 * own.repeat_interleave(2, dim=2))
            # and the layer's k, v do not reach the window branch at all with separate_kv
            changed = backend(q, k + 1, v + 1, x=x)
            assert torch.equal(changed, out) == separate
    sel = only_gate(make(window=1, separate_kv=True), 1)  # the selected branch: the layer's k, v
    sel.chunked = chunked_path
    with torch.no_grad():
        assert not torch.allclose(sel(q, k, v + 1, x=x), sel(q, k, v, x=x))
        # its first query reads only its own key: the layer's v
        torch.testing.assert_close(sel(q, k, v, x=x)[:, 0], 0.5 * v[:, 0].repeat_interleave(2, dim=1))


def test_separate_kv_keys_are_rotated_like_the_layer_keys():
    """In a model with rotary positions the branches' own keys are rotated too (at their absolute positions), so
    cached decoding (positions from the cache's length) equals the full forward; without the rotary hook a model's
    separate keys would carry no positions."""
    from efftx.models import build as build_model

    cfg = recipes.get("nsa_debug").override({"name": "t", "attention.nsa.separate_kv": True, "model.max_seq_len": 64})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    inner = model.blocks[0].attention.inner
    assert inner.separate and inner.rotary is model.blocks[0].attention.rotary is not None
    x = torch.randn(1, 5, cfg.model.dim)
    k0, _ = inner.branch_kv(inner.kv_win, x, 0)
    k3, _ = inner.branch_kv(inner.kv_win, x, 3)
    raw = inner.kv_win(x).view(1, 5, 2, inner.spec.kv_heads, inner.spec.head_dim)[:, :, 0]
    torch.testing.assert_close(k0[:, 0], raw[:, 0])  # position 0: no rotation
    assert not torch.allclose(k0[:, 1:], raw[:, 1:]) and not torch.allclose(k3, k0)
    torch.testing.assert_close(k3[:, :2], model.blocks[0].attention.rotary(raw, 3)[:, :2])


@pytest.mark.parametrize("chunked_path", [True, False])
def test_compress_mem_kv_early_queries_read_the_memory_slots_hand_worked(chunked_path):
    """Blocks of 8: queries 0..6 see no complete block. Without memory slots they get zeros from the compressed
    branch; with one slot, exactly its value (a softmax over one slot); later queries mix slot and blocks."""
    q, k, v, x = inputs(24)
    for mem in (0, 1):
        backend = only_gate(make(block=8, stride=4, compress_mem_kv=mem), 0)
        backend.chunked = chunked_path
        with torch.no_grad():
            out = backend(q, k, v, x=x)
        if mem == 0:
            assert (out[:, :7] == 0).all()
        else:
            want = 0.5 * backend.mem_v[:, 0].repeat_interleave(2, dim=0)  # (H, D): per query head its group's slot
            torch.testing.assert_close(out[:, :7], want.expand(2, 7, 4, 8))
            # query 7 reads the slot and block 0 ([0, 8)): softmax over two scores, by hand
            ck, cv = backend.compress_k(k), backend.compress_v(v)
            mk, mv = backend.mem_k[:, 0], backend.mem_v[:, 0]  # (Hkv, D)
            for h in range(4):
                g = h // 2
                s = torch.stack([q[:, 7, h] @ mk[g], (q[:, 7, h] * ck[:, 0, g]).sum(-1)], -1) / math.sqrt(8)
                p = s.softmax(-1)
                want7 = 0.5 * (p[:, :1] * mv[g] + p[:, 1:] * cv[:, 0, g])
                torch.testing.assert_close(out[:, 7, h], want7, rtol=1e-5, atol=1e-6)


def test_compress_mem_kv_is_no_block_and_keeps_one_head_rankings():
    """The memory slots share the compressed softmax but are never selected: with one query head per group (and
    compressed = selection blocks) every block's probability is scaled alike, so the selections are those without
    memory slots, although the probabilities differ."""
    q, k, _, x = inputs(40, heads=2, kv_heads=2)
    plain, mem = (make(heads=2, kv_heads=2, block=4, stride=4, sel=4, n_sel=3, compress_mem_kv=m) for m in (0, 2))
    with torch.no_grad():
        a, b = selections(plain, q, k, 40, x), selections(mem, q, k, 40, x)
    assert torch.equal(a, b) and (b < 10).all()  # block ids, never shifted by the slots
    # with two heads per group the summed probabilities can rank differently: the slots do change the importances
    q4, k4, _, x4 = inputs(40)
    plain4, mem4 = (make(block=4, stride=4, sel=4, n_sel=3, compress_mem_kv=m) for m in (0, 2))
    with torch.no_grad():
        assert not torch.equal(selections(plain4, q4, k4, 40, x4), selections(mem4, q4, k4, 40, x4))


def test_logits_softmax_importance_picks_another_block_than_the_probability_sum_hand_worked():
    """Blocks of 4 (compressed = selection), a query at 28 (own block 7, past blocks 0..6), one kv group of two heads
    with scaled queries along orthonormal u (head 0) and w (head 1), so a logit is u . ck or w . ck. Block 2 =
    10u - 10w, block 5 = 3w, the others 0: head 0's logits 10 (block 2), 0 elsewhere; head 1's: -10 (block 2), 3
    (block 5), 0 elsewhere. Summed probabilities: block 2 ~ 1.0 + 0, block 5 ~ 0 + e^3 / (e^3 + 5) = 0.80: block 2.
    Mean logits: block 2 = 0, block 5 = 1.5: block 5, importance e^1.5 / (e^1.5 + 6) = 0.4276."""
    g = torch.Generator().manual_seed(5)
    u, w = torch.linalg.qr(torch.randn(8, 2, generator=g))[0].T  # orthonormal
    q = torch.zeros(1, 32, 2, 8)
    q[:, :, 0], q[:, :, 1] = math.sqrt(8) * u, math.sqrt(8) * w  # the 1 / sqrt(D) scale undone
    ck = torch.zeros(1, 7, 1, 8)
    ck[0, 2, 0], ck[0, 5, 0] = 10 * u - 10 * w, 3 * w
    pos = torch.tensor([28])
    picks = {}
    for importance in ("probs_sum", "logits_softmax"):
        bk = make(heads=2, kv_heads=1, block=4, stride=4, sel=4, n_sel=1, importance=importance)
        picks[importance] = as_sets(bk.select(q[:, pos], ck, pos, 32))[0][0][0]
        scores = torch.einsum("btgd,bnd->bgtn", q[:, pos], ck[:, :, 0])[:, None] * bk.scale  # (B, Hkv, G, 1, Nc)
        imp = bk.importance(scores, torch.ones(1, 7, dtype=torch.bool), pos, 8)[0, 0, 0]
        if importance == "logits_softmax":
            torch.testing.assert_close(imp[5], torch.tensor(math.exp(1.5) / (math.exp(1.5) + 6)), rtol=1e-4, atol=0)
            assert imp[7] == 0 and abs(float(imp.sum()) - 1) < 1e-6  # a softmax over the past blocks only
        else:
            assert abs(float(imp[5]) - math.exp(3) / (math.exp(3) + 5)) < 1e-3 and imp[2] > 0.99
    assert picks == {"probs_sum": {2, 7}, "logits_softmax": {5, 7}}


def test_min_importance_drops_unimportant_blocks_hand_worked():
    """Blocks of 4 (compressed = selection), a query at 28 (past blocks 0..6): block 0's logit is 3 x 30 / sqrt(8) =
    31.8, every other block's 0, so (logits_softmax) the others' importance is about e^-31.8 = 1.5e-14 each. Today
    three slots take block 0 and, by the tie-break, the most recent blocks 6 and 5; with min_importance=1e-10 (the
    seed library's) only block 0 is selected; a forced block (local) stays whatever its importance."""
    q, ck = aligned([30.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    pos = torch.tensor([28, 31])
    def sets(**o):
        bk = make(block=4, stride=4, sel=4, n_sel=3, importance="logits_softmax", **o)
        return [row[0] for row in as_sets(bk.select(q[:, pos], ck, pos, 32))[0]]

    assert sets() == [{0, 6, 5, 7}] * 2
    assert sets(min_importance=1e-10) == [{0, 7}] * 2
    assert sets(min_importance=1e-10, num_local_blocks=2) == [{0, 6, 7}] * 2
    # the chunked path drops the same blocks: its unused slots read nothing
    bk = make(block=4, stride=4, sel=4, n_sel=3, importance="logits_softmax", min_importance=1e-10)
    lay = nsa_cpu._Layout(q[:, pos], torch.zeros(2, 32, 2, 8), ck, 4, 4, 4, 3, 4, bk.scale, 28, None,
                          importance="logits_softmax", min_importance=1e-10)
    scores = torch.matmul(lay.rows(q[:, pos] * bk.scale), ck.transpose(1, 2).transpose(-1, -2))
    sel = lay.select(scores.softmax(-1), pos, 32, scores)  # (c, B, Hkv, n_sel)
    assert [set(r) for r in sel[:, 0, 0].tolist()] == [{0, -1}] * 2


@pytest.mark.parametrize("chunked_path", [True, False])
def test_diff_topk_gate_keys_hand_worked(chunked_path):
    """With the compressed branch gated off, the compression of the keys learns only through the importances of
    the selected blocks. Gate on the keys (the seed library's): d(loss)/d(gate) = sum over the block's keys of
    dS * S, zero when every query is orthogonal to every key (queries along e_0, keys with e_0 = 0: all scores
    exactly 0), although the gate on the output (dO . the block's part of the output) still gives a gradient there;
    with generic keys both give one."""
    def compress_k_grad(gate, orthogonal):
        backend = make(block=8, stride=4, sel=8, n_sel=2, diff_topk=True, diff_topk_gate=gate).train()
        backend.chunked = chunked_path
        with torch.no_grad():
            backend.gate.weight[0::3] = 0
            backend.gate.bias[0::3] = float("-inf")  # compressed gate 0
        q, k, v, x = inputs(40)
        if orthogonal:
            q = torch.zeros_like(q)
            q[..., 0] = torch.randn(q.shape[:-1], generator=torch.Generator().manual_seed(9))
            k = k.clone()
            k[..., 0] = 0
        q, k, v, x = (z.requires_grad_() for z in (q, k, v, x))
        out = backend(q, k, v, x=x)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(2))).sum().backward()
        return backend.compress_k.w1.grad
    assert (compress_k_grad("keys", orthogonal=True) == 0).all()
    assert compress_k_grad("output", orthogonal=True).abs().sum() > 0
    assert compress_k_grad("keys", orthogonal=False).abs().sum() > 0


@pytest.mark.parametrize("bad, message", [
    ({"num_initial_blocks": -1}, "num_initial_blocks must be >= 0"),
    ({"num_local_blocks": 0}, "num_local_blocks must be >= 1"),
    ({"num_initial_blocks": 2, "num_local_blocks": 2, "num_selected_blocks": 2}, "forces 3 past blocks"),
    ({"score_mapping": "mean"}, "score_mapping must be one of overlap, eq9"),
    ({"compress": "gru"}, "compress must be one of mlp, conv_linear, attention_pool"),
    ({"compress_mem_kv": -1}, "attention.nsa.compress_mem_kv must be an integer >= 0"),
    ({"importance": "logits"}, "attention.nsa.importance must be one of probs_sum, logits_softmax"),
    ({"min_importance": -0.1}, r"attention.nsa.min_importance must be a number in \[0, 1\)"),
    ({"min_importance": 1.0}, r"attention.nsa.min_importance must be a number in \[0, 1\)"),
    ({"diff_topk_gate": "values"}, "attention.nsa.diff_topk_gate must be one of output, keys"),
    ({"cpu_kernel": "yes"}, "attention.nsa.cpu_kernel must be one of auto, on, off; got 'yes'"),
])
def test_invalid_option_is_a_config_error_naming_the_key(bad, message):
    cfg = recipes.get("nsa_debug").override({"name": "x", **{f"attention.nsa.{k}": v for k, v in bad.items()}})
    with pytest.raises(ConfigError, match=message):
        cfg.validate()
    with pytest.raises(ConfigError, match="share_selection expects true/false"):
        recipes.get("nsa_debug").override({"attention.nsa.share_selection": "maybe"})
    with pytest.raises(ConfigError, match="separate_kv expects true/false"):
        recipes.get("nsa_debug").override({"attention.nsa.separate_kv": "maybe"})
    spec = AttentionSpec(kind="nsa", dim=32, heads=4, kv_heads=2, head_dim=8, max_seq_len=64)
    for key, value in (("separate_kv", 1), ("compress_mem_kv", 1.5), ("compress_mem_kv", True)):
        with pytest.raises(ConfigError, match=f"attention.nsa.{key} must be"):
            NSAOptions(**{key: value}).validate(spec)


# every option away from today's value, alone and together, on overlapping / unequal block geometries
OPTION_CASES = [{"num_initial_blocks": 1, "num_local_blocks": 2}, {"score_mapping": "eq9"}, {"share_selection": False},
                {"diff_topk": True}, {"diff_topk": True, "score_mapping": "eq9"},
                {"compress": "conv_linear"}, {"compress": "attention_pool", "diff_topk": True},
                {"num_initial_blocks": 2, "num_local_blocks": 3, "score_mapping": "eq9", "share_selection": False,
                 "diff_topk": True},
                {"separate_kv": True}, {"separate_kv": True, "share_selection": False, "diff_topk": True},
                {"compress_mem_kv": 1}, {"compress_mem_kv": 3, "diff_topk": True, "score_mapping": "eq9"},
                {"separate_kv": True, "compress_mem_kv": 2, "share_selection": False, "diff_topk": True},
                {"importance": "logits_softmax"}, {"importance": "logits_softmax", "diff_topk": True},
                {"importance": "logits_softmax", "diff_topk": True, "score_mapping": "eq9", "compress_mem_kv": 1},
                {"importance": "logits_softmax", "diff_topk": True, "share_selection": False, "separate_kv": True},
                # thresholds that drop 9-55% of the selections here (the seed's 1e-10 rarely bites on random data)
                {"min_importance": 0.4}, {"min_importance": 0.3, "diff_topk": True, "num_initial_blocks": 1,
                                           "num_local_blocks": 2, "score_mapping": "eq9"},
                {"min_importance": 1e-10, "importance": "logits_softmax", "diff_topk": True, "compress_mem_kv": 1,
                 "share_selection": False},
                {"diff_topk": True, "diff_topk_gate": "keys"},
                {"diff_topk": True, "diff_topk_gate": "keys", "share_selection": False, "score_mapping": "eq9"},
                # the seed library's choices together
                {"diff_topk": True, "diff_topk_gate": "keys", "importance": "logits_softmax", "min_importance": 1e-10,
                 "compress_mem_kv": 1}]
# block, stride, sel, n_sel, window; the last: equal compressed and selection blocks (the seed's geometry: the
# identity score mapping, where the chunked path's logits_softmax importance gradient is written by hand)
OPTION_GEOMETRIES = [(8, 4, 8, 4, 6), (16, 8, 8, 4, 12), (4, 4, 8, 4, 5), (4, 4, 4, 4, 6)]


@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("geometry", OPTION_GEOMETRIES, ids=str)
def test_options_both_paths_equal_float64_reference_forward_selection_and_gradients(options, geometry, small_subchunks):
    block, stride, sel, n_sel, window = geometry
    t = 45
    backend = make(block=block, stride=stride, sel=sel, n_sel=n_sel, window=window, **options).double().train()
    backend.chunk_size = 7
    q, k, v, x = (z.double() for z in inputs(t))
    want, chosen = naive_nsa(backend, q, k, v, x)
    with torch.no_grad():
        assert as_sets(selections(backend, q, k, t, x)) == chosen
    _, want_grads = grads(backend, q, k, v, x, lambda bk, *a: naive_nsa(bk, *a[:3], a[3])[0])
    # the chunked path with its selected branch as the C++ kernel and as torch ops, and the branch composition
    for chunked_path, kernel in ((True, "on"), (True, "off"), (False, "off")):
        backend.chunked, backend.cpu_kernel = chunked_path, kernel
        got, got_grads = grads(backend, q, k, v, x, lambda bk, q, k, v, x: bk(q, k, v, x=x))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)
        for name, g in want_grads.items():
            torch.testing.assert_close(got_grads[name], g, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("options", OPTION_CASES, ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("chunked_path", [True, False])
def test_options_cached_decoding_equals_full_forward(options, chunked_path):
    backend = make(block=8, stride=4, sel=8, n_sel=4, window=6, **options)
    backend.chunked = chunked_path
    q, k, v, x = inputs(40)
    with torch.no_grad():
        full = backend(q, k, v, x=x)
        cache = backend.new_cache(2, 40, torch.device("cpu"), torch.float32)
        parts = [backend(q[:, :9], k[:, :9], v[:, :9], cache=cache, x=x[:, :9])]
        parts += [backend(q[:, i:i + 2], k[:, i:i + 2], v[:, i:i + 2], cache=cache, x=x[:, i:i + 2])
                  for i in range(9, 40, 2)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ the chunked CPU path

# (block, stride, sel, n_sel, window, heads, kv_heads, head_dim): the seed's settings (16/16/16, 4 blocks, window
# 64) with GQA groups of 2 and of 1, overlapping compressed blocks, selection blocks smaller than compressed ones
CHUNKED_CASES = [(16, 16, 16, 4, 64, 4, 2, 16), (16, 16, 16, 4, 64, 4, 4, 8), (8, 4, 8, 2, 6, 4, 2, 8),
                 (16, 8, 8, 3, 12, 6, 2, 8)]


def chunked(case, chunk=None, dtype=torch.float32, kernel="on"):
    block, stride, sel, n_sel, window, heads, kv_heads, head_dim = case
    backend = make(heads=heads, kv_heads=kv_heads, head_dim=head_dim, block=block, stride=stride, sel=sel,
                   n_sel=n_sel, window=window).to(dtype)
    backend.chunk_size, backend.cpu_kernel = chunk, kernel
    assert backend.uses_chunked_path(torch.zeros(1))
    return backend


@pytest.fixture
def small_subchunks(monkeypatch):
    """Sub-chunks of the selected branch of 3 queries (with B * Hkv = 4), so they end inside chunks; on the branch
    composition, the selection and the straight-through gradient's backward in chunks of 6-25 queries."""
    monkeypatch.setattr(nsa_cpu, "SELECTED_ROWS", 12)
    monkeypatch.setattr(nsa_module, "_SCORE_CHUNK_CPU", 1500)


# T = 150: the default chunk (64) leaves a partial last chunk; 150 is no multiple of any block size
@pytest.mark.parametrize("case", CHUNKED_CASES)
@pytest.mark.parametrize("chunk", [None, 1, 5, 16])
@pytest.mark.parametrize("kernel", ["on", "off"])
def test_chunked_path_equals_naive_reference_forward_and_selection(case, chunk, kernel, small_subchunks):
    backend = chunked(case, chunk, kernel=kernel)
    t = 150 if chunk in (None, 16) else 45
    q, k, v, x = inputs(t, heads=case[5], kv_heads=case[6], head_dim=case[7])
    want, chosen = naive_nsa(backend, q, k, v, x)
    with torch.no_grad():
        got = backend(q, k, v, x=x)
        idx = selections(backend, q, k, t, x)
    assert as_sets(idx) == chosen
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    backend64 = chunked(case, chunk, torch.float64, kernel)  # float64 throughout: equal to rounding
    q, k, v, x = (z.double() for z in (q, k, v, x))
    with torch.no_grad():
        want, chosen = naive_nsa(backend64, q, k, v, x)
        got = backend64(q, k, v, x=x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)


def grads(backend, q, k, v, x, fn):
    """(output, gradients of q, k, v, x and every parameter) of ``fn(backend, q, k, v, x)`` under a fixed
    random output gradient."""
    backend.zero_grad()
    q, k, v, x = (z.detach().requires_grad_() for z in (q, k, v, x))
    out = fn(backend, q, k, v, x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(out.dtype)
    (out * weight).sum().backward()
    named = {"q": q.grad, "k": k.grad, "v": v.grad, "x": x.grad}
    named.update({n: p.grad.clone() for n, p in backend.named_parameters()})
    return out, named


@pytest.mark.parametrize("case", CHUNKED_CASES)
@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("kernel", ["on", "off"])
def test_chunked_path_gradients_equal_float64_reference(case, chunk, kernel, small_subchunks):
    t = 150 if chunk is None else 45
    q, k, v, x = (z.double() for z in inputs(t, heads=case[5], kv_heads=case[6], head_dim=case[7]))
    backend = chunked(case, chunk, torch.float64, kernel).train()
    want, want_grads = grads(backend, q, k, v, x, lambda bk, *a: naive_nsa(bk, *a[:3], a[3])[0])
    got, got_grads = grads(backend, q, k, v, x, lambda bk, q, k, v, x: bk(q, k, v, x=x))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)
    assert set(got_grads) == {"q", "k", "v", "x", "gate.weight", "gate.bias", *(
        f"compress_{kv}.{p}" for kv in "kv" for p in ("pos", "w1", "b1", "w2", "b2"))}
    for name, g in want_grads.items():
        # a bias shared by every compressed key shifts each query's compressed scores equally: no gradient
        assert name == "compress_k.b2" or g.abs().sum() > 0, name
        torch.testing.assert_close(got_grads[name], g, rtol=1e-9, atol=1e-10, msg=name)
    # float32, as trained: the same gradients to float32 rounding
    backend32 = chunked(case, chunk, kernel=kernel).train()
    backend32.load_state_dict(backend.state_dict())
    got32, got32_grads = grads(backend32, *(z.float() for z in (q, k, v, x)),
                               lambda bk, q, k, v, x: bk(q, k, v, x=x))
    torch.testing.assert_close(got32.double(), want, rtol=1e-4, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(got32_grads[name].double(), g, rtol=1e-4, atol=1e-4, msg=name)


def _nsa_call(t, heads, kv_heads, block, stride, sel, kernel, batch=1, seed=3):
    """Output and gradients (q, k, v, ck, cv, gates) of nsa_cpu.nsa_attention in float64 on random inputs."""
    g = torch.Generator().manual_seed(seed)
    d, nc = 8, t // stride + 2

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    leaves = [rnd(batch, t, heads, d), rnd(batch, t, kv_heads, d), rnd(batch, t, kv_heads, d),
              rnd(batch, nc, kv_heads, d), rnd(batch, nc, kv_heads, d),
              torch.rand(batch, t, heads, 3, generator=g, dtype=torch.float64)]
    leaves = [z.requires_grad_() for z in leaves]
    out = nsa_cpu.nsa_attention(*leaves, block=block, stride=stride, sel_block=sel, n_sel=3, window=9, scale=0.3,
                                mem=1, diff_topk=True, importance="logits_softmax", diff_topk_gate="keys",
                                cpu_kernel=kernel)
    weight = rnd(*out.shape)
    return [out, *torch.autograd.grad((out * weight).sum(), leaves)]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("geometry", [(16, 16, 16), (8, 8, 24)], ids=["blocks16", "blocks24"])
def test_selected_kernel_query_ranges_and_padded_blocks_equal_torch_ops(threads, geometry):
    """One (batch, kv head) on 3 threads: the kernel splits the queries into ranges with key/value gradient tables
    of their own, summed at the end; selection blocks of 24 keys are padded to 32 in its transposed tables."""
    block, stride, sel = geometry
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _nsa_call(131, 2, 1, block, stride, sel, "on")
    finally:
        torch.set_num_threads(before)
    want = _nsa_call(131, 2, 1, block, stride, sel, "off")
    for name, a, b in zip(("out", "q", "k", "v", "ck", "cv", "gates"), got, want):
        assert b.abs().sum() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("importance", ["probs_sum", "logits_softmax"])
@pytest.mark.parametrize("kernel", ["on", "off"])
def test_chunked_selection_ties_go_to_the_most_recent_blocks(importance, kernel):
    """Compressed keys all zero: every past block is equally important, so each query takes its n_sel most recent
    past blocks (the tie-break both the kernel's fused selection and torch ops apply)."""
    t, l, n_sel = 100, 8, 3
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, t, 4, 8, generator=g)
    k, v = torch.randn(1, t, 2, 8, generator=g), torch.randn(1, t, 2, 8, generator=g)
    ck = torch.zeros(1, t // l, 2, 8)
    gates = torch.rand(1, t, 4, 3, generator=g)
    out = nsa_cpu.nsa_attention(q.requires_grad_(), k, v, ck, ck.clone(), gates, block=l, stride=l, sel_block=l,
                                n_sel=n_sel, window=4, scale=0.3, importance=importance, cpu_kernel=kernel)
    (sel,) = [z for z in out.grad_fn.saved_tensors if z.dtype == torch.int32]  # (T, B, Hkv, n_sel)
    for pos in range(t):
        own = pos // l
        want = set(range(max(0, own - n_sel), own))
        for h in range(2):
            assert {int(b) for b in sel[pos, 0, h] if b >= 0} == want, (pos, h)


def test_selected_kernel_unavailable_auto_uses_torch_ops_and_says_why_on_raises(monkeypatch, caplog):
    from efftx.kernels import nsa_selected_cpu as kernels

    monkeypatch.setattr(kernels.KERNEL, "load", lambda: (None, "RuntimeError: no C++ compiler"))
    kernels.KERNEL.warned.clear()
    with caplog.at_level("WARNING", logger=kernels.__name__):
        got = _nsa_call(40, 4, 2, 8, 8, 8, "auto", batch=2)
    assert "C++ CPU NSA kernel is unavailable (RuntimeError: no C++ compiler)" in caplog.text
    for a, b in zip(got, _nsa_call(40, 4, 2, 8, 8, 8, "off", batch=2)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(kernels.KernelUnavailable, match="cpu_kernel=on, but the C..? kernel could not be built: "
                                                        "RuntimeError: no C"):
        _nsa_call(40, 4, 2, 8, 8, 8, "on", batch=2)
    with pytest.raises(ValueError, match="cpu_kernel must be one of auto, on, off, got 'maybe'"):
        _nsa_call(40, 4, 2, 8, 8, 8, "maybe", batch=2)
    kernels.KERNEL.warned.clear()


def test_chunked_path_equals_the_branch_composition_forward_and_backward():
    """The chunked path against the branch-by-branch path CUDA runs (SDPA + the selected-block reference)."""
    backend = chunked(CHUNKED_CASES[0]).train()
    q, k, v, x = inputs(200, heads=4, kv_heads=2, head_dim=16)
    got, got_grads = grads(backend, q, k, v, x, lambda bk, q, k, v, x: bk(q, k, v, x=x))
    backend.chunked = False
    assert not backend.uses_chunked_path(q)
    want, want_grads = grads(backend, q, k, v, x, lambda bk, q, k, v, x: bk(q, k, v, x=x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-4, msg=name)


def test_chunked_path_keeps_only_its_inputs_and_the_selections_for_the_backward():
    """Nothing of size (T, selected keys, D) or (T, compressed blocks) is saved: the backward recomputes."""
    t, case = 300, CHUNKED_CASES[0]
    backend = chunked(case).train()
    q, k, v, x = (z.requires_grad_() for z in inputs(t, heads=4, kv_heads=2, head_dim=16))
    out = backend(q, k, v, x=x)
    node = out.grad_fn
    assert type(node).__name__ == "_NSAFunctionBackward"
    saved = node.saved_tensors
    big = [tuple(z.shape) for z in saved if z.numel() > q.numel()]
    assert big == [], big
    sel = [z for z in saved if z.dtype == torch.int32]
    assert [tuple(z.shape) for z in sel] == [(t, 2, 2, 4)]  # (T, B, Hkv, n_sel) block indices
    assert sum(z.numel() for z in saved) <= 3 * q.numel() + sel[0].numel() + x.numel()


@pytest.mark.parametrize("prefill", [1, 70, 150])
def test_chunked_path_cached_decoding_equals_full_forward(prefill):
    backend = chunked(CHUNKED_CASES[0])
    q, k, v, x = inputs(160, heads=4, kv_heads=2, head_dim=16)
    with torch.no_grad():
        full = backend(q, k, v, x=x)
        cache = backend.new_cache(2, 160, torch.device("cpu"), torch.float32)
        parts = [backend(q[:, :prefill], k[:, :prefill], v[:, :prefill], cache=cache, x=x[:, :prefill])]
        for i in range(prefill, 160, 3):  # decode a few tokens at a time
            j = min(i + 3, 160)
            parts.append(backend(q[:, i:j], k[:, i:j], v[:, i:j], cache=cache, x=x[:, i:j]))
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)


def test_early_queries_get_nothing_from_the_compressed_branch():
    backend = make(block=8, stride=4)
    q, k, v, _ = inputs(12)
    ck, cv = backend.compress_k(k), backend.compress_v(v)
    out = backend.compressed(q, ck, cv, start=0)
    assert (out[:, :7] == 0).all() and (out[:, 7:].abs().sum((0, 2, 3)) > 0).all()


# ------------------------------------------------------------------------------------------ gradients, dtypes

def test_gradients_reach_the_gates_and_the_compression_network():
    backend = make().train()
    q, k, v, x = (t.requires_grad_() for t in inputs(24))
    (backend(q, k, v, x=x) ** 2).sum().backward()
    for name, p in backend.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
    assert {n.split(".")[0] for n, _ in backend.named_parameters()} == {"compress_k", "compress_v", "gate"}
    for t in (q, k, v, x):
        assert torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_bfloat16_stays_bfloat16():
    backend = make().to(torch.bfloat16)
    q, k, v, x = inputs(20, dtype=torch.bfloat16)
    out = backend(q, k, v, x=x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    want = make()(*(t.float() for t in (q, k, v)), x=x.float())
    assert (out.float() - want).abs().max() < 0.1


@pytest.mark.parametrize("options", [{}, {"num_initial_blocks": 1, "num_local_blocks": 2, "score_mapping": "eq9",
                                          "share_selection": False},
                                     {"separate_kv": True, "compress_mem_kv": 1, "importance": "logits_softmax",
                                      "min_importance": 0.2},
                                     {"min_importance": 0.4, "diff_topk": True, "diff_topk_gate": "keys"}],
                         ids=["default", "paper_forced_eq9_per_head", "separate_kv_mem_logits_min", "min_keys_gate"])
def test_triton_selected_branch_equals_the_reference_forward_backward_and_cached(options):
    """The backend's selections fed to the Triton kernel (interpreted on CPU; tests/conftest.py sets
    TRITON_INTERPRET=1) give the reference's output, gradients and cached decoding; with the options that
    change which blocks are attended too (per-head selection: the kernel gets k/v repeated per query head)."""
    from efftx.kernels.selected_attention import INTERPRETED, triton_available

    if not (triton_available() and (INTERPRETED or torch.cuda.is_available())):
        pytest.skip("the Triton kernel needs CUDA or TRITON_INTERPRET=1")
    opts = dict(block=16, stride=8, sel=16, n_sel=2, window=8, head_dim=16, **options)
    ref, tri = make(**opts, impl="reference"), make(**opts, impl="triton")
    assert tri.impl == "triton"
    q, k, v, x = (t.requires_grad_() for t in inputs(40, head_dim=16))
    want = ref(q, k, v, x=x)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    got = tri(q, k, v, x=x)
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g_got, g_want in zip(got_grads, want_grads):
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)
    cache = tri.new_cache(2, 64, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        parts = [tri(q[:, :35], k[:, :35], v[:, :35], cache=cache, x=x[:, :35])]
        parts += [tri(q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], cache=cache, x=x[:, i:i + 1]) for i in range(35, 40)]
    torch.testing.assert_close(torch.cat(parts, 1), want.detach(), rtol=1e-5, atol=1e-5)


def test_backend_needs_the_hidden_state():
    q, k, v, _ = inputs(8)
    with pytest.raises(ValueError, match="x="):
        make()(q, k, v)


# ------------------------------------------------------------------------------------------ cache

def test_cache_holds_compressed_blocks_and_the_partial_block_and_rewinds():
    backend = make(block=8, stride=4)
    q, k, v, x = inputs(22)
    cache = backend.new_cache(2, 32, torch.device("cpu"), torch.float32)
    assert isinstance(cache, NSACache)
    full = backend(q, k, v, x=x)
    out = backend(q[:, :13], k[:, :13], v[:, :13], cache=cache, x=x[:, :13])
    torch.testing.assert_close(out, full[:, :13], rtol=1e-5, atol=1e-6)
    assert cache.length == 13 and cache.blocks == 2  # [0, 8) and [4, 12)
    torch.testing.assert_close(cache.ck[:, :, :2].transpose(1, 2), backend.compress_k(k[:, :13]), rtol=1e-5, atol=1e-6)
    pk, pv = cache.partial()
    assert torch.equal(pk, k[:, 8:13]) and torch.equal(pv, v[:, 8:13])  # from the next block's start on
    cache.rewind(2)  # 11 tokens: block [4, 12) loses a token
    assert cache.length == 11 and cache.blocks == 1
    out = backend(q[:, 11:], k[:, 11:], v[:, 11:], cache=cache, x=x[:, 11:])
    torch.testing.assert_close(out, full[:, 11:], rtol=1e-5, atol=1e-6)
    assert cache.blocks == complete_blocks(22, 8, 4) == 4
    cache.rewind([3, 3])
    assert cache.length == 19
    cache.rewind([1, 2])  # rows of different lengths (ragged): each row keeps its own
    assert cache.lengths == [18, 17] and cache.row_pos.tolist() == [18, 17]
    with pytest.raises(RaggedCacheError):
        cache.blocks
    with pytest.raises(ValueError):
        cache.rewind(20)


# ------------------------------------------------------------------------------------------ slow: Ray

def _val_history(summary) -> dict[int, float]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    return {m.step: m.value for m in client.get_metric_history(summary["mlflow_run_id"], "val_bpb")}


@pytest.mark.slow
def test_nsa_debug_trains_with_falling_validation_loss(ray_cluster):
    from efftx.generate import sample_text
    from efftx.export import load_export
    from efftx.train.launch import launch

    summary = launch(recipes.get("nsa_debug").override({"name": "nsa-debug-run"}))
    assert summary["final_step"] == 40
    val = _val_history(summary)
    assert sorted(val) == [0, 20, 40]
    assert val[40] < val[20] < val[0] and val[40] < 0.8 * val[0], val
    model, cfg, _ = load_export(summary["export_path"])
    assert cfg.attention.kind == "nsa" and cfg.attention.nsa.compress_block_size == 8
    assert isinstance(model.blocks[0].attention.inner, NativeSparseAttention)
    assert len(sample_text(summary["export_path"], "def ", 20, temperature=0)) > 0


@pytest.mark.slow
def test_tiny_nsa_blocks_sweep_completes(ray_cluster):
    from mlflow import MlflowClient

    from efftx.tuning import SPACES, sweep

    # one point of the NSA space through the whole sweep path (tests/test_tune.py sweeps several points)
    summary = sweep("nsa_blocks", samples=1, max_concurrent=1, name="tiny-nsa-sweep",
                    overrides=["train.steps=10", "train.eval_every=5", "train.checkpoint_every=10"])
    assert summary["trials"] == 1 and summary["finished"] == 1
    assert set(summary["best"]) == set(SPACES["nsa_blocks"].grid)
    best = summary["best"]
    assert best["attention.nsa.selection_block_size"] % best["attention.nsa.compress_block_size"] == 0
    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    png = client.download_artifacts(summary["mlflow_parent_run_id"], "sweep/nsa_blocks.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_nsa_blocks_space_excludes_invalid_points_up_front():
    from efftx.tuning import SPACES, points

    space = SPACES["nsa_blocks"]
    pts = points(space, recipes.get(space.recipe).override({"name": "t"}))
    grid_size = math.prod(len(v) for v in space.grid.values())
    assert 0 < len(pts) < grid_size  # (compress 16, selection 8) is left out, not run as a failing trial
    for p in pts:
        assert p["attention.nsa.selection_block_size"] % p["attention.nsa.compress_block_size"] == 0
        Config.from_dict(recipes.get(space.recipe).to_dict()).override({**p, "name": "t"}).validate()

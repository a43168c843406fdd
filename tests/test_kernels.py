"""Selected-block attention (efftx.kernels): torch reference vs a dense oracle, Triton kernel vs reference.

On CPU the Triton kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
efftx is imported); the interpreter's tl.dot is wrong for bf16, so CPU runs fp32 and fp16 only. On a CUDA
machine, `EFFTX_TRITON_GPU=1 python -m pytest tests/test_kernels.py` runs the compiled kernels, bf16 included.

Tolerances are derived, not guessed: for every case the float64 reference on the same (rounded) inputs is the
truth; the same-dtype torch reference's error against it measures what this dtype costs, and the kernel must
stay within C times that error plus a float32-sized floor.
"""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from efftx.kernels import selected_attention
from efftx.kernels.selected_attention import (
    AUTOTUNE_ENV, AUTOTUNE_LOG_ENV, HEAD_DIM_BUCKETS, INTERPRETED, KERNEL_PASSES, TUNING_DTYPES, TUNING_ENV,
    TUNING_TABLE, LaunchConfig, _autotune_candidates, _kernel_meta, _SelectedAttentionFn, launch_config,
    triton_available,
)

sa = importlib.import_module("efftx.kernels.selected_attention")  # the module: the package re-exports its function

ON_GPU = os.environ.get("EFFTX_TRITON_GPU") == "1"
DEVICE = "cuda" if ON_GPU else "cpu"
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
needs_triton = pytest.mark.skipif(
    not triton_available(), reason="triton is not installed (pip install 'efftx[triton]')"
)

# Kernel error <= C * (same-dtype torch reference error) + floor. Measured kernel/reference error ratios on CPU
# (interpreter, the KERNEL_CASES below, 2 seeds each): fp16 <= 0.81 forward, <= 1.95 gradients; fp32 errors of
# both are 1e-7..1e-6, under the floor. C leaves headroom for summation-order noise (GPU atomics, tile orders).
C_FWD, C_GRAD = 2.0, 3.0


# --------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------


def make_block_indices(B, Tq, Tk, Hkv, block_size, S, *, seed=0, device="cpu"):
    """A selection exercising every rule: slot 0 = the query's own (partially future) block, slot 1 = a past
    block (often repeating slot 0), the other slots any block incl. future/out-of-range ones or -1. One row holds
    no slot at all and one only an out-of-range block: both must come back as zeros."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = math.ceil(Tk / block_size)
    own = (Tk - Tq + torch.arange(Tq)) // block_size  # (Tq,)
    idx = torch.randint(0, n_blocks + 1, (B, Tq, Hkv, S), generator=g)
    idx[..., 0] = own.view(1, Tq, 1)
    idx[..., 1] = (torch.rand(B, Tq, Hkv, generator=g) * (own.view(1, Tq, 1) + 1)).long()
    if S > 2:
        unused = torch.rand(B, Tq, Hkv, S - 2, generator=g) < 0.3
        idx[..., 2:] = idx[..., 2:].masked_fill(unused, -1)
    idx[0, 0, 0, :] = -1  # empty selection
    idx[-1, -1, -1, :] = -1
    idx[-1, -1, -1, 0] = n_blocks + 3  # only an out-of-range (future) block
    return idx.to(device)


def dense_oracle(q, k, v, block_indices, block_size, scale):
    """Plain masked-softmax attention with the dense (B, Tq, Hkv, Tk) mask the selection describes."""
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    key_pos = torch.arange(Tk, device=q.device)
    q_pos = Tk - Tq + torch.arange(Tq, device=q.device)
    selected = (block_indices.unsqueeze(-1) == (key_pos // block_size)).any(-2)  # (B, Tq, Hkv, Tk)
    mask = selected & (key_pos.view(1, 1, 1, Tk) <= q_pos.view(1, Tq, 1, 1))
    qg = q.view(B, Tq, Hkv, H // Hkv, D)
    scores = torch.einsum("btgjd,bsgd->btgjs", qg, k) * scale
    scores = scores.masked_fill(~mask.unsqueeze(3), float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> zeros
    return torch.einsum("btgjs,bsgd->btgjd", probs, v).reshape(B, Tq, H, D)


def random_qkv(B, Tq, Tk, H, Hkv, D, dtype, *, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, H, D, generator=g)
    k = torch.randn(B, Tk, Hkv, D, generator=g)
    v = torch.randn(B, Tk, Hkv, D, generator=g)
    return [x.to(device=device, dtype=dtype) for x in (q, k, v)]


# The reference gathers every query's selected keys at once, (B, Hkv, Tq, S * block_size, D): at the GPU cases'
# lengths (T 16384-65536) in float64 that and its gradient are 70-140 GB, more than an H100 holds (seen on one,
# OOM). Above this many gathered elements it runs over query chunks instead (each chunk against the keys up to its
# last query, which is all a causal query sees), each chunk's gradients summed in float64 and rounded once.
REF_CHUNK_ELEMENTS = 1 << 28


def reference_chunk(q, k, idx, block_size) -> int:
    """Queries per chunk of the reference in `forward_and_grads` (all of them when the gather is small)."""
    B, Tq, _, D = q.shape
    per_query = B * k.shape[2] * idx.shape[-1] * block_size * D
    return max(1, min(Tq, REF_CHUNK_ELEMENTS // per_query))


def forward_and_grads(q, k, v, idx, block_size, grad_out, **kw):
    """Output and (dq, dk, dv) for leaf copies of q, k, v."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    Tq, Tk = q.shape[1], k.shape[1]
    chunk = reference_chunk(q, k, idx, block_size) if kw.get("impl") == "reference" else Tq
    if chunk >= Tq:
        out = selected_attention(*leaves, idx, block_size, **kw)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        return out, grads
    outs, sums = [], [torch.zeros_like(x, dtype=torch.float64) for x in leaves]
    for s in range(0, Tq, chunk):
        e = min(Tq, s + chunk)
        keys = Tk - Tq + e  # the chunk's last query sits at key position keys - 1
        parts = [leaves[0][:, s:e], leaves[1][:, :keys], leaves[2][:, :keys]]
        out = selected_attention(*parts, idx[:, s:e], block_size, **kw)
        dq, dk, dv = torch.autograd.grad(out, parts, grad_out[:, s:e].to(out.dtype))
        sums[0][:, s:e] += dq.double()
        sums[1][:, :keys] += dk.double()
        sums[2][:, :keys] += dv.double()
        outs.append(out.detach())
    return torch.cat(outs, 1), tuple(total.to(q.dtype) for total in sums)


@pytest.mark.parametrize("case", [(2, 40, 40, 4, 2, 8, 16, 3), (1, 29, 45, 6, 2, 12, 8, 4)])
def test_chunked_reference_equals_the_whole_one(case, monkeypatch):
    """The long GPU cases' reference runs in query chunks: here forced on small cases (Tq == Tk and Tq < Tk, chunks
    cut mid-block), float64, against the reference over every query at once."""
    B, Tq, Tk, H, Hkv, D, bs, S = case
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, torch.float64, seed=4)
    idx = make_block_indices(B, Tq, Tk, Hkv, bs, S, seed=5)
    grad_out = torch.randn(B, Tq, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    whole, whole_grads = forward_and_grads(q, k, v, idx, bs, grad_out, impl="reference")
    monkeypatch.setattr(sys.modules[__name__], "REF_CHUNK_ELEMENTS", 7 * B * Hkv * S * bs * D)  # 7 queries a chunk
    assert reference_chunk(q, k, idx, bs) == 7
    out, grads = forward_and_grads(q, k, v, idx, bs, grad_out, impl="reference")
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    for got, want in zip(grads, whole_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def max_err(got, truth):
    return (got.double() - truth.double()).abs().max().item()


def check_derived(name, got, same_dtype_ref, truth, c):
    ref_err = max_err(same_dtype_ref, truth)
    floor = 8 * torch.finfo(torch.float32).eps * max(truth.abs().max().item(), 1.0)
    err = max_err(got, truth)
    assert err <= c * ref_err + floor, (
        f"{name}: kernel error {err:.3g} > {c} x same-dtype reference error {ref_err:.3g} + {floor:.3g}"
    )
    return err, ref_err


# --------------------------------------------------------------------------------------------------------------
# reference
# --------------------------------------------------------------------------------------------------------------

REF_CASES = [  # (B, Tq, Tk, H, Hkv, D, block_size, S)
    (2, 40, 40, 4, 2, 8, 16, 3),
    (1, 7, 45, 6, 2, 12, 8, 4),  # Tq < Tk, block size not a multiple of 16 (reference only)
    (2, 1, 33, 4, 4, 8, 16, 2),  # one-token decode
]


@pytest.mark.parametrize("case", REF_CASES, ids=lambda c: "B{}_Tq{}_Tk{}_H{}_Hkv{}_D{}_bs{}_S{}".format(*c))
def test_reference_matches_dense_oracle_float64(case):
    B, Tq, Tk, H, Hkv, D, bs, S = case
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, torch.float64)
    idx = make_block_indices(B, Tq, Tk, Hkv, bs, S)
    scale = 0.37
    grad_out = torch.randn(B, Tq, H, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out, grads = forward_and_grads(q, k, v, idx, bs, grad_out, scale=scale, impl="reference")
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    want = dense_oracle(*leaves, idx, bs, scale)
    want_grads = torch.autograd.grad(want, leaves, grad_out)
    assert out.dtype == torch.float64 and out.shape == (B, Tq, H, D)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for name, got, exp in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got, exp, rtol=0, atol=1e-12, msg=f"d{name}")
    # the rows with nothing visible are exactly zero (first query's group 0, last query's last group)
    G = H // Hkv
    assert out[0, 0, :G].abs().max() == 0 and out[-1, -1, -G:].abs().max() == 0


def test_reference_counts_repeated_blocks_once_and_ignores_unused_slots():
    B, Tq, Tk, H, Hkv, D, bs = 1, 16, 64, 2, 1, 8, 16
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, torch.float64)
    base = torch.tensor([3, 1, -1, -1]).expand(B, Tq, Hkv, 4)
    # block 1 twice (would weigh double if counted twice); any negative index = unused slot
    messy = torch.tensor([1, 3, 1, -7]).expand(B, Tq, Hkv, 4)
    a = selected_attention(q, k, v, base, bs, impl="reference")
    b = selected_attention(q, k, v, messy, bs, impl="reference")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_reference_keeps_dtype_and_grads_are_finite_for_empty_rows():
    B, Tq, Tk, H, Hkv, D, bs = 1, 8, 32, 4, 2, 8, 16
    q, k, v = [x.requires_grad_(True) for x in random_qkv(B, Tq, Tk, H, Hkv, D, torch.float16)]
    idx = torch.full((B, Tq, Hkv, 2), -1)
    idx[:, :, 0, 0] = 1  # group 0 sees its own block, group 1 sees nothing
    out = selected_attention(q, k, v, idx, bs, impl="reference")
    assert out.dtype == torch.float16
    assert out[:, :, 2:].abs().max() == 0 and out[:, :, :2].abs().max() > 0
    out.float().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    assert q.grad[:, :, 2:].abs().max() == 0


# --------------------------------------------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(impl="cuda"), "impl"),
        (dict(q=torch.zeros(1, 4, 3, 8)), "multiple of k/v heads"),
        (dict(q=torch.zeros(4, 4, 8)), "q must be 4-D"),
        (dict(v=torch.zeros(1, 8, 1, 8)), "k and v must have the same shape"),
        (dict(q=torch.zeros(1, 9, 4, 8)), "more positions"),
        (dict(block_indices=torch.zeros(1, 4, 1, 1, dtype=torch.long)), "block_indices must have shape"),
        (dict(block_indices=torch.zeros(1, 4, 2, 1)), "block_indices must be int64"),
        (dict(block_size=0), "block_size"),
        (dict(q=torch.zeros(1, 4, 4, 8, dtype=torch.float64)), "share one dtype"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, match):
    args = dict(
        q=torch.zeros(1, 4, 4, 8), k=torch.zeros(1, 8, 2, 8), v=torch.zeros(1, 8, 2, 8),
        block_indices=torch.zeros(1, 4, 2, 1, dtype=torch.long), block_size=16, impl="reference",
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        selected_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("block_indices"), **args)


@needs_triton
@pytest.mark.parametrize(
    "block_size, D, dtype, match",
    [(24, 16, torch.float32, "block_size must be a multiple of 16"), (16, 160, torch.float32, "head dim"),
     (16, 16, torch.float64, "q dtype")],
)
def test_triton_rejects_what_it_cannot_run(block_size, D, dtype, match):
    q, k, v = random_qkv(1, 2, 2, 1, 1, D, dtype, device=DEVICE)
    idx = torch.zeros(1, 2, 1, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=match):
        selected_attention(q, k, v, idx, block_size, impl="triton")


# --------------------------------------------------------------------------------------------------------------
# Triton kernel vs reference
# --------------------------------------------------------------------------------------------------------------


@needs_triton
def test_triton_path_really_ran():
    """The kernels, not a silent fallback: interpreted on CPU (conftest), compiled on GPU; auto = reference on CPU."""
    assert INTERPRETED != ON_GPU, "TRITON_INTERPRET must be set before efftx is imported (tests/conftest.py)"
    q, k, v = [x.requires_grad_(True) for x in random_qkv(1, 16, 16, 2, 1, 16, torch.float32, device=DEVICE)]
    idx = torch.zeros(1, 16, 1, 1, dtype=torch.long, device=DEVICE)
    out = selected_attention(q, k, v, idx, 16, impl="triton")
    assert type(out.grad_fn).__name__ == _SelectedAttentionFn.__name__ + "Backward"
    auto = selected_attention(q, k, v, idx, 16, impl="auto")
    assert (type(auto.grad_fn).__name__ == _SelectedAttentionFn.__name__ + "Backward") == ON_GPU


KERNEL_CASES = [  # (B, Tq, Tk, H, Hkv, D, block_size, S, noncontiguous)
    (1, 32, 32, 2, 2, 16, 16, 3, False),  # GQA 1, Tq == Tk
    (2, 24, 40, 4, 2, 64, 16, 4, True),  # GQA 2, chunked prefill (Tq < Tk), strided q/k/v views
    (1, 20, 64, 8, 2, 48, 32, 3, False),  # GQA 4, head dim 48 (padded to 64), block 32
    (1, 48, 48, 4, 1, 32, 32, 2, False),  # GQA 4, Tq == Tk, block 32, last block partial
    (2, 1, 50, 4, 2, 16, 16, 3, False),  # one-token decode
    (1, 24, 80, 4, 2, 128, 64, 2, False),  # head dim 128: backward walks a block in 2 tiles of 32 keys
    (1, 16, 224, 2, 1, 16, 128, 2, False),  # block 128: 2 tiles of 64 keys, the second partly in the future
    (1, 8, 176, 2, 1, 128, 48, 3, False),  # block 48 at head dim 128: tiles cut at the block's end
]
if ON_GPU:  # compiled on a GPU (bench/gpu_check.py): long sequences, GQA 8, head dims 64 and 128
    KERNEL_CASES += [
        (2, 4096, 4096, 8, 8, 64, 64, 8, False),  # GQA 1, T 4096
        (1, 8192, 8192, 8, 1, 128, 32, 8, False),  # GQA 8, head dim 128
        (1, 16384, 16384, 16, 2, 128, 64, 16, False),  # GQA 8, T 16384
        (1, 65536, 65536, 8, 2, 64, 64, 4, False),  # GQA 4, T 65536
    ]


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "B{}_Tq{}_Tk{}_H{}_Hkv{}_D{}_bs{}_S{}_nc{}".format(*c))
def test_triton_matches_reference_forward_and_grads(case, dtype):
    B, Tq, Tk, H, Hkv, D, bs, S, noncontiguous = case
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, dtype, seed=1, device=DEVICE)
    if noncontiguous:  # (B, H, T, D) storage seen as (B, T, H, D), like heads split out of a projection
        q, k, v = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
        assert not q.is_contiguous()
    idx = make_block_indices(B, Tq, Tk, Hkv, bs, S, seed=2, device=DEVICE)
    if noncontiguous:
        idx = idx.int()  # int32 indices are accepted too
    grad_out = torch.randn(B, Tq, H, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    out, grads = forward_and_grads(q, k, v, idx, bs, grad_out.to(dtype), impl="triton")
    ref, ref_grads = forward_and_grads(q, k, v, idx, bs, grad_out.to(dtype), impl="reference")
    truth, truth_grads = forward_and_grads(
        *(x.double() for x in (q, k, v)), idx, bs, grad_out.double(), impl="reference"
    )

    assert out.dtype == dtype and out.shape == (B, Tq, H, D)
    assert all(g.dtype == dtype for g in grads)
    G = H // Hkv
    assert out[0, 0, :G].abs().max() == 0 and out[-1, -1, -G:].abs().max() == 0  # empty selections
    check_derived("out", out, ref, truth, C_FWD)
    for name, got, same, exact in zip(("dq", "dk", "dv"), grads, ref_grads, truth_grads):
        check_derived(name, got, same, exact, C_GRAD)

    # The derived tolerance is tight enough to catch a real bug: a 2% wrong softmax scale fails it.
    wrong = selected_attention(q, k, v, idx, bs, scale=1.02 * D**-0.5, impl="reference")
    with pytest.raises(AssertionError):
        check_derived("out(wrong scale)", wrong, ref, truth, C_FWD)


@needs_triton
def test_triton_no_grad_and_repeated_blocks():
    """Inference mode works, and a repeated block is counted once by the kernel as by the reference."""
    B, Tq, Tk, H, Hkv, D, bs = 1, 16, 64, 2, 1, 16, 16
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, torch.float32, device=DEVICE)
    base = torch.tensor([3, 1, -1, -1], device=DEVICE).expand(B, Tq, Hkv, 4)
    messy = torch.tensor([1, 3, 1, -1], device=DEVICE).expand(B, Tq, Hkv, 4)
    with torch.no_grad():
        a = selected_attention(q, k, v, base, bs, impl="triton")
        b = selected_attention(q, k, v, messy, bs, impl="triton")
        ref = selected_attention(q, k, v, base, bs, impl="reference")
    torch.testing.assert_close(a, ref)  # fp32 tolerances; blocks visited in another order in `b`
    torch.testing.assert_close(b, ref)


# Every selection block size the config lets the kernel run: efftx.attention.nsa.NSAOptions.validate accepts any positive
# multiple of 16 for impl=triton (and impl=auto picks the kernel for those on CUDA), with no upper bound; the sweep
# covers 16..256. Sizes that are not a power of two (48, 80, 96, ...) end inside a key tile, whose keys past the
# block's end belong to the next block: they must neither be attended to nor receive dK/dV.
SWEEP_BLOCK_SIZES = list(range(16, 257, 16))


def test_sweep_covers_the_block_sizes_the_config_accepts_for_the_kernel():
    from efftx.attention.base import AttentionSpec
    from efftx.attention.nsa import NSAOptions
    from efftx.errors import ConfigError

    spec = AttentionSpec(kind="nsa", dim=256, heads=4, kv_heads=4, head_dim=64, max_seq_len=256)
    accepted = []
    for bs in range(1, 257):
        try:
            NSAOptions(selection_block_size=bs, compress_block_size=1, impl="triton").validate(spec)
            accepted.append(bs)
        except ConfigError:
            pass
    assert accepted == SWEEP_BLOCK_SIZES


def sweep_block_indices(B, Tq, Tk, Hkv, block_size, S, *, seed=0, device="cpu"):
    """Queries in the last (partial) block 3 of Tk = 3.5 blocks. Slot 0 = the own block; the other slots pick
    from blocks {0, 2} for even kv groups and {1, 2} for odd ones, or -1, a repeat, or an out-of-range block. So
    for every group a block is followed by an unselected block (0 -> 1 in even groups) or by a selected one
    (1 -> 2, 2 -> 3), and one block per group (1 or 0) holds keys no query selected."""
    g = torch.Generator().manual_seed(seed)
    n_blocks = math.ceil(Tk / block_size)
    assert n_blocks == 4 and (Tk - Tq) // block_size == 3
    even, odd = torch.tensor([0, 2, -1, 3, n_blocks + 1]), torch.tensor([1, 2, -1, 3, n_blocks + 1])
    choice = torch.randint(0, 5, (B, Tq, Hkv, S), generator=g)
    choice[..., 1] = torch.randint(0, 2, (B, Tq, Hkv), generator=g)  # slot 1: always a past block
    groups = torch.arange(Hkv).view(1, 1, Hkv, 1)
    idx = torch.where(groups % 2 == 0, even[choice], odd[choice])
    idx[..., 0] = 3
    return idx.to(device)


def unselected_keys(idx, Tq, Tk, block_size):
    """(B, Tk, Hkv) True for the keys no query of that (batch, kv group) attends to (not in a selected block,
    or only in selected blocks after the query)."""
    key = torch.arange(Tk, device=idx.device)
    q_pos = (Tk - Tq + torch.arange(Tq, device=idx.device)).view(1, Tq, 1, 1, 1)
    hit = (idx.unsqueeze(-1) == key // block_size) & (key <= q_pos)  # (B, Tq, Hkv, S, Tk)
    return ~hit.any(-2).any(1).transpose(1, 2)


@needs_triton
@pytest.mark.parametrize("block_size", SWEEP_BLOCK_SIZES)
def test_triton_matches_reference_for_every_accepted_block_size(block_size):
    """Forward and dQ/dK/dV against the reference for every block size, and exactly zero dK/dV for the keys of no
    selected block (the kernel's atomics must land only inside selected blocks)."""
    B, Tq, H, Hkv, D, S = 1, 6, 4, 2, 16, 3
    Tk = 3 * block_size + block_size // 2
    dtype = torch.float32 if not ON_GPU else torch.bfloat16
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, dtype, seed=block_size, device=DEVICE)
    idx = sweep_block_indices(B, Tq, Tk, Hkv, block_size, S, seed=block_size, device=DEVICE)
    grad_out = torch.randn(B, Tq, H, D, generator=torch.Generator().manual_seed(3)).to(DEVICE)

    out, grads = forward_and_grads(q, k, v, idx, block_size, grad_out.to(dtype), impl="triton")
    ref, ref_grads = forward_and_grads(q, k, v, idx, block_size, grad_out.to(dtype), impl="reference")
    truth, truth_grads = forward_and_grads(
        *(x.double() for x in (q, k, v)), idx, block_size, grad_out.double(), impl="reference"
    )
    check_derived("out", out, ref, truth, C_FWD)
    for name, got, same, exact in zip(("dq", "dk", "dv"), grads, ref_grads, truth_grads):
        check_derived(name, got, same, exact, C_GRAD)

    untouched = unselected_keys(idx, Tq, Tk, block_size)  # (B, Tk, Hkv)
    assert untouched[..., 0].sum() >= block_size and untouched[..., 1].sum() >= block_size  # blocks 1 and 0
    for name, grad in zip(("dk", "dv"), grads[1:]):
        stray = grad[untouched].abs().max().item()
        assert stray == 0, f"{name}: {stray:.3g} of gradient landed on keys of no selected block"


# Compiles both kernels for an H100 (sm_90) in a subprocess without TRITON_INTERPRET: Triton's real frontend,
# the NVIDIA lowering and ptxas (shipped in the triton wheel) run without a GPU. fp16 and bf16 (which the
# interpreter cannot check), head dims 64 and 128 (the backward walks 64- and 32-key tiles) and block sizes that are
# a power of two (16, 128, 256: several tiles per block) or not (48, 80: the last tile is cut at the block's end);
# then every tuning-table entry not compiled yet at its full tile (fp32, head dims 16 and 32). The launch's
# num_warps and num_stages must be the compiled kernel's.
COMPILE_DTYPES = ("fp16", "bf16")
COMPILE_HEAD_DIMS = (64, 128)
COMPILE_BLOCK_SIZES = (16, 48, 80, 128, 256)
_SHORT = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}
_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    import sys
    import torch, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from efftx.kernels.selected_attention import (
        INTERPRETED, _kernel_meta, _selected_bwd_kernel, _selected_fwd_kernel)

    assert not INTERPRETED
    for case in sys.argv[1].split(","):
        name, D, bs = case.split(":")
        D, bs = int(D), int(bs)
        dtype = dict(fp16=torch.float16, bf16=torch.bfloat16, fp32=torch.float32)[name]
        q, k = torch.zeros(1, 1, 8, D, dtype=dtype), torch.zeros(1, 1, 4, D, dtype=dtype)
        fwd, bwd = _kernel_meta(q, k, torch.zeros(1, 1, 4, 5, dtype=torch.long), bs)
        pointers = dict(Q="*" + name, K="*" + name, V="*" + name, IDX="*i64", O="*" + name, DO="*" + name,
                        DQ="*" + name, LSE="*fp32", DELTA="*fp32", DK="*fp32", DV="*fp32")
        for kernel, meta in ((_selected_fwd_kernel, fwd), (_selected_bwd_kernel, bwd)):
            consts = {n: meta[n] for n in kernel.arg_names if n in meta}
            sig = {n: "constexpr" if n in consts else pointers.get(n, "fp32" if n == "scale" else "i32")
                   for n in kernel.arg_names}
            compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                      options=dict(num_warps=meta["num_warps"], num_stages=meta["num_stages"]))
            assert compiled.asm["cubin"], kernel
            got = (compiled.metadata.num_warps, compiled.metadata.num_stages)
            assert got == (meta["num_warps"], meta["num_stages"]), (kernel, got, meta)
            print("compiled", kernel.__name__, name, "D", D, "block", bs, "TILE", meta["TILE"],
                  "warps", meta["num_warps"], "stages", meta["num_stages"], flush=True)
    """
)


def compile_cases() -> tuple[list[tuple[str, int, int]], set]:
    """(dtype, head dim, block size) to compile, and the tuning-table entries they compile at full tile."""
    cases = list(itertools.product(COMPILE_DTYPES, COMPILE_HEAD_DIMS, COMPILE_BLOCK_SIZES))
    full_tile_block = max(entry.tile for entry in TUNING_TABLE.values())
    names = {short: long for long, short in _SHORT.items()}

    def entries(case):  # the table entries a case compiles unchanged (its block is no smaller than their tile)
        short, head_dim, block_size = case
        keys = [(p, names[short], sa._pow2_at_least(head_dim, 16)) for p in KERNEL_PASSES]
        return {key for key in keys
                if launch_config(key[0], getattr(torch, key[1]), head_dim, block_size) == TUNING_TABLE[key]}

    covered = set().union(*map(entries, cases))
    for pass_, dtype, d_pad in sorted(TUNING_TABLE):
        if (pass_, dtype, d_pad) not in covered:
            case = (_SHORT[dtype], d_pad, full_tile_block)
            cases.append(case)
            covered |= entries(case)
    return cases, covered


@needs_triton
def test_kernels_compile_for_an_h100_without_a_gpu(tmp_path, monkeypatch):
    ptxas = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin")
    if not os.path.isdir(ptxas):
        pytest.skip("this triton build ships no NVIDIA backend tools (ptxas)")
    monkeypatch.delenv(TUNING_ENV, raising=False)  # the table itself, not an experiment's overrides
    cases, covered = compile_cases()
    assert covered == set(TUNING_TABLE)  # every table entry is compiled at its own tile, warps and stages
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # really compile, no cache hit from an earlier run
    arg = ",".join(f"{name}:{d}:{bs}" for name, d, bs in cases)
    run = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, arg], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.count("compiled") == 2 * len(cases), run.stdout


# --------------------------------------------------------------------------------------------------------------
# launch tuning: the table, overrides, autotune
# --------------------------------------------------------------------------------------------------------------


def pinned_launch(dtype, head_dim, block_size):
    """The (TILE, num_warps) pairs, forward and backward, that were compiled and checked with ptxas before the
    tuning table existed (then a formula in _kernel_meta); the table must reproduce them."""
    d_pad = max(16, 1 << (head_dim - 1).bit_length())
    block_pow2 = max(16, 1 << (block_size - 1).bit_length())
    fwd_tile, bwd_tile = min(block_pow2, 64), min(block_pow2, 64 if d_pad <= 64 else 32)
    elem = torch.empty(0, dtype=dtype).element_size()
    return ((fwd_tile, 8 if fwd_tile * d_pad * elem >= 32768 else 4), (bwd_tile, 8 if bwd_tile * d_pad >= 4096 else 4))


def meta_for(dtype, head_dim, block_size, tuning=None, H=8, Hkv=2, S=4):
    q = torch.empty(1, 1, H, head_dim, dtype=dtype, device="meta")
    k = torch.empty(1, 1, Hkv, head_dim, dtype=dtype, device="meta")
    return _kernel_meta(q, k, torch.empty(1, 1, Hkv, S, dtype=torch.long, device="meta"), block_size, tuning)


def test_tuning_table_has_one_entry_per_pass_dtype_and_head_dim_bucket():
    assert set(TUNING_TABLE) == set(itertools.product(KERNEL_PASSES, TUNING_DTYPES, HEAD_DIM_BUCKETS))
    assert HEAD_DIM_BUCKETS[-1] == sa.MAX_TRITON_HEAD_DIM
    assert all(isinstance(entry, LaunchConfig) for entry in TUNING_TABLE.values())


def test_table_choices_for_every_accepted_block_size_head_dim_and_dtype(monkeypatch):
    """Every block size the config accepts for the kernel (and a larger one), every head dim 1..128 and every
    dtype get a valid launch, exactly the ptxas-checked choices of before (same tiles = same numerics)."""
    monkeypatch.delenv(TUNING_ENV, raising=False)
    for dtype, block_size in itertools.product((torch.float16, torch.bfloat16, torch.float32),
                                               SWEEP_BLOCK_SIZES + [512]):
        for head_dim in range(1, sa.MAX_TRITON_HEAD_DIM + 1):
            fwd, bwd = meta_for(dtype, head_dim, block_size)
            for meta in (fwd, bwd):
                LaunchConfig(meta["TILE"], meta["num_warps"], meta["num_stages"])  # valid (raises otherwise)
                assert meta["TILE"] <= max(16, 1 << (block_size - 1).bit_length())  # no tile wider than the block
                assert meta["num_stages"] == 3  # the NVIDIA backend's default: compiled as before
            got = ((fwd["TILE"], fwd["num_warps"]), (bwd["TILE"], bwd["num_warps"]))
            assert got == pinned_launch(dtype, head_dim, block_size), (dtype, head_dim, block_size)


def test_overrides_from_the_environment_and_the_argument(monkeypatch):
    monkeypatch.setenv(TUNING_ENV, "fwd.tile=16, bwd.num_warps=2,bwd.num_stages=1")
    fwd, bwd = meta_for(torch.float16, 128, 64)
    assert (fwd["TILE"], fwd["num_warps"], fwd["num_stages"]) == (16, 4, 3)  # warps, stages from the table
    assert (bwd["TILE"], bwd["num_warps"], bwd["num_stages"]) == (32, 2, 1)
    # the argument goes on top of the environment; overridden values are taken literally (warps 8 at tile 16)
    fwd, bwd = meta_for(torch.float16, 128, 64, tuning={"fwd": {"tile": 32, "num_warps": 8}, "bwd": {"tile": 16}})
    assert (fwd["TILE"], fwd["num_warps"], bwd["TILE"], bwd["num_warps"]) == (32, 8, 16, 2)
    assert launch_config("fwd", torch.float16, 128, 64, "fwd.num_warps=16").num_warps == 16  # string form too


@pytest.mark.parametrize(
    "spec, match",
    [
        ("fwd.tile=24", r"fwd\.tile \(keys per TILE\) must be a power of two >= 16, got 24"),
        ("fwd.tile=8", "power of two >= 16, got 8"),
        ("bwd.num_warps=3", r"bwd\.num_warps must be one of \(1, 2, 4, 8, 16\), got 3"),
        ("bwd.num_warps=32", "num_warps must be one of .*got 32"),
        ("fwd.num_stages=0", r"fwd\.num_stages must be >= 1, got 0"),
        ("fw.tile=32", "unknown kernel pass 'fw'"),
        ("fwd.tiles=32", r"unknown field fwd\.tiles"),
        ("fwd.tile=big", "'big' is not an integer"),
        ("fwd.tile", "not of the form PASS.FIELD=INT"),
        ({"fwd": {"tile": 48}}, "power of two >= 16, got 48"),
        ({"bwd": {"num_stages": 2.5}}, r"bwd\.num_stages must be an int, got 2\.5"),
        ({"fwd": 32}, "'fwd' must map to a dict"),
    ],
)
def test_bad_overrides_raise_naming_the_value(monkeypatch, spec, match):
    q, k, v = random_qkv(1, 2, 2, 1, 1, 16, torch.float32)
    idx = torch.zeros(1, 2, 1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match=f"^tuning: .*{match}"):  # even on the reference path
        selected_attention(q, k, v, idx, 16, impl="reference", tuning=spec)
    if isinstance(spec, str):
        monkeypatch.setenv(TUNING_ENV, spec)
        with pytest.raises(ValueError, match=f"^{TUNING_ENV}: .*{match}"):
            meta_for(torch.float16, 64, 64)


def test_launch_config_validates_its_fields():
    with pytest.raises(ValueError, match="tile .* must be a power of two >= 16, got 96"):
        LaunchConfig(96, 4, 3)
    with pytest.raises(ValueError, match="num_warps must be one of .* got 0"):
        LaunchConfig(64, 0, 3)
    with pytest.raises(ValueError, match="num_stages must be >= 1, got -1"):
        LaunchConfig(64, 4, -1)


def test_autotune_switch_rejects_anything_but_0_or_1(monkeypatch):
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(AUTOTUNE_ENV, value)
        assert sa.autotune_enabled() is on
    monkeypatch.setenv(AUTOTUNE_ENV, "yes")
    with pytest.raises(ValueError, match=f"{AUTOTUNE_ENV} must be 0 or 1, got 'yes'"):
        sa.autotune_enabled()


def test_autotune_candidates_surround_the_table_choice():
    c = LaunchConfig
    assert _autotune_candidates(c(64, 8, 3), 256) == [c(64, 8, 3), c(32, 8, 3), c(128, 8, 3), c(64, 4, 3),
                                                      c(64, 16, 3)]
    # no tile wider than the block (64), none under 16, warps within 2..16
    assert _autotune_candidates(c(64, 4, 3), 64) == [c(64, 4, 3), c(32, 4, 3), c(64, 2, 3), c(64, 8, 3)]
    assert _autotune_candidates(c(16, 2, 1), 16) == [c(16, 2, 1), c(16, 4, 1)]
    for (pass_, dtype, d_pad), entry in TUNING_TABLE.items():
        for block_size in SWEEP_BLOCK_SIZES:
            chosen = launch_config(pass_, getattr(torch, dtype), d_pad, block_size)
            got = _autotune_candidates(chosen, block_size)
            assert got[0] == chosen and 2 <= len(got) <= 5 and len(set(got)) == len(got)
            block_pow2 = sa._pow2_at_least(block_size, 16)
            assert all(x.tile <= max(chosen.tile, block_pow2) and x.num_stages == chosen.num_stages for x in got)


class _RecordingKernel:
    """Stands in for a Triton kernel: records the launch keywords, then launches the real kernel."""

    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)

        return launch


@needs_triton
def test_launch_carries_tile_warps_and_stages_to_the_kernels(monkeypatch):
    """The chosen num_stages (and TILE, num_warps) reach both kernel launches; an overridden smaller tile (a
    64-key block walked in 4 tiles of 16) still matches the reference."""
    monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
    monkeypatch.delenv(TUNING_ENV, raising=False)
    calls = []
    monkeypatch.setattr(sa, "_selected_fwd_kernel", _RecordingKernel(sa._selected_fwd_kernel, calls))
    monkeypatch.setattr(sa, "_selected_bwd_kernel", _RecordingKernel(sa._selected_bwd_kernel, calls))
    B, Tq, Tk, H, Hkv, D, bs, S = 1, 4, 128, 2, 1, 16, 64, 2
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, torch.float32, device=DEVICE)
    idx = make_block_indices(B, Tq, Tk, Hkv, bs, S, seed=4, device=DEVICE)
    grad_out = torch.randn(B, Tq, H, D, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    tuning = {"fwd": {"tile": 16, "num_stages": 2}, "bwd": {"tile": 16, "num_warps": 2, "num_stages": 4}}
    out, grads = forward_and_grads(q, k, v, idx, bs, grad_out, impl="triton", tuning=tuning)
    fwd, bwd = calls
    assert (fwd["TILE"], fwd["num_warps"], fwd["num_stages"]) == (16, 4, 2)
    assert (bwd["TILE"], bwd["num_warps"], bwd["num_stages"]) == (16, 2, 4)
    ref, ref_grads = forward_and_grads(q, k, v, idx, bs, grad_out, impl="reference")
    torch.testing.assert_close(out, ref)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    calls.clear()
    forward_and_grads(q, k, v, idx, bs, grad_out, impl="triton")  # no overrides: the table's
    assert [(c["TILE"], c["num_warps"], c["num_stages"]) for c in calls] == [(64, 4, 3), (64, 4, 3)]


@needs_triton
def test_autotuned_launch_matches_the_default_and_reports_its_choice(monkeypatch, tmp_path):
    """EFFTX_TRITON_AUTOTUNE=1 under the interpreter (Triton's autotuner runs there with a wall-clock timer): every
    candidate runs, the fastest is kept (here the timer is scripted so a smaller tile wins, a real change of
    numerics path), the result equals the default launch's, including dK/dV, which the trial runs accumulate into
    atomically, and the choice is readable (autotune_choices, the log file). Tuning happens once per bucket."""
    monkeypatch.delenv(TUNING_ENV, raising=False)
    monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
    monkeypatch.setattr(sa, "_AUTOTUNERS", {})
    monkeypatch.setattr(sa, "_AUTOTUNE_CHOICES", {})
    B, Tq, Tk, H, Hkv, D, bs, S = 1, 4, 64, 4, 2, 16, 32, 2
    table = launch_config("fwd", torch.float32, D, bs)
    assert table == launch_config("bwd", torch.float32, D, bs) == LaunchConfig(32, 4, 3)
    n = len(_autotune_candidates(table, bs))
    assert n == 4  # TILE 32 (the table's), TILE 16, 2 warps, 8 warps
    bench_calls = []

    def scripted_bench(kernel_call, quantiles):  # the second candidate (TILE 16) is the fastest
        kernel_call()
        bench_calls.append(1)
        return [0.5 if len(bench_calls) % n == 2 else 1.0 + len(bench_calls) % n] * len(quantiles)

    monkeypatch.setattr(sa, "_autotune_do_bench", lambda: scripted_bench)
    q, k, v = random_qkv(B, Tq, Tk, H, Hkv, D, torch.float32, seed=6, device=DEVICE)
    idx = make_block_indices(B, Tq, Tk, Hkv, bs, S, seed=7, device=DEVICE)
    grad_out = torch.randn(B, Tq, H, D, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    want, want_grads = forward_and_grads(q, k, v, idx, bs, grad_out, impl="triton")
    assert not bench_calls and not sa.autotune_choices()  # off by default

    monkeypatch.setenv(AUTOTUNE_ENV, "1")
    log = tmp_path / "autotune.jsonl"
    monkeypatch.setenv(AUTOTUNE_LOG_ENV, str(log))
    got, got_grads = forward_and_grads(q, k, v, idx, bs, grad_out, impl="triton")
    assert len(bench_calls) == 2 * n  # every candidate of both kernels ran
    torch.testing.assert_close(got, want)
    for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
        torch.testing.assert_close(g, w, msg=name)
    choices = sa.autotune_choices()
    assert [c["kernel"] for c in choices] == ["fwd", "bwd"]
    for c in choices:
        assert (c["TILE"], c["num_warps"], c["num_stages"]) == (16, 4, 3)
        assert c["table"] == dict(tile=32, num_warps=4, num_stages=3) and len(c["timings"]) == n
        assert (c["dtype"], c["D"], c["BLOCK"], c["G"], c["programs"]) == ("float32", D, bs, H // Hkv, 8)
    assert [json.loads(line) for line in log.read_text().splitlines()] == choices

    # 3 queries = 6 programs, the same power-of-two bucket (8): no re-tuning; 16 queries (32 programs) re-tune
    forward_and_grads(q[:, 1:], k, v, idx[:, 1:], bs, grad_out[:, 1:], impl="triton")
    assert len(bench_calls) == 2 * n and len(sa.autotune_choices()) == 2
    q16, k16, v16 = random_qkv(B, 16, Tk, H, Hkv, D, torch.float32, seed=9, device=DEVICE)
    idx16 = make_block_indices(B, 16, Tk, Hkv, bs, S, seed=7, device=DEVICE)
    with torch.no_grad():
        selected_attention(q16, k16, v16, idx16, bs, impl="triton")
    assert len(bench_calls) == 3 * n and sa.autotune_choices()[-1]["programs"] == 32

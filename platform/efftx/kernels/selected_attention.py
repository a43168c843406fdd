"""Selected-block attention, the "selection" branch of Native Sparse Attention (NSA).

Every query attends only to a few key blocks picked for it (its own block and the top blocks scored by the
compressed branch); all query heads of a GQA group share the group's pick. Two implementations of the same
operation live here, side by side:

- ``impl="reference"``: pure torch. Gathers the selected keys/values of every query, masks, softmax in fp32.
  Differentiable by autograd, runs anywhere, and is the test oracle. Memory is O(B * Tq * Hkv * S * block_size * D)
  for the gathered keys/values (no Tq x Tk matrix).
- ``impl="triton"``: Triton forward and backward kernels wrapped in a ``torch.autograd.Function``.
- ``impl="auto"``: Triton when ``q`` lives on CUDA (and Triton imports), the reference otherwise.

Semantics shared by both (the tests hold them to it):

- Query ``i`` of ``Tq`` sits at absolute position ``Tk - Tq + i``: ``Tq == Tk`` is a full forward, ``Tq < Tk`` is
  cached decoding or chunked prefill over a key cache that already holds the earlier positions.
- Block ``j`` is keys ``[j * block_size, (j + 1) * block_size)``. Keys after the query's position are masked even
  inside a selected block, so a query may select its own, partially future block (block-causal). A block that
  starts after the query (including any index ``>= ceil(Tk / block_size)``) contributes nothing.
- ``-1`` (any negative index) marks an unused slot. A block index repeated in one query's slots counts ONCE
  (both implementations skip the repeats), so the result is attention over the union of the selected blocks.
- A query row whose selection holds no visible key (all slots -1 or in the future) returns zeros and gets zero
  gradients.

Launch tuning (tile sizes, warps, pipeline stages per kernel, dtype and head dim) lives in one table,
``TUNING_TABLE``; ``EFFTX_TRITON_TUNING="fwd.tile=32,bwd.num_warps=4"`` or the ``tuning=`` argument override it for
experiments, and ``EFFTX_TRITON_AUTOTUNE=1`` autotunes each launch over a few configs around the table's choice
(``autotune_choices()`` reports what it picked; ``EFFTX_TRITON_AUTOTUNE_LOG=FILE`` also appends it to FILE).

Testing on CPU: with ``TRITON_INTERPRET=1`` in the environment before this module is imported (Triton decides at
kernel decoration), ``impl="triton"`` runs the same kernels on CPU tensors through Triton's interpreter
(``INTERPRETED`` is then True); tests/conftest.py does that. The interpreter's bf16 ``tl.dot`` is wrong, so CPU
tests use fp32/fp16.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time

import torch

try:  # Triton is an optional extra (`pip install efftx[triton]`); the reference works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = [
    "selected_attention", "selected_attention_reference", "triton_available", "IMPLS",
    "LaunchConfig", "TUNING_TABLE", "launch_config", "parse_tuning", "autotune_enabled", "autotune_choices",
]

IMPLS = ("auto", "triton", "reference")
MAX_TRITON_HEAD_DIM = 128


def triton_available() -> bool:
    """True when the Triton kernels can be used at all (Triton imported)."""
    return triton is not None


# --------------------------------------------------------------------------------------------------------------
# argument checks (shared)
# --------------------------------------------------------------------------------------------------------------


def _check_args(q, k, v, block_indices, block_size, impl) -> None:
    """Raise ValueError naming the offending argument; nothing here syncs with the device."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    for name, t in (("q", q), ("k", k), ("v", v), ("block_indices", block_indices)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    B, Tq, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    Bk, Tk, Hkv, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} (batch, head dim)")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv}) (GQA)")
    if Tq > Tk:
        raise ValueError(f"q has more positions ({Tq}) than k/v ({Tk}); queries must sit at the end of the keys")
    if block_indices.shape[:3] != (B, Tq, Hkv):
        raise ValueError(
            f"block_indices must have shape (B, Tq, Hkv, S) = ({B}, {Tq}, {Hkv}, S), got {tuple(block_indices.shape)}"
        )
    if block_indices.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"block_indices must be int64 (or int32), got {block_indices.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device == block_indices.device):
        raise ValueError("q, k, v and block_indices must be on one device")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


# --------------------------------------------------------------------------------------------------------------
# torch reference
# --------------------------------------------------------------------------------------------------------------


def _unique_slots(block_indices: torch.Tensor) -> torch.Tensor:
    """(..., S) -> (..., S) block indices with every repeat of an earlier slot replaced by -1."""
    S = block_indices.shape[-1]
    same = block_indices.unsqueeze(-1) == block_indices.unsqueeze(-2)  # (..., S, S): [s, s'] = idx[s] == idx[s']
    earlier = torch.ones(S, S, dtype=torch.bool, device=block_indices.device).tril(-1)  # s' < s
    repeated = (same & earlier).any(-1)
    return block_indices.masked_fill(repeated, -1)


def selected_attention_reference(q, k, v, block_indices, block_size: int, scale: float) -> torch.Tensor:
    """Torch reference (no argument checks; call `selected_attention`).

    Rounding follows the usual mixed-precision attention recipe, which is also what the kernel does:
    q @ k^T in the input dtype, masked softmax in fp32, probabilities cast back to the input dtype, then @ v.
    """
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = H // Hkv
    S = block_indices.shape[-1]
    idx = _unique_slots(block_indices.long())  # (B, Tq, Hkv, S)

    # Absolute key positions of every selected slot: (B, Tq, Hkv, S * block_size).
    pos = (idx.unsqueeze(-1) * block_size + torch.arange(block_size, device=q.device)).flatten(-2)
    q_pos = (Tk - Tq + torch.arange(Tq, device=q.device)).view(1, Tq, 1, 1)
    visible = (idx.unsqueeze(-1) >= 0).expand(-1, -1, -1, -1, block_size).flatten(-2) & (pos <= q_pos)
    pos = pos.clamp(0, Tk - 1)  # masked slots gather any valid key

    # Gather per (batch, kv head): k as (B, Hkv, Tk, D), positions as (B, Hkv, Tq * N).
    N = S * block_size
    gather_idx = pos.permute(0, 2, 1, 3).reshape(B, Hkv, Tq * N, 1).expand(-1, -1, -1, D)
    k_sel = torch.gather(k.transpose(1, 2), 2, gather_idx).view(B, Hkv, Tq, N, D)
    v_sel = torch.gather(v.transpose(1, 2), 2, gather_idx).view(B, Hkv, Tq, N, D)

    qg = q.reshape(B, Tq, Hkv, G, D).permute(0, 2, 1, 3, 4)  # (B, Hkv, Tq, G, D)
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for a float64 oracle
    scores = torch.matmul(qg, k_sel.transpose(-1, -2)).to(softmax_dtype) * scale  # (B, Hkv, Tq, G, N)
    mask = visible.permute(0, 2, 1, 3).unsqueeze(3)  # (B, Hkv, Tq, 1, N)
    scores = scores.masked_fill(~mask, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty rows
    expd = torch.exp(scores - row_max)
    denom = expd.sum(-1, keepdim=True)
    probs = expd / torch.where(denom > 0, denom, torch.ones_like(denom))  # empty rows -> all-zero probs
    out = torch.matmul(probs.to(v.dtype), v_sel)  # (B, Hkv, Tq, G, D)
    return out.permute(0, 2, 1, 3, 4).reshape(B, Tq, H, D)


# --------------------------------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------------------------------


def selected_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    block_size: int,
    *,
    scale: float | None = None,
    impl: str = "auto",
    tuning: dict | str | None = None,
) -> torch.Tensor:
    """Attention of every query over its selected key blocks.

    q: (B, Tq, H, D); k, v: (B, Tk, Hkv, D) with H % Hkv == 0 (GQA: query heads h*G .. h*G+G-1 use kv head h).
    block_indices: (B, Tq, Hkv, S) int64, the key blocks (block j = keys [j*block_size, (j+1)*block_size)) that
    query t of kv group g attends to; -1 = unused slot; a repeated index counts once.
    Query i sits at absolute position Tk - Tq + i (Tq < Tk: cached decoding / chunked prefill); keys after the
    query's position are masked even inside a selected block. All H/Hkv query heads of a group share the
    group's selection. scale defaults to D ** -0.5.

    impl: "reference" (pure torch, autograd), "triton" (Triton kernels, forward + backward for q, k, v; needs
    block_size % 16 == 0 and D <= 128), or "auto" (triton on CUDA, reference elsewhere).
    Returns (B, Tq, H, D) in q's dtype; a query row whose selection holds no visible key returns zeros.
    Bad shapes / names raise ValueError naming the argument.

    tuning (impl="triton" only; for experiments): launch overrides over the tuning table, e.g.
    ``{"fwd": {"tile": 32}, "bwd": {"num_warps": 4}}`` or ``"fwd.tile=32,bwd.num_warps=4"`` (see `parse_tuning`);
    EFFTX_TRITON_TUNING in the environment takes the same string. EFFTX_TRITON_AUTOTUNE=1 autotunes the launch
    around that choice instead (`autotune_choices()` tells what it picked).
    """
    _check_args(q, k, v, block_indices, block_size, impl)
    parse_tuning(tuning, "tuning")  # a bad override is an error whichever impl runs
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if impl == "auto":
        impl = "triton" if (q.is_cuda and triton_available()) else "reference"
    if impl == "reference":
        return selected_attention_reference(q, k, v, block_indices, block_size, float(scale))
    return _selected_attention_triton(q, k, v, block_indices, block_size, float(scale), tuning)


# --------------------------------------------------------------------------------------------------------------
# Triton kernels
#
# Forward (the NSA paper's design): one program per (query position t, batch b, kv group g). It loads the query
# rows of ALL G = H / Hkv heads of the group as one [G_PAD, D_PAD] tile (G padded to >= 16 rows so tl.dot can use
# tensor cores, D padded to a power of two with masks), then walks the query's S slots; for every slot that
# holds a visible, not yet seen block it loads that block's keys/values once for all G heads, TILE keys at a time
# ([TILE, D_PAD] tiles, TILE a power of two; key tiles after the query skipped; keys past the block's end masked
# where TILE does not divide the block size, so nothing of the next block is read), and does an online-softmax
# update (running max m and sum l in fp32, fp32 accumulator). The output is stored in the input dtype, with the
# row logsumexp (fp32) for the backward. The backward's dK/dV atomics use the same masks, so they land only on
# the visible keys of selected blocks.
#
# Backward: the same grid and the same walk recompute the probabilities from the saved logsumexp
# (P = exp(S - lse)); dQ is accumulated in registers by the program and stored once. dK and dV of a block get
# contributions from every query that selected it, which no single program owns, so they are added with fp32
# atomics into (B, Tk, Hkv, D) fp32 buffers and cast to the input dtype at the end. Atomics make the summation
# order (and so the last bits of dK/dV) nondeterministic, and blocks that many queries pick (the first block,
# the recent ones) see contention; a key-centric second pass would avoid both but needs the inverse of the
# selection (which queries picked block j). Atomics were chosen for simplicity at S of a few blocks.
#
# Rounding matches the reference: Q@K^T from input-dtype tiles with fp32 accumulation, softmax in fp32,
# probabilities (and dS) cast to the input dtype before their matmuls. For fp32 inputs the dots use exact fp32
# ("ieee") unless torch.backends.cuda.matmul.allow_tf32 is on, like torch's own matmuls.
# --------------------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _slot_block(idx_row, stride_is, s, slots, offs_s, q_pos, BLOCK: tl.constexpr):
        """Block index in slot `s` of one query's index row and whether it contributes: set (>= 0), starting
        at or before the query, and not a repeat of an earlier slot (`slots` is the whole row, -1 padded)."""
        blk = tl.load(idx_row + s * stride_is).to(tl.int64)
        repeats = tl.sum(((slots == blk) & (offs_s < s)).to(tl.int32), axis=0)
        valid = (blk >= 0) & (blk * BLOCK <= q_pos) & (repeats == 0)
        return blk, valid

    @triton.jit
    def _selected_fwd_kernel(
        Q, K, V, IDX, O, LSE,
        sqb, sqt, sqh, sqd,
        skb, skt, skh, skd,
        svb, svt, svh, svd,
        sib, sit, sih, sis,
        sob, sot, soh, sod,
        slb, slt, slh,
        Tq, Tk, Hkv, S, scale,
        G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, PRECISION: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        bg = tl.program_id(1).to(tl.int64)
        b = bg // Hkv
        g = bg % Hkv
        q_pos = Tk - Tq + t

        offs_h = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, TILE)
        offs_s = tl.arange(0, S_PAD)
        head = g * G + offs_h
        h_mask = offs_h < G
        d_mask = offs_d < D
        qd_mask = h_mask[:, None] & d_mask[None, :]

        q = tl.load(Q + b * sqb + t * sqt + head[:, None] * sqh + offs_d[None, :] * sqd, mask=qd_mask, other=0.0)
        idx_row = IDX + b * sib + t * sit + g * sih
        slots = tl.load(idx_row + offs_s * sis, mask=offs_s < S, other=-1).to(tl.int64)

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, D_PAD], tl.float32)
        for s in range(0, S):
            blk, valid = _slot_block(idx_row, sis, s, slots, offs_s, q_pos, BLOCK)
            if valid:
                for off in range(0, BLOCK, TILE):
                    start = blk * BLOCK + off
                    if start <= q_pos:  # the first tile of a valid block always passes
                        key = start + offs_n
                        # causal inside the block (and so also key < Tk), and not past the block's end: a
                        # block that is no multiple of TILE ends inside its last tile
                        k_mask = (key <= q_pos) & (off + offs_n < BLOCK)
                        kv_mask = k_mask[:, None] & d_mask[None, :]
                        k = tl.load(K + b * skb + key[:, None] * skt + g * skh + offs_d[None, :] * skd,
                                    mask=kv_mask, other=0.0)
                        v = tl.load(V + b * svb + key[:, None] * svt + g * svh + offs_d[None, :] * svd,
                                    mask=kv_mask, other=0.0)
                        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                        scores = tl.where(k_mask[None, :], scores, float("-inf"))
                        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: >= 1 visible key so far
                        alpha = tl.exp(m_i - m_new)
                        p = tl.exp(scores - m_new[:, None])
                        l_i = l_i * alpha + tl.sum(p, axis=1)
                        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                        m_i = m_new

        has_keys = l_i > 0
        out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # rows without any visible key stay 0
        # +inf for empty rows: P = exp(S - lse) = 0 in the backward.
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("inf"))
        tl.store(O + b * sob + t * sot + head[:, None] * soh + offs_d[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=qd_mask)
        tl.store(LSE + b * slb + t * slt + head * slh, lse, mask=h_mask)

    @triton.jit
    def _selected_bwd_kernel(
        Q, K, V, IDX, DO, LSE, DELTA, DQ, DK, DV,
        sqb, sqt, sqh, sqd,
        skb, skt, skh, skd,
        svb, svt, svh, svd,
        sib, sit, sih, sis,
        sdob, sdot, sdoh, sdod,
        slb, slt, slh,
        sdqb, sdqt, sdqh, sdqd,
        sgb, sgt, sgh, sgd,
        Tq, Tk, Hkv, S, scale,
        G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
        G_PAD: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Same grid and walk as the forward. LSE and DELTA (= rowsum(dO * O)) share one (B, Tq, H) layout;
        DK and DV are fp32 buffers sharing one (B, Tk, Hkv, D) layout (strides sg*)."""
        t = tl.program_id(0).to(tl.int64)
        bg = tl.program_id(1).to(tl.int64)
        b = bg // Hkv
        g = bg % Hkv
        q_pos = Tk - Tq + t

        offs_h = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, TILE)
        offs_s = tl.arange(0, S_PAD)
        head = g * G + offs_h
        h_mask = offs_h < G
        d_mask = offs_d < D
        qd_mask = h_mask[:, None] & d_mask[None, :]

        q = tl.load(Q + b * sqb + t * sqt + head[:, None] * sqh + offs_d[None, :] * sqd, mask=qd_mask, other=0.0)
        do = tl.load(DO + b * sdob + t * sdot + head[:, None] * sdoh + offs_d[None, :] * sdod, mask=qd_mask, other=0.0)
        lse = tl.load(LSE + b * slb + t * slt + head * slh, mask=h_mask, other=float("inf"))
        delta = tl.load(DELTA + b * slb + t * slt + head * slh, mask=h_mask, other=0.0)
        idx_row = IDX + b * sib + t * sit + g * sih
        slots = tl.load(idx_row + offs_s * sis, mask=offs_s < S, other=-1).to(tl.int64)

        dq = tl.zeros([G_PAD, D_PAD], tl.float32)
        for s in range(0, S):
            blk, valid = _slot_block(idx_row, sis, s, slots, offs_s, q_pos, BLOCK)
            if valid:
                for off in range(0, BLOCK, TILE):
                    start = blk * BLOCK + off
                    if start <= q_pos:
                        key = start + offs_n
                        k_mask = (key <= q_pos) & (off + offs_n < BLOCK)  # causal, inside the block
                        kv_mask = k_mask[:, None] & d_mask[None, :]
                        k = tl.load(K + b * skb + key[:, None] * skt + g * skh + offs_d[None, :] * skd,
                                    mask=kv_mask, other=0.0)
                        v = tl.load(V + b * svb + key[:, None] * svt + g * svh + offs_d[None, :] * svd,
                                    mask=kv_mask, other=0.0)
                        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                        p = tl.where(k_mask[None, :], tl.exp(scores - lse[:, None]), 0.0)  # [G_PAD, TILE] fp32
                        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                        ds = p * (dp - delta[:, None])  # d(scores) / scale
                        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
                        dk_tile = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION) * scale
                        dv_tile = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
                        grad_off = b * sgb + key[:, None] * sgt + g * sgh + offs_d[None, :] * sgd
                        # relaxed: nothing in this kernel reads dK/dV back
                        tl.atomic_add(DK + grad_off, dk_tile, mask=kv_mask, sem="relaxed")
                        tl.atomic_add(DV + grad_off, dv_tile, mask=kv_mask, sem="relaxed")

        tl.store(DQ + b * sdqb + t * sdqt + head[:, None] * sdqh + offs_d[None, :] * sdqd,
                 (dq * scale).to(DQ.dtype.element_ty), mask=qd_mask)

    #: True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 before this import).
    INTERPRETED = not isinstance(_selected_fwd_kernel, triton.JITFunction)
else:  # pragma: no cover
    INTERPRETED = False


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def _check_triton_inputs(q, block_size) -> None:
    """What the Triton path needs beyond `_check_args` (ValueError naming the argument)."""
    if triton is None:
        raise ValueError("impl='triton' needs the triton package (pip install 'efftx[triton]'); use impl='reference'")
    if not (q.is_cuda or INTERPRETED):
        raise ValueError(
            f"impl='triton' needs CUDA tensors (q is on {q.device}) or TRITON_INTERPRET=1 set before efftx is "
            "imported; use impl='reference' or 'auto' on CPU"
        )
    if block_size % 16:
        raise ValueError(f"block_size must be a multiple of 16 for impl='triton', got {block_size}")
    if q.shape[-1] > MAX_TRITON_HEAD_DIM:
        raise ValueError(
            f"head dim (q.shape[-1]) must be <= {MAX_TRITON_HEAD_DIM} for impl='triton', got {q.shape[-1]}"
        )
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype must be float16, bfloat16 or float32 for impl='triton', got {q.dtype}")


# --------------------------------------------------------------------------------------------------------------
# launch tuning: one table of tile sizes, warps and pipeline stages; overrides; opt-in autotune
# --------------------------------------------------------------------------------------------------------------

#: Environment variable with launch overrides for experiments, e.g. ``fwd.tile=32,bwd.num_warps=4`` (see
#: `parse_tuning`). Read at every launch; the ``tuning=`` argument of `selected_attention` goes on top of it.
TUNING_ENV = "EFFTX_TRITON_TUNING"
#: ``1`` launches the autotuned kernels (`_autotune_candidates`), ``0`` or unset the table's choice.
AUTOTUNE_ENV = "EFFTX_TRITON_AUTOTUNE"
#: When set (a file path), every autotune decision is appended to it as one JSON line (bench/gpu_check.py reads it).
AUTOTUNE_LOG_ENV = "EFFTX_TRITON_AUTOTUNE_LOG"

KERNEL_PASSES = ("fwd", "bwd")
TUNING_DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIM_BUCKETS = (16, 32, 64, 128)  # D padded to a power of two >= 16 (D_PAD); D <= MAX_TRITON_HEAD_DIM
VALID_NUM_WARPS = (1, 2, 4, 8, 16)
TUNING_FIELDS = ("tile", "num_warps", "num_stages")
_FLOOR_WARPS = 4  # a tile smaller than the table's runs on fewer warps, down to this


def _check_launch_field(name: str, value, where: str) -> None:
    """ValueError naming `where`, the field and the bad value."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}{name} must be an int, got {value!r}")
    if name == "tile" and (value < 16 or value & (value - 1)):
        raise ValueError(f"{where}tile (keys per TILE) must be a power of two >= 16, got {value}")
    if name == "num_warps" and value not in VALID_NUM_WARPS:
        raise ValueError(f"{where}num_warps must be one of {VALID_NUM_WARPS}, got {value}")
    if name == "num_stages" and value < 1:
        raise ValueError(f"{where}num_stages must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How one kernel is launched: ``tile`` keys per K/V tile (the TILE constexpr), ``num_warps`` and
    ``num_stages`` (Triton's software-pipelining depth). Invalid values raise ValueError naming the field."""

    tile: int
    num_warps: int
    num_stages: int

    def __post_init__(self):
        for name in TUNING_FIELDS:
            _check_launch_field(name, getattr(self, name), "")

    def for_block(self, block_size: int) -> "LaunchConfig":
        """The table entry applied to a selection block: the tile shrinks to the block (rounded up to a power of
        two; a bigger tile would only load masked keys) and the warps with it, in proportion to the tile's size,
        down to 4 (or the entry's own count if smaller)."""
        tile = min(self.tile, _pow2_at_least(block_size, 16))
        warps = max(min(self.num_warps, _FLOOR_WARPS), self.num_warps * tile // self.tile)
        return LaunchConfig(tile, warps, self.num_stages)

    def describe(self) -> str:
        return f"TILE {self.tile} x {self.num_warps} warps x {self.num_stages} stages"


#: THE tuning table: (pass, dtype, head-dim bucket D_PAD) -> launch at full tile (selection blocks >= the tile;
#: `LaunchConfig.for_block` shrinks it for smaller blocks). What it encodes:
#:
#: * Register budget. A program holds the query rows of a GQA group ([16+, D_PAD] tiles), an fp32 accumulator of
#:   the same size, and one [TILE, D_PAD] K and V tile at a time; the backward also holds dO, dQ (fp32) and the
#:   [G_PAD, TILE] P/dS tiles. Tile sizes and warps keep that in registers. Compiled for sm_90 and sm_80 and
#:   checked with ``ptxas -v`` (no GPU needed): forward TILE 64 keys on 4 warps, 8 warps once a K/V tile reaches
#:   32 KiB (fp32 at D 128); backward TILE 64 up to D 64 and 32 at D 128, 8 warps from 4096-element tiles
#:   (TILE x D_PAD). fp16/bf16 then spill nothing or a few bytes; a 64 x 128 backward tile on 4 warps spilled
#:   ~1.2 KB. For a smaller tile the warps halve with its size (never below 4): exactly the choices the kernels
#:   made before this table existed, for every block size and head dim (tests/test_kernels.py pins that).
#: * Pipeline stages: 3, the NVIDIA backend's own default, so launches compile as they did before num_stages was
#:   passed. Triton 3.9 does not software-pipeline these kernels' loops (their loads sit under data-dependent
#:   ``if``s: a slot's block is loaded only when it is valid and not in the future), and the sm_90 PTX of both
#:   kernels is identical for num_stages 1..4 (checked at D 128, bf16); the knob is carried so that a restructured
#:   kernel can use it. Autotune therefore varies tiles and warps only.
TUNING_TABLE: dict[tuple[str, str, int], LaunchConfig] = {
    ("fwd", "float16", 16): LaunchConfig(64, 4, 3),
    ("fwd", "float16", 32): LaunchConfig(64, 4, 3),
    ("fwd", "float16", 64): LaunchConfig(64, 4, 3),
    ("fwd", "float16", 128): LaunchConfig(64, 4, 3),
    ("fwd", "bfloat16", 16): LaunchConfig(64, 4, 3),
    ("fwd", "bfloat16", 32): LaunchConfig(64, 4, 3),
    ("fwd", "bfloat16", 64): LaunchConfig(64, 4, 3),
    ("fwd", "bfloat16", 128): LaunchConfig(64, 4, 3),
    ("fwd", "float32", 16): LaunchConfig(64, 4, 3),
    ("fwd", "float32", 32): LaunchConfig(64, 4, 3),
    ("fwd", "float32", 64): LaunchConfig(64, 4, 3),
    ("fwd", "float32", 128): LaunchConfig(64, 8, 3),  # 64 x 128 fp32 K/V tiles: 32 KiB each
    ("bwd", "float16", 16): LaunchConfig(64, 4, 3),
    ("bwd", "float16", 32): LaunchConfig(64, 4, 3),
    ("bwd", "float16", 64): LaunchConfig(64, 8, 3),
    ("bwd", "float16", 128): LaunchConfig(32, 8, 3),  # 64-key tiles spill at D 128
    ("bwd", "bfloat16", 16): LaunchConfig(64, 4, 3),
    ("bwd", "bfloat16", 32): LaunchConfig(64, 4, 3),
    ("bwd", "bfloat16", 64): LaunchConfig(64, 8, 3),
    ("bwd", "bfloat16", 128): LaunchConfig(32, 8, 3),
    ("bwd", "float32", 16): LaunchConfig(64, 4, 3),
    ("bwd", "float32", 32): LaunchConfig(64, 4, 3),
    ("bwd", "float32", 64): LaunchConfig(64, 8, 3),
    ("bwd", "float32", 128): LaunchConfig(32, 8, 3),
}


def parse_tuning(spec, source: str = "tuning") -> dict[str, dict[str, int]]:
    """Launch overrides from a mapping ``{"fwd": {"tile": 32}, "bwd": {"num_warps": 4}}`` or a string
    ``"fwd.tile=32,bwd.num_warps=4"`` (the EFFTX_TRITON_TUNING syntax); fields: tile, num_warps, num_stages.
    Returns ``{pass: {field: value}}``; anything malformed raises ValueError naming `source` and the bad item."""
    if spec is None:
        return {}
    items: list[tuple[str, str, object]] = []
    if isinstance(spec, str):
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            name, sep, value = item.partition("=")
            pass_, dot, field = name.strip().partition(".")
            if not (sep and dot):
                raise ValueError(f"{source}: {item!r} is not of the form PASS.FIELD=INT (e.g. 'fwd.tile=32')")
            try:
                number = int(value.strip())
            except ValueError:
                raise ValueError(f"{source}: {item!r}: {value.strip()!r} is not an integer") from None
            items.append((pass_.strip(), field.strip(), number))
    elif isinstance(spec, dict):
        for pass_, fields in spec.items():
            if not isinstance(fields, dict):
                raise ValueError(f"{source}: {pass_!r} must map to a dict of fields, got {fields!r}")
            items.extend((pass_, field, value) for field, value in fields.items())
    else:
        raise ValueError(f"{source} must be a dict or a 'fwd.tile=32,...' string, got {type(spec).__name__}")
    out: dict[str, dict[str, int]] = {}
    for pass_, field, value in items:
        if pass_ not in KERNEL_PASSES:
            raise ValueError(f"{source}: unknown kernel pass {pass_!r} (expected one of {KERNEL_PASSES})")
        if field not in TUNING_FIELDS:
            raise ValueError(f"{source}: unknown field {pass_}.{field} (expected one of {TUNING_FIELDS})")
        _check_launch_field(field, value, f"{source}: {pass_}.")
        out.setdefault(pass_, {})[field] = value
    return out


def launch_config(pass_: str, dtype: torch.dtype, head_dim: int, block_size: int, tuning=None) -> LaunchConfig:
    """The launch of kernel `pass_` ("fwd" / "bwd") for this dtype, head dim and selection block size: the table's
    entry for the block, then EFFTX_TRITON_TUNING, then `tuning` (overridden fields are taken as given)."""
    entry = TUNING_TABLE[(pass_, str(dtype).removeprefix("torch."), _pow2_at_least(head_dim, 16))]
    chosen = dataclasses.asdict(entry.for_block(block_size))
    for source, spec in ((TUNING_ENV, os.environ.get(TUNING_ENV)), ("tuning", tuning)):
        chosen.update(parse_tuning(spec, source).get(pass_, {}))
    return LaunchConfig(**chosen)


def autotune_enabled() -> bool:
    """EFFTX_TRITON_AUTOTUNE: '1' on, '0' or unset off; anything else raises ValueError naming the value."""
    value = os.environ.get(AUTOTUNE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{AUTOTUNE_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def _autotune_candidates(chosen: LaunchConfig, block_size: int) -> list[LaunchConfig]:
    """A small set around `chosen` (first, so a tie keeps it): the tile halved and doubled (16 .. the block's
    power-of-two size, at most 128), and the warps halved and doubled (2 .. 16), one change at a time. num_stages
    stays: the kernels' loops are not pipelined (see TUNING_TABLE). At most 5 configs."""
    block_pow2 = _pow2_at_least(block_size, 16)
    candidates = [chosen]
    for tile in (chosen.tile // 2, chosen.tile * 2):
        if 16 <= tile <= min(block_pow2, 128):
            candidates.append(dataclasses.replace(chosen, tile=tile))
    for warps in (chosen.num_warps // 2, chosen.num_warps * 2):
        if 2 <= warps <= 16:
            candidates.append(dataclasses.replace(chosen, num_warps=warps))
    return list(dict.fromkeys(candidates))


_AUTOTUNERS: dict[tuple, object] = {}  # bucket -> triton Autotuner over that bucket's candidates
_AUTOTUNE_CHOICES: dict[tuple, dict] = {}  # bucket -> what autotune chose there (autotune_choices())


def autotune_choices() -> list[dict]:
    """What autotune chose so far in this process, one dict per tuned bucket (kernel pass, dtype, D, block,
    GQA group, slots, launch programs), with the table's choice beside it and every candidate's time (ms; the
    interpreter's are wall-clock seconds of one run, meaningless)."""
    return [dict(choice) for choice in _AUTOTUNE_CHOICES.values()]


def _interpreter_bench(kernel_call, quantiles):
    """do_bench for the CPU interpreter (Triton's needs a GPU driver): one timed run."""
    start = time.perf_counter()
    kernel_call()
    return [time.perf_counter() - start] * len(quantiles)


def _autotune_do_bench():
    """The autotuner's timer: Triton's own on a GPU (None), one wall-clock run under the interpreter."""
    return _interpreter_bench if INTERPRETED else None


def _launch(kernel, pass_: str, grid, args, meta: dict, reset_to_zero=()) -> None:
    """:func:`_launch_here` on the device of the kernel's tensors (Triton launches on torch's current device: a
    model on cuda:N while cuda:0 is current would read other memory)."""
    first = args[0]
    with torch.cuda.device(first.device) if first.is_cuda else contextlib.nullcontext():
        _launch_here(kernel, pass_, grid, args, meta, reset_to_zero)


def _launch_here(kernel, pass_: str, grid, args, meta: dict, reset_to_zero=()) -> None:
    """Launch `kernel` with `meta` (constexprs + TILE, num_warps, num_stages). With EFFTX_TRITON_AUTOTUNE=1, an
    autotuned launch instead, over `_autotune_candidates` of meta's choice. Tuning happens once per bucket of
    what matters for speed: the constexprs (head dim, GQA group, block size, slots, precision), the dtype and the
    number of programs rounded up to a power of two (not the exact length: decoding grows Tk by one token a step
    and must not re-tune every step). Kernels that accumulate (`reset_to_zero`, the backward's atomics) get those
    buffers zeroed before every trial run and before the real one."""
    chosen = LaunchConfig(meta["TILE"], meta["num_warps"], meta["num_stages"])
    if not autotune_enabled():
        kernel[grid](*args, **meta)
        return
    consts = {name: value for name, value in meta.items() if name not in ("TILE", "num_warps", "num_stages")}
    programs = _pow2_at_least(grid[0] * grid[1], 1)
    bucket = (pass_, str(args[0].dtype), tuple(sorted(consts.items())), chosen, programs)
    tuner = _AUTOTUNERS.get(bucket)
    if tuner is None:
        configs = [triton.Config({"TILE": c.tile}, num_warps=c.num_warps, num_stages=c.num_stages)
                   for c in _autotune_candidates(chosen, consts["BLOCK"])]
        tuner = triton.autotune(configs, key=[], reset_to_zero=list(reset_to_zero),
                                do_bench=_autotune_do_bench())(kernel)
        _AUTOTUNERS[bucket] = tuner
    tuner[grid](*args, **consts)
    if bucket not in _AUTOTUNE_CHOICES:
        best = tuner.best_config
        timings = getattr(tuner, "configs_timings", None) or {}
        choice = dict(
            kernel=pass_, dtype=str(args[0].dtype).removeprefix("torch."), D=consts["D"], D_PAD=consts["D_PAD"],
            BLOCK=consts["BLOCK"], G=consts["G"], S_PAD=consts["S_PAD"], programs=programs,
            TILE=best.kwargs["TILE"], num_warps=best.num_warps, num_stages=best.num_stages,
            table=dataclasses.asdict(chosen),
            timings={f"TILE {c.kwargs['TILE']} x {c.num_warps} warps x {c.num_stages} stages": t[0]
                     for c, t in timings.items()},
        )
        _AUTOTUNE_CHOICES[bucket] = choice
        log = os.environ.get(AUTOTUNE_LOG_ENV)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps(choice) + "\n")


def _kernel_meta(q, k, block_indices, block_size, tuning=None) -> tuple[dict, dict]:
    """Forward and backward launch options (constexprs + TILE, num_warps, num_stages) from the tuning table (and
    the overrides, see `launch_config`); pure apart from reading EFFTX_TRITON_TUNING, so tests compile without
    a GPU."""
    H, D = q.shape[2], q.shape[3]
    Hkv = k.shape[2]
    # "ieee" = exact fp32 dots for fp32 inputs (torch's default); fp16/bf16 dots ignore it, keep the default.
    tf32 = q.dtype != torch.float32 or (q.is_cuda and torch.backends.cuda.matmul.allow_tf32)
    common = dict(
        G=H // Hkv, D=D, BLOCK=block_size,
        G_PAD=_pow2_at_least(H // Hkv, 16), D_PAD=_pow2_at_least(D, 16),
        S_PAD=_pow2_at_least(block_indices.shape[-1], 1),
        PRECISION="tf32" if tf32 else "ieee",
    )
    # Power-of-two tiles (tl.arange): a block that is no multiple of the tile (48, 80, 96, ...) has its last tile
    # cut at the block's end by the kernels' mask (masked keys are not loaded).
    metas = []
    for pass_ in KERNEL_PASSES:
        cfg = launch_config(pass_, q.dtype, D, block_size, tuning)
        metas.append(dict(common, TILE=cfg.tile, num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return metas[0], metas[1]


class _SelectedAttentionFn(torch.autograd.Function):
    """Triton forward/backward; saves q, k, v, the indices, the output and its logsumexp."""

    @staticmethod
    def forward(ctx, q, k, v, block_indices, scale: float, fwd_meta: dict, bwd_meta: dict):
        B, Tq, H, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        S = block_indices.shape[-1]
        out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        lse = torch.empty(B, Tq, H, device=q.device, dtype=torch.float32)
        if out.numel() > 0 and S > 0:
            args = (q, k, v, block_indices, out, lse,
                    *q.stride(), *k.stride(), *v.stride(), *block_indices.stride(), *out.stride(), *lse.stride(),
                    Tq, Tk, Hkv, S, scale)
            _launch(_selected_fwd_kernel, "fwd", (Tq, B * Hkv), args, fwd_meta)
        else:
            out.zero_()
            lse.fill_(float("inf"))
        ctx.save_for_backward(q, k, v, block_indices, out, lse)
        ctx.scale, ctx.bwd_meta = scale, bwd_meta
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, block_indices, out, lse = ctx.saved_tensors
        B, Tq, H, D = q.shape
        Tk, Hkv = k.shape[1], k.shape[2]
        S = block_indices.shape[-1]
        delta = (grad_out.float() * out.float()).sum(-1).contiguous()  # (B, Tq, H), same layout as lse
        dq = torch.zeros_like(q)
        dk = torch.zeros(B, Tk, Hkv, D, device=k.device, dtype=torch.float32)
        dv = torch.zeros_like(dk)
        if dq.numel() > 0 and S > 0:
            args = (q, k, v, block_indices, grad_out, lse, delta, dq, dk, dv,
                    *q.stride(), *k.stride(), *v.stride(), *block_indices.stride(), *grad_out.stride(),
                    *lse.stride(), *dq.stride(), *dk.stride(),
                    Tq, Tk, Hkv, S, ctx.scale)
            # dK/dV are atomically accumulated: autotune's trial runs must start each from zero
            _launch(_selected_bwd_kernel, "bwd", (Tq, B * Hkv), args, ctx.bwd_meta, reset_to_zero=("DK", "DV"))
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def _selected_attention_triton(q, k, v, block_indices, block_size, scale, tuning=None):
    _check_triton_inputs(q, block_size)  # before the autograd.Function: errors name the argument
    fwd_meta, bwd_meta = _kernel_meta(q, k, block_indices, block_size, tuning)
    return _SelectedAttentionFn.apply(q, k, v, block_indices, scale, fwd_meta, bwd_meta)

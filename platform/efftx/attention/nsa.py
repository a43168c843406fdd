"""Native Sparse Attention (NSA; Yuan et al., 2025): three branches mixed by learned per-head gates.

Every query (absolute position ``p``) reads the keys through three branches, then
``out = g_cmp * compressed + g_sel * selected + g_win * window`` with per-head sigmoid gates computed from
the normed hidden state ``x`` (a ``Linear(dim, 3 * heads)``; the backend must be called with ``x=``).

* **Compressed.** Compressed block ``j`` covers keys ``[j * d, j * d + l)`` (``l`` = ``compress_block_size``,
  ``d`` = ``compress_stride``, 0 meaning ``d = l``). A learned network turns each block of keys (and,
  separately, of values) into one key (value): a learned intra-block position embedding (kv head,
  position in block, D) is added, the block is flattened to ``l * D`` and a per-kv-head two-layer MLP
  (ReLU, hidden ``compress_mlp_mult * l * D``, as the seed's ``GroupedMLP``) maps it to ``D``
  (``compress=mlp``; ``conv_linear``: one linear map of the flattened block, a grouped strided conv;
  ``attention_pool``: per feature, a softmax over the block's positions of learned logits pools it). A query
  attends (one softmax, SDPA) to the compressed blocks that end at or before its own position, and to the
  ``compress_mem_kv`` learned memory key/value slots (per kv head, zeros at first, as the seed library's) that
  lead them, which every query reads. Without memory slots (the default) a query with no complete block yet
  (``p < l - 1``) gets zeros from this branch.
* **Selected.** Block importance (``importance=probs_sum``) comes from the compressed branch's attention
  probabilities (the blocks' columns: memory slots are never selected), summed
  over the query heads of each GQA group (``share_selection=true``: all heads of a group share one
  selection, as the NSA kernel prefers; ``false``: each query head ranks by its own probabilities, and
  every path runs with k, v and the compressed keys/values repeated per query head). They are mapped onto
  selection blocks (``l'`` = ``selection_block_size`` tokens) by ``score_mapping``: ``overlap``, compressed
  block ``j`` gives selection block ``s`` the fraction of its ``l`` tokens lying in ``s``; ``eq9``, the
  paper's Eq. 9 taken literally (:func:`eq9_to_selection`). (With ``d | l`` and ``d | l'``, which the
  config requires as the paper does, both grids start on multiples of ``d``; when ``l = d = l'`` both
  mappings are the identity.) Each query takes its own block ``p // l'`` (keys after ``p`` are masked
  inside it: block-causal) plus ``num_selected_blocks`` blocks strictly before its own, never a future
  block: first the forced ones (the first ``num_initial_blocks`` blocks and the ``num_local_blocks - 1``
  blocks just before its own; the paper keeps 1 initial and 2 local blocks, the own one counted), then
  the highest-scoring others; slots it cannot fill (fewer past blocks, or only blocks of an importance below
  ``min_importance``, which are never selected unless forced) are ``-1``. ``importance=logits_softmax`` (the seed
  library's ranking): the compressed logits of the complete blocks averaged over the heads (0 for the others),
  mapped the same way, then a softmax over the query's past selection blocks
  (:func:`efftx.attention.nsa_cpu.logit_importance`). Exact ties, e.g.
  recent blocks no complete compressed block covers yet, go to the most recent block. The attention over
  the chosen blocks is :func:`efftx.kernels.selected_attention` (Triton on CUDA, a torch reference
  elsewhere; ``impl``).
  The probabilities are recomputed (q @ k in the input dtype, softmax in float32) in query chunks
  without autograd: the choice is discrete, and the compressed output itself goes through SDPA, which
  keeps no (T x T/d) probability matrix for the backward. As in the paper, gradients reach the
  compression network through the compressed branch only, unless ``diff_topk``: then each selected past
  block's part of the selected output is multiplied by ``1 + s - s.detach()`` (``s`` its importance), a
  straight-through factor equal to 1 whose gradient reaches the queries and compressed keys through the
  importances (the chunked CPU path adds it in its backward, the branch-by-branch path by
  :meth:`NativeSparseAttention.straight_through`). ``diff_topk_gate=keys`` (the seed library's) puts that factor on
  the selected block's keys instead (its scores become ``(1 + s - s.detach()) q.k``): the same forward, and the
  importance's gradient is the sum over the block's keys of ``dS * S`` rather than ``dO . O_j``.
* **Separate projections.** With ``separate_kv`` the compressed and window branches read keys/values of their
  own, two more ``Linear(dim, 2 * Hkv * D)`` of ``x`` held by this backend (their keys rotated as the layer's k when
  the model has rotary positions: :meth:`NativeSparseAttention.use_rotary`); the layer's k, v serve the selected
  branch. Default: all three share the layer's k, v (as the seed does).
* **Sliding window.** Causal attention to the last ``sliding_window_size`` keys (the query's own
  included), computed chunk by chunk (queries in chunks of ``c <= w``, each against its ``c + w``
  neighbouring keys), so memory is O(T * w), never T x T.

Where it runs: on CPU tensors (``impl`` auto or reference) all three branches, the selection and the gating
run in one chunked ``torch.autograd.Function``, :func:`efftx.attention.nsa_cpu.nsa_attention`: queries in
chunks, the compressed scores computed once for both the compressed output and the selection, the selected
branch (and, for equal compressed and selection blocks, the compressed softmax fused with the selection) in
compiled C++ kernels reading each query's blocks in place (``cpu_kernel``: auto | on | off; off, or where they
cannot be built: torch ops gathering each chunk's blocks once per GQA group), nothing of size
(T, selected keys, D) kept, the backward recomputing scores from the inputs and the saved block indices.
Elsewhere (CUDA, or
``impl=triton``) the branches are composed one by one as described above (SDPA, the selection in
:meth:`NativeSparseAttention.select`, :func:`efftx.kernels.selected_attention`), and so on CPU with
``backend.chunked = False``. Both compute the same function (tests/test_nsa.py holds both to a float64
reference, forward and gradients).

Rotary positions are applied to q and k by the outer attention module, so the compressed branch
compresses rotated keys and scores them with rotated queries. Attention dropout does not apply.

Cached decoding (:class:`NSACache`, ragged: rows may hold different numbers of tokens, and every cache tensor is one
entry per row, so rows can be split and joined for continuous batching): preallocated kv-head-major keys/values
(a table of whole selection blocks), the compressed keys/values of every complete block (each block compressed
once, when its last token arrives, row by row) after the memory slots, with ``separate_kv`` also the compressed and
window branches' own keys/values, and the row positions on the device. A call writes its tokens at each row's
position, compresses the blocks they complete, then :meth:`NativeSparseAttention.decode` attends in place: the
compressed scores over the blocks each query sees (O(blocks)), the importances, ranking and forced blocks as the
uncached forward defines them per query, the selected blocks gathered from the block table and the last
``window`` keys (O(selected + window keys)), no copy of the cache. On a CPU, with the identity score mapping
(compressed blocks = selection blocks, the seed's geometry) and one selection per kv head, the C++ kernel
(``cpu_kernel``) does all of that in one call per layer (:meth:`NativeSparseAttention._fused_decoder`; a decoding
step is latency bound, and the torch version is a few dozen small operations per layer); ``decode`` is its
reference. A cached call of rows of equal length with more
than ``DECODE_QUERIES`` tokens (a prefill) runs the uncached forward's path over the cache's keys instead. Either way
decoding equals the full forward (up to rounding, which could only change a selection where two blocks' importances
tie to within it). ``rewind(n)`` (one count, or one per row) shortens rows; compressed blocks that lose a token are
recompressed when they complete again. Cached calls are for inference (no diff_topk gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from efftx.attention.base import AttentionBackend, AttentionSpec
from efftx.attention.cache import RowLengths, cache_limit, cache_offset
from efftx.attention.nsa_cpu import CPU_KERNEL_MODES, _to_selection, logit_importance, nsa_attention
from efftx.attention.registry import register
from efftx.errors import ConfigError
from efftx.host import host_values
from efftx.kernels.linear_cpu import Linear

# Elements of the (B, H, query chunk, blocks) float32 scores held at once while selecting: 32 MiB on a CPU,
# 512 MiB on an accelerator (fewer, larger chunks: at T = 65536 a chunk is 4096 queries, not 256).
_SCORE_CHUNK_CPU = 1 << 23
_SCORE_CHUNK_ACCELERATOR = 1 << 27
_TIE_BREAK = 1e-12  # per block index, added in float64: exact importance ties go to the most recent block
# Queries per chunk of the cached decoding path (NativeSparseAttention.decode); a cached call of rows of equal length
# with more new tokens than this (a prefill) takes the uncached forward's path over the cache's keys instead.
DECODE_QUERIES = 64


@dataclass
class NSAOptions:
    """attention.kind=nsa: Native Sparse Attention (Yuan et al., 2025), see the module docstring."""

    compress_block_size: int = 16  # tokens per compressed block
    compress_stride: int = 0  # tokens between compressed block starts; 0 = compress_block_size (no overlap)
    compress_mlp_mult: float = 1.0  # hidden width of the compression MLP / (compress_block_size x head_dim)
    selection_block_size: int = 16  # tokens per selectable key block
    num_selected_blocks: int = 4  # top-scored past blocks each query attends to, besides its own block
    sliding_window_size: int = 64  # tokens (the query's own and the previous ones) of the window branch
    impl: str = "auto"  # selected-block attention: auto (Triton on CUDA when possible) | triton | reference
    # Forced blocks (the paper keeps 1 initial and 2 local blocks), counted within the selection: every query
    # attends its own block plus num_selected_blocks past blocks; the forced past blocks take some of those
    # slots and the top-scored blocks fill the rest.
    num_initial_blocks: int = 0  # blocks 0 .. n-1, always selected (paper: 1)
    num_local_blocks: int = 1  # the query's own block and the n-1 blocks just before it, always selected (paper: 2)
    score_mapping: str = "overlap"  # compressed -> selection block scores: overlap (token fractions) | eq9 (paper)
    share_selection: bool = True  # True: the query heads of a GQA group share one selection (summed scores)
    diff_topk: bool = False  # True: gradients reach the importances of the selected blocks (straight-through)
    compress: str = "mlp"  # compression network: mlp (the seed's GroupedMLP) | conv_linear | attention_pool
    # True: the compressed and window branches get key/value projections of their own (the paper's design; the
    # layer's k, v then serve the selected branch only); False: all three share the layer's k, v (the seed's)
    separate_kv: bool = False
    compress_mem_kv: int = 0  # learned memory key/value slots leading the compressed keys (the seed library's: 1)
    # block importance: probs_sum (compressed probabilities summed over the selection's heads) | logits_softmax
    # (the seed library's: a softmax over each query's past blocks of the compressed logits averaged over the heads)
    importance: str = "probs_sum"
    # past blocks of an importance below this are not selected (forced blocks excepted; the seed library's: 1e-10)
    min_importance: float = 0.0
    # diff_topk's straight-through factor 1 + s - s.detach() scales: output (each selected past block's part of the
    # selected output) | keys (the block's keys, as the seed library's use_diff_topk): other gradients, same forward
    diff_topk_gate: str = "output"
    # the chunked CPU path's C++ kernels (efftx/kernels/nsa_selected_cpu.cpp: the selected branch, the compressed
    # softmax fused with the selection): auto (where they build; else torch ops, saying why once) | on (an error
    # where they cannot be built) | off
    cpu_kernel: str = "auto"

    @property
    def stride(self) -> int:
        return self.compress_stride or self.compress_block_size

    def validate(self, spec: AttentionSpec) -> None:
        """Checks of this section for a layer of ``spec``; errors name the keys."""
        k = "attention.nsa."
        positive = {"compress_block_size": self.compress_block_size, "selection_block_size": self.selection_block_size,
                    "sliding_window_size": self.sliding_window_size, "compress_mlp_mult": self.compress_mlp_mult}
        for key, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{k}{key} must be > 0, got {value}")
        for key, value in {"compress_stride": self.compress_stride, "num_selected_blocks": self.num_selected_blocks}.items():
            if value < 0:
                raise ConfigError(f"{k}{key} must be >= 0, got {value}")
        if self.stride > self.compress_block_size:
            raise ConfigError(f"{k}compress_stride={self.compress_stride} exceeds {k}compress_block_size="
                              f"{self.compress_block_size}: tokens between blocks would never be compressed")
        # The NSA paper's alignment (stride d divides the compressed block l and the selection block l'):
        # compressed and selection blocks then start on one grid of d tokens.
        for key in ("compress_block_size", "selection_block_size"):
            if getattr(self, key) % self.stride:
                raise ConfigError(f"{k}{key}={getattr(self, key)} must be a multiple of the compression stride "
                                  f"({k}compress_stride, or {k}compress_block_size when the stride is 0) = {self.stride}")
        if self.num_initial_blocks < 0:
            raise ConfigError(f"{k}num_initial_blocks must be >= 0, got {self.num_initial_blocks}")
        if self.num_local_blocks < 1:
            raise ConfigError(f"{k}num_local_blocks must be >= 1 (the query's own block is always attended), "
                              f"got {self.num_local_blocks}")
        forced = self.num_initial_blocks + self.num_local_blocks - 1  # past blocks forced into the selection
        if forced > self.num_selected_blocks:
            raise ConfigError(f"{k}num_initial_blocks={self.num_initial_blocks} + {k}num_local_blocks="
                              f"{self.num_local_blocks} - 1 (the own block) forces {forced} past blocks, more than "
                              f"the {k}num_selected_blocks={self.num_selected_blocks} slots they are counted in")
        if self.compress not in COMPRESSORS:
            raise ConfigError(f"{k}compress must be one of {', '.join(COMPRESSORS)}; got {self.compress!r}")
        if isinstance(self.min_importance, bool) or not isinstance(self.min_importance, (int, float)) \
                or not 0 <= self.min_importance < 1:
            raise ConfigError(f"{k}min_importance must be a number in [0, 1), got {self.min_importance!r}")
        if self.diff_topk_gate not in ("output", "keys"):
            raise ConfigError(f"{k}diff_topk_gate must be one of output, keys; got {self.diff_topk_gate!r}")
        if self.importance not in IMPORTANCES:
            raise ConfigError(f"{k}importance must be one of {', '.join(IMPORTANCES)}; got {self.importance!r}")
        if self.score_mapping not in SCORE_MAPPINGS:
            raise ConfigError(f"{k}score_mapping must be one of {', '.join(SCORE_MAPPINGS)}; "
                              f"got {self.score_mapping!r}")
        for key in ("share_selection", "diff_topk", "separate_kv"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"{k}{key} must be true or false, got {getattr(self, key)!r}")
        if isinstance(self.compress_mem_kv, bool) or not isinstance(self.compress_mem_kv, int) \
                or self.compress_mem_kv < 0:
            raise ConfigError(f"{k}compress_mem_kv must be an integer >= 0 (memory slots), "
                              f"got {self.compress_mem_kv!r}")
        if self.cpu_kernel not in CPU_KERNEL_MODES:
            raise ConfigError(f"{k}cpu_kernel must be one of {', '.join(CPU_KERNEL_MODES)}; got {self.cpu_kernel!r}")
        impls = ("auto", "triton", "reference")
        if self.impl not in impls:
            raise ConfigError(f"{k}impl must be one of {', '.join(impls)}; got {self.impl!r}")
        if self.impl == "triton":
            if self.selection_block_size % 16:
                raise ConfigError(f"{k}impl=triton needs {k}selection_block_size to be a multiple of 16, "
                                  f"got {self.selection_block_size}")
            if spec.head_dim > 128:
                raise ConfigError(f"{k}impl=triton supports head dims up to 128 (model.head_dim), got {spec.head_dim}")


def complete_blocks(length: int, block: int, stride: int) -> int:
    """How many compressed blocks (``[j * stride, j * stride + block)``) fit entirely in ``length`` keys."""
    return 0 if length < block else (length - block) // stride + 1


def visible_blocks(pos: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """For absolute query positions ``pos``: how many compressed blocks end at or before each."""
    return ((pos - block + 1).div(stride, rounding_mode="floor") + 1).clamp(min=0)


def overlap_to_selection(scores: torch.Tensor, block: int, stride: int, sel_block: int, n_sel: int) -> torch.Tensor:
    """Map (..., Nc) compressed-block scores onto (..., n_sel) selection blocks.

    Compressed block ``j`` (tokens ``[j * stride, j * stride + block)``) adds its score times the
    fraction of its tokens in selection block ``s`` (tokens ``[s * sel_block, (s + 1) * sel_block)``).
    Each compressed block touches at most ``ceil(block / sel_block) + 1`` selection blocks, so this is
    a few index-adds, O(Nc), not an (Nc x n_sel) matrix.
    """
    nc = scores.shape[-1]
    out = scores.new_zeros(*scores.shape[:-1], n_sel)
    start = torch.arange(nc, device=scores.device) * stride  # (Nc,) first token of each compressed block
    first = start // sel_block
    for r in range(-(-block // sel_block) + 1):
        s = first + r
        lo = torch.maximum(start, s * sel_block)
        hi = torch.minimum(start + block, (s + 1) * sel_block)
        weight = (hi - lo).clamp(min=0).to(scores.dtype) / block
        weight = weight * (s < n_sel)
        out.index_add_(-1, s.clamp(max=n_sel - 1), scores * weight)
    return out


def eq9_to_selection(scores: torch.Tensor, block: int, stride: int, sel_block: int, n_sel: int) -> torch.Tensor:
    """Map (..., Nc) compressed-block scores onto (..., n_sel) selection blocks by the NSA paper's Eq. 9.

    With ``d | l`` and ``d | l'`` (compressed block ``l``, stride ``d``, selection block ``l'``), Eq. 9 reads
    ``p_slc[j] = sum_{m=0}^{l'/d - 1} sum_{n=0}^{l/d - 1} p_cmp[(l'/d) * j - m - n]``, indices outside
    ``[0, Nc)`` counting 0. Taken literally: compressed block ``i`` enters selection block ``j`` with weight
    ``#{(m, n): m + n = (l'/d) j - i}``, so with ``l = l' = 2d`` block ``j`` gets ``p[2j] + 2 p[2j-1] + p[2j-2]``
    (the overlap mapping would give ``p[2j] + p[2j-1] / 2 + p[2j+1] / 2``); with ``l = l' = d`` it is the
    identity, as the overlap mapping is. Differentiable in ``scores``.
    """
    a, c = sel_block // stride, block // stride
    nc = scores.shape[-1]
    out = scores.new_zeros(*scores.shape[:-1], n_sel)
    base = torch.arange(n_sel, device=scores.device) * a
    for r in range(a + c - 1):  # r = m + n
        weight = min(r, a - 1) - max(0, r - c + 1) + 1  # pairs 0 <= m < a, 0 <= n < c with m + n = r
        if not any(0 <= j * a - r < nc for j in range(n_sel)):  # no block j's term r in range (host integers: no
            continue  # read of the device per term)
        i = base - r
        ok = (i >= 0) & (i < nc)
        out = out + weight * scores[..., i.clamp(0, max(nc - 1, 0))] * ok
    return out


SCORE_MAPPINGS = {"overlap": overlap_to_selection, "eq9": eq9_to_selection}
IMPORTANCES = ("probs_sum", "logits_softmax")


def forced_blocks(blocks: torch.Tensor, own: torch.Tensor, initial: int, local: int) -> torch.Tensor:
    """True where block ``blocks`` (a row) is forced into the selection of a query whose own block is ``own``
    (a column): one of the first ``initial`` blocks or of the ``local`` blocks ending with the own one.
    (Blocks after ``own`` come out True too; callers mask them as future afterwards.)"""
    return (blocks < initial) | (blocks > own - local)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             scale: float | None = None) -> torch.Tensor:
    """Causal attention to the last ``window`` keys: q (B, Tq, H, D), k/v (B, Tk, Hkv, D) -> (B, Tq, H, D).

    Query ``i`` sits at absolute position ``p = Tk - Tq + i`` and reads keys ``(p - window, p]``.
    Queries go in chunks of ``c = min(window, Tq)``; the keys are left-padded so that chunk ``n`` needs
    exactly the ``c + window`` padded keys from ``n * c`` (an unfold, no copy of T x T anything).
    """
    b, tq, h, d = q.shape
    tk = k.shape[1]
    start = max(0, tk - tq - window + 1)  # no query reads a key before this one
    k, v = k[:, start:], v[:, start:]
    off = tk - tq - start  # position of query 0 among the kept keys, < window
    c = min(window, tq)
    nq = -(-tq // c)
    pad_left = window - off  # query i then reads padded keys [i + 1, i + window], its own key last
    pad = (0, 0, 0, 0, pad_left, nq * c - tq)  # total nq * c + window padded keys
    kw = F.pad(k, pad).unfold(1, c + window, c)  # (B, nq, Hkv, D, c + window)
    vw = F.pad(v, pad).unfold(1, c + window, c)
    kw = kw.permute(0, 1, 2, 4, 3).reshape(b * nq, -1, c + window, d)  # (B * nq, Hkv, c + w, D)
    vw = vw.permute(0, 1, 2, 4, 3).reshape(b * nq, -1, c + window, d)
    qc = F.pad(q, (0, 0, 0, 0, 0, nq * c - tq)).view(b, nq, c, h, d).transpose(2, 3).reshape(b * nq, h, c, d)
    j = torch.arange(c, device=q.device)[:, None]
    m = torch.arange(c + window, device=q.device)[None, :]
    chunk = torch.arange(nq, device=q.device)[:, None, None]
    mask = (m > j) & (m <= j + window) & (chunk * c + m >= pad_left)  # (nq, c, c + w); never an empty row
    mask = mask[None, :, None].expand(b, nq, 1, c, c + window).reshape(b * nq, 1, c, c + window)
    out = F.scaled_dot_product_attention(qc, kw, vw, attn_mask=mask, scale=scale, enable_gqa=h != kw.shape[1])
    return out.view(b, nq, h, c, d).transpose(2, 3).reshape(b, nq * c, h, d)[:, :tq]


class _StraightThrough(torch.autograd.Function):
    """:meth:`NativeSparseAttention.straight_through`: zeros forward, the slot importances' gradient backward,
    query chunk by query chunk (each chunk's parts and importances recomputed, nothing kept between chunks)."""

    @staticmethod
    def forward(ctx, q, ck, k, v, idx, pos, backend):
        ctx.save_for_backward(q, ck, k, v, idx, pos)
        ctx.backend = backend
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, grad):
        q, ck, k, v, idx, pos = ctx.saved_tensors
        nsa: NativeSparseAttention = ctx.backend
        want_q, want_ck = ctx.needs_input_grad[:2]
        b, tq, h, d = q.shape
        hkv = ck.shape[2]
        budget = _SCORE_CHUNK_CPU if q.device.type == "cpu" else _SCORE_CHUNK_ACCELERATOR
        chunk = max(1, budget // max(1, b * h * ck.shape[1]))
        dq = torch.zeros_like(q) if want_q else None
        dck = torch.zeros(ck.shape, dtype=torch.promote_types(ck.dtype, torch.float32), device=ck.device) \
            if want_ck else None
        ck_leaf = ck.detach().requires_grad_(want_ck)
        for a in range(0, tq, chunk):
            e = min(a + chunk, tq)
            part = nsa.slot_parts(q[:, a:e], k, v, idx[:, a:e], pos[a:e])  # (B, c, Hkv, G, n_sel, D)
            g = grad[:, a:e].reshape(b, e - a, hkv, h // hkv, 1, d).to(part.dtype)
            ds = (g * part).sum((3, 5))  # (B, c, Hkv, n_sel): d loss / d s
            with torch.enable_grad():
                q_leaf = q[:, a:e].detach().requires_grad_(want_q)
                s = nsa.slot_importance(q_leaf, ck_leaf, idx[:, a:e], pos[a:e], k.shape[1])
                wrt = [t for t, want in ((q_leaf, want_q), (ck_leaf, want_ck)) if want]
                got = list(torch.autograd.grad(s, wrt, ds.to(s.dtype)))
            if want_q:
                dq[:, a:e] = got.pop(0)
            if want_ck:
                dck += got.pop(0)
        return dq, dck.to(ck.dtype) if want_ck else None, None, None, None, None, None


class BlockCompressor(nn.Module):
    """Learned compression of key (or value) blocks: (B, L, Hkv, D) -> (B, N, Hkv, D).

    Block ``j`` = tokens ``[j * stride, j * stride + block)``; an intra-block position embedding
    (Hkv, block, D) is added, then a per-kv-head MLP maps the flattened (block * D) block to D.
    """

    def __init__(self, kv_heads: int, head_dim: int, block: int, stride: int, mult: float):
        super().__init__()
        self.block, self.stride = block, stride
        fan_in = block * head_dim
        hidden = max(1, round(fan_in * mult))
        self.pos = nn.Parameter(torch.zeros(kv_heads, block, head_dim))
        self.w1 = nn.Parameter(torch.randn(kv_heads, fan_in, hidden) / math.sqrt(fan_in))
        self.b1 = nn.Parameter(torch.zeros(kv_heads, hidden))
        self.w2 = nn.Parameter(torch.randn(kv_heads, hidden, head_dim) / math.sqrt(hidden))
        self.b2 = nn.Parameter(torch.zeros(kv_heads, head_dim))

    def forward(self, t: torch.Tensor, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Compress blocks ``first .. first + count - 1`` (default: every complete block) of ``t``."""
        b, length, hkv, d = t.shape
        if count is None:
            count = complete_blocks(length, self.block, self.stride) - first
        if count <= 0:
            return t.new_zeros(b, 0, hkv, d)
        seg = t[:, first * self.stride:(first + count - 1) * self.stride + self.block]
        return self._compress(seg.unfold(1, self.block, self.stride).transpose(-1, -2))  # (B, N, Hkv, block, D)

    def _compress(self, blocks: torch.Tensor) -> torch.Tensor:
        """(B, N, Hkv, block, D) blocks of tokens -> (B, N, Hkv, D) compressed keys (values)."""
        dt = blocks.dtype
        return _GroupedMLP.apply(blocks, *(p.to(dt) for p in (self.pos, self.w1, self.b1, self.w2, self.b2)))


def grouped_mlp_reference(blocks, pos, w1, b1, w2, b2) -> torch.Tensor:
    """The compression MLP as plain autograd ops (what :class:`_GroupedMLP` computes; kept for tests): blocks
    (B, N, Hkv, l, D) + pos (Hkv, l, D), flattened, through ``relu(x @ w1[h] + b1[h]) @ w2[h] + b2[h]``."""
    b, n, hkv, l, d = blocks.shape
    flat = (blocks + pos).reshape(b, n, hkv, l * d)
    hidden = F.relu(torch.einsum("bnhi,hio->bnho", flat, w1) + b1)
    return torch.einsum("bnho,hod->bnhd", hidden, w2) + b2


class _GroupedMLP(torch.autograd.Function):
    """The per-kv-head compression MLP with a lean backward: the forward keeps only the post-ReLU hidden layer
    (Hkv, B * N, hidden) besides its inputs (the blocks are a view of the keys, saved anyway); the flattened
    blocks + position embedding are rebuilt in the backward (one add) instead of being stored, and no
    pre-activation copy is kept (the ReLU's mask is ``hidden > 0``). Every product is one batched matmul over
    the kv heads in a head-major layout."""

    @staticmethod
    def _flat(blocks: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        b, n, hkv, l, d = blocks.shape
        x = blocks.new_empty(hkv, b, n, l, d)
        torch.add(blocks.permute(2, 0, 1, 3, 4), pos[:, None, None], out=x)
        return x.view(hkv, b * n, l * d)

    @staticmethod
    def forward(ctx, blocks, pos, w1, b1, w2, b2):
        b, n, hkv, _, d = blocks.shape
        hidden = torch.baddbmm(b1[:, None], _GroupedMLP._flat(blocks, pos), w1).relu_()  # (Hkv, B * N, hidden)
        out = torch.baddbmm(b2[:, None], hidden, w2)  # (Hkv, B * N, D)
        ctx.save_for_backward(blocks, pos, w1, w2, hidden)
        return out.view(hkv, b, n, d).permute(1, 2, 0, 3).contiguous()

    @staticmethod
    def backward(ctx, grad_out):
        blocks, pos, w1, w2, hidden = ctx.saved_tensors
        b, n, hkv, l, d = blocks.shape
        need = ctx.needs_input_grad
        go = grad_out.permute(2, 0, 1, 3).reshape(hkv, b * n, d)
        dw2 = torch.bmm(hidden.transpose(1, 2), go) if need[4] else None
        db2 = go.sum(1) if need[5] else None
        dh = torch.bmm(go, w2.transpose(1, 2)).masked_fill_(hidden <= 0, 0.0)  # through the ReLU
        db1 = dh.sum(1) if need[3] else None
        x = _GroupedMLP._flat(blocks, pos)
        dw1 = torch.bmm(x.transpose(1, 2), dh) if need[2] else None
        dblocks = dpos = None
        if need[0] or need[1]:
            dx = torch.bmm(dh, w1.transpose(1, 2), out=x).view(hkv, b, n, l, d)  # x is no longer needed
            dpos = dx.sum((1, 2)) if need[1] else None
            dblocks = dx.permute(1, 2, 0, 3, 4) if need[0] else None
        return dblocks, dpos, dw1, db1, dw2, db2


class LinearCompressor(BlockCompressor):
    """``compress=conv_linear`` (the seed's ConvLinearCompress): one per-kv-head linear map of the flattened block
    (position embedding added) to D, i.e. a grouped Conv1d of kernel ``block`` and stride ``stride`` over the keys."""

    def __init__(self, kv_heads: int, head_dim: int, block: int, stride: int, mult: float):
        nn.Module.__init__(self)
        self.block, self.stride = block, stride
        fan_in = block * head_dim
        self.pos = nn.Parameter(torch.zeros(kv_heads, block, head_dim))
        self.w = nn.Parameter(torch.randn(kv_heads, fan_in, head_dim) / math.sqrt(fan_in))
        self.b = nn.Parameter(torch.zeros(kv_heads, head_dim))

    def _compress(self, blocks: torch.Tensor) -> torch.Tensor:
        b, n, hkv, l, d = blocks.shape
        flat = (blocks + self.pos.to(blocks.dtype)).reshape(b, n, hkv, l * d)
        return torch.einsum("bnhi,hid->bnhd", flat, self.w.to(blocks.dtype)) + self.b.to(blocks.dtype)


class PoolCompressor(BlockCompressor):
    """``compress=attention_pool`` (the seed's AttentionPool): per feature, a softmax over the block's positions of
    learned logits (a per-kv-head D x D map of each token, position embedding added) weights the tokens' sum.
    The logits start at zero: a new layer compresses a block to its mean (plus the mean position embedding)."""

    def __init__(self, kv_heads: int, head_dim: int, block: int, stride: int, mult: float):
        nn.Module.__init__(self)
        self.block, self.stride = block, stride
        self.pos = nn.Parameter(torch.zeros(kv_heads, block, head_dim))
        self.w = nn.Parameter(torch.zeros(kv_heads, head_dim, head_dim))

    def _compress(self, blocks: torch.Tensor) -> torch.Tensor:
        x = blocks + self.pos.to(blocks.dtype)  # (B, N, Hkv, block, D)
        logits = torch.einsum("bnhld,hde->bnhle", x, self.w.to(blocks.dtype))
        return (logits.softmax(-2) * x).sum(-2)


COMPRESSORS = {"mlp": BlockCompressor, "conv_linear": LinearCompressor, "attention_pool": PoolCompressor}


class NSACache(RowLengths):
    """Decoding state of one NSA layer; rows may hold different numbers of tokens (ragged, :class:`RowLengths`).

    Every tensor is one entry per row along dim 0 (so rows can be split and joined,
    :func:`efftx.generation.decode.splittable`), preallocated for ``max_len`` tokens:

    * ``k``, ``v`` (B, Hkv, capacity, D): every key/value, kv-head-major, the capacity rounded up to whole
      selection blocks, so that ``k.view(B * Hkv * blocks, l' * D)`` is a table of selection blocks (a selected
      block is one row of it, gathered without copying the cache);
    * with ``separate`` (``separate_kv``) also the compressed branch's ``k_cmp``, ``v_cmp`` and the window branch's
      ``k_win``, ``v_win`` (else both branches read ``k``, ``v``);
    * ``ck``, ``cv`` (B, Hkv, M + max blocks, D): the ``compress_mem_kv`` memory slots (written from the layer's
      parameters at every call), then the compressed keys/values of the row's complete blocks: block ``j`` is
      compressed once, when its last token arrives; a row's first ``complete_blocks(lengths[b])`` are valid, the
      later ones are stale after a rewind and recompressed when their block completes again;
    * ``row_pos`` (B,) long: ``lengths`` on the device (the next token's position per row).
    """

    def __init__(self, batch_size: int, max_len: int, kv_heads: int, head_dim: int, block: int, stride: int,
                 sel_block: int = 0, mem: int = 0, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, separate: bool = False):
        super().__init__(batch_size, device)
        self.block, self.stride, self.sel_block = block, stride, sel_block or block
        self.mem, self.separate, self.capacity = mem, separate, max_len
        cap = -(-max(max_len, 1) // self.sel_block) * self.sel_block
        new = lambda: torch.zeros(batch_size, kv_heads, cap, head_dim, device=device, dtype=dtype)  # noqa: E731
        self.k, self.v = new(), new()
        if separate:
            self.k_cmp, self.v_cmp, self.k_win, self.v_win = new(), new(), new(), new()
        n = mem + max(complete_blocks(max_len, block, stride), 0)
        self.ck = torch.zeros(batch_size, kv_heads, n, head_dim, device=device, dtype=dtype)
        self.cv = torch.zeros_like(self.ck)
        self.row_pos = torch.zeros(batch_size, dtype=torch.long, device=device)

    @property
    def max_len(self) -> int:
        return self.capacity

    @property
    def blocks(self) -> int:
        """Complete compressed blocks of the rows (equal rows only)."""
        return complete_blocks(self.length, self.block, self.stride)

    def cmp_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The compressed branch's keys/values (B, Hkv, capacity, D)."""
        return (self.k_cmp, self.v_cmp) if self.separate else (self.k, self.v)

    def win_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window branch's keys/values (B, Hkv, capacity, D)."""
        return (self.k_win, self.v_win) if self.separate else (self.k, self.v)

    def offset(self) -> int | torch.Tensor:
        """Position of each row's next token: an int for equal rows, else (B, 1) long on the device."""
        return self.row_pos[:, None] if self.ragged else self.length

    def partial(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values (B, P, Hkv, D) (equal rows) from the start of the next block to compress to the end."""
        start, end = self.blocks * self.stride, self.length
        kc, vc = self.cmp_kv()
        return kc[:, :, start:end].transpose(1, 2), vc[:, :, start:end].transpose(1, 2)

    def keys(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        """Equal rows: ((k, v), (window k, v), ck, cv) so far as (B, T, Hkv, D) / (B, Nc, Hkv, D) (memory slots
        left out), contiguous, the layout of the uncached forward."""
        end = self.length
        n = self.mem + complete_blocks(end, self.block, self.stride)
        seq = lambda t: t[:, :, :end].transpose(1, 2).contiguous()  # noqa: E731
        kv = (seq(self.k), seq(self.v))
        win = (seq(self.k_win), seq(self.v_win)) if self.separate else kv
        return kv, win, self.ck[:, :, self.mem:n].transpose(1, 2), self.cv[:, :, self.mem:n].transpose(1, 2)

    def write(self, k: torch.Tensor, v: torch.Tensor, cmp: tuple[torch.Tensor, torch.Tensor] | None = None,
              win: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[int]:
        """Store (B, T, Hkv, D) new keys/values (and, with separate projections, the compressed branch's ``cmp``
        and the window branch's ``win``) at each row's own position; return the row lengths before."""
        if (cmp is not None) != self.separate:
            raise ValueError("this nsa cache was made for another attention.nsa.separate_kv: make it with the "
                             "layer's new_cache")
        if k.shape[0] != len(self.lengths):
            raise ValueError(f"{k.shape[0]} rows of keys for an nsa cache of {len(self.lengths)} rows")
        before, t = list(self.lengths), k.shape[1]
        self._grow(t, self.capacity, "nsa cache")
        pairs = [(self.k, k), (self.v, v)]
        if self.separate:
            pairs += [(self.k_cmp, cmp[0]), (self.v_cmp, cmp[1]), (self.k_win, win[0]), (self.v_win, win[1])]
        if len(set(before)) == 1:
            a = before[0]
            for dst, src in pairs:
                dst[:, :, a:a + t] = src.transpose(1, 2)
        else:
            slots = self.row_pos[:, None] + torch.arange(t, device=self.row_pos.device)  # (B, T)
            rows = torch.arange(len(before), device=self.row_pos.device)[:, None]
            for dst, src in pairs:
                dst[rows, :, slots] = src.to(dst.dtype)  # indexed as (B, T, Hkv, D)
        self.row_pos += t
        return before

    def compress(self, before: Sequence[int], compress_k: BlockCompressor, compress_v: BlockCompressor) -> None:
        """Compress the blocks that the tokens after ``before`` (row lengths) completed, row by row."""
        ends = [complete_blocks(n, self.block, self.stride) for n in self.lengths]
        starts = [complete_blocks(n, self.block, self.stride) for n in before]
        if all(e <= s for s, e in zip(starts, ends)):
            return
        kc, vc = self.cmp_kv()
        l, d, m = self.block, self.stride, self.mem
        if len(set(starts)) == 1 and len(set(ends)) == 1:  # the same blocks in every row: slices
            j0, j1 = starts[0], ends[0]
            for net, src, dst in ((compress_k, kc, self.ck), (compress_v, vc, self.cv)):
                seg = src[:, :, j0 * d:(j1 - 1) * d + l].unfold(2, l, d)  # (B, Hkv, N, D, l)
                out = net._compress(seg.permute(0, 2, 1, 4, 3))  # (B, N, Hkv, D)
                dst[:, :, m + j0:m + j1] = out.transpose(1, 2).to(dst.dtype)
            return
        pairs = [(b, j) for b, (s, e) in enumerate(zip(starts, ends)) for j in range(s, e)]
        dev = self.row_pos.device
        rows = host_values([b for b, _ in pairs], torch.long, dev)
        cols = host_values([j for _, j in pairs], torch.long, dev)
        tok = cols[:, None] * d + torch.arange(l, device=dev)  # (N, l)
        for net, src, dst in ((compress_k, kc, self.ck), (compress_v, vc, self.cv)):
            blocks = src[rows[:, None], :, tok].transpose(1, 2)  # (N, Hkv, l, D)
            dst[rows, :, m + cols] = net._compress(blocks[None])[0].to(dst.dtype)  # (N, Hkv, D)

    def _rewound(self, old: list[int]) -> None:
        self.row_pos = host_values(self.lengths, torch.long, self.row_pos.device)


@register("nsa", options=NSAOptions)
class NativeSparseAttention(AttentionBackend):
    supports_ragged = True  # NSACache keeps per-row lengths; decode() works at each row's own positions
    # overlapping compressed blocks (stride 4 < block 8), 2 of up to 3 past selection blocks, a short window
    contract_options = {"compress_block_size": 8, "compress_stride": 4, "selection_block_size": 8,
                        "num_selected_blocks": 2, "sliding_window_size": 6, "compress_mlp_mult": 0.5}

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        opts: NSAOptions = self.spec.options  # checked, defaults filled in
        if not spec.causal:
            raise ConfigError("attention.kind=nsa is causal only")
        self.opts = opts
        self.block, self.stride = opts.compress_block_size, opts.stride
        self.sel_block, self.n_sel = opts.selection_block_size, opts.num_selected_blocks
        self.window = opts.sliding_window_size
        self.scale = spec.head_dim ** -0.5
        # The kernel module (and Triton) is imported when an nsa layer is built, not by every `import efftx`.
        from efftx.kernels.selected_attention import MAX_TRITON_HEAD_DIM, selected_attention

        self._selected_attention = selected_attention
        # "auto" falls back to the reference where the Triton kernel's limits are not met
        kernel_ok = self.sel_block % 16 == 0 and spec.head_dim <= MAX_TRITON_HEAD_DIM
        self.impl = "reference" if opts.impl == "auto" and not kernel_ok else opts.impl
        args = (spec.kv_heads, spec.head_dim, self.block, self.stride, opts.compress_mlp_mult)
        self.initial, self.local = opts.num_initial_blocks, opts.num_local_blocks
        self.to_selection = SCORE_MAPPINGS[opts.score_mapping]
        self.share = opts.share_selection
        self.diff_topk = opts.diff_topk
        network = COMPRESSORS[opts.compress]
        self.compress_k, self.compress_v = network(*args), network(*args)
        self.separate, self.mem = opts.separate_kv, opts.compress_mem_kv
        if self.separate:  # the compressed and window branches' own key/value projections (the layer's: selected)
            width = 2 * spec.kv_heads * spec.head_dim
            self.kv_cmp = Linear(spec.dim, width, bias=False)
            self.kv_win = Linear(spec.dim, width, bias=False)
        if self.mem:  # learned memory slots leading the compressed keys/values; zeros at first, as the seed's
            self.mem_k = nn.Parameter(torch.zeros(spec.kv_heads, self.mem, spec.head_dim))
            self.mem_v = nn.Parameter(torch.zeros(spec.kv_heads, self.mem, spec.head_dim))
        self.__dict__["rotary"] = None  # the layer's rotary module (use_rotary), a plain attribute: not our child
        self.gate = Linear(spec.dim, 3 * spec.heads)  # per head: compressed, selected, window
        # CPU: all three branches in one chunked autograd.Function (nsa_cpu.py); False = the branch-by-branch
        # composition below (SDPA + selected_attention reference), which CUDA always uses.
        self.chunked = True
        self.chunk_size: int | None = None  # queries per chunk of the chunked path (None: its default)
        self.cpu_kernel = opts.cpu_kernel  # its C++ kernels (auto | on) or torch ops only (off)

    def use_rotary(self, rotary: nn.Module | None) -> None:
        """The layer's rotary positions (called by :class:`efftx.models.layers.Attention`): with ``separate_kv``
        the branches' own keys are rotated as the layer rotates its k."""
        self.__dict__["rotary"] = rotary

    def branch_kv(self, proj: nn.Linear, x: torch.Tensor, offset: int | torch.Tensor, limit: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys, values (B, T, Hkv, D) of a branch's own projection of x (tokens from position ``offset``; ``limit``:
        one past the last, known on the host, see :meth:`efftx.models.layers.Rotary.angles`)."""
        b, t, _ = x.shape
        k, v = proj(x).view(b, t, 2, self.spec.kv_heads, self.spec.head_dim).unbind(2)
        if self.rotary is not None:
            k = self.rotary(k, offset, limit)
        return k, v

    def with_memory(self, ck: torch.Tensor, cv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ck, cv (B, Nc, Hkv, D) with the ``compress_mem_kv`` memory slots in front: (B, M + Nc, Hkv, D)."""
        if not self.mem:
            return ck, cv
        b = ck.shape[0]
        mk, mv = (m.to(ck.dtype).transpose(0, 1).expand(b, -1, -1, -1) for m in (self.mem_k, self.mem_v))
        return torch.cat([mk, ck], 1), torch.cat([mv, cv], 1)

    def uses_chunked_path(self, q: torch.Tensor) -> bool:
        """True where the forward runs :func:`efftx.attention.nsa_cpu.nsa_attention` (CPU tensors, not Triton)."""
        return self.chunked and q.device.type == "cpu" and self.impl != "triton"

    def new_cache(self, batch_size, max_len, device, dtype) -> NSACache:
        s = self.spec
        return NSACache(batch_size, max_len, s.kv_heads, s.head_dim, self.block, self.stride, self.sel_block, self.mem,
                        device=device, dtype=dtype, separate=self.separate)

    # ------------------------------------------------------------------------------------ branches

    def compressed(self, q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, start: int) -> torch.Tensor:
        """Attention of q (B, Tq, H, D), query i at position ``start + i``, over compressed ck/cv (B, M + Nc, Hkv, D)
        (the ``compress_mem_kv`` memory slots first, seen by every query)."""
        b, tq, h, d = q.shape
        # the queries before this one see no complete block (and, without memory slots, nothing)
        first = 0 if self.mem else min(tq, max(0, self.block - 1 - start))
        if first == tq or ck.shape[1] == 0:
            return torch.zeros_like(q)
        pos = torch.arange(start + first, start + tq, device=q.device)
        seen = self.mem + visible_blocks(pos, self.block, self.stride)
        mask = torch.arange(ck.shape[1], device=q.device) < seen[:, None]
        out = F.scaled_dot_product_attention(q[:, first:].transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2),
                                             attn_mask=mask, scale=self.scale, enable_gqa=h != ck.shape[2])
        return torch.cat([q.new_zeros(b, first, h, d), out.transpose(1, 2)], 1)  # (B, Tq, H, D)

    @torch.no_grad()
    def select(self, q: torch.Tensor, ck: torch.Tensor, pos: torch.Tensor, n_keys: int) -> torch.Tensor:
        """Selection blocks (B, Tq, Hkv, num_selected_blocks + 1) for queries at ``pos``; -1 = unused.

        Slot 0 is the query's own block; the others are its top past blocks by importance. ``ck`` (B, M + Nc, Hkv,
        D): the memory slots (which share the softmax but are no block) and the compressed blocks' keys.
        """
        b, tq, h, d = q.shape
        hkv, ncol = ck.shape[2], ck.shape[1]
        nc = ncol - self.mem
        n_sel = -(-n_keys // self.sel_block)
        own = (pos // self.sel_block).view(1, tq, 1, 1).expand(b, tq, hkv, 1)
        k_top = min(self.n_sel, n_sel)
        if k_top == 0:
            return F.pad(own, (0, self.n_sel), value=-1)
        qg = q.view(b, tq, hkv, h // hkv, d).permute(0, 2, 3, 1, 4)  # (B, Hkv, G, Tq, D)
        ckt = ck.transpose(1, 2)  # (B, Hkv, Nc, D)
        blocks = torch.arange(n_sel, device=q.device)
        budget = _SCORE_CHUNK_CPU if q.device.type == "cpu" else _SCORE_CHUNK_ACCELERATOR
        chunk = max(1, budget // max(1, b * h * ncol))
        picks = []
        for a in range(0, tq, chunk):
            p = pos[a:a + chunk]
            if nc:
                scores = torch.einsum("bhgtd,bhnd->bhgtn", qg[:, :, :, a:a + chunk], ckt).float() * self.scale
                seen = torch.arange(ncol, device=q.device) < (
                    self.mem + visible_blocks(p, self.block, self.stride)[:, None])
                importance = self.importance(scores, seen, p, n_sel)
            else:
                importance = q.new_zeros(b, hkv, len(p), n_sel, dtype=torch.float32)
            rank = importance.double() + blocks * _TIE_BREAK  # (B, Hkv, c, n_sel)
            if self.opts.min_importance > 0:  # too unimportant: not selected (forced blocks are set just below)
                rank = rank.masked_fill(importance < self.opts.min_importance, float("-inf"))
            own_p = (p // self.sel_block)[:, None]
            rank = rank.masked_fill(forced_blocks(blocks, own_p, self.initial, self.local), float("inf"))
            rank = rank.masked_fill(blocks >= own_p, float("-inf"))  # own/future out
            top = rank.topk(k_top, dim=-1)
            picks.append(top.indices.masked_fill(top.values == float("-inf"), -1))
        past = torch.cat(picks, 2).permute(0, 2, 1, 3)  # (B, Tq, Hkv, k_top)
        return F.pad(torch.cat([own, past], -1), (0, self.n_sel - k_top), value=-1)

    def importance(self, scores: torch.Tensor, seen: torch.Tensor, pos: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """Selection-block importances (B, Hkv, Tq, n_blocks) from compressed scores (B, Hkv, G, Tq, M + Nc) (memory
        slots first) and ``seen`` (Tq, M + Nc), the columns each query reads: ``importance=probs_sum``, the
        probabilities summed over the G heads and mapped (``score_mapping``); ``logits_softmax``, the complete
        blocks' logits averaged over the heads, mapped, softmaxed over the query's past blocks. Differentiable."""
        if self.opts.importance == "logits_softmax":
            mean = scores[..., self.mem:].masked_fill(~seen[:, self.mem:], 0.0).mean(2)
            return logit_importance(mean, pos // self.sel_block, self.block, self.stride, self.sel_block, n_blocks,
                                    self.opts.score_mapping)
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)  # no block: zeros
        return self.to_selection(probs[..., self.mem:].sum(2), self.block, self.stride, self.sel_block, n_blocks)

    def straight_through(self, q, k, v, ck, idx, pos) -> torch.Tensor:
        """diff_topk on the branch-by-branch path: ``sum_j (s_j - s_j.detach()) * O_j`` (B, Tq, H, D), zero in
        value, where ``O_j`` is the part of the selected output that past slot ``j``'s block contributes and
        ``s_j`` that block's importance, with autograd from q and the compressed keys. With
        ``diff_topk_gate=keys``, ``O_j`` is instead the output's derivative in a gate on slot ``j``'s keys,
        ``sum_i P_i S_i (v_i - O)`` over its keys ``i``. The accelerator path's form of it (the chunked CPU path
        adds the same gradient inside its backward): the forward returns zeros and keeps only its inputs; the
        backward walks the queries in chunks (the selection's score budget) and, per chunk, recomputes ``O_j``
        without autograd and the importances ``s`` with it, and back-propagates ``sum(grad * O_j)`` into q and ck.
        Nothing of size (Tq, compressed blocks) or (Tq, selected keys, D) is held beyond one chunk: held for the
        whole sequence (autograd kept them), they were 1.6 GB of the composed layer's 4.1 GB peak at T = 8192
        (CPU, bench/nsa.py --composed; now 2.6 GB), and on an H100 the layer's peak was 13 GB at T = 32768, 33x
        flash attention's (measured before this change)."""
        if ck.shape[1] == self.mem or idx.shape[-1] <= 1:
            return torch.zeros_like(q)
        return _StraightThrough.apply(q, ck, k.detach(), v.detach(), idx, pos, self)

    def slot_importance(self, q, ck, idx, pos, n_keys: int) -> torch.Tensor:
        """Importances (B, Tq, Hkv, n_sel) of each query's past slots ``idx[..., 1:]`` (0 for unused slots), with
        autograd from q (B, Tq, H, D) and ck (B, M + Nc, Hkv, D)."""
        b, tq, h, d = q.shape
        hkv = ck.shape[2]
        past = idx[..., 1:]
        scores = torch.einsum("bthgd,bnhd->bhgtn", q.view(b, tq, hkv, h // hkv, d), ck)
        scores = scores.to(torch.promote_types(q.dtype, torch.float32)) * self.scale
        seen = torch.arange(ck.shape[1], device=q.device) < (
            self.mem + visible_blocks(pos, self.block, self.stride)[:, None])
        imp = self.importance(scores, seen, pos, -(-n_keys // self.sel_block)).permute(0, 2, 1, 3)
        return imp.gather(-1, past.clamp(min=0)) * (past >= 0)  # (B, Tq, Hkv, n_sel)

    @torch.no_grad()
    def slot_parts(self, q, k, v, idx, pos) -> torch.Tensor:
        """``O_j`` of :meth:`straight_through` for each query's past slots: (B, Tq, Hkv, G, n_sel, D), float32 (or
        float64)."""
        b, tq, h, d = q.shape
        tk, hkv, l = k.shape[1], k.shape[2], self.sel_block
        grp, work = h // hkv, torch.promote_types(q.dtype, torch.float32)
        qg = q.view(b, tq, hkv, grp, d)
        key = idx[..., None] * l + torch.arange(l, device=q.device)  # (B, Tq, Hkv, S, l)
        ok = (idx[..., None] >= 0) & (key <= pos.view(1, tq, 1, 1, 1))
        flat = key.clamp(0, tk - 1).flatten(-2).permute(0, 2, 1, 3).reshape(b, hkv, -1)  # (B, Hkv, Tq * S * l)
        gather = lambda t: t.transpose(1, 2).gather(2, flat[..., None].expand(-1, -1, -1, d))  # noqa: E731
        ks, vs = (gather(t).view(b, hkv, tq, -1, d) for t in (k, v))  # (B, Hkv, Tq, S * l, D)
        raw = torch.einsum("bthgd,bhtnd->bhtgn", qg, ks).to(work) * self.scale
        att = raw.masked_fill(~ok.flatten(-2).permute(0, 2, 1, 3)[:, :, :, None], float("-inf")).softmax(-1)
        att = att.nan_to_num(0.0)
        if self.opts.diff_topk_gate == "keys":  # d O / d (slot gate) = sum over its keys of P S (v - O)
            o = torch.einsum("bhtgn,bhtnd->bhtgd", att, vs.to(work))  # (B, Hkv, Tq, G, D) the selected output
            w = (att * raw).unflatten(-1, (-1, l))  # (B, Hkv, Tq, G, S, l') P S
            part = (torch.einsum("bhtgsl,bhtsld->bthgsd", w, vs.to(work).unflatten(-2, (-1, l)))
                    - w.sum(-1).permute(0, 2, 1, 3, 4)[..., None] * o.permute(0, 2, 1, 3, 4)[..., None, :])
            return part.to(q.dtype).to(work)[..., 1:, :]
        return torch.einsum("bhtgsl,bhtsld->bthgsd", att.to(q.dtype).unflatten(-1, (-1, l)),
                            vs.unflatten(-2, (-1, l)))[..., 1:, :].to(work)  # (B, Tq, Hkv, G, n_sel, D)

    # ------------------------------------------------------------------------------------ forward

    def forward(self, q, k, v, *, cache: NSACache | None = None, x=None):
        # q: (B, T, H, D); k, v: (B, T, Hkv, D); x: (B, T, dim)
        if x is None:
            raise ValueError("the nsa backend gates its branches by the hidden state: call it with x=(B, T, dim)")
        b, tq, h, _ = q.shape
        g = torch.sigmoid(self.gate(x)).view(b, tq, h, 3)
        cmp = win = None
        if self.separate:  # the compressed and window branches' own keys/values
            offset, limit = cache_offset(cache), cache_limit(cache, tq)
            cmp, win = self.branch_kv(self.kv_cmp, x, offset, limit), self.branch_kv(self.kv_win, x, offset, limit)
        if cache is None:
            kc, vc = cmp if cmp is not None else (k, v)
            kw, vw = win if win is not None else (k, v)
            ck, cv = self.compress_k(kc), self.compress_v(vc)  # (B, Nc, Hkv, D)
            return self.attend(q, k, v, kw, vw, ck, cv, g)
        before = cache.write(k, v, cmp, win)
        cache.compress(before, self.compress_k, self.compress_v)
        if self.mem:
            cache.ck[:, :, :self.mem] = self.mem_k.to(cache.ck.dtype)
            cache.cv[:, :, :self.mem] = self.mem_v.to(cache.cv.dtype)
        if len(set(before)) == 1 and tq > DECODE_QUERIES:  # a prefill of equal rows: the uncached forward's path
            (k, v), (kw, vw), ck, cv = cache.keys()
            return self.attend(q, k, v, kw, vw, ck, cv, g)
        start = cache.row_pos - tq  # (B,) each row's first new position
        fused = self._fused_decoder(q, g, cache)
        if fused is not None:  # every query of every row in one call of the C++ kernel
            return fused(q, g, start)
        equal = len(set(before)) == 1  # equal rows: decode() reads the window as a slice
        if tq == 1:  # a decoding step: no output buffer, no position range
            return self.decode(q, g, start[:, None], cache, max(before) + 1, before[0] if equal else None)
        out = q.new_empty(q.shape)
        for a in range(0, tq, DECODE_QUERIES):
            e = min(a + DECODE_QUERIES, tq)
            pos = start[:, None] + torch.arange(a, e, device=q.device)  # (B, c)
            first = before[0] + a if equal else None
            out[:, a:e] = self.decode(q[:, a:e], g[:, a:e], pos, cache, max(before) + e, first)
        return out

    def attend(self, q, k, v, kw, vw, ck, cv, g) -> torch.Tensor:
        """The three branches over all keys so far: q (B, Tq, H, D) the last Tq positions of k, v (B, Tk, Hkv, D),
        window keys kw, vw, compressed ck, cv (B, Nc, Hkv, D) without the memory slots, gates g (B, Tq, H, 3)."""
        b, tq, h, _ = q.shape
        ck, cv = self.with_memory(ck, cv)  # (B, M + Nc, Hkv, D)
        tk = k.shape[1]
        if not self.share and h != k.shape[2]:
            # per-head selection: every query head its own kv "group" (k, v, ck, cv repeated per query head), so
            # each path (chunked CPU, reference, Triton) ranks blocks by that head's scores alone
            rep = h // k.shape[2]
            k, v, ck, cv = (t.repeat_interleave(rep, dim=2) for t in (k, v, ck, cv))
            kw, vw = (t.repeat_interleave(rep, dim=2) for t in (kw, vw)) if self.separate else (k, v)
        if self.uses_chunked_path(q):
            return nsa_attention(q, k, v, ck, cv, g.to(q.dtype), block=self.block, stride=self.stride,
                                 sel_block=self.sel_block, n_sel=self.n_sel, window=self.window, scale=self.scale,
                                 chunk=self.chunk_size, initial=self.initial, local=self.local,
                                 mapping=self.opts.score_mapping, diff_topk=self.diff_topk, mem=self.mem,
                                 window_kv=(kw, vw) if self.separate else None, importance=self.opts.importance,
                                 min_importance=self.opts.min_importance, diff_topk_gate=self.opts.diff_topk_gate,
                                 cpu_kernel=self.cpu_kernel)
        pos = torch.arange(tk - tq, tk, device=q.device)  # absolute positions of the queries
        out_cmp = self.compressed(q, ck, cv, tk - tq)
        idx = self.select(q, ck, pos, tk)
        out_sel = self._selected_attention(q, k, v, idx, self.sel_block, scale=self.scale, impl=self.impl)
        if self.diff_topk and torch.is_grad_enabled() and (q.requires_grad or ck.requires_grad):
            out_sel = out_sel + self.straight_through(q, k, v, ck, idx, pos)
        out_win = sliding_window_attention(q, kw, vw, self.window, self.scale)
        g = g.unsqueeze(-1).to(q.dtype)
        return g[:, :, :, 0] * out_cmp + g[:, :, :, 1] * out_sel + g[:, :, :, 2] * out_win  # (B, T, H, D)

    def _fused_decoder(self, q: torch.Tensor, g: torch.Tensor, cache: NSACache):
        """The C++ kernel's fused cached decoding (:mod:`efftx.kernels.nsa_selected_cpu`, ``decode``) over ``cache``
        as a function ``(q, g, start) -> out`` (``start`` (B,): each row's first new position), where it applies:
        CPU tensors of one float type (float32 or float64) with no gradient wanted, the identity score mapping
        (compressed blocks = selection blocks) and one selection per kv head (``share_selection`` or no GQA),
        ``cpu_kernel`` auto (and the kernel built) or on. Else None: then :meth:`decode`, its reference, runs (tests
        hold the two to each other)."""
        if self.cpu_kernel == "off" or q.device.type != "cpu" or not (self.block == self.stride == self.sel_block):
            return None
        if not (self.share or q.shape[2] == cache.k.shape[1]):
            return None
        dtype = q.dtype
        if dtype not in (torch.float32, torch.float64) or g.dtype != dtype:
            return None
        if torch.is_grad_enabled() and (q.requires_grad or g.requires_grad):
            return None
        tables = (cache.k, cache.v, *cache.win_kv(), cache.ck, cache.cv)  # keys, values, window's, compressed
        if any(t.dtype != dtype or not t.is_contiguous() for t in tables):
            return None
        from efftx.kernels.nsa_selected_cpu import kernel as compiled  # (importing efftx.kernels imports Triton)

        kernel = compiled(required=self.cpu_kernel == "on")
        if kernel is None:
            return None

        def fused(q, g, start):
            pos = (start[:, None] + torch.arange(q.shape[1], device=q.device)).contiguous()  # (B, c)
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            kernel.decode(q.contiguous(), *tables, pos, g.contiguous(), out, self.block, self.mem, self.n_sel,
                          self.window, self.initial, self.local, float(self.opts.min_importance),
                          self.opts.importance == "logits_softmax", self.scale)
            return out

        return fused

    def _decode_consts(self, cache: NSACache, b: int, hs: int, grp: int, n: int, device: torch.device):
        """Index tensors the cached decoding step reuses (made once per shape and device, not per step): a long
        ``arange`` of at least ``n``, its tie-breaks ``arange * _TIE_BREAK`` and, for ``b`` rows of ``hs``
        selection groups, each group's first row in the cache's block table ``k.view(B * Hkv * blocks, l' * D)``
        (B, Hs, 1). Kept on the backend as plain attributes (no buffers): the cache holds only per-row tensors."""
        memo = self.__dict__.setdefault("_decode_memo", {})
        hkv, nblk = cache.k.shape[1], cache.k.shape[2] // self.sel_block
        ar = memo.get(("arange", device))
        if ar is None or ar.numel() < n:
            ar = memo[("arange", device)] = torch.arange(max(n, 1024), device=device)
            memo[("tie", device)] = ar * _TIE_BREAK  # as select()'s blocks * _TIE_BREAK (default float dtype)
        key = ("base", device, b, hs, hkv, grp, nblk)
        base = memo.get(key)
        if base is None:
            heads = torch.arange(hs, device=device) // (1 if hs == hkv else grp)  # kv head of each group
            base = memo[key] = ((torch.arange(b, device=device)[:, None] * hkv + heads) * nblk)[..., None]
        return ar, memo[("tie", device)], base

    def decode(self, q: torch.Tensor, g: torch.Tensor, pos: torch.Tensor, cache: NSACache, hi: int,
               first: int | None = None) -> torch.Tensor:
        """Cached decoding of queries q (B, c, H, D) at positions ``pos`` (B, c) (rows may differ), whose keys are
        already in ``cache``; g (B, c, H, 3) the gates; ``hi`` (host) bounds the keys any of them reads. Reads the
        cache in place: O(blocks) for the compressed scores and the importances, O(selected + window keys) for
        the rest, no copy of the keys. Each query's result is the uncached forward's (same selection rules).
        ``first`` (host): the first query's position when every row's queries start there (equal rows), else None;
        then the window branch reads its keys as one slice of the cache, not gathered per row. Few small tensor
        operations per step (a decoding step is latency bound): index tensors are reused across steps
        (:meth:`_decode_consts`), masks are built in the polarity they are used in, and casts that would not change
        a dtype are skipped."""
        b, c, h, d = q.shape
        hkv = cache.k.shape[1]
        grp = h // hkv
        hs, gs = (hkv, grp) if self.share or grp == 1 else (h, 1)  # selection groups, query heads per group
        work = torch.promote_types(q.dtype, torch.float32)
        cast = lambda t: t if t.dtype == work else t.to(work)  # noqa: E731
        l, mem, inf = self.sel_block, self.mem, float("inf")
        wk = self.window + c - 1
        ncol = mem + complete_blocks(hi, self.block, self.stride)
        cand = (hi - 1) // l  # blocks before the last query's own block
        ar, tie, base = self._decode_consts(cache, b, hs, grp, max(ncol, cand, wk, l), q.device)
        qw = cast(q) * self.scale
        qr = qw.view(b, c, hkv, grp, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, grp * c, d)  # group heads as rows
        unrows = lambda t: t.view(b, hkv, grp, c, d).permute(0, 3, 1, 2, 4).reshape(b, c, h, d)  # noqa: E731

        # compressed branch: the memory slots and the complete blocks each query sees
        vis = mem + visible_blocks(pos, self.block, self.stride)  # (B, c) columns seen
        raw = probs = hidden = None
        if ncol:
            hidden = (ar[:ncol] >= vis[..., None])[:, None, None]  # (B, 1, 1, c, ncol)
            raw = torch.matmul(qr, cast(cache.ck[:, :, :ncol]).transpose(-1, -2)).view(b, hkv, grp, c, ncol)
            probs = raw.masked_fill(hidden, -inf).softmax(-1)  # (B, Hkv, G, c, ncol)
            if not mem:  # a query that sees nothing: zeros (memory slots are seen by every query)
                probs = probs.nan_to_num_(0.0)
            out_cmp = unrows(torch.matmul(probs.view(b, hkv, grp * c, ncol), cast(cache.cv[:, :, :ncol])))
        else:
            out_cmp = None

        # selection: the own block, then the top past blocks by importance (forced ones first)
        own = pos // l  # (B, c)
        k_top = min(self.n_sel, cand)
        idx = own[:, None, :, None].expand(b, hs, c, 1)
        if k_top:
            blocks = ar[:cand]
            nb = ncol - mem
            mapping = self.opts.score_mapping
            future = blocks >= own[:, None, :, None]  # (B, 1, c, cand): the own block and later ones
            if self.opts.importance == "logits_softmax":
                if nb:
                    mean = raw.view(b, hs, gs, c, ncol)[..., mem:].mean(2).masked_fill(hidden[:, :, 0, :, mem:], 0.0)
                    z = _to_selection(mean, self.block, self.stride, l, cand, mapping)  # (B, Hs, c, cand)
                else:
                    z = qw.new_zeros(b, hs, c, cand)
                # a query with no past block softmaxes zeros (no NaN), then the mask zeroes them all
                z = z.masked_fill(future, -inf).masked_fill(future.all(-1, keepdim=True), 0.0)
                imp = z.softmax(-1).masked_fill_(future, 0.0)
                if not mem:  # a query that sees no compressed column ranks by zeros (as the chunked path)
                    imp = imp.masked_fill_((vis == 0)[:, None, :, None], 0.0)
            elif nb:
                p = probs.view(b, hs, gs, c, ncol)[..., mem:]
                imp = _to_selection(p[:, :, 0] if gs == 1 else p.sum(2), self.block, self.stride, l, cand, mapping)
            else:
                imp = qw.new_zeros(b, hs, c, cand)
            rank = imp.double() + tie[:cand]  # (B, Hs, c, cand)
            if self.opts.min_importance > 0:
                rank = rank.masked_fill_(imp < self.opts.min_importance, -inf)
            if self.initial or self.local > 1:
                rank = rank.masked_fill_(forced_blocks(blocks, own[:, None, :, None], self.initial, self.local), inf)
            top = rank.masked_fill_(future, -inf).topk(k_top, dim=-1)
            idx = torch.cat([idx, top.indices.masked_fill_(top.values == -inf, -1)], -1)  # (B, Hs, c, S)

        # selected branch: whole blocks gathered from the cache's block table
        s = idx.shape[-1]
        flat = (base[..., None] + idx.clamp(min=0)).view(-1)
        ks = cast(cache.k.view(-1, l * d).index_select(0, flat).view(b, hs, c, s * l, d))
        vs = cast(cache.v.view(-1, l * d).index_select(0, flat).view(b, hs, c, s * l, d))
        # masked: unused slots (-1) and the own block's keys after the query
        off = (idx * l - pos[:, None, :, None]).unsqueeze(-1) + ar[:l]  # key position - query position
        bad = (off > 0).logical_or_(idx.unsqueeze(-1) < 0).view(b, hs, c, 1, s * l)
        qs = qw.view(b, c, hs, gs, d).transpose(1, 2)  # (B, Hs, c, Gs, D)
        att = torch.matmul(qs, ks.transpose(-1, -2)).masked_fill_(bad, -inf)
        out = torch.matmul(att.softmax(-1), vs).transpose(1, 2).reshape(b, c, h, d)  # the own key: never empty

        # window branch: the last `window` keys of each query
        kwin, vwin = cache.win_kv()
        if first is not None:  # equal rows: keys [lo, first + c) of every row, a view of the cache
            lo = max(0, first - self.window + 1)
            wk = first + c - lo
            kw, vw = cast(kwin[:, :, lo:first + c]), cast(vwin[:, :, lo:first + c])  # (B, Hkv, W, D)
            rel = pos[..., None] - (ar[:wk] + lo)  # (B, c, W) query position - key position
            unseen = (rel < 0).logical_or_(rel >= self.window)
        else:
            kpos = (pos[:, :1] - (self.window - 1)) + ar[:wk]  # (B, W)
            at = kpos.clamp(min=0)[:, None, :, None].expand(b, hkv, wk, d)
            kw, vw = cast(kwin.gather(2, at)), cast(vwin.gather(2, at))  # (B, Hkv, W, D)
            rel = pos[..., None] - kpos[:, None]  # (B, c, W) query position - key position
            unseen = (rel < 0).logical_or_(rel >= self.window).logical_or_(kpos[:, None] < 0)
        sw = torch.matmul(qr, kw.transpose(-1, -2)).view(b, hkv, grp, c, wk).masked_fill_(unseen[:, None, None], -inf)
        out_win = unrows(torch.matmul(sw.softmax(-1).view(b, hkv, grp * c, wk), vw))

        g = cast(g)
        out = out * g[..., 1:2]
        out += out_win * g[..., 2:3]
        if out_cmp is not None:
            out += out_cmp * g[..., 0:1]
        return out.to(q.dtype)

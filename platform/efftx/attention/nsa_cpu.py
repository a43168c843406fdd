"""Chunked NSA attention for CPUs: the three branches of :mod:`efftx.attention.nsa` in one pass over query chunks.

:func:`nsa_attention` takes the queries, keys, values, compressed keys/values and the three per-head gates and
returns ``g_cmp * compressed + g_sel * selected + g_win * window``, exactly the composition the NSA backend
defines (block selection included), but computed chunk by chunk inside one ``torch.autograd.Function``:

* Queries go in chunks of ``chunk`` positions. For a chunk, the **compressed** branch is one dense block of
  attention over the compressed keys its last query can see (per GQA group, all the group's heads stacked as
  rows of one matrix product); only the columns of the blocks that complete inside the chunk need a causal
  mask. The chunk's softmax probabilities are also the block importances: summed over the group's heads and
  mapped onto selection blocks they give each query's top ``n_sel`` past blocks right there, so the
  compressed scores are computed once, not again for the selection.
* The **selected** branch runs, by default, as a compiled C++ kernel (:mod:`efftx.kernels.nsa_selected_cpu`,
  ``cpu_kernel``) over every query once the chunk loop has chosen every selection: each query's own and
  selected blocks are read in place from kv-head-major key/value tables (the keys also transposed by block, so
  a query's scores against a block are register-tiled vector products), one GQA group's heads at a time, and
  its backward adds the key/value gradients straight into their tables. With torch ops instead (``off``, or
  where the kernel cannot be built), each query's blocks are gathered once per GQA group (``index_select`` of
  whole blocks, in sub-chunks of ``SELECTED_ROWS`` (query, kv head) pairs so the gathered blocks stay in
  cache) and attended with batched (heads of the group x selected keys) products. Either way keys after the
  query (in its own block) are masked.
* With the kernel and the identity score mapping, the compressed branch's softmax and the selection are one
  kernel pass over each chunk's scores (and, in the backward, the softmax's gradient and the importance
  gradient another); the products stay torch matmuls.
* The **window** branch is a dense block of the chunk's queries against the ``chunk + window - 1`` keys
  they can reach, band-masked.

Nothing of size (T, selected keys, D) or (T, compressed blocks) is ever held for the whole sequence: the
forward keeps the output and the selections (T x Hkv x n_sel block indices) and nothing else (and a
kv-head-major copy of k and v while it runs). The backward
walks the chunks again and recomputes every score and probability from the inputs (the saved selections
make it skip the top-k), then uses ``rowsum(P * dP)`` for both the softmax backward and the gates' gradients,
so no branch output is stored either. The gates scale small (rows x D) operands, never a score matrix.

Arithmetic is in the input dtype (float32 or float64; half precision is computed in float32); softmax in
that dtype. The selection ranks importances in float64 with the same tie-break (most recent block) as
:meth:`efftx.attention.nsa.NativeSparseAttention.select`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TIE_BREAK = 1e-12  # per block index, added in float64: exact importance ties go to the most recent block
DEFAULT_CHUNK = 64  # queries per chunk (compressed and window branches)
SCORE_BUDGET = 1 << 21  # elements of one chunk's (B, H, chunk, compressed blocks) score matrix, at most
CPU_KERNEL_MODES = ("auto", "on", "off")  # the C++ kernels where they build | the kernels | torch ops only
SELECTED_ROWS = 64  # (query, kv head) pairs per sub-chunk of the selected branch: its gathered keys stay in cache


def _visible(pos: torch.Tensor | int, block: int, stride: int):
    """How many compressed blocks ``[j * stride, j * stride + block)`` end at or before position ``pos``."""
    if isinstance(pos, int):
        return 0 if pos < block - 1 else (pos - block + 1) // stride + 1
    return ((pos - block + 1).div(stride, rounding_mode="floor") + 1).clamp(min=0)


def _to_selection(imp: torch.Tensor, block: int, stride: int, sel_block: int, n_blocks: int,
                  mapping: str = "overlap") -> torch.Tensor:
    """(..., nv) compressed-block importances -> (..., n_blocks) selection-block importances (``mapping``: by
    token overlap or by the paper's Eq. 9, see :mod:`efftx.attention.nsa`)."""
    nv = imp.shape[-1]
    if block == stride == sel_block:  # the identity (both mappings); blocks no compressed block covers yet score 0
        return imp[..., :n_blocks] if nv >= n_blocks else F.pad(imp, (0, n_blocks - nv))
    from efftx.attention.nsa import SCORE_MAPPINGS

    return SCORE_MAPPINGS[mapping](imp, block, stride, sel_block, n_blocks)


def logit_importance(mean_logits: torch.Tensor, own: torch.Tensor, block: int, stride: int, sel_block: int,
                     n_blocks: int, mapping: str = "overlap") -> torch.Tensor:
    """``importance=logits_softmax`` (the seed library's ranking): (..., c, nb) compressed-block logits averaged over
    a selection's heads (0 for blocks not yet complete) -> (..., c, n_blocks) importances: the logits mapped onto
    selection blocks (``mapping``), then a softmax over each query's past blocks (those before ``own`` (c,)); 0 for
    its own and later blocks (a query with no past block: all 0). Differentiable in ``mean_logits``."""
    z = _to_selection(mean_logits, block, stride, sel_block, n_blocks, mapping)
    past = torch.arange(n_blocks, device=z.device)[None, :] < own[:, None]  # (c, n_blocks)
    z = z.masked_fill(~past, float("-inf")).masked_fill(~past.any(-1, keepdim=True), 0.0)  # no NaN rows
    return z.softmax(-1) * past


def _logit_importance_of_chunk(mean_logits: torch.Tensor, own: torch.Tensor, block: int, stride: int, sel_block: int,
                               n_blocks: int, mapping: str) -> torch.Tensor:
    """:func:`logit_importance` without autograd for one chunk of consecutive queries, the same values: the masks
    are written in place, and only from the first query's own block on (the blocks before it are past blocks of
    every query of the chunk). ``mean_logits`` must be a tensor of the caller's own (its columns may be changed)."""
    z = _to_selection(mean_logits, block, stride, sel_block, n_blocks, mapping)
    first = min(int(own[0]), n_blocks)
    past = torch.arange(first, n_blocks, device=z.device)[None, :] < own[:, None]  # (c, n_blocks - first)
    z[..., first:].masked_fill_(~past, float("-inf"))
    if first == 0:  # queries in the first block have no past block: zeros, not NaN
        z.masked_fill_((own == 0)[:, None], 0.0)
    y = z.softmax(-1)
    y[..., first:].mul_(past)
    return y


class _Layout:
    """Shapes, options and the layouts shared by the forward and the backward of one call.

    Two per-chunk layouts of query-side tensors (queries, gates, output gradients):

    * *rows* (B, Hkv, G * c, X): a GQA group's heads stacked as the rows of one matrix, for the dense blocks
      of the compressed and window branches;
    * *per query* (c * B * Hkv, G, X): one batch entry per (query, kv head), for the selected branch (a view
      of the (B, c, H, X) tensor when B = 1; consecutive queries are contiguous, so sub-chunks are slices).
    """

    def __init__(self, q, k, ck, block, stride, sel_block, n_sel, window, scale, start, chunk, initial=0, local=1,
                 mapping="overlap", diff_topk=False, mem=0, separate=False, importance="probs_sum",
                 min_importance=0.0, gate="output", kernel=None):
        self.b, self.tq, self.h, self.d = q.shape
        self.kernel = kernel  # the compiled kernels (efftx.kernels.nsa_selected_cpu), None: torch ops
        self.initial, self.local, self.mapping, self.diff_topk = initial, local, mapping, diff_topk
        self.mem = mem  # learned memory slots leading the compressed keys/values, visible to every query
        self.separate = separate  # the window branch has keys/values of its own (kw, vw)
        self.logits = importance == "logits_softmax"  # rank by the logits' softmax, not the summed probabilities
        self.min_importance = min_importance  # past blocks of a lower importance are never selected (unless forced)
        self.gate_keys = gate == "keys"  # diff_topk: the straight-through gate scales the block's keys, not its output
        self.tk, self.hkv = k.shape[1], k.shape[2]
        self.g = self.h // self.hkv
        self.bh = self.b * self.hkv
        self.nc = ck.shape[1]
        self.block, self.stride, self.sel_block, self.n_sel, self.window = block, stride, sel_block, n_sel, window
        self.slots = n_sel + 1
        self.scale, self.start = scale, start
        if chunk is None:
            chunk = DEFAULT_CHUNK
            while chunk > 16 and self.b * self.h * chunk * max(self.nc, 1) > SCORE_BUDGET:
                chunk //= 2
        self.chunk = max(1, min(chunk, self.tq))
        self.sub = max(1, SELECTED_ROWS // self.bh)
        self.nblk = -(-self.tk // sel_block)
        self.device = q.device
        # the kernel's fused compressed softmax + selection (forward) and its gradient + the importance gradient
        # (backward): the identity score mapping only; the backward's importance gradient for logits_softmax only
        self.fused_forward = kernel is not None and block == stride == sel_block
        self.fused_backward = self.fused_forward and (self.logits or not diff_topk)

    def chunks(self):
        for a in range(0, self.tq, self.chunk):
            yield a, min(a + self.chunk, self.tq)

    def heads_major(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Tk, Hkv, D) -> (B, Hkv, nblk * sel_block, D), zero-padded to whole selection blocks."""
        out = t.new_empty(self.b, self.hkv, self.nblk * self.sel_block, self.d)
        out[:, :, :self.tk] = t.transpose(1, 2)
        out[:, :, self.tk:] = 0
        return out

    def blocks_transposed(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, nblk * l', D) -> (B, Hkv, nblk, D, l' rounded up to 16, zero-padded): the kernel's layout."""
        l = self.sel_block
        blocks = t.view(self.b, self.hkv, self.nblk, l, self.d).transpose(-1, -2)
        return F.pad(blocks, (0, -l % 16)).contiguous()

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """(B, c, H, X) -> (B, Hkv, G * c, X)."""
        b, c, _, x = t.shape
        return t.view(b, c, self.hkv, self.g, x).permute(0, 2, 3, 1, 4).reshape(b, self.hkv, self.g * c, x)

    def unrows(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """Inverse of :meth:`rows` as a view: (B, Hkv, G * c, X) -> (B, c, Hkv, G, X)."""
        return t.view(self.b, self.hkv, self.g, c, -1).permute(0, 3, 1, 2, 4)

    def per_query(self, t: torch.Tensor) -> torch.Tensor:
        """(B, c, H, X) -> (c * B * Hkv, G, X)."""
        b, c, _, x = t.shape
        return t.transpose(0, 1).reshape(c * self.bh, self.g, x)

    def unper_query(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """Inverse of :meth:`per_query` as a view: -> (B, c, Hkv, G, X)."""
        return t.view(c, self.b, self.hkv, self.g, -1).transpose(0, 1)

    # ------------------------------------------------------------------ masks and selections
    def visible(self, pos):
        """Compressed columns (memory slots first, then complete blocks) the query at ``pos`` reads."""
        return self.mem + _visible(pos, self.block, self.stride)

    def cmp_mask(self, pos: torch.Tensor, first: int, nv: int) -> torch.Tensor:
        """(c, nv - first) True = compressed column ``first + j`` (a block) not yet complete for the query at
        ``pos``."""
        cols = torch.arange(first, nv, device=self.device)
        return cols[None, :] >= self.visible(pos)[:, None]

    def window_mask(self, pos: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """(c, hi - lo) True = key outside the query's window ``(p - window, p]``."""
        key = torch.arange(lo, hi, device=self.device)[None, :]
        p = pos[:, None]
        return (key > p) | (key <= p - self.window)

    def mean_logits(self, logits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """A chunk's compressed scores (B, Hkv, G * c, nv) -> the blocks' logits averaged over the group's heads
        (B, Hkv, c, nv - mem), 0 for blocks not yet complete."""
        c, nv = pos.shape[0], logits.shape[-1]
        mean = logits.view(self.b, self.hkv, self.g, c, nv)[..., self.mem:].mean(2)  # a new tensor
        # the incomplete blocks' scores are -inf (for every head: the mask is per query), so is their mean; they lie
        # in the columns from the first one the chunk's first query does not see
        first = min(int(self.visible(int(pos[0]))), nv)
        if first < nv:
            mean[..., first - self.mem:].masked_fill_(self.cmp_mask(pos, first, nv), 0.0)
        return mean

    def select(self, probs: torch.Tensor | None, pos: torch.Tensor, p1: int,
               logits: torch.Tensor | None = None) -> torch.Tensor:
        """Top past selection blocks (c, B, Hkv, n_sel), -1 = unused, from a chunk's compressed probabilities
        (B, Hkv, G * c, nv) (None when no compressed block is visible yet), or (``importance=logits_softmax``) its
        compressed scores ``logits`` of the same shape."""
        c = pos.shape[0]
        out = torch.full((c, self.b, self.hkv, self.n_sel), -1, dtype=torch.int64, device=self.device)
        cand = (p1 - 1) // self.sel_block  # blocks before the last query's own block
        k_top = min(self.n_sel, cand)
        if k_top == 0:
            return out
        tie = torch.arange(cand, device=self.device, dtype=torch.float64) * TIE_BREAK
        if probs is None:  # every importance is 0
            rank = tie.expand(self.b, self.hkv, c, cand).clone()
            if self.min_importance > 0:
                rank.fill_(float("-inf"))
        else:
            if self.logits:
                imp = _logit_importance_of_chunk(self.mean_logits(logits, pos), pos // self.sel_block, self.block,
                                                 self.stride, self.sel_block, cand, self.mapping)
            else:
                imp = probs.view(self.b, self.hkv, self.g, c, -1)[..., self.mem:]  # the blocks' columns
                imp = imp[:, :, 0] if self.g == 1 else imp.sum(2)  # (B, Hkv, c, nv)
                imp = _to_selection(imp, self.block, self.stride, self.sel_block, cand, self.mapping)
            rank = imp.double() + tie
            if self.min_importance > 0:  # blocks below it are not selected (unless forced): their slots stay -1
                rank.masked_fill_(imp < self.min_importance, float("-inf"))
        own = pos // self.sel_block
        if self.initial or self.local > 1:  # forced blocks first (later ones are then masked as future)
            cols = torch.arange(cand, device=self.device)[None, :]
            rank.masked_fill_((cols < self.initial) | (cols > own[:, None] - self.local), float("inf"))
        first = int(own[0])  # blocks before it are candidates of every query of the chunk
        if first < cand:
            later = torch.arange(first, cand, device=self.device)[None, :] >= own[:, None]
            rank[..., first:].masked_fill_(later, float("-inf"))
        top = rank.topk(k_top, dim=-1, sorted=False)
        out[..., :k_top] = top.indices.masked_fill_(top.values == float("-inf"), -1).permute(2, 0, 1, 3)
        return out


class _Chunk:
    """Recomputed pieces of one query chunk: positions, scaled queries in both layouts, compressed probabilities."""

    def __init__(self, lay: _Layout, q: torch.Tensor, a: int, e: int, ck_t: torch.Tensor, raw: bool = False):
        self.a, self.e, self.c = a, e, e - a
        self.p0, self.p1 = lay.start + a, lay.start + e
        self.pos = torch.arange(self.p0, self.p1, device=lay.device)
        qc = q[:, a:e] * lay.scale
        self.qr = lay.rows(qc)  # (B, Hkv, G * c, D)
        self.qs = lay.per_query(qc) if lay.kernel is None else None  # (c * B * Hkv, G, D): torch ops' layout
        self.nv = min(lay.visible(self.p1 - 1), lay.nc)  # memory slots included
        self.probs = self.logits = self.raw = None
        if self.nv:
            first = min(lay.visible(self.p0), self.nv)  # columns every query of the chunk sees
            s = torch.matmul(self.qr, ck_t[:, :, :self.nv].transpose(-1, -2))  # (B, Hkv, G * c, nv)
            if raw:  # the scores as they are: the kernel's fused softmax (and selection) take them from here
                self.raw = s
                return
            if first < self.nv:
                tail = s.view(lay.b, lay.hkv, lay.g, self.c, self.nv)[..., first:]
                tail.masked_fill_(lay.cmp_mask(self.pos, first, self.nv), float("-inf"))
            self.logits = s if lay.logits else None  # (masked: -inf; mean_logits reads only complete blocks)
            self.probs = torch.softmax(s, -1)
            if first == 0:  # queries that see no complete block yet: all-masked rows, zeros
                self.probs.nan_to_num_(0.0)


def _selected(lay: _Layout, ch: _Chunk, kt_blocks: torch.Tensor, vt_blocks: torch.Tensor, sel: torch.Tensor):
    """The selected branch of a chunk, by sub-chunks of ``lay.sub`` queries. Yields, per sub-chunk, its slice of
    the per-query layout, the flat block ids (into the (B * Hkv * nblk, l' * D) block tables), the gathered keys
    and values (m, S * l', D), the scaled scores (m, G, S * l') with the masked ones at the dtype's lowest finite
    value (not -inf: their probability is exactly 0 either way, and ``dS * S`` stays 0 there rather than NaN) and
    the probabilities (m, G, S * l'); ``sel`` (c, B, Hkv, n_sel)."""
    c, bh, n, l = ch.c, lay.bh, lay.slots, lay.sel_block
    own = (ch.pos // l).view(c, 1, 1, 1).expand(c, lay.b, lay.hkv, 1)
    idx = torch.cat([own, sel.long()], -1)  # (c, B, Hkv, S); slot 0 = the query's own block
    unused = None
    if ch.p0 < lay.n_sel * l or lay.min_importance > 0:  # later queries fill every slot, unless blocks are dropped
        unused = (idx < 0).view(c, bh, 1, n, 1)
        idx = idx.clamp(min=0)
    flat = (idx + (torch.arange(bh, device=lay.device) * lay.nblk).view(1, lay.b, lay.hkv, 1)).view(c, -1)
    after = torch.arange(l, device=lay.device)[None, :] > (ch.pos % l)[:, None]  # (c, l'): own block, after p
    lowest = torch.finfo(kt_blocks.dtype).min
    for a in range(0, c, lay.sub):
        e = min(a + lay.sub, c)
        f = flat[a:e].reshape(-1)
        ks = kt_blocks.index_select(0, f).view(-1, n * l, lay.d)
        vs = vt_blocks.index_select(0, f).view(-1, n * l, lay.d)
        s = torch.bmm(ch.qs[a * bh:e * bh], ks.transpose(1, 2))  # (m, G, S * l')
        s5 = s.view(e - a, bh, lay.g, n, l)
        s5[:, :, :, 0].masked_fill_(after[a:e, None, None], lowest)
        if unused is not None:
            s5.masked_fill_(unused[a:e], lowest)
        yield a * bh, e * bh, f, ks, vs, s, torch.softmax(s, -1)  # the query's own key is always readable


def _outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T b`` per batch entry, a (m, G, N), b (m, G, D) -> (m, N, D): a sum of G outer products. With G = 1 a
    broadcast product (the same values: one product per element), which on a CPU costs a fraction of a batched
    matmul of inner dimension 1."""
    if a.shape[1] == 1:
        return a.transpose(1, 2) * b
    return torch.bmm(a.transpose(1, 2), b)


def _selected_backward(lay: _Layout, ch: _Chunk, kt_blocks, vt_blocks, dkt_blocks, dvt_blocks, sel, dos, gc, dg):
    """The selected branch's backward for one chunk with torch ops: adds dk, dv into the block tables, writes the
    gate's gradient into ``dg[..., 1]``; -> dq (per-query layout) and ``d_slot`` (c * B * Hkv, slots) for
    diff_topk (None without it)."""
    c, blk = ch.c, lay.sel_block * lay.d
    g_s = lay.per_query(gc[..., 1:2])  # (c * B * Hkv, G, 1)
    dq_s = torch.empty_like(ch.qs)
    delta_s = dq_s.new_empty(c * lay.bh, lay.g)
    d_slot = dq_s.new_zeros(c * lay.bh, lay.slots) if lay.diff_topk else None
    for r0, r1, f, ks, vs, s, ps in _selected(lay, ch, kt_blocks, vt_blocks, sel):
        do_r, g_r = dos[r0:r1], g_s[r0:r1]
        dp = torch.bmm(do_r, vs.transpose(1, 2))  # (m, G, N)
        delta_s[r0:r1] = torch.linalg.vecdot(ps, dp)  # = dO . O_sel: the gate's gradient
        ds = torch._softmax_backward_data(dp, ps, -1, dp.dtype)
        if d_slot is not None and lay.gate_keys:  # keys x gate: dS . S over each slot's keys (dS is 0 where a key
            # is masked, and S finite there)
            d_slot[r0:r1] = ((ds * s).view(r1 - r0, lay.g, lay.slots, -1).sum(-1) * g_r).sum(1)
        elif d_slot is not None:  # dO . (gated output of each slot's block), summed over the group's heads
            d_slot[r0:r1] = ((ps * dp).view(r1 - r0, lay.g, lay.slots, -1).sum(-1) * g_r).sum(1)
        torch.bmm(ds, ks, out=dq_s[r0:r1]).mul_(g_r * lay.scale)
        dkt_blocks.index_add_(0, f, _outer(ds, ch.qs[r0:r1] * g_r).view(-1, blk))
        dvt_blocks.index_add_(0, f, _outer(ps, do_r * g_r).view(-1, blk))
    dg[..., 1] = lay.unper_query(delta_s, c)[..., 0]
    return dq_s, d_slot


def _window_probs(lay: _Layout, ch: _Chunk, kt, vt):
    lo, hi = max(0, ch.p0 - lay.window + 1), ch.p1
    kw, vw = kt[:, :, lo:hi], vt[:, :, lo:hi]
    s = torch.matmul(ch.qr, kw.transpose(-1, -2))  # (B, Hkv, G * c, L)
    s.view(lay.b, lay.hkv, lay.g, ch.c, hi - lo).masked_fill_(lay.window_mask(ch.pos, lo, hi), float("-inf"))
    return lo, hi, kw, vw, torch.softmax(s, -1)


def _importance_grad(lay: _Layout, ch: _Chunk, d_slot: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
    """diff_topk: the gradient (B, Hkv, c, nv) of a chunk's compressed probabilities (summed over a group's heads)
    through the importances of the selected past blocks. ``d_slot`` (c * B * Hkv, slots): dL/d(importance) of each
    slot (the selected branch's output of that slot's block, dotted with dO); ``sel`` (c, B, Hkv, n_sel)."""
    c, cand, nb = ch.c, (ch.p1 - 1) // lay.sel_block, ch.nv - lay.mem
    if cand == 0 or nb == 0:  # no past block to select yet, or no complete compressed block (memory slots only)
        return d_slot.new_zeros(lay.b, lay.hkv, c, ch.nv)
    dsel = d_slot.view(c, lay.b, lay.hkv, lay.slots)[..., 1:]  # the past slots (slot 0, the own block, has no factor)
    idx = sel.long()
    if lay.logits and lay.block == lay.stride == lay.sel_block:  # the identity mapping: the softmax's adjoint by hand
        return _logit_importance_grad(lay, ch, dsel, idx, cand, nb)
    dblk = dsel.new_zeros(c, lay.b, lay.hkv, max(cand, 1))
    dblk.scatter_add_(-1, idx.clamp(min=0), dsel * (idx >= 0))  # unused slots (-1) add 0
    dblk = dblk[..., :cand].permute(1, 2, 0, 3)  # (B, Hkv, c, cand)
    with torch.enable_grad():
        if lay.logits:  # through the softmax over the past blocks and the mapping to the group-mean logits
            x = lay.mean_logits(ch.logits, ch.pos).detach().requires_grad_()
            y = logit_importance(x, ch.pos // lay.sel_block, lay.block, lay.stride, lay.sel_block, cand, lay.mapping)
        else:  # the adjoint of the (linear) score mapping
            x = dblk.new_zeros(lay.b, lay.hkv, c, nb, requires_grad=True)
            y = _to_selection(x, lay.block, lay.stride, lay.sel_block, cand, lay.mapping)
        (grad,) = torch.autograd.grad(y, x, dblk, allow_unused=True)
    if grad is None:
        grad = dblk.new_zeros(lay.b, lay.hkv, c, nb)
    if lay.logits:  # the mean over the group's heads, complete blocks only: each head's score gets grad / G
        grad = grad.masked_fill(lay.cmp_mask(ch.pos, lay.mem, ch.nv), 0.0) / lay.g
    return F.pad(grad, (lay.mem, 0))  # memory slots are no block: no importance


def _logit_importance_grad(lay: _Layout, ch: _Chunk, dsel: torch.Tensor, idx: torch.Tensor, cand: int,
                           nb: int) -> torch.Tensor:
    """:func:`_importance_grad` for ``importance=logits_softmax`` with the identity score mapping (compressed and
    selection blocks the same): ``y = softmax(z over the past blocks)``, so ``dz = y * (dy - <y, dy>)``, and ``dy``
    is nonzero at the selected blocks only (``dsel`` (c, B, Hkv, n_sel) at ``idx``, -1 = unused): one dense pass
    ``-y <y, dy>`` plus a scatter of ``y dy`` at the selected blocks, no dense ``dy`` and no autograd graph."""
    c = ch.c
    z = lay.mean_logits(ch.logits, ch.pos)  # (B, Hkv, c, nb)
    y = _logit_importance_of_chunk(z, ch.pos // lay.sel_block, lay.block, lay.stride, lay.sel_block, cand, lay.mapping)
    at = idx.permute(1, 2, 0, 3)  # (B, Hkv, c, n_sel)
    dy = dsel.permute(1, 2, 0, 3) * (at >= 0)  # unused slots (-1) contribute nothing
    at = at.clamp(min=0)
    ydy = y.gather(-1, at) * dy
    dz = y * ydy.sum(-1, keepdim=True).neg_()
    dz.scatter_add_(-1, at, ydy)  # (B, Hkv, c, cand)
    grad = dz.new_zeros(lay.b, lay.hkv, c, ch.nv)  # memory slots first (no block: no importance)
    n = min(cand, nb)
    grad[..., lay.mem:lay.mem + n] = dz[..., :n]
    # the mean over the group's heads, complete blocks only: each head's score gets grad / G
    return grad.masked_fill_(F.pad(lay.cmp_mask(ch.pos, lay.mem, ch.nv), (lay.mem, 0)), 0.0).div_(lay.g)


class _NSAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ck, cv, gates, kw, vw, lay: _Layout):
        kt, vt = lay.heads_major(k), lay.heads_major(v)  # (B, Hkv, nblk * l', D)
        kwt, vwt = (lay.heads_major(kw), lay.heads_major(vw)) if lay.separate else (kt, vt)  # the window's
        kt_blocks = kt.view(-1, lay.sel_block * lay.d)  # (B * Hkv * nblk, l' * D): one row per block
        vt_blocks = vt.view(-1, lay.sel_block * lay.d)
        ck_t, cv_t = ck.transpose(1, 2).contiguous(), cv.transpose(1, 2).contiguous()  # (B, Hkv, Nc, D)
        out = q.new_empty(q.shape)
        sel_all = torch.empty(lay.tq, lay.b, lay.hkv, lay.n_sel, dtype=torch.int32, device=lay.device)
        for a, e in lay.chunks():
            ch = _Chunk(lay, q, a, e, ck_t, raw=lay.fused_forward)
            gc = gates[:, a:e].view(lay.b, ch.c, lay.hkv, lay.g, 3)
            if ch.raw is not None:  # the softmax (in place) and the selection in one pass over the scores
                sel = torch.empty(ch.c, lay.b, lay.hkv, lay.n_sel, dtype=torch.int64, device=lay.device)
                lay.kernel.compressed_select(ch.raw, sel, lay.g, ch.p0, lay.block, lay.stride, lay.mem,
                                             lay.sel_block, lay.n_sel, (ch.p1 - 1) // lay.sel_block, lay.initial,
                                             lay.local, lay.min_importance, lay.logits)
                ch.probs = ch.raw
            else:
                sel = lay.select(ch.probs, ch.pos, ch.p1, ch.logits)
            sel_all[a:e] = sel
            o = out[:, a:e].view(lay.b, ch.c, lay.hkv, lay.g, lay.d)
            _, _, _, vwin, pw = _window_probs(lay, ch, kwt, vwt)
            if lay.kernel is None:
                sub = lay.sub
                for i, (r0, r1, _, _, vs, _, ps) in enumerate(_selected(lay, ch, kt_blocks, vt_blocks, sel)):
                    a2 = i * sub
                    torch.mul(lay.unper_query(torch.bmm(ps, vs), (r1 - r0) // lay.bh),
                              gc[:, a2:a2 + sub, ..., 1:2], out=o[:, a2:a2 + sub])
                o.addcmul_(lay.unrows(torch.matmul(pw, vwin), ch.c), gc[..., 2:3])
            else:  # the kernel adds the selected branch after the loop
                torch.mul(lay.unrows(torch.matmul(pw, vwin), ch.c), gc[..., 2:3], out=o)
            if ch.probs is not None:
                o.addcmul_(lay.unrows(torch.matmul(ch.probs, cv_t[:, :, :ch.nv]), ch.c), gc[..., 0:1])
        if lay.kernel is not None:  # out += g_sel * selected, every query's blocks read in place from kt, vt
            lay.kernel.forward(q, lay.blocks_transposed(kt), vt, sel_all, gates[..., 1].contiguous(), out,
                               lay.sel_block, lay.start, lay.scale)
        ctx.save_for_backward(q, k, v, ck, cv, gates, sel_all, *((kw, vw) if lay.separate else ()))
        ctx.lay = lay
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, ck, cv, gates, sel_all, *window_kv = ctx.saved_tensors
        lay: _Layout = ctx.lay
        dtype = q.dtype
        kt, vt = lay.heads_major(k), lay.heads_major(v)
        kwt, vwt = (lay.heads_major(t) for t in window_kv) if lay.separate else (kt, vt)
        kt_blocks, vt_blocks = kt.view(-1, lay.sel_block * lay.d), vt.view(-1, lay.sel_block * lay.d)
        ck_t, cv_t = ck.transpose(1, 2).contiguous(), cv.transpose(1, 2).contiguous()
        dq = torch.empty_like(q)
        dkt, dvt = torch.zeros_like(kt), torch.zeros_like(vt)
        dkt_blocks, dvt_blocks = dkt.view_as(kt_blocks), dvt.view_as(vt_blocks)
        dkwt, dvwt = (torch.zeros_like(kwt), torch.zeros_like(vwt)) if lay.separate else (dkt, dvt)
        dck_t, dcv_t = torch.zeros_like(ck_t), torch.zeros_like(cv_t)
        dgates = torch.empty_like(gates)  # (B, T, H, 3)
        d_slots = None
        if lay.kernel is not None:  # the selected branch for every query first: dq, dgates[..., 1], dk, dv
            d_slots = q.new_empty(lay.tq, lay.b, lay.hkv, lay.slots) if lay.diff_topk else None
            dg_sel = q.new_empty(lay.b, lay.tq, lay.h)
            lay.kernel.backward(q, kt, lay.blocks_transposed(kt), lay.blocks_transposed(vt), sel_all,
                                gates[..., 1].contiguous(), grad_out.contiguous(), dq, dkt, dvt, dg_sel, d_slots,
                                lay.gate_keys, lay.sel_block, lay.start, lay.scale)
            dgates[..., 1] = dg_sel
        for a, e in lay.chunks():
            ch = _Chunk(lay, q, a, e, ck_t, raw=lay.fused_backward)
            c = ch.c
            gc = gates[:, a:e]
            go = grad_out[:, a:e].contiguous()  # (a sum's gradient arrives expanded, with zero strides)
            dor = lay.rows(go)  # dO as rows (and per query, for torch ops' selected branch)
            dg = dgates[:, a:e].view(lay.b, c, lay.hkv, lay.g, 3)

            # selected branch (torch ops): dq in the per-query layout, dk/dv added block by block
            if lay.kernel is None:
                dq_s, d_slot = _selected_backward(lay, ch, kt_blocks, vt_blocks, dkt_blocks, dvt_blocks, sel_all[a:e],
                                                  lay.per_query(go), gc, dg)
            else:  # done above, for every query
                dq_s, d_slot = None, d_slots[a:e].view(c * lay.bh, lay.slots) if d_slots is not None else None

            # window branch
            g_r = lay.rows(gc[..., 2:3])
            lo, hi, kw, vw, pw = _window_probs(lay, ch, kwt, vwt)
            dp = torch.matmul(dor, vw.transpose(-1, -2))  # (B, Hkv, G * c, L)
            dg[..., 2] = lay.unrows(torch.linalg.vecdot(pw, dp)[..., None], c)[..., 0]
            ds = torch._softmax_backward_data(dp, pw, -1, dtype)
            del dp
            dq_r = torch.matmul(ds, kw).mul_(g_r * lay.scale)
            dkwt[:, :, lo:hi] += torch.matmul(ds.transpose(-1, -2), ch.qr * g_r)
            dvwt[:, :, lo:hi] += torch.matmul(pw.transpose(-1, -2), dor * g_r)
            del pw, ds

            # compressed branch
            if ch.raw is not None:
                g_r = lay.rows(gc[..., 0:1])
                nv, pc = ch.nv, ch.raw  # (the kernel turns the scores into probabilities in place)
                ds = torch.matmul(dor, cv_t[:, :, :nv].transpose(-1, -2))  # dP in, dS out (in place)
                dg0 = ds.new_empty(lay.b, lay.hkv, lay.g * c, 1)
                cand = (ch.p1 - 1) // lay.sel_block
                imp = d_slot is not None and cand > 0 and nv > lay.mem  # diff_topk: the importance gradient too
                lay.kernel.compressed_backward(pc, ds, g_r.contiguous(), dg0,
                                               d_slots[a:e] if imp else None, sel_all[a:e] if imp else None,
                                               lay.g, ch.p0, lay.block, lay.stride, lay.mem, lay.sel_block, lay.n_sel,
                                               cand)
                dg[..., 0] = lay.unrows(dg0, c)[..., 0]
                dq_r += torch.matmul(ds, ck_t[:, :, :nv]).mul_(lay.scale)
                dck_t[:, :, :nv] += torch.matmul(ds.transpose(-1, -2), ch.qr)
                dcv_t[:, :, :nv] += torch.matmul(pc.transpose(-1, -2), dor * g_r)
                del ds
            elif ch.probs is not None:
                g_r = lay.rows(gc[..., 0:1])
                nv, pc = ch.nv, ch.probs
                dp = torch.matmul(dor, cv_t[:, :, :nv].transpose(-1, -2))  # (B, Hkv, G * c, nv)
                dg[..., 0] = lay.unrows(torch.linalg.vecdot(pc, dp)[..., None], c)[..., 0]
                ds = torch._softmax_backward_data(dp, pc, -1, dtype).mul_(g_r)
                del dp
                if d_slot is not None:  # diff_topk: the selected blocks' importances are functions of pc
                    dimp = _importance_grad(lay, ch, d_slot, sel_all[a:e])  # (B, Hkv, c, nv)
                    if lay.logits:  # of the scores themselves: every head of the group gets it (broadcast, in place)
                        ds.view(lay.b, lay.hkv, lay.g, c, nv).add_(dimp[:, :, None])
                    else:  # of the probabilities, through their softmax
                        dimp = dimp[:, :, None].expand(-1, -1, lay.g, -1, -1).reshape(lay.b, lay.hkv, lay.g * c, nv)
                        ds += torch._softmax_backward_data(dimp, pc, -1, dtype)
                dq_r += torch.matmul(ds, ck_t[:, :, :nv]).mul_(lay.scale)
                dck_t[:, :, :nv] += torch.matmul(ds.transpose(-1, -2), ch.qr)
                dcv_t[:, :, :nv] += torch.matmul(pc.transpose(-1, -2), dor * g_r)
                del ds
            else:
                dg[..., 0] = 0
            ch.probs = ch.raw = None
            dq_c = dq[:, a:e].view(lay.b, c, lay.hkv, lay.g, lay.d)
            if dq_s is None:  # the kernel's selected dq is there already
                dq_c.add_(lay.unrows(dq_r, c))
            else:
                torch.add(lay.unrows(dq_r, c), lay.unper_query(dq_s, c), out=dq_c)
        dk = dkt[:, :, :lay.tk].transpose(1, 2)
        dv = dvt[:, :, :lay.tk].transpose(1, 2)
        dkw = dkwt[:, :, :lay.tk].transpose(1, 2) if lay.separate else None
        dvw = dvwt[:, :, :lay.tk].transpose(1, 2) if lay.separate else None
        return dq, dk, dv, dck_t.transpose(1, 2), dcv_t.transpose(1, 2), dgates, dkw, dvw, None


def nsa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor,
                  gates: torch.Tensor, *, block: int, stride: int, sel_block: int, n_sel: int, window: int,
                  scale: float, chunk: int | None = None, initial: int = 0, local: int = 1,
                  mapping: str = "overlap", diff_topk: bool = False, mem: int = 0,
                  window_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                  importance: str = "probs_sum", min_importance: float = 0.0,
                  diff_topk_gate: str = "output", cpu_kernel: str = "auto") -> torch.Tensor:
    """NSA attention of q (B, Tq, H, D) over k, v (B, Tk, Hkv, D) and compressed ck, cv (B, Nc, Hkv, D).

    Query ``i`` sits at position ``Tk - Tq + i``. ``gates`` (B, Tq, H, 3): the compressed, selected and window
    gates (after the sigmoid). Returns (B, Tq, H, D) in q's dtype; differentiable in q, k, v, ck, cv, gates
    (the block selection itself is discrete). ``chunk``: queries per chunk (default: 64, halved while one
    chunk's compressed scores exceed ``SCORE_BUDGET`` elements). ``initial``/``local``: the forced first blocks
    and local blocks (own block included), ``mapping`` (overlap | eq9) and ``diff_topk`` (the importances of the
    selected past blocks get gradients: each block's part of the selected output is scaled by a straight-through
    ``1 + s - s.detach()``), as ``attention.nsa.*`` define them. ``mem``: the first ``mem`` rows of ck/cv are
    learned memory slots every query reads (no block: they take no part in the selection). ``window_kv``: the
    window branch's own keys/values (B, Tk, Hkv, D) (``separate_kv``); None: it reads k, v. ``importance``:
    probs_sum | logits_softmax (:func:`logit_importance`); past blocks whose importance is below ``min_importance``
    are not selected (forced ones excepted), their slots left unused. ``diff_topk_gate``: what the straight-through
    factor of ``diff_topk`` scales, each selected past block's part of the output or (``keys``) its keys.
    ``cpu_kernel``: auto | on | off, whether the selected branch runs as the compiled C++ kernel
    (:mod:`efftx.kernels.nsa_selected_cpu`; auto: where it builds) or with torch ops.
    """
    dtype = q.dtype
    work = torch.promote_types(dtype, torch.float32)
    q, k, v, ck, cv, gates = (t.to(work) for t in (q, k, v, ck, cv, gates))
    q = q.contiguous()  # the kernel reads (B, T, H, D) rows; so does the backward's dq
    kw, vw = (t.to(work) for t in window_kv) if window_kv is not None else (None, None)
    if cpu_kernel not in CPU_KERNEL_MODES:
        raise ValueError(f"cpu_kernel must be one of {', '.join(CPU_KERNEL_MODES)}, got {cpu_kernel!r}")
    kernel = None
    if q.device.type == "cpu" and cpu_kernel != "off":
        from efftx.kernels.nsa_selected_cpu import kernel as compiled  # (importing efftx.kernels imports Triton)

        kernel = compiled(required=cpu_kernel == "on")
    lay = _Layout(q, k, ck, block, stride, sel_block, n_sel, window, scale, k.shape[1] - q.shape[1], chunk,
                  initial, local, mapping, diff_topk, mem, window_kv is not None, importance, min_importance,
                  diff_topk_gate, kernel)
    with torch.autocast(q.device.type, enabled=False):
        out = _NSAFunction.apply(q, k, v, ck, cv, gates, kw, vw, lay)
    return out.to(dtype)

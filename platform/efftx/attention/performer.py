"""Performer attention: FAVOR+ positive orthogonal random features (Choromanski et al., 2021).

Softmax attention weighs key j for query i by ``exp(q_i·k_j / sqrt(D))``. FAVOR+ writes that kernel
as an expectation over random vectors w ~ N(0, I_D):

    exp(q·k / sqrt(D)) = E_w[ phi_w(q) phi_w(k) ],   phi_w(x) = exp(w·x̂ - |x̂|²/2),  x̂ = x · D^-0.25

and estimates it with ``m = nb_features`` fixed draws stacked in a projection W (m, D):
``phi(x) = exp(W x̂ - |x̂|²/2) / sqrt(m)``, a positive (m,) feature vector. The rows of W are
orthogonal within blocks of D (QR of Gaussian matrices) and rescaled by chi-distributed norms, so
each row is still marginally Gaussian but the estimate has lower variance. Attention then becomes

    out_i = phi(q_i)ᵀ S_i / phi(q_i)ᵀ z_i,
    S_i = Σ_{j<=i} phi(k_j) v_jᵀ  (m, D),   z_i = Σ_{j<=i} phi(k_j)  (m,)

which costs O(T·m·D) instead of O(T²·D). Causal prefix sums are computed chunk by chunk
(``chunk_size`` C): a chunk sees the exclusive running sums of all earlier chunks plus its own
C×C lower-triangular block of ``phi(q)ᵀphi(k)``; no T×T tensor is ever built.

Numerics: features are computed in float32 (float64 for float64 inputs), outside autocast. The
query features subtract their own row maximum before ``exp``, a per-query factor that cancels
between numerator and denominator. Keys get no data-dependent stabiliser (one that looked at
other keys would break causality and cached decoding); instead the key exponent is clamped at a
fixed ``KEY_EXP_MAX``, which only bites for pathological keys (|k| ≈ D^0.75 aligned with a
feature) and keeps float32 sums finite. The denominator is clamped at ``EPS``.

Features: W is a buffer (saved in checkpoints) drawn from a ``torch.Generator`` seeded by
(train.seed, layer index, redraw index), never the global RNG, so every data-parallel rank and
every resumed run hold the same features. In training mode the buffer ``calls`` counts forward
passes; the pass numbered n (from 0) uses draw ``n // feature_redraw_interval`` (0 = never
redraw). The redraw happens at the start of a pass, so a reversible/checkpointed recompute
(:func:`efftx.attention.base.recomputing`) sees the same features and does not count.

Training/prefill on CPU (causal): :func:`chunked_causal_favor`, one autograd.Function computing the same
sums from raw q, k, v chunk by chunk (chunks batched in segments, ``segment_length``), which saves its inputs,
its output, one denominator per query and the state entering each segment, and recomputes every feature in
the backward (not the numerator); the composition above (autograd through ``feature_map`` and
``causal_linear_attention``, which keeps every token's features and every chunk's intra-chunk products)
runs for non-causal prefills, on CUDA and with ``backend.chunked = False``.

Decoding: :class:`PerformerCache` carries the state ``Σ phi(k) [v, 1]`` (B, Hkv, m, D + 1) in float64, so
a new token costs O(m·D) whatever the prompt length: a decode step (one token per row) is a handful of
small operations (its features, one outer-product update of the state, one read). The cache also records
each token's phi(k) and v, read only by ``rewind(n)``, which subtracts the removed tokens' contributions:
O(n), and exact to float64 rounding because every contribution is the same float64 product when added and
when subtracted.

Attention dropout (``attention.dropout``) is ignored: the attention probabilities are never
materialised, so there is nothing to drop.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from efftx.attention.base import AttentionBackend, AttentionSpec, is_recomputing
from efftx.attention.cache import RowLengths
from efftx.attention.registry import register
from efftx.errors import ConfigError
from efftx.host import host_values

KEY_EXP_MAX = 50.0  # cap on a key feature's exponent: exp(50) * tokens stays far below float32 max
EPS = 1e-6  # floor of the attention denominator phi(q)·z


@dataclass
class PerformerOptions:
    """attention.kind=performer: FAVOR+ positive orthogonal random features (Choromanski et al., 2021)."""

    nb_features: int = 256  # random features per head
    feature_redraw_interval: int = 1000  # training forward passes between feature redraws; 0 = never
    # causal prefix sums are computed chunk by chunk (memory linear in T); the C x C intra-chunk products cost
    # ~4·C·m per token and head in training, the inter-chunk state products ~7·m·(D + 1): 64 is ~8% faster
    # than 128 on CPU at T = 2048..8192 (m = 256, D = 64), 32 slower again (small products)
    chunk_size: int = 64

    def validate(self, spec: AttentionSpec) -> None:
        """Checks of this section; errors name the keys."""
        if self.nb_features < 1:
            raise ConfigError(f"attention.performer.nb_features={self.nb_features} must be >= 1")
        if self.chunk_size < 1:
            raise ConfigError(f"attention.performer.chunk_size={self.chunk_size} must be >= 1")
        if self.feature_redraw_interval < 0:
            raise ConfigError(f"attention.performer.feature_redraw_interval={self.feature_redraw_interval} "
                              f"must be >= 0")


def draw_seed(seed: int, layer_index: int, redraw: int) -> int:
    """A 63-bit generator seed from (run seed, layer, redraw index); same on every host."""
    digest = hashlib.sha256(f"efftx-performer:{seed}:{layer_index}:{redraw}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def orthogonal_features(nb_features: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """(nb_features, dim) float32: blocks of dim orthonormal rows, each row scaled by a chi(dim) norm."""
    blocks = []
    for _ in range(math.ceil(nb_features / dim)):
        g = torch.randn(dim, dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        q = q * torch.sign(torch.diagonal(r))[None, :]  # unique (Haar-distributed) orthogonal matrix
        blocks.append(q.T)  # rows orthonormal
    w = torch.cat(blocks)[:nb_features]  # (m, D)
    norms = torch.randn(nb_features, dim, generator=generator, dtype=torch.float64).norm(dim=1, keepdim=True)
    return (w * norms).float()


def feature_map(x: torch.Tensor, projection: torch.Tensor, *, is_query: bool) -> torch.Tensor:
    """phi(x) = exp(W x̂ - |x̂|²/2) / sqrt(m), x̂ = x · D^-0.25: (..., D) -> (..., m).

    Queries subtract their row maximum (cancels in the attention ratio); keys are clamped at
    ``KEY_EXP_MAX`` (a no-op for all but pathological keys). Computed in ``x``'s dtype.
    """
    d = x.shape[-1]
    m = projection.shape[0]
    x = x * d ** -0.25
    logits = x @ projection.to(x.dtype).T - (x * x).sum(-1, keepdim=True) / 2  # (..., m)
    if is_query:
        logits = logits - logits.amax(-1, keepdim=True).detach()
    else:
        logits = logits.clamp(max=KEY_EXP_MAX)
    return torch.exp(logits) / math.sqrt(m)


def causal_linear_attention(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor, chunk_size: int,
                            s0: torch.Tensor | None = None, z0: torch.Tensor | None = None):
    """Causal FAVOR+ over chunks.

    qf: (B, T, Hkv, R, m) query features (R query heads per kv head); kf: (B, T, Hkv, m);
    v: (B, T, Hkv, D); s0 (B, Hkv, m, D), z0 (B, Hkv, m): sums of earlier tokens, or None.
    Returns out (B, T, Hkv, R, D) and the sums after the last token, s (B, Hkv, m, D), z (B, Hkv, m).
    """
    b, t, hkv, r, m = qf.shape
    d = v.shape[-1]
    c = max(1, min(chunk_size, t))
    n = math.ceil(t / c)
    pad = n * c - t
    if pad:  # zero key features and values add nothing; padded queries are dropped at the end
        qf = F.pad(qf, (0, 0, 0, 0, 0, 0, 0, pad))
        kf = F.pad(kf, (0, 0, 0, 0, 0, pad))
        v = F.pad(v, (0, 0, 0, 0, 0, pad))
    qc = qf.reshape(b, n, c, hkv, r, m)
    kc = kf.reshape(b, n, c, hkv, m)
    vc = v.reshape(b, n, c, hkv, d)

    # inter-chunk: exclusive prefix sums over whole chunks (shift, not subtract: exactly causal)
    s_incl = torch.einsum("bnchm,bnchd->bnhmd", kc, vc).cumsum(1)  # (B, n, Hkv, m, D)
    z_incl = kc.sum(2).cumsum(1)  # (B, n, Hkv, m)
    s_prev = torch.cat((torch.zeros_like(s_incl[:, :1]), s_incl[:, :-1]), 1)
    z_prev = torch.cat((torch.zeros_like(z_incl[:, :1]), z_incl[:, :-1]), 1)
    if s0 is not None:
        s_prev, s_incl = s_prev + s0[:, None], s_incl + s0[:, None]
        z_prev, z_incl = z_prev + z0[:, None], z_incl + z0[:, None]
    num = torch.einsum("bnchrm,bnhmd->bnchrd", qc, s_prev)  # (B, n, C, Hkv, R, D)
    den = torch.einsum("bnchrm,bnhm->bnchr", qc, z_prev)  # (B, n, C, Hkv, R)

    # intra-chunk: C x C lower-triangular block of phi(q)·phi(k)
    scores = torch.einsum("bnihrm,bnjhm->bnhrij", qc, kc)  # (B, n, Hkv, R, C, C)
    future = torch.ones(c, c, dtype=torch.bool, device=qf.device).triu(1)
    scores = scores.masked_fill(future, 0.0)
    num = num + torch.einsum("bnhrij,bnjhd->bnihrd", scores, vc)
    den = den + scores.sum(-1).permute(0, 1, 4, 2, 3)  # (B, n, C, Hkv, R)

    out = num / den.clamp_min(EPS)[..., None]
    out = out.reshape(b, n * c, hkv, r, d)[:, :t]
    return out, s_incl[:, -1], z_incl[:, -1]


def _features(x: torch.Tensor, w: torch.Tensor, is_query: bool, mask: bool = True):
    """:func:`feature_map` of (..., D) rows in few passes; returns (phi, x̂) and, for keys with ``mask``, the
    mask of exponents clamped at ``KEY_EXP_MAX`` (for the backward; None without ``mask``: the forward skips it).

    Queries: the row maximum is subtracted, so the row constant -|x̂|²/2 cancels and is left out; keys: the
    1/sqrt(m) factor goes into the exponent (clamped at ``KEY_EXP_MAX`` - log sqrt(m), the same bound)."""
    log_norm = 0.5 * math.log(w.shape[0])
    if torch.is_grad_enabled() and x.requires_grad:  # (out= records no graph)
        xh = (x * x.shape[-1] ** -0.25).contiguous()
    else:  # contiguous whatever x's layout, in one pass
        xh = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        torch.mul(x, x.shape[-1] ** -0.25, out=xh)
    # one (rows, D) x (D, m) product: a matmul of an N-d tensor by W would broadcast W into a slower bmm
    logits = (xh.view(-1, xh.shape[-1]) @ w.T).view(*xh.shape[:-1], w.shape[0])  # (..., m)
    inplace = not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))  # no graph to keep
    if is_query:
        shift = logits.amax(-1, keepdim=True).detach() + log_norm
        logits = logits.sub_(shift) if inplace else logits - shift
        return (logits.exp_() if inplace else logits.exp()), xh, None
    shift = (xh * xh).sum(-1, keepdim=True) / 2 + log_norm
    logits = logits.sub_(shift) if inplace else logits - shift
    bound = KEY_EXP_MAX - log_norm
    clamped = logits > bound if mask else None
    logits = logits.clamp_(max=bound) if inplace else logits.clamp(max=bound)
    return (logits.exp_() if inplace else logits.exp()), xh, clamped


def _features_backward(dphi: torch.Tensor, phi: torch.Tensor, xh: torch.Tensor, w: torch.Tensor,
                       clamped: torch.Tensor | None) -> torch.Tensor:
    """Gradient of x̂ from that of phi = exp(W x̂ - |x̂|²/2 [- max]) / sqrt(m) (that of x = x̂ D^0.25 is this
    times D^-0.25; the query's maximum is a constant, as in :func:`feature_map`; clamped key exponents pass
    no gradient)."""
    dlogits = dphi.mul_(phi)
    if clamped is not None and bool(clamped.any()):
        dlogits.masked_fill_(clamped, 0.0)
    dx = (dlogits.view(-1, w.shape[0]) @ w).view(xh.shape)
    return dx.sub_(xh * dlogits.sum(-1, keepdim=True))  # times D^-0.25: the caller's (into its output)


# Elements of a segment's (B, H, tokens, m) query features, at most. Every large operation of the chunked
# function runs once per segment, and on a CPU each one waits for all threads (on a loaded machine for as long
# as the scheduler takes to run them all), so fewer, larger segments are faster; the segment's temporaries
# (about a dozen tensors of this size in the backward) bound the memory. At T = 2048 (8 heads x 256 features,
# chunks of 64) the bench's layer peaks at ~1.0x dense's memory with 1 << 19 (8 segments), ~1.25-1.45x with
# 1 << 20 (too close to issue 17's bound of 1.5x), ~1.9x with 1 << 21.
SEGMENT_BUDGET = 1 << 19


def segment_length(batch: int, heads: int, nb_features: int, chunk: int) -> int:
    """Tokens per segment of :func:`chunked_causal_favor`: whole chunks, as many as keep the segment's query
    features within ``SEGMENT_BUDGET`` elements (at least one chunk)."""
    return chunk * max(1, SEGMENT_BUDGET // (batch * heads * nb_features * chunk))


class _CausalFavor(torch.autograd.Function):
    """Causal FAVOR+ from raw q (B, T, H, D), k, v (B, T, Hkv, D) and the projection W (m, D).

    Tokens go in chunks of ``c`` (the chunk size of :func:`causal_linear_attention`, same sums), and chunks in
    segments of several chunks processed as one batch (few, large operations); the state carries from one
    segment to the next. Per kv head the group's query heads are stacked as rows, and values carry an extra
    column of ones, so one state ``S = Σ phi(k) [v, 1]`` (m, D + 1) and one product give both the numerator
    and the denominator. The forward saves its inputs, its output (the tensor it returns, which the output
    projection keeps anyway), each query's denominator and the state entering each segment
    ((T / segment) x m x (D + 1) per kv head), never a token's features; the backward walks the segments
    backwards with the running gradient of the state, recomputing each segment's features, its chunks'
    states (from the segment's entering state) and its intra-chunk products from q, k and v (not the
    numerator: out and the denominator give its gradient).

    Every large operation runs once per segment (on a loaded CPU each one waits for all threads), and whole
    chunks are read from and written to the (B, T, H, D) tensors through strided views, without layout copies.
    """

    @staticmethod
    def _token_view(x: torch.Tensor, a: int, e: int, chunk: int, hkv: int) -> torch.Tensor:
        """Tokens [a, e) of x (B, T, H, X), a whole number of chunks, as a view (B, Hkv, n, R, c, X)."""
        b, _, h, width = x.shape
        n = (e - a) // chunk
        return x[:, a:e].view(b, n, chunk, hkv, h // hkv, width).permute(0, 3, 1, 4, 2, 5)

    @staticmethod
    def _rows(x: torch.Tensor, a: int, e: int, chunk: int, hkv: int) -> torch.Tensor:
        """Tokens [a, e) of x (B, T, H, X), padded with zeros to whole chunks, in the query-row layout
        (B, Hkv, n, R * c, X) (a copy)."""
        b, _, h, width = x.shape
        n = -(-(e - a) // chunk)
        pad = n * chunk - (e - a)
        x = F.pad(x[:, a:e], (0, 0, 0, 0, 0, pad)) if pad else x[:, a:e]
        x = x.reshape(b, n, chunk, hkv, h // hkv, width)
        return x.permute(0, 3, 1, 4, 2, 5).reshape(b, hkv, n, (h // hkv) * chunk, width)

    @staticmethod
    def _write(dst: torch.Tensor, a: int, e: int, chunk: int, hkv: int, rows: torch.Tensor, fn=None, *args):
        """dst[:, a:e] (B, T, H, X) = fn(rows, *args) (or rows) for rows in the layout of :meth:`_rows`; one
        operation straight into dst when [a, e) is whole chunks."""
        b, _, h, width = dst.shape
        r = h // hkv
        n = rows.shape[2]
        rows = rows.reshape(b, hkv, n, r, chunk, rows.shape[-1])[..., :width]
        args = [z.reshape(b, hkv, n, r, chunk, z.shape[-1]) if isinstance(z, torch.Tensor) else z for z in args]
        if (e - a) == n * chunk:
            view = _CausalFavor._token_view(dst, a, e, chunk, hkv)
            if fn is None:
                view.copy_(rows)
            else:
                fn(rows, *args, out=view)
            return
        full = rows if fn is None else fn(rows, *args)  # the last, partial segment
        dst[:, a:e] = full.permute(0, 2, 4, 1, 3, 5).reshape(b, n * chunk, h, width)[:, :e - a]

    @staticmethod
    def _segment(q, k, v, w, a, e, chunk, mask: bool = True):
        """Chunk-batched pieces of tokens [a, e), padded to whole chunks: query features qf and x̂
        (B, Hkv, n, R * c, m / D), key features kf and x̂ (B, Hkv, n, c, m / D), the keys' clamp mask,
        v_aug (B, Hkv, n, c, D + 1) (padded tokens: zero features, zero values, zero ones column). The clamp
        mask (None without ``mask``) is only needed by the backward."""
        b, _, _, d = q.shape
        hkv = k.shape[2]
        length = e - a
        n = -(-length // chunk)
        pad = n * chunk - length
        qf, qh, _ = _features(_CausalFavor._rows(q, a, e, chunk, hkv), w, is_query=True)
        ks = k[:, a:e] if not pad else F.pad(k[:, a:e], (0, 0, 0, 0, 0, pad))
        kf, kh, clamped = _features(ks.view(b, n, chunk, hkv, d).permute(0, 3, 1, 2, 4), w, is_query=False,
                                    mask=mask)
        v_aug = v.new_empty(b, hkv, n * chunk, d + 1)
        v_aug[:, :, :length, :d] = v[:, a:e].transpose(1, 2)
        v_aug[:, :, :length, d] = 1
        if pad:
            v_aug[:, :, length:] = 0
            kf.view(b, hkv, n * chunk, -1)[:, :, length:] = 0
        return qf, qh, kf, kh, clamped, v_aug.view(b, hkv, n, chunk, d + 1)

    @staticmethod
    def _segments(t: int, chunk: int, seg: int):
        return [(a, min(a + seg, t)) for a in range(0, t, seg)]

    @staticmethod
    def _states_before(kv: torch.Tensor, s0: torch.Tensor) -> torch.Tensor:
        """The state entering each chunk of a segment: s0 + the exclusive prefix sum of its chunks' kv."""
        out = torch.empty_like(kv)
        out[:, :, 0] = s0
        if kv.shape[2] > 1:
            torch.add(kv[:, :, :-1].cumsum(2), s0[:, :, None], out=out[:, :, 1:])
        return out

    @staticmethod
    def _intra(qf, kf, r: int, chunk: int) -> torch.Tensor:
        """The causal C x C blocks phi(q)·phi(k) of every chunk: (B, Hkv, n, R * c, c)."""
        b, hkv, n = qf.shape[:3]
        att = (qf @ kf.transpose(-1, -2)).view(b, hkv, n, r, chunk, chunk).tril_()
        return att.view(b, hkv, n, r * chunk, chunk)

    @staticmethod
    def forward(ctx, q, k, v, w, chunk: int, seg: int, state0: torch.Tensor | None = None):
        b, t, h, d = q.shape
        hkv = k.shape[2]
        r = h // hkv
        m = w.shape[0]
        out = q.new_empty(q.shape)
        # every query's denominator phi(q)·z (before the EPS floor), in the row layout, chunk by chunk
        den_all = q.new_empty(b, hkv, -(-t // chunk), r * chunk, 1)
        segments = _CausalFavor._segments(t, chunk, seg)
        entering = q.new_empty(len(segments), b, hkv, m, d + 1)  # the state entering each segment
        state = q.new_zeros(b, hkv, m, d + 1) if state0 is None else state0
        for i, (a, e) in enumerate(segments):
            entering[i] = state
            qf, _, kf, _, _, v_aug = _CausalFavor._segment(q, k, v, w, a, e, chunk, mask=False)
            n = qf.shape[2]
            kv = kf.transpose(-1, -2) @ v_aug  # (B, Hkv, n, m, D + 1)
            before = _CausalFavor._states_before(kv, state)
            att = _CausalFavor._intra(qf, kf, r, chunk)
            num = torch.baddbmm(att.view(-1, r * chunk, chunk) @ v_aug.view(-1, chunk, d + 1),
                                qf.view(-1, r * chunk, m), before.view(-1, m, d + 1))
            num = num.view(b, hkv, n, r * chunk, d + 1)
            den = den_all[:, :, a // chunk:a // chunk + n]
            den.copy_(num[..., d:])
            _CausalFavor._write(out, a, e, chunk, hkv, num, torch.div, den.clamp_min(EPS))
            state = before[:, :, -1] + kv[:, :, -1]
        ctx.save_for_backward(q, k, v, w, entering, out, den_all)
        ctx.chunk, ctx.seg = chunk, seg
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, w, entering, out, den_all = ctx.saved_tensors
        chunk, seg = ctx.chunk, ctx.seg
        grad_out = grad_out.contiguous()
        b, t, h, d = q.shape
        hkv = k.shape[2]
        r = h // hkv
        m = w.shape[0]
        segments = _CausalFavor._segments(t, chunk, seg)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dstate = q.new_zeros(b, hkv, m, d + 1)  # gradient of the state leaving the current segment
        for i in reversed(range(len(segments))):
            a, e = segments[i]
            length = e - a
            qf, qh, kf, kh, clamped, v_aug = _CausalFavor._segment(q, k, v, w, a, e, chunk)
            n = qf.shape[2]
            kv = kf.transpose(-1, -2) @ v_aug
            before = _CausalFavor._states_before(kv, entering[i])
            del kv
            att = _CausalFavor._intra(qf, kf, r, chunk)
            # the numerator is not recomputed: out = num / max(den, EPS), and out and den were saved
            den = den_all[:, :, a // chunk:a // chunk + n]  # (B, Hkv, n, R * c, 1)
            den_c = den.clamp_min(EPS)
            dnum = q.new_empty(b, hkv, n, r * chunk, d + 1)
            if length == n * chunk:  # d out / d num = 1 / den_c, read straight from grad_out's layout
                dnum6 = dnum.view(b, hkv, n, r, chunk, d + 1)
                torch.div(_CausalFavor._token_view(grad_out, a, e, chunk, hkv),
                          den_c.view(b, hkv, n, r, chunk, 1), out=dnum6[..., :d])
                o = _CausalFavor._token_view(out, a, e, chunk, hkv)
                dout_o = (dnum6[..., :d] * o).sum(-1, keepdim=True).view(b, hkv, n, r * chunk, 1)
            else:
                torch.div(_CausalFavor._rows(grad_out, a, e, chunk, hkv), den_c, out=dnum[..., :d])
                dout_o = (dnum[..., :d] * _CausalFavor._rows(out, a, e, chunk, hkv)).sum(-1, keepdim=True)
            # d out / d den = -out / den_c; no gradient where the floor EPS applies
            torch.mul(dout_o, (den >= EPS).to(dnum.dtype).neg_(), out=dnum[..., d:])
            del den, den_c, dout_o
            datt = (dnum @ v_aug.transpose(-1, -2)).view(b, hkv, n, r, chunk, chunk).tril_()
            datt = datt.view(b, hkv, n, r * chunk, chunk)
            dqf = torch.baddbmm(datt.view(-1, r * chunk, chunk) @ kf.view(-1, chunk, m),
                                dnum.view(-1, r * chunk, d + 1), before.view(-1, m, d + 1).transpose(-1, -2))
            dqf = dqf.view(b, hkv, n, r * chunk, m)
            dbefore = qf.transpose(-1, -2) @ dnum  # (B, Hkv, n, m, D + 1)
            # gradient reaching chunk j's keys through the state: every later chunk's, and the later segments'
            after = torch.empty_like(dbefore)
            after[:, :, -1] = dstate
            if n > 1:
                torch.add(dbefore[:, :, 1:].flip(2).cumsum(2).flip(2), dstate[:, :, None], out=after[:, :, :-1])
            dstate = after[:, :, 0] + dbefore[:, :, 0]
            del dbefore, before
            dkf = torch.baddbmm(datt.view(-1, r * chunk, chunk).transpose(-1, -2) @ qf.view(-1, r * chunk, m),
                                v_aug.view(-1, chunk, d + 1), after.view(-1, m, d + 1).transpose(-1, -2))
            dkf = dkf.view(b, hkv, n, chunk, m)
            dv_aug = torch.baddbmm(att.view(-1, r * chunk, chunk).transpose(-1, -2) @ dnum.view(-1, r * chunk, d + 1),
                                   kf.view(-1, chunk, m), after.view(-1, m, d + 1))
            dv_aug = dv_aug.view(b, hkv, n, chunk, d + 1)
            del datt, att, after, dnum
            scale = d ** -0.25
            _CausalFavor._write(dq, a, e, chunk, hkv, _features_backward(dqf, qf, qh, w, None), torch.mul, scale)
            del dqf, qf, qh
            dks = _features_backward(dkf, kf, kh, w, clamped).view(b, hkv, n * chunk, d)
            del dkf, kf, kh
            torch.mul(dks[:, :, :length], scale, out=dk[:, a:e].transpose(1, 2))
            dv[:, a:e].transpose(1, 2).copy_(dv_aug.view(b, hkv, n * chunk, d + 1)[:, :, :length, :d])
        return dq, dk, dv, None, None, None, None


def chunked_causal_favor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor,
                         chunk_size: int, state0: torch.Tensor | None = None) -> torch.Tensor:
    """Causal FAVOR+ attention of q (B, T, H, D) over k, v (B, T, Hkv, D) with features ``projection`` (m, D),
    as :func:`feature_map` + :func:`causal_linear_attention`, in a memory-lean autograd.Function (q, k and v
    are differentiable; the projection is a fixed draw). Computed in q's dtype (at least float32).
    ``state0`` (B, Hkv, m, D + 1): ``Σ phi(k) [v, 1]`` of earlier tokens (a cache's), constant (no gradient)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, w = (z.to(dtype) for z in (q, k, v, projection))
    b, t, h, _ = q.shape
    chunk = max(1, min(chunk_size, t))
    seg = segment_length(b, h, w.shape[0], chunk)
    if state0 is not None:
        state0 = state0.detach().to(dtype)
    with torch.autocast(q.device.type, enabled=False):
        return _CausalFavor.apply(q, k, v, w, chunk, seg, state0)


def global_linear_attention(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor,
                            s0: torch.Tensor | None = None, z0: torch.Tensor | None = None):
    """Non-causal FAVOR+: every query sees every key (and the cached ones). Shapes as above."""
    s = torch.einsum("bthm,bthd->bhmd", kf, v)  # (B, Hkv, m, D)
    z = kf.sum(1)  # (B, Hkv, m)
    if s0 is not None:
        s, z = s + s0, z + z0
    num = torch.einsum("bthrm,bhmd->bthrd", qf, s)
    den = torch.einsum("bthrm,bhm->bthr", qf, z)
    return num / den.clamp_min(EPS)[..., None], s, z


class PerformerCache(RowLengths):
    """Decoding state of one Performer layer.

    ``state`` (B, Hkv, m, D + 1) holds ``Σ phi(k) [v, 1]`` over each row's tokens in **float64**: its first D
    columns are S = Σ phi(k) vᵀ, its last z = Σ phi(k) (read as :attr:`s` and :attr:`z`). A decode step
    adds its token's contribution and reads the state (O(m·D), whatever the context); ``rewind(n)`` subtracts
    the removed tokens' contributions (O(n·m·D)). Every contribution is the float64 product of the recorded
    float32 ``phi_k`` and ``v``, so adding then subtracting it restores the state to float64 rounding (about
    1e-16 of its size) and repeated speculative steps do not drift.

    ``phi_k`` (B, max_len, Hkv, m) and ``v`` (B, max_len, Hkv, D) record each token's features and value in
    the compute dtype, read only by ``rewind``. The sums do not depend on positions, so rows of different
    lengths need no masking: only the per-token records go to each row's own slots.
    """

    def __init__(self, batch_size: int, max_len: int, kv_heads: int, head_dim: int, nb_features: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(batch_size, device)
        dtype = torch.promote_types(dtype, torch.float32)  # records kept in at least float32
        self.head_dim = head_dim
        self.state = torch.zeros(batch_size, kv_heads, nb_features, head_dim + 1, device=device,
                                 dtype=torch.float64)
        self.phi_k = torch.zeros(batch_size, max_len, kv_heads, nb_features, device=device, dtype=dtype)
        self.v = torch.zeros(batch_size, max_len, kv_heads, head_dim, device=device, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.phi_k.shape[1]

    @property
    def s(self) -> torch.Tensor:
        """S = Σ phi(k) vᵀ (B, Hkv, m, D), float64 (a view of ``state``)."""
        return self.state[..., :self.head_dim]

    @property
    def z(self) -> torch.Tensor:
        """z = Σ phi(k) (B, Hkv, m), float64 (a view of ``state``)."""
        return self.state[..., self.head_dim]

    def _add(self, state: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor, sign: float = 1.0) -> None:
        """state (b, Hkv, m, D + 1) += sign * Σ_t phi_k[:, t] [v[:, t], 1], in float64; phi_k (b, T, Hkv, m),
        v (b, T, Hkv, D)."""
        kf = phi_k.to(torch.float64).permute(0, 2, 3, 1)  # (b, Hkv, m, T)
        if sign < 0:
            kf = -kf
        d = self.head_dim
        state[..., :d].add_(kf @ v.to(torch.float64).transpose(1, 2))
        state[..., d].add_(kf.sum(-1))

    def append(self, phi_k: torch.Tensor, v: torch.Tensor) -> None:
        """Record T new tokens' (B, T, Hkv, m) key features and (B, T, Hkv, D) values; add them to the sums."""
        phi_k, v = phi_k.detach(), v.detach()
        t = phi_k.shape[1]
        before = self.lengths
        ragged = self.ragged
        self._grow(t, self.max_len, "performer cache")
        if ragged:
            device = self.phi_k.device
            slots = host_values(before, torch.long, device)[:, None] + torch.arange(t, device=device)
            rows = torch.arange(phi_k.shape[0], device=device)[:, None]
            self.phi_k[rows, slots] = phi_k
            self.v[rows, slots] = v
        else:
            a = before[0] if before else 0
            self.phi_k[:, a:a + t] = phi_k
            self.v[:, a:a + t] = v
        if t == 1:  # the decode step: one outer product per head, no matmul set-up
            kf = phi_k[:, 0].to(torch.float64)[..., None]  # (B, Hkv, m, 1)
            d = self.head_dim
            self.state[..., :d].addcmul_(kf, v[:, 0].to(torch.float64)[:, :, None, :])
            self.state[..., d:].add_(kf)
        else:
            self._add(self.state, phi_k, v)

    def _rewound(self, old: list[int]) -> None:
        """Subtract the contributions of the removed slots [new, old) of every row: O(tokens removed)."""
        pairs = [(new, was) for new, was in zip(self.lengths, old)]
        if len(set(pairs)) == 1:  # every row lost the same slots: one batched subtraction
            new, was = pairs[0]
            self._add(self.state, self.phi_k[:, new:was], self.v[:, new:was], -1.0)
            return
        for b, (new, was) in enumerate(pairs):
            if was > new:
                self._add(self.state[b:b + 1], self.phi_k[b:b + 1, new:was], self.v[b:b + 1, new:was], -1.0)


@register("performer", options=PerformerOptions)
class PerformerAttention(AttentionBackend):
    """FAVOR+ linear attention; see the module docstring."""

    supports_ragged = True
    contract_options = {"nb_features": 32, "chunk_size": 8}  # several chunks at the contract's lengths

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        opts: PerformerOptions = self.spec.options  # checked, defaults filled in
        self.nb_features = opts.nb_features
        self.redraw_interval = opts.feature_redraw_interval
        self.chunk_size = opts.chunk_size
        self.register_buffer("projection", self.draw(0))  # (m, D)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))  # training forward passes
        # CPU: causal training/prefill runs the memory-lean autograd.Function (chunked_causal_favor); False =
        # the autograd composition (feature_map + causal_linear_attention), which CUDA always uses.
        self.chunked = True
        self._calls = 0  # host mirror of ``calls``: reading a GPU buffer every pass would sync

    def uses_chunked_path(self, q: torch.Tensor) -> bool:
        """True where a causal forward without a cache runs :func:`chunked_causal_favor` (CPU tensors)."""
        return self.chunked and q.device.type == "cpu"

    def draw(self, redraw: int) -> torch.Tensor:
        """The features of redraw number ``redraw`` (0 = the initial draw), float32 on the CPU."""
        g = torch.Generator().manual_seed(draw_seed(self.spec.seed, self.spec.layer_index, redraw))
        return orthogonal_features(self.nb_features, self.spec.head_dim, g)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._calls = int(self.calls)

    def _count_training_pass(self) -> None:
        """Redraw if this pass starts a new interval, then count it. Replaces (never mutates) the
        projection buffer, so graphs of earlier passes keep the features they used."""
        every = self.redraw_interval
        if every > 0 and self._calls > 0 and self._calls % every == 0:
            p = self.projection
            self.projection = self.draw(self._calls // every).to(device=p.device, dtype=p.dtype)
        self._calls += 1
        self.calls.fill_(self._calls)

    def forward(self, q, k, v, *, cache: PerformerCache | None = None, x=None):
        # q: (B, T, H, D); k, v: (B, T, Hkv, D)
        if self.training and not is_recomputing():
            self._count_training_pass()
        b, t, h, d = q.shape
        hkv = k.shape[2]
        dtype = torch.promote_types(q.dtype, torch.float32)
        if cache is not None and t == 1:
            return self._decode_step(q, k, v, cache)
        if self.spec.causal and self.uses_chunked_path(q):
            if cache is None:
                return chunked_causal_favor(q, k, v, self.projection, self.chunk_size).to(q.dtype)
            state0 = cache.state.to(dtype) if cache.end else None
            out = chunked_causal_favor(q, k, v, self.projection, self.chunk_size, state0)
            with torch.autocast(q.device.type, enabled=False):
                kf = _features(k.to(dtype), self.projection.to(dtype), is_query=False, mask=False)[0]
            cache.append(kf, v.to(dtype))
            return out.to(q.dtype)
        with torch.autocast(q.device.type, enabled=False):
            w = self.projection.to(dtype)
            qf = feature_map(q.to(dtype), w, is_query=True)  # (B, T, H, m)
            kf = feature_map(k.to(dtype), w, is_query=False)  # (B, T, Hkv, m)
            qf = qf.view(b, t, hkv, h // hkv, -1)  # (B, T, Hkv, R, m): head h reads kv head h // R
            v32 = v.to(dtype)
            s0 = z0 = None
            if cache is not None and cache.end:
                s0, z0 = cache.s.to(dtype), cache.z.to(dtype)
            if self.spec.causal:
                out, _, _ = causal_linear_attention(qf, kf, v32, self.chunk_size, s0, z0)
            else:
                out, _, _ = global_linear_attention(qf, kf, v32, s0, z0)
        if cache is not None:
            cache.append(kf, v32)
        return out.reshape(b, t, h, d).to(q.dtype)  # (B, T, H, D)

    def _decode_step(self, q, k, v, cache: PerformerCache) -> torch.Tensor:
        """One new token per row (T = 1), causal or not (the token sees the cached ones and itself): add its
        key's contribution to the float64 state, read the state with its query's features. A handful of small
        operations, none of them over the context."""
        b, _, h, d = q.shape
        hkv = k.shape[2]
        dtype = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            w = self.projection.to(dtype)
            qf = _features(q.to(dtype).reshape(b, hkv, h // hkv, d), w, is_query=True)[0]  # (B, Hkv, R, m)
            kf = _features(k.to(dtype).reshape(b, 1, hkv, d), w, is_query=False, mask=False)[0]  # (B, 1, Hkv, m)
            cache.append(kf, v.to(dtype))
            state = cache.state
            if torch.is_grad_enabled() and qf.requires_grad:  # the graph keeps this step's state
                state = state.clone()
            num = qf.to(torch.float64) @ state  # (B, Hkv, R, D + 1)
            out = num[..., :d] / num[..., d:].clamp_min(EPS)
        return out.reshape(b, 1, h, d).to(q.dtype)

    def new_cache(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> PerformerCache:
        s = self.spec
        return PerformerCache(batch_size, max_len, s.kv_heads, s.head_dim, self.nb_features,
                              device=device, dtype=dtype)

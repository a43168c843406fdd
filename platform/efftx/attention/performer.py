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

Training/prefill on CPU (causal, no cache): :func:`chunked_causal_favor`, one autograd.Function computing
the same sums from raw q, k, v chunk by chunk (chunks batched in segments), which saves only its inputs and
the state entering each segment and recomputes every feature in the backward; the composition above
(autograd through ``feature_map`` and ``causal_linear_attention``, which keeps every token's features and
every chunk's intra-chunk products) runs elsewhere, for caches, and with ``backend.chunked = False``.

Decoding: :class:`PerformerCache` carries S (B, Hkv, m, D) and z (B, Hkv, m), so a new token
costs O(m·D) whatever the prompt length. It also keeps each token's phi(k) and v, used only
by ``rewind(n)``, which recomputes S and z from the first ``length - n`` of them.

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

KEY_EXP_MAX = 50.0  # cap on a key feature's exponent: exp(50) * tokens stays far below float32 max
EPS = 1e-6  # floor of the attention denominator phi(q)·z


@dataclass
class PerformerOptions:
    """attention.kind=performer: FAVOR+ positive orthogonal random features (Choromanski et al., 2021)."""

    nb_features: int = 256  # random features per head
    feature_redraw_interval: int = 1000  # training forward passes between feature redraws; 0 = never
    chunk_size: int = 128  # causal prefix sums are computed chunk by chunk (memory linear in T)

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


def _features(x: torch.Tensor, w: torch.Tensor, is_query: bool):
    """:func:`feature_map` of (..., D) rows in few passes; returns (phi, x̂) and, for keys, the mask of
    exponents clamped at ``KEY_EXP_MAX`` (for the backward).

    Queries: the row maximum is subtracted, so the row constant -|x̂|²/2 cancels and is left out; keys: the
    1/sqrt(m) factor goes into the exponent (clamped at ``KEY_EXP_MAX`` - log sqrt(m), the same bound)."""
    log_norm = 0.5 * math.log(w.shape[0])
    xh = x * x.shape[-1] ** -0.25
    logits = xh @ w.T  # (..., m)
    if is_query:
        logits -= logits.amax(-1, keepdim=True) + log_norm
        return logits.exp_(), xh, None
    logits -= (xh * xh).sum(-1, keepdim=True) / 2 + log_norm
    bound = KEY_EXP_MAX - log_norm
    clamped = logits > bound
    return logits.clamp_(max=bound).exp_(), xh, clamped


def _features_backward(dphi: torch.Tensor, phi: torch.Tensor, xh: torch.Tensor, w: torch.Tensor,
                       clamped: torch.Tensor | None) -> torch.Tensor:
    """Gradient of x from that of phi = exp(W x̂ - |x̂|²/2 [- max]) / sqrt(m), x̂ = x D^-0.25 (the query's
    maximum is a constant, as in :func:`feature_map`; clamped key exponents pass no gradient)."""
    dlogits = dphi.mul_(phi)
    if clamped is not None and bool(clamped.any()):
        dlogits.masked_fill_(clamped, 0.0)
    return (dlogits @ w - xh * dlogits.sum(-1, keepdim=True)).mul_(xh.shape[-1] ** -0.25)


SEGMENT_BUDGET = 1 << 19  # elements of a segment's (B, H, tokens, m) query features, at most


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
    and the denominator. The forward saves its inputs and the state entering each segment
    ((T / segment) x m x (D + 1) per kv head), never a token's features; the backward walks the segments
    backwards with the running gradient of the state, recomputing each segment's features, its chunks'
    states (from the segment's entering state) and its intra-chunk products from q, k and v.
    """

    @staticmethod
    def _segment(q, k, v, w, a, e, chunk):
        """Chunk-batched pieces of tokens [a, e), padded to whole chunks: query features qf and x̂
        (B, Hkv, n, R * c, m / D), key features kf and x̂ (B, Hkv, n, c, m / D), the keys' clamp mask,
        v_aug (B, Hkv, n, c, D + 1) (padded tokens: zero features, zero values, zero ones column)."""
        b, _, h, d = q.shape
        hkv = k.shape[2]
        r = h // hkv
        length = e - a
        n = -(-length // chunk)
        pad = n * chunk - length
        qs = F.pad(q[:, a:e], (0, 0, 0, 0, 0, pad)).view(b, n, chunk, hkv, r, d)
        qs = qs.permute(0, 3, 1, 4, 2, 5).reshape(b, hkv, n, r * chunk, d)
        qf, qh, _ = _features(qs, w, is_query=True)
        ks = F.pad(k[:, a:e], (0, 0, 0, 0, 0, pad)).view(b, n, chunk, hkv, d).permute(0, 3, 1, 2, 4)
        kf, kh, clamped = _features(ks, w, is_query=False)
        vs = v[:, a:e].transpose(1, 2)
        v_aug = vs.new_zeros(b, hkv, n * chunk, d + 1)
        v_aug[:, :, :length, :d] = vs
        v_aug[:, :, :length, d] = 1
        v_aug = v_aug.view(b, hkv, n, chunk, d + 1)
        if pad:
            kf.view(b, hkv, n * chunk, -1)[:, :, length:] = 0
        return qf, qh, kf, kh, clamped, v_aug

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
    def _unrows(x: torch.Tensor, b: int, h: int, r: int, chunk: int, length: int) -> torch.Tensor:
        """(B, Hkv, n, R * c, D) -> (B, length, H, D)."""
        n, d = x.shape[2], x.shape[-1]
        x = x.view(b, -1, n, r, chunk, d).permute(0, 2, 4, 1, 3, 5).reshape(b, n * chunk, h, d)
        return x[:, :length]

    @staticmethod
    def forward(ctx, q, k, v, w, chunk: int, seg: int):
        b, t, h, d = q.shape
        hkv = k.shape[2]
        r = h // hkv
        out = q.new_empty(q.shape)
        segments = _CausalFavor._segments(t, chunk, seg)
        entering = q.new_empty(len(segments), b, hkv, w.shape[0], d + 1)  # the state entering each segment
        state = q.new_zeros(b, hkv, w.shape[0], d + 1)
        for i, (a, e) in enumerate(segments):
            entering[i] = state
            qf, _, kf, _, _, v_aug = _CausalFavor._segment(q, k, v, w, a, e, chunk)
            n = qf.shape[2]
            kv = kf.transpose(-1, -2) @ v_aug  # (B, Hkv, n, m, D + 1)
            before = _CausalFavor._states_before(kv, state)
            att = (qf @ kf.transpose(-1, -2)).view(b, hkv, n, r, chunk, chunk).tril_().view(b, hkv, n, r * chunk, chunk)
            num = (att @ v_aug).add_(qf @ before)  # (B, Hkv, n, R * c, D + 1)
            o = num[..., :d] / num[..., d:].clamp_min(EPS)
            out[:, a:e] = _CausalFavor._unrows(o, b, h, r, chunk, e - a)
            state = before[:, :, -1] + kv[:, :, -1]
        ctx.save_for_backward(q, k, v, w, entering)
        ctx.chunk, ctx.seg = chunk, seg
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, w, entering = ctx.saved_tensors
        chunk, seg = ctx.chunk, ctx.seg
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
            att = (qf @ kf.transpose(-1, -2)).view(b, hkv, n, r, chunk, chunk).tril_().view(b, hkv, n, r * chunk, chunk)
            num = (att @ v_aug).add_(qf @ before)  # (B, Hkv, n, R * c, D + 1)
            den = num[..., d:]
            den_c = den.clamp_min(EPS)
            go = F.pad(grad_out[:, a:e], (0, 0, 0, 0, 0, n * chunk - length)).view(b, n, chunk, hkv, r, d)
            go = go.permute(0, 3, 1, 4, 2, 5).reshape(b, hkv, n, r * chunk, d)
            dnum = torch.empty_like(num)
            torch.div(go, den_c, out=dnum[..., :d])
            # d out / d den = -out / den with out = num / den_c; no gradient where the floor EPS applies
            torch.mul((dnum[..., :d] * num[..., :d]).sum(-1, keepdim=True), (den >= EPS) / -den_c, out=dnum[..., d:])
            del num, den, den_c, go
            datt = (dnum @ v_aug.transpose(-1, -2)).view(b, hkv, n, r, chunk, chunk).tril_()
            datt = datt.view(b, hkv, n, r * chunk, chunk)
            dqf = (datt @ kf).add_(dnum @ before.transpose(-1, -2))  # (B, Hkv, n, R * c, m)
            dbefore = qf.transpose(-1, -2) @ dnum  # (B, Hkv, n, m, D + 1)
            # gradient reaching chunk j's keys through the state: every later chunk's, and the later segments'
            after = torch.empty_like(dbefore)
            after[:, :, -1] = dstate
            if n > 1:
                torch.add(dbefore[:, :, 1:].flip(2).cumsum(2).flip(2), dstate[:, :, None], out=after[:, :, :-1])
            dstate = after[:, :, 0] + dbefore[:, :, 0]
            del dbefore
            dkf = (datt.transpose(-1, -2) @ qf).add_(v_aug @ after.transpose(-1, -2))  # (B, Hkv, n, c, m)
            dv_aug = (att.transpose(-1, -2) @ dnum).add_(kf @ after)  # (B, Hkv, n, c, D + 1)
            del datt, att, after
            dqs = _features_backward(dqf, qf, qh, w, None)  # (B, Hkv, n, R * c, D)
            dq[:, a:e] = _CausalFavor._unrows(dqs, b, h, r, chunk, length)
            dks = _features_backward(dkf, kf, kh, w, clamped).reshape(b, hkv, n * chunk, d)
            dk[:, a:e] = dks[:, :, :length].transpose(1, 2)
            dv[:, a:e] = dv_aug.view(b, hkv, n * chunk, d + 1)[:, :, :length, :d].transpose(1, 2)
        return dq, dk, dv, None, None, None


def chunked_causal_favor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, projection: torch.Tensor,
                         chunk_size: int) -> torch.Tensor:
    """Causal FAVOR+ attention of q (B, T, H, D) over k, v (B, T, Hkv, D) with features ``projection`` (m, D),
    as :func:`feature_map` + :func:`causal_linear_attention`, in a memory-lean autograd.Function (q, k and v
    are differentiable; the projection is a fixed draw). Computed in q's dtype (at least float32)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v, w = (z.to(dtype) for z in (q, k, v, projection))
    b, t, h, _ = q.shape
    chunk = max(1, min(chunk_size, t))
    seg = segment_length(b, h, w.shape[0], chunk)
    with torch.autocast(q.device.type, enabled=False):
        return _CausalFavor.apply(q, k, v, w, chunk, seg)


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

    ``s`` (B, Hkv, m, D) = Σ phi(k) vᵀ and ``z`` (B, Hkv, m) = Σ phi(k) over each row's tokens; a
    decode step reads and replaces only these. ``phi_k`` (B, max_len, Hkv, m) and ``v``
    (B, max_len, Hkv, D) keep each token's contribution so that ``rewind`` can rebuild the sums.
    The sums do not depend on positions, so rows of different lengths need no masking: only the
    per-token records go to each row's own slots.
    """

    def __init__(self, batch_size: int, max_len: int, kv_heads: int, head_dim: int, nb_features: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(batch_size, device)
        dtype = torch.promote_types(dtype, torch.float32)  # sums are kept in at least float32
        self.s = torch.zeros(batch_size, kv_heads, nb_features, head_dim, device=device, dtype=dtype)
        self.z = torch.zeros(batch_size, kv_heads, nb_features, device=device, dtype=dtype)
        self.phi_k = torch.zeros(batch_size, max_len, kv_heads, nb_features, device=device, dtype=dtype)
        self.v = torch.zeros(batch_size, max_len, kv_heads, head_dim, device=device, dtype=dtype)

    @property
    def max_len(self) -> int:
        return self.phi_k.shape[1]

    def append(self, phi_k: torch.Tensor, v: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> None:
        """Record T new tokens' (B, T, Hkv, m) key features and (B, T, Hkv, D) values; new sums s, z."""
        t = phi_k.shape[1]
        before = list(self.lengths)
        self._grow(t, self.max_len, "performer cache")
        slots = torch.tensor(before, device=self.phi_k.device)[:, None] + torch.arange(t, device=self.phi_k.device)
        rows = torch.arange(phi_k.shape[0], device=self.phi_k.device)[:, None]
        self.phi_k[rows, slots] = phi_k.detach()
        self.v[rows, slots] = v.detach()
        self.s = s.detach().to(self.s.dtype)
        self.z = z.detach().to(self.z.dtype)

    def _rewound(self, old: list[int]) -> None:
        keep = torch.arange(self.max_len, device=self.phi_k.device)[None, :] < torch.tensor(
            self.lengths, device=self.phi_k.device)[:, None]  # (B, max_len)
        kept_k = self.phi_k * keep[:, :, None, None]
        self.s = torch.einsum("bthm,bthd->bhmd", kept_k, self.v)
        self.z = kept_k.sum(1)


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
        if cache is None and self.spec.causal and self.uses_chunked_path(q):
            return chunked_causal_favor(q, k, v, self.projection, self.chunk_size).to(q.dtype)
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
                out, s, z = causal_linear_attention(qf, kf, v32, self.chunk_size, s0, z0)
            else:
                out, s, z = global_linear_attention(qf, kf, v32, s0, z0)
        if cache is not None:
            cache.append(kf, v32, s, z)
        return out.reshape(b, t, h, d).to(q.dtype)  # (B, T, H, D)

    def new_cache(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> PerformerCache:
        s = self.spec
        return PerformerCache(batch_size, max_len, s.kv_heads, s.head_dim, self.nb_features,
                              device=device, dtype=dtype)

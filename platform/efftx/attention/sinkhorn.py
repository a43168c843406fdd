"""Sparse Sinkhorn attention (Tay et al., 2020): a bucket attends to itself and to a learned "sorted" bucket.

How it works:

* **Buckets.** The sequence is cut into buckets of ``bucket_size`` tokens (padded to a whole number of
  buckets inside the backend; padded keys are masked, padded outputs dropped).
* **Sort net.** Every bucket gets a summary: the mean of its keys. A small learned bilinear form per
  query head, ``score[i, j] = s_q(i) @ W_h @ s(j) / sqrt(D)``, rates how useful key bucket ``j`` is for
  query bucket ``i``. The scores are divided by ``temperature``.
* **Non-causal: Sinkhorn normalisation.** ``sinkhorn_iters`` rounds of log-space row and column
  normalisation, then one final row normalisation, turn the (n_buckets x n_buckets) scores into a soft
  permutation matrix ``P`` (doubly stochastic). The *sorted bucket* of query bucket ``i`` is the
  ``P[i]``-weighted mixture of whole buckets of keys and values, slot by slot. A query attends, in one
  softmax, to the keys of its own bucket and to the keys of its sorted bucket. The query side of the
  scores is the summary of bucket ``i`` itself. With ``gumbel_noise`` the scores get Gumbel(0, 1) noise
  before the division by the temperature while training (the reference's ``gumbel_sinkhorn``); evaluation
  is deterministic (the reference draws noise in evaluation too).
* **Causal attention**, two designs chosen by ``causal_mode``. In both, within its own bucket a query sees
  keys up to its own position, and a bucket draws only on complete buckets wholly in its past.

  - ``blend`` (efftx's design, the default): row ``i`` of the scores uses the summary of bucket ``i - 1``
    on the query side, and ``P`` is the masked *row* normalisation alone, a softmax over all past buckets
    ``j < i``; the sorted bucket blends every past bucket slot by slot; bucket 0 has no past bucket (its
    sorted slots are masked). ``sinkhorn_iters`` does not apply: column normalisation is left out because a
    column sums over *all* rows, and row ``i + 1`` reads bucket ``i``, so it would leak bucket ``i``'s later
    tokens into the queries of bucket ``i``; normalising each column over rows ``<= i`` only is causal but
    pins the whole matrix on a strictly lower-triangular support (to the "previous bucket" shift, or to
    uniform rows with rescaled targets) whatever the scores, so the sort net could not learn. Masked
    entries sit at a large finite negative value, never ``-inf``, so fully masked rows cannot produce NaN.
  - ``topk`` (the reference implementation's design, lucidrains' ``SinkhornCausalAttention``): the
    candidates of query bucket ``i`` are ``topk`` copies of a learned *null bucket* (one learned key and
    one learned value per sorting head, repeated over the bucket's slots; score 0) and the past buckets
    ``j < i``. The query side of the scores is the running mean of the keys up to and including the
    first token of bucket ``i`` (the reference: first-token running mean), so every query of the bucket
    may read it. Differentiable top-k as in the reference: pick the candidate with the largest softmax
    probability (scores / temperature), mask it, re-softmax over the rest for the next pick, ``topk``
    times; each picked bucket's keys and values are multiplied by its probability, which is how the
    gradient reaches the sort net. A query attends, in one softmax, to its own bucket (causally) and to the
    ``topk * bucket_size`` picked keys. Bucket 0 has only null candidates, so it always reads the null
    bucket; later buckets read the null bucket where it outscores the past (or where fewer than ``topk``
    past buckets exist). Never a future bucket, never the own bucket.
* **Local heads.** The first ``n_local_attn_heads`` query heads do windowed attention instead: causal,
  the own bucket up to the query's position plus the whole previous bucket; non-causal, the previous,
  own and next buckets. The remaining heads do sorted-bucket attention.

Grouped-query attention: query head ``h`` reads kv head ``h // (H // Hkv)`` everywhere (summaries, own
bucket, sorted or picked buckets), and each query head has its own sort weights (and null bucket).

Cache: a plain :class:`KVCache` holding every key and value. Each call appends the new keys/values,
then computes exactly what the full forward computes for the new positions: the bucket summaries and
the (small) sort scores are recomputed from the cache, and attention is computed for the buckets that
hold new tokens only (a decode step recomputes its own bucket's queries, never all past positions). In
both causal modes the choice for bucket ``i`` reads only keys at positions ``<= i * bucket_size``, all
in the cache by the time any query of bucket ``i`` arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from efftx.attention.base import AttentionBackend, AttentionSpec
from efftx.attention.cache import KVCache
from efftx.attention.registry import register
from efftx.errors import ConfigError

_MASKED = -1e9  # log-space "zero" of the sort matrix: finite, so masked rows/columns stay NaN-free


CAUSAL_MODES = ("blend", "topk")


@dataclass
class SinkhornOptions:
    """attention.kind=sinkhorn: learned bucket sorting (Tay et al., 2020)."""

    bucket_size: int = 64  # tokens per bucket; sequences are padded to a multiple inside the backend
    n_local_attn_heads: int = 0  # heads doing local (windowed) attention instead of sorted-bucket attention
    sinkhorn_iters: int = 8  # row/column normalisation rounds (non-causal)
    temperature: float = 0.75  # of the sort scores before Sinkhorn normalisation / the top-k softmax
    # causal sorting heads: blend (softmax over all past buckets, slot by slot) | topk (the reference:
    # the top past bucket(s) by the sort net, a learned null bucket where the past has none)
    causal_mode: str = "blend"
    topk: int = 1  # causal_mode=topk: buckets each query bucket picks (the reference's n_top_buckets)
    gumbel_noise: bool = False  # non-causal: Gumbel noise on the sort scores while training (gumbel_sinkhorn)

    def validate(self, spec: AttentionSpec) -> None:
        """Checks of this section for a layer of ``spec``; errors name the keys."""
        k = "attention.sinkhorn."
        if self.bucket_size < 1:
            raise ConfigError(f"{k}bucket_size={self.bucket_size} must be >= 1")
        if not 0 <= self.n_local_attn_heads <= spec.heads:
            raise ConfigError(f"{k}n_local_attn_heads={self.n_local_attn_heads} must be "
                              f"between 0 and model.heads={spec.heads}")
        if self.sinkhorn_iters < 0:
            raise ConfigError(f"{k}sinkhorn_iters={self.sinkhorn_iters} must be >= 0")
        if self.temperature <= 0:
            raise ConfigError(f"{k}temperature={self.temperature} must be > 0")
        if self.causal_mode not in CAUSAL_MODES:
            raise ConfigError(f"{k}causal_mode={self.causal_mode!r} is not one of {', '.join(CAUSAL_MODES)}")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ConfigError(f"{k}topk={self.topk!r} must be an integer >= 1")
        if self.topk != 1 and self.causal_mode != "topk":
            raise ConfigError(f"{k}topk={self.topk} has no effect unless {k}causal_mode=topk "
                              f"(it is {self.causal_mode!r})")
        if self.causal_mode == "topk" and not spec.causal:
            raise ConfigError(f"{k}causal_mode=topk chooses the causal design, but this attention is not causal")
        if not isinstance(self.gumbel_noise, bool):
            raise ConfigError(f"{k}gumbel_noise={self.gumbel_noise!r} must be true or false")
        if self.gumbel_noise and spec.causal:
            raise ConfigError(f"{k}gumbel_noise applies to non-causal attention only (the reference's causal "
                              f"attention has none), but this attention is causal")


def sort_mask(n_buckets: int, causal: bool, device=None) -> torch.Tensor:
    """(n, n) bool, True where query bucket i may use key bucket j: j < i when causal, else all."""
    allowed = torch.ones(n_buckets, n_buckets, dtype=torch.bool, device=device)
    return allowed.tril(-1) if causal else allowed


def sinkhorn(logits: torch.Tensor, iters: int, causal: bool) -> torch.Tensor:
    """Soft permutation from (..., n, n) sort scores (already divided by the temperature), in float32.

    Non-causal: ``iters`` rounds of log-space row then column normalisation, then a final row
    normalisation: rows sum to 1 exactly and columns approach 1 (doubly stochastic).
    Causal: entries j >= i are masked (row 0 is all zero) and only rows are normalised, i.e. a
    softmax over the past buckets; see the module docstring for why columns are not.
    Masked entries sit at a large finite negative value (never -inf), so an entirely masked row or
    column cannot produce NaN, forward or backward.
    """
    n = logits.shape[-1]
    allowed = sort_mask(n, causal, logits.device)
    x = logits.float().masked_fill(~allowed, _MASKED)

    def rows(x):
        return (x - torch.logsumexp(x, dim=-1, keepdim=True)).masked_fill(~allowed, _MASKED)

    def cols(x):
        return (x - torch.logsumexp(x, dim=-2, keepdim=True)).masked_fill(~allowed, _MASKED)

    if not causal:
        for _ in range(iters):
            x = cols(rows(x))
    return rows(x).exp().masked_fill(~allowed, 0.0)


def gumbel_like(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gumbel(0, 1) samples shaped like ``x`` (float32), from the global generator (replayed by the
    reversible backward with the dropout masks)."""
    u = torch.rand(x.shape, device=x.device, dtype=torch.float32).clamp(eps, 1 - eps)
    return -torch.log(-torch.log(u))


def top_buckets(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable top-k of the reference: ``k`` picks from (..., C) candidate scores (already divided
    by the temperature; excluded candidates at a large negative value). Each pick is the candidate of
    largest softmax probability over those not yet picked; its weight is that probability (so gradients
    reach the scores). Returns indices (..., k) long and weights (..., k) float32."""
    x = logits.float()
    picks, weights = [], []
    for _ in range(k):
        w, i = x.softmax(-1).max(-1, keepdim=True)
        picks.append(i)
        weights.append(w)
        x = x.scatter(-1, i, _MASKED)
    return torch.cat(picks, -1), torch.cat(weights, -1)


class SortNet(nn.Module):
    """Per-head bilinear scores between bucket summaries: (B, Hs, I, D) x (B, Hs, J, D) -> (B, Hs, I, J).

    ``score[i, j] = query_side[i] @ W_h @ key_side[j] / sqrt(D)`` in float32. What the query side of row
    ``i`` is depends on the mode (see the module docstring); the key side is the bucket's mean key.
    """

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(heads, 1, 1))  # (Hs, D, D)

    def forward(self, query_side: torch.Tensor, key_side: torch.Tensor) -> torch.Tensor:
        scores = torch.einsum("bhid,hde,bhje->bhij", query_side.float(), self.weight.float(), key_side.float())
        return scores / math.sqrt(key_side.shape[-1])


@register("sinkhorn", options=SinkhornOptions)
class SinkhornAttention(AttentionBackend):
    contract_options = {"bucket_size": 8, "n_local_attn_heads": 2}  # several buckets, both kinds of heads

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        opts: SinkhornOptions = self.spec.options  # checked, defaults filled in
        self.bucket_size = opts.bucket_size
        self.n_local = opts.n_local_attn_heads
        self.iters = opts.sinkhorn_iters
        self.temperature = opts.temperature
        self.topk_mode = spec.causal and opts.causal_mode == "topk"
        self.topk = opts.topk
        self.gumbel_noise = opts.gumbel_noise
        n_sort = spec.heads - self.n_local
        self.sort_net = SortNet(n_sort, spec.head_dim) if n_sort else None
        if self.topk_mode and n_sort:
            # the learned null bucket: one key and one value per sorting head (efftx's std 0.02 init)
            self.null_key = nn.Parameter(torch.randn(n_sort, spec.head_dim) * 0.02)
            self.null_value = nn.Parameter(torch.randn(n_sort, spec.head_dim) * 0.02)
        rep = spec.heads // spec.kv_heads
        self.register_buffer("kv_of_head", torch.arange(spec.heads) // rep, persistent=False)

    # ------------------------------------------------------------------------------------ pieces

    def sort_matrix(self, k: torch.Tensor) -> torch.Tensor:
        """Soft permutation of the sorting heads for keys (B, L, Hkv, D): (B, Hs, nb, nb), float32
        (the non-causal and the causal ``blend`` design)."""
        kb, valid = self._buckets(k)
        return self._sort(kb, valid)

    def select_buckets(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal ``topk`` design: the buckets every query bucket picks, for keys (B, L, Hkv, D).
        Returns bucket indices (B, Hs, nb, topk), -1 for the null bucket, and their weights (float32)."""
        kb, valid = self._buckets(k)
        picks, weights = self._select(kb, valid, 0)
        return torch.where(picks < self.topk, -1, picks - self.topk), weights

    def _buckets(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L, Hkv, D) -> zero-padded (B, Hkv, nb, n, D) and the (nb, n) bool mask of real positions."""
        b, length, hkv, d = t.shape
        n = self.bucket_size
        nb = -(-length // n)
        t = F.pad(t, (0, 0, 0, 0, 0, nb * n - length))
        valid = (torch.arange(nb * n, device=t.device) < length).view(nb, n)
        return t.view(b, nb, n, hkv, d).permute(0, 3, 1, 2, 4), valid

    def _sort(self, kb: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        count = valid.sum(-1).clamp(min=1)[:, None]  # (nb, 1)
        summary = kb.float().sum(3) / count  # (B, Hkv, nb, D): mean of each bucket's real keys
        summary = summary[:, self.kv_of_head[self.n_local:]]  # (B, Hs, nb, D)
        causal = self.spec.causal
        # causal: row i reads the summary of bucket i - 1 (row 0 gets zeros; it is masked)
        query_side = F.pad(summary[:, :, :-1], (0, 0, 1, 0)) if causal else summary
        logits = self.sort_net(query_side, summary)
        if self.gumbel_noise and self.training:
            logits = logits + gumbel_like(logits)
        return sinkhorn(logits / self.temperature, self.iters, causal)

    def _select(self, kb: torch.Tensor, valid: torch.Tensor, b0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Picks of query buckets b0.. among [topk null buckets, buckets 0..nb-1]: candidate indices
        (B, Hs, nb - b0, topk) (index < topk: the null bucket) and weights (float32)."""
        n, k = self.bucket_size, self.topk
        nb = kb.shape[2]
        sums = kb.float().sum(3)  # (B, Hkv, nb, D)
        summary = sums / valid.sum(-1).clamp(min=1)[:, None]
        # query side of bucket i: mean of the keys at positions 0 .. i * n (its first token included)
        before = F.pad(sums.cumsum(2)[:, :, :-1], (0, 0, 1, 0))[:, :, b0:]  # keys of the buckets before i
        first = kb[:, :, b0:, 0].float()
        count = (torch.arange(b0, nb, device=kb.device, dtype=torch.float32) * n + 1)[:, None]
        query_side = (before + first) / count  # (B, Hkv, nq, D)
        heads = self.kv_of_head[self.n_local:]
        logits = self.sort_net(query_side[:, heads], summary[:, heads]) / self.temperature  # (B, Hs, nq, nb)
        rows = torch.arange(b0, nb, device=kb.device)[:, None]
        past = torch.arange(nb, device=kb.device)[None, :] < rows  # (nq, nb): j < i only
        logits = F.pad(logits.masked_fill(~past, _MASKED), (k, 0))  # the null candidates score 0
        return top_buckets(logits, k)

    def _softmax_attend(self, q, k, v, mask):
        """One softmax per query over its block's keys: q (B, h, I, n, D); k, v (B, h, I, K, D);
        mask broadcastable to (B, h, I, n, K), True = may attend. Returns (B, h, I, n, D)."""
        scores = torch.einsum("bhisd,bhitd->bhist", q, k).float() / math.sqrt(q.shape[-1])
        probs = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1)
        if self.training and self.spec.dropout > 0:
            probs = F.dropout(probs, self.spec.dropout)
        return torch.einsum("bhist,bhitd->bhisd", probs.to(v.dtype), v)

    # ------------------------------------------------------------------------------------ forward

    def forward(self, q, k, v, *, cache: KVCache | None = None, x=None):
        # q: (B, T, H, D); k, v: (B, T, Hkv, D)
        t = q.shape[1]
        if cache is not None:
            k, v = cache.append(k, v)  # (B, L, Hkv, D), all tokens so far
        length = k.shape[1]
        start = length - t  # absolute position of the first new query
        n, nl, causal = self.bucket_size, self.n_local, self.spec.causal
        b, _, h, d = q.shape
        hkv = k.shape[2]

        kb, valid = self._buckets(k)  # (B, Hkv, nb, n, D), (nb, n)
        vb, _ = self._buckets(v)
        nb = kb.shape[2]
        b0 = start // n  # first bucket holding a new query; only buckets b0.. are computed
        nq = nb - b0
        off = start - b0 * n
        qb = F.pad(q, (0, 0, 0, 0, off, nb * n - length))  # (B, nq * n, H, D)
        qb = qb.view(b, nq, n, h, d).permute(0, 3, 1, 2, 4)  # (B, H, nq, n, D)

        own_mask = valid[b0:, None, :]  # (nq, 1, n): real keys of the own bucket
        if causal:
            own_mask = own_mask & torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # (nq, n, n)
        own_mask = own_mask.expand(nq, n, n)
        outs = []

        if nl:  # local heads: previous + own (+ next, non-causal) bucket
            lo = max(b0 - 1, 0)
            pad = (0, 0, 0, 0, 1 if b0 == 0 else 0, 1)  # a zero bucket before bucket 0 and after the last
            idx = self.kv_of_head[:nl]
            seg_k = F.pad(kb[:, :, lo:], pad)[:, idx]  # (B, nl, nq + 2, n, D)
            seg_v = F.pad(vb[:, :, lo:], pad)[:, idx]
            bucket = torch.arange(b0, nb, device=q.device)
            prev_mask = (bucket >= 1)[:, None, None].expand(nq, n, n)
            parts_k, parts_v, masks = [seg_k[:, :, :nq], seg_k[:, :, 1:nq + 1]], \
                [seg_v[:, :, :nq], seg_v[:, :, 1:nq + 1]], [prev_mask, own_mask]
            if not causal:
                next_valid = F.pad(valid, (0, 0, 0, 1), value=False)[b0 + 1:]  # (nq, n)
                parts_k.append(seg_k[:, :, 2:])
                parts_v.append(seg_v[:, :, 2:])
                masks.append(next_valid[:, None, :].expand(nq, n, n))
            outs.append(self._softmax_attend(qb[:, :nl], torch.cat(parts_k, 3), torch.cat(parts_v, 3),
                                             torch.cat(masks, -1)))

        if nl < h:  # sorting heads: own bucket + sorted (blend) or picked (topk) buckets
            hs = h - nl
            idx = self.kv_of_head[nl:]
            own_k, own_v = kb[:, idx, b0:], vb[:, idx, b0:]  # (B, Hs, nq, n, D)
            if self.topk_mode:
                sel_k, sel_v = self._picked(kb, vb, valid, b0)  # (B, Hs, nq, topk * n, D)
                sel_ok = torch.ones(nq, n, sel_k.shape[3], dtype=torch.bool, device=q.device)
                mask = torch.cat([own_mask, sel_ok], -1)  # (nq, n, n + topk * n)
            else:
                sel_k, sel_v, slot_ok = self._blended(kb, vb, valid, b0)
                mask = torch.cat([own_mask.expand(b, hs, nq, n, n),
                                  slot_ok[:, :, :, None, :].expand(b, hs, nq, n, n)], -1)  # (B, Hs, nq, n, 2n)
            outs.append(self._softmax_attend(qb[:, nl:], torch.cat([own_k, sel_k], 3),
                                             torch.cat([own_v, sel_v], 3), mask))

        out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]  # (B, H, nq, n, D)
        out = out.permute(0, 2, 3, 1, 4).reshape(b, nq * n, h, d)
        return out[:, off:off + t].to(q.dtype)  # (B, T, H, D)

    def _blended(self, kb, vb, valid, b0):
        """The sorted bucket of each query bucket b0..: the P-weighted mixture of whole buckets, slot by slot.
        Returns keys, values (B, Hs, nq, n, D) and the (B, Hs, nq, n) mask of slots that hold any key."""
        b, hkv, nb, n, d = kb.shape
        nl, h = self.n_local, self.spec.heads
        nq = nb - b0
        p = self._sort(kb, valid)[:, :, b0:]  # (B, Hs, nq, nb) rows of the new buckets
        # Mix whole buckets per kv group without copying the keys to every query head: pad the
        # local heads that share the first sorting head's kv group with zero rows.
        rep = h // hkv
        g0, lead = nl // rep, nl % rep
        pg = F.pad(p, (0, 0, 0, 0, lead, 0)).view(b, hkv - g0, rep, nq, nb)
        mix_k = torch.einsum("bgrij,bgjsd->bgrisd", pg.to(kb.dtype), kb[:, g0:])
        mix_v = torch.einsum("bgrij,bgjsd->bgrisd", pg.to(vb.dtype), vb[:, g0:])
        mix_k = mix_k.reshape(b, -1, nq, n, d)[:, lead:]  # (B, Hs, nq, n, D)
        mix_v = mix_v.reshape(b, -1, nq, n, d)[:, lead:]
        # Slot s of the sorted bucket averages slot s of the chosen buckets; renormalise by the
        # weight on buckets that are real at slot s (only the last bucket can be partly padding).
        mass = torch.einsum("bhij,js->bhis", p, valid.float())  # (B, Hs, nq, n)
        slot_ok = mass > 1e-6  # causal bucket 0: no past bucket, all slots masked
        scale = (1.0 / mass.clamp(min=1e-6)).masked_fill(~slot_ok, 0.0)[..., None]
        return mix_k * scale.to(mix_k.dtype), mix_v * scale.to(mix_v.dtype), slot_ok

    def _picked(self, kb, vb, valid, b0):
        """The buckets query buckets b0.. pick (causal topk): keys and values (B, Hs, nq, topk * n, D),
        each picked bucket scaled by its weight; null picks are the learned null key/value in every slot.
        Picked real buckets are complete past buckets, so every slot holds a key."""
        b, _, nb, n, d = kb.shape
        k = self.topk
        picks, weights = self._select(kb, valid, b0)  # (B, Hs, nq, k)
        is_null = (picks < k)[..., None, None]
        bucket = (picks - k).clamp(min=0)
        batch = torch.arange(b, device=kb.device)[:, None, None, None]
        group = self.kv_of_head[self.n_local:][None, :, None, None]
        w = weights[..., None, None]
        out = []
        for t, null in ((kb, self.null_key), (vb, self.null_value)):
            chosen = t[batch, group, bucket]  # (B, Hs, nq, k, n, D)
            chosen = torch.where(is_null, null[None, :, None, None, None, :].to(t.dtype), chosen)
            out.append((chosen * w.to(t.dtype)).flatten(3, 4))
        return out[0], out[1]

"""Sparse Sinkhorn attention (Tay et al., 2020): a bucket attends to itself and to a learned "sorted" bucket.

How it works, in five steps:

* **Buckets.** The sequence is cut into buckets of ``bucket_size`` tokens (padded to a whole number of
  buckets inside the backend; padded keys are masked, padded outputs dropped).
* **Sort net.** Every bucket gets a summary: the mean of its keys. A small learned bilinear form per
  query head, ``score[i, j] = s_q(i) @ W_h @ s(j) / sqrt(D)``, rates how useful key bucket ``j`` is for
  query bucket ``i``. The scores are divided by ``temperature``.
* **Sinkhorn normalisation.** ``sinkhorn_iters`` rounds of log-space row and column normalisation, then
  one final row normalisation, turn the (n_buckets x n_buckets) scores into a soft permutation matrix
  ``P`` (doubly stochastic). The *sorted bucket* of query bucket ``i`` is the ``P[i]``-weighted mixture
  of whole buckets of keys and values, slot by slot. A query attends, in one softmax, to the keys of
  its own bucket and to the keys of its sorted bucket.
* **Causality.** Within its own bucket a query sees keys up to its own position. The sorted bucket of
  bucket ``i`` mixes only complete past buckets ``j < i`` (bucket 0 has none: those slots are masked),
  and row ``i`` of the sort scores uses the summary of bucket ``i - 1`` on the query side, so it depends
  only on tokens before bucket ``i``. Column normalisation is left out when causal: a column sums over
  *all* rows, and row ``i + 1`` reads bucket ``i``, so it would leak bucket ``i``'s later tokens into
  the queries of bucket ``i``. Normalising each column over rows ``<= i`` only is causal but pointless:
  on a strictly lower-triangular support those constraints pin the whole matrix (to the "previous
  bucket" shift, or to uniform rows with rescaled targets) whatever the scores, so the sort net could
  not learn. The causal ``P`` is therefore the masked row normalisation alone (a softmax over past
  buckets, as in the reference implementation the seed script ran), and ``sinkhorn_iters`` only
  affects non-causal attention. Masked entries sit at a large finite negative value, never ``-inf``,
  so fully masked rows (bucket 0) cannot produce NaN.
* **Local heads.** The first ``n_local_attn_heads`` query heads do windowed attention instead: causal,
  the own bucket up to the query's position plus the whole previous bucket; non-causal, the previous,
  own and next buckets. The remaining heads do sorted-bucket attention.

Grouped-query attention: query head ``h`` reads kv head ``h // (H // Hkv)`` everywhere (summaries, own
bucket, sorted mixture), and each query head has its own sort weights.

Cache: a plain :class:`KVCache` holding every key and value. Each call appends the new keys/values,
then computes exactly what the full forward computes for the new positions: the bucket summaries and
the (small) sort matrix are recomputed from the cache, and attention is computed for the buckets that
hold new tokens only (a decode step recomputes its own bucket's queries, never all past positions).
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


@dataclass
class SinkhornOptions:
    """attention.kind=sinkhorn: learned bucket sorting (Tay et al., 2020)."""

    bucket_size: int = 64  # tokens per bucket; sequences are padded to a multiple inside the backend
    n_local_attn_heads: int = 0  # heads doing local (windowed) attention instead of sorted-bucket attention
    sinkhorn_iters: int = 8  # row/column normalisation rounds
    temperature: float = 0.75  # of the sort scores before Sinkhorn normalisation

    def validate(self, spec: AttentionSpec) -> None:
        """Checks of this section for a layer of ``spec``; errors name the keys."""
        if self.bucket_size < 1:
            raise ConfigError(f"attention.sinkhorn.bucket_size={self.bucket_size} must be >= 1")
        if not 0 <= self.n_local_attn_heads <= spec.heads:
            raise ConfigError(f"attention.sinkhorn.n_local_attn_heads={self.n_local_attn_heads} must be "
                              f"between 0 and model.heads={spec.heads}")
        if self.sinkhorn_iters < 0:
            raise ConfigError(f"attention.sinkhorn.sinkhorn_iters={self.sinkhorn_iters} must be >= 0")
        if self.temperature <= 0:
            raise ConfigError(f"attention.sinkhorn.temperature={self.temperature} must be > 0")


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


class SortNet(nn.Module):
    """Per-head bilinear scores between bucket summaries: (B, Hs, nb, D) -> (B, Hs, nb, nb) logits.

    The key side of column j is the summary of bucket j. The query side of row i is the summary of
    bucket i when not causal, and of bucket i - 1 when causal (row 0 gets a zero query; it is masked).
    """

    def __init__(self, heads: int, head_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(head_dim).repeat(heads, 1, 1))  # (Hs, D, D)

    def forward(self, summary: torch.Tensor, causal: bool) -> torch.Tensor:
        s = summary.float()  # (B, Hs, nb, D)
        query_side = F.pad(s[:, :, :-1], (0, 0, 1, 0)) if causal else s
        scores = torch.einsum("bhid,hde,bhje->bhij", query_side, self.weight.float(), s)
        return scores / math.sqrt(s.shape[-1])


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
        n_sort = spec.heads - self.n_local
        self.sort_net = SortNet(n_sort, spec.head_dim) if n_sort else None
        rep = spec.heads // spec.kv_heads
        self.register_buffer("kv_of_head", torch.arange(spec.heads) // rep, persistent=False)

    # ------------------------------------------------------------------------------------ pieces

    def sort_matrix(self, k: torch.Tensor) -> torch.Tensor:
        """Soft permutation of the sorting heads for keys (B, L, Hkv, D): (B, Hs, nb, nb), float32."""
        kb, valid = self._buckets(k)
        return self._sort(kb, valid)

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
        logits = self.sort_net(summary, self.spec.causal) / self.temperature
        return sinkhorn(logits, self.iters, self.spec.causal)

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

        if nl < h:  # sorting heads: own bucket + sorted bucket
            hs = h - nl
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
            mix_k, mix_v = mix_k * scale.to(mix_k.dtype), mix_v * scale.to(mix_v.dtype)
            idx = self.kv_of_head[nl:]
            own_k, own_v = kb[:, idx, b0:], vb[:, idx, b0:]  # (B, Hs, nq, n, D)
            mask = torch.cat([own_mask.expand(b, hs, nq, n, n),
                              slot_ok[:, :, :, None, :].expand(b, hs, nq, n, n)], -1)  # (B, Hs, nq, n, 2n)
            outs.append(self._softmax_attend(qb[:, nl:], torch.cat([own_k, mix_k], 3),
                                             torch.cat([own_v, mix_v], 3), mask))

        out = torch.cat(outs, 1) if len(outs) > 1 else outs[0]  # (B, H, nq, n, D)
        out = out.permute(0, 2, 3, 1, 4).reshape(b, nq * n, h, d)
        return out[:, off:off + t].to(q.dtype)  # (B, T, H, D)

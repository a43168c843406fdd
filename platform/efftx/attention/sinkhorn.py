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

How it is computed (memory and speed):

* Every softmax runs in torch's SDPA (on CPU its flash kernel): per bucket, the queries against
  the block of keys they read. It keeps no attention probabilities for backward (it recomputes them from
  the saved log-sum-exp), which is what held most of the forward+backward memory before.
* Local heads read overlapping windows of the keys as ``unfold`` views, not copies; the sorting heads' block
  is the own bucket followed by the sorted or picked bucket(s) (the one copy made).
* Bucket 0, which has no previous or past bucket, is computed on its own, so every other bucket shares one
  (r, K) mask instead of a per-bucket one. Causally the own-bucket mask is the triangle alone: for every real
  query it already excludes the padding after the last key, and padded query rows are dropped.
* Causal ``blend``: the rows of the sort matrix are softmaxes over the complete past buckets, so every
  slot of the sorted bucket carries weight 1 (up to rounding) and needs no renormalisation (only non-causal
  attention over a padded last bucket does). The past buckets are mixed straight from the (unpadded) keys.
* Causal ``topk``: the picked buckets are a one-hot (weighted) mix of the past buckets plus the weighted null
  bucket, so no gathered copy of the keys is kept for backward.
* Training without a cache (a call that wants a gradient; no attention dropout): every head runs in one
  ``autograd.Function`` (``_BucketAttention``), chunk by chunk of buckets (1/8 of the sequence, at most 2048
  tokens), with the CPU flash kernel's own forward and backward ops. It keeps for backward the queries, keys,
  values, output, log-sum-exp and the selection weights only, never a block: backward builds each chunk's
  local windows and own + selected blocks again, and takes the gradients of the selection (linear in the past
  buckets and in its weights) by hand. The same attention as the paths below, keeping about the keys' worth
  less (issue 17: fwd+bwd memory). Elsewhere (no gradient, a cache, dropout) the paths below run.
* With attention dropout in training, SDPA takes its math path (probabilities materialised).
* A call whose new queries all sit in one bucket (a decode step) reads its keys as plain views of the cache,
  unpadded, and with at most 16 query rows uses two small products instead of SDPA, whose flash kernel
  costs more to set up than such a step's whole attention.

Cache: :class:`SinkhornCache`, a :class:`KVCache` that also keeps, for causal attention, the key sums of
complete buckets (extended as buckets complete) and the sorted/picked keys and values of the newest query
bucket. Each call appends the new keys/values and computes exactly what the full forward computes for the
new positions, for the buckets holding new tokens only; when the new tokens sit in one bucket, only their
query rows. A decode step inside a bucket therefore reads its own bucket, the previous one (local heads)
and the kept selection: its cost does not grow with the context. The first token of a bucket computes that
bucket's selection (one sort-net row over the bucket summaries and a mix of the past buckets, O(context)).
In both causal modes the choice for bucket ``i`` reads only keys at positions ``<= i * bucket_size``, all
in the cache by the time any query of bucket ``i`` arrives, so it holds for the rest of the bucket; a
rewind drops the selection of a bucket whose first token it removed (the sums of buckets no longer
complete are summed again when needed). Non-causal attention with a cache recomputes the sort matrix
from all keys each call (every bucket summary may change).

Rows of different lengths (``supports_ragged``; issue 15): the cache keeps that state per row (each row's
bucket sums, selection and the bucket it belongs to), every tensor one entry per row, so rows at different
positions (different bucket phases) share one cache and can be split and joined (continuous batching). The
model's forward is one batched pass; inside the attention, a one-token step of rows at different positions is
one batched step too: each row's own (and previous) bucket is gathered from the cache at its own position and
its kept selection read, and only rows whose token starts a bucket compute their new selection, each on its
own. Any other call (a ragged prefill, padded by the caller; chunks of several tokens) takes the runs of
consecutive rows of equal length one after another, each exactly as a batch of equal rows, on views of the cache.
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
from efftx.host import host_values

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


class SinkhornCache(KVCache):
    """The key/value cache of Sinkhorn attention plus what a decoding step would otherwise recompute from the
    whole cache (causal attention only), one entry per row, so that rows at different positions (different
    bucket phases) share one cache and rows can be split and joined (continuous batching):

    * ``sums``: (B, max_len // bucket_size, Hkv, D) float32 key sums of complete buckets. Row ``b``'s sums of
      buckets ``j < (lengths[b] - 1) // bucket_size`` (every complete bucket before the one holding its last
      token) are valid: a call that reaches bucket ``i`` sums every complete bucket before it when it computes
      bucket ``i``'s selection, and a complete bucket's sum never changes. A rewind needs no bookkeeping:
      what lies beyond the rule is summed again when needed (a padded prefill's padding included).
    * ``sel_k``, ``sel_v``: (B, K, Hs, D), the sorted (``blend``, K = bucket_size) or picked (``topk``,
      K = topk * bucket_size) keys and values of the newest query bucket ``sel_bucket[b]`` of each row. They
      read only keys at positions ``<= i * bucket_size``, so they hold for every later query of bucket ``i``.
    * ``sel_bucket``: (B,) long, on the host (it decides what to compute; a device copy would cost a sync
      per step), the bucket whose selection row ``b`` holds, -1 for none.

    All are kept detached (a cache is for decoding: its keys are written in place, so no gradient runs through
    it anyway). A rewind drops the selection of a row whose bucket lost its first token.
    """

    def __init__(self, batch_size: int, max_len: int, kv_heads: int, head_dim: int, *, bucket_size: int,
                 sort_heads: int = 0, selected_len: int = 0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(batch_size, max_len, kv_heads, head_dim, device=device, dtype=dtype)
        self.bucket_size = bucket_size
        buckets = max_len // bucket_size if sort_heads else 0  # no causal sorting heads: nothing is kept
        self.sums = torch.zeros(batch_size, buckets, kv_heads, head_dim, device=device, dtype=torch.float32)
        self.sel_k = torch.zeros(batch_size, selected_len, sort_heads, head_dim, device=device, dtype=dtype)
        self.sel_v = torch.zeros_like(self.sel_k)
        self.sel_bucket = torch.full((batch_size,), -1, dtype=torch.long)  # host side

    def summed(self, length: int) -> int:
        """Complete buckets whose sums are valid for a row holding ``length`` tokens."""
        return max(length - 1, 0) // self.bucket_size

    def rows(self, a: int, b: int, length: int) -> "_RowState":
        """The decoding state of rows a .. b - 1, which held ``length`` tokens each before the call that
        appended the new ones (views: writes land in the cache)."""
        return _RowState(self.sums[a:b], self.sel_k[a:b], self.sel_v[a:b], self.sel_bucket[a:b],
                         self.summed(length))

    def _rewound(self, old: list[int]) -> None:
        lengths = torch.tensor(self.lengths, dtype=torch.long)
        self.sel_bucket.masked_fill_(lengths <= self.sel_bucket * self.bucket_size, -1)


@dataclass
class _RowState:
    """Rows of a :class:`SinkhornCache` holding equally many tokens, as one forward call sees them: views of
    the cache's per-row state, and ``have``, how many leading bucket sums are valid for every one of them."""

    sums: torch.Tensor
    sel_k: torch.Tensor
    sel_v: torch.Tensor
    sel_bucket: torch.Tensor
    have: int

    def holds(self, i: int) -> bool:
        """Whether every row holds the selection of query bucket ``i``."""
        return bool((self.sel_bucket == i).all())

    def keep(self, i: int, sel_k: torch.Tensor, sel_v: torch.Tensor) -> None:
        self.sel_k.copy_(sel_k.detach())
        self.sel_v.copy_(sel_v.detach())
        self.sel_bucket.fill_(i)


@register("sinkhorn", options=SinkhornOptions)
class SinkhornAttention(AttentionBackend):
    supports_ragged = True
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

    def new_cache(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> SinkhornCache:
        s = self.spec
        keep = s.causal and self.sort_net is not None  # only causal sorting heads keep a selection
        return SinkhornCache(batch_size, max_len, s.kv_heads, s.head_dim, bucket_size=self.bucket_size,
                             sort_heads=s.heads - self.n_local if keep else 0,
                             selected_len=(self.topk if self.topk_mode else 1) * self.bucket_size if keep else 0,
                             device=device, dtype=dtype)

    # ------------------------------------------------------------------------------------ sorting

    def sort_matrix(self, k: torch.Tensor) -> torch.Tensor:
        """Soft permutation of the sorting heads for keys (B, L, Hkv, D): (B, Hs, nb, nb), float32
        (the non-causal and the causal ``blend`` design)."""
        n = self.bucket_size
        nb = -(-k.shape[1] // n)
        if not self.spec.causal:
            return self._sinkhorn(k, nb)
        return F.pad(self._blend_rows(self._sums(k, nb - 1), 0, nb), (0, 1))  # column nb - 1: no row reads it

    def select_buckets(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal ``topk`` design: the buckets every query bucket picks, for keys (B, L, Hkv, D).
        Returns bucket indices (B, Hs, nb, topk), -1 for the null bucket, and their weights (float32)."""
        nb = -(-k.shape[1] // self.bucket_size)
        picks, weights = self._pick_rows(k, self._sums(k, nb - 1), 0, nb)
        return torch.where(picks < self.topk, -1, picks - self.topk), weights

    def _sums(self, k: torch.Tensor, j: int, state: "_RowState | None" = None) -> torch.Tensor:
        """Key sums (B, j, Hkv, D), float32, of the first ``j`` buckets, which must be complete; with a
        cache, only the buckets it does not hold yet are summed (and kept)."""
        n = self.bucket_size
        if state is None:
            return k[:, :j * n].unflatten(1, (j, n)).float().sum(2)
        have = state.have
        if have >= j:
            return state.sums[:, :j]
        new = k[:, have * n:j * n].unflatten(1, (j - have, n)).float().sum(2)
        state.sums[:, have:j] = new.detach()
        state.have = j
        return torch.cat([state.sums[:, :have], new], 1)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(B, X, Hkv, D) per kv head -> (B, Hs, X, D) per sorting head."""
        return t.transpose(1, 2)[:, self.kv_of_head[self.n_local:]]

    def _blend_rows(self, sums: torch.Tensor, r0: int, nb: int) -> torch.Tensor:
        """Causal ``blend``: rows r0 .. nb - 1 of the sort matrix over the J = nb - 1 complete buckets
        whose key sums are ``sums`` (B, J, Hkv, D): (B, Hs, nb - r0, J), each row a softmax over the
        buckets before it (row 0: all zero)."""
        j = sums.shape[1]
        summary = self._heads(sums / self.bucket_size)  # (B, Hs, J, D)
        query_side = F.pad(summary, (0, 0, 1, 0))[:, :, r0:nb]  # row i reads bucket i - 1 (row 0: zeros)
        x = self.sort_net(query_side, summary).float() / self.temperature
        past = torch.arange(j, device=x.device)[None, :] < torch.arange(r0, nb, device=x.device)[:, None]
        x = x.masked_fill(~past, _MASKED)
        x = (x - torch.logsumexp(x, dim=-1, keepdim=True)).masked_fill(~past, _MASKED)
        return x.exp().masked_fill(~past, 0.0)

    def _pick_rows(self, k: torch.Tensor, sums: torch.Tensor, r0: int, nb: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal ``topk``: the picks of query buckets r0 .. nb - 1 among [topk null buckets, the J = nb - 1
        complete buckets whose key sums are ``sums``]: candidate indices (B, Hs, nb - r0, topk) (index <
        topk: the null bucket) and weights (float32)."""
        n, top = self.bucket_size, self.topk
        j = sums.shape[1]
        summary = self._heads(sums / n)
        # query side of bucket i: mean of the keys at positions 0 .. i * n (its first token included)
        before = F.pad(sums.cumsum(1), (0, 0, 0, 0, 1, 0))[:, r0:nb]  # (B, nr, Hkv, D): buckets before i
        first = k[:, r0 * n:(nb - 1) * n + 1:n].float()  # (B, nr, Hkv, D)
        count = (torch.arange(r0, nb, device=k.device, dtype=torch.float32) * n + 1)[:, None, None]
        query_side = self._heads((before + first) / count)
        logits = self.sort_net(query_side, summary) / self.temperature  # (B, Hs, nr, J)
        past = torch.arange(j, device=k.device)[None, :] < torch.arange(r0, nb, device=k.device)[:, None]
        logits = F.pad(logits.masked_fill(~past, _MASKED), (top, 0))  # the null candidates score 0
        return top_buckets(logits, top)

    def _sinkhorn(self, k: torch.Tensor, nb: int) -> torch.Tensor:
        """Non-causal: the (B, Hs, nb, nb) doubly stochastic sort matrix over every (maybe partial) bucket."""
        n, length = self.bucket_size, k.shape[1]
        sums = F.pad(k, (0, 0, 0, 0, 0, nb * n - length)).unflatten(1, (nb, n)).float().sum(2)
        count = (length - torch.arange(nb, device=k.device) * n).clamp(max=n)[:, None, None]
        summary = self._heads(sums / count)
        logits = self.sort_net(summary, summary)
        if self.gumbel_noise and self.training:
            logits = logits + gumbel_like(logits)
        return sinkhorn(logits / self.temperature, self.iters, False)

    def _mix(self, w: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Weighted sums of whole buckets, slot by slot: weights (B, Hs, nr, m, J) per sorting head over the
        buckets kv (B, J, n, Hkv, D) -> (B, nr, m, n, Hs, D). The keys are not copied to every query head:
        the local heads sharing the first sorting head's kv group get zero weight rows."""
        b, hs, nr, m, j = w.shape
        n, hkv, d = kv.shape[2:]
        rep = self.spec.heads // hkv
        g0, lead = self.n_local // rep, self.n_local % rep
        if j == 0:
            return kv.new_zeros(b, nr, m, n, hs, d)
        pg = F.pad(w, (0, 0, 0, 0, 0, 0, lead, 0)).unflatten(1, (hkv - g0, rep)).to(kv.dtype)
        out = torch.einsum("bgrimj,bjsgd->bimsgrd", pg, kv[:, :, :, g0:])
        return out.flatten(4, 5)[:, :, :, :, lead:]

    def _selected(self, k, v, r0: int, nb: int, cache: "_RowState | None"):
        """Causal: the sorted (blend) or picked (topk) keys and values of query buckets r0 .. nb - 1,
        (B, nr, K, Hs, D) with K = bucket_size (blend) or topk * bucket_size (topk)."""
        n = self.bucket_size
        j = nb - 1  # complete buckets: every past bucket of the rows computed here
        w, w_null = self._selection_weights(k, r0, nb, cache)
        past_k, past_v = (t[:, :j * n].unflatten(1, (j, n)) for t in (k, v))  # (B, J, n, Hkv, D), views
        if w_null is None:
            return self._combine(w, None, past_k, None), self._combine(w, None, past_v, None)
        return self._combine(w, w_null, past_k, self.null_key), self._combine(w, w_null, past_v, self.null_value)

    def _selection_weights(self, k, r0: int, nb: int, cache: "_RowState | None"):
        """Causal: what the selection of query buckets r0 .. nb - 1 mixes: weights (B, Hs, nr, m, J) of the
        J = nb - 1 complete buckets (blend: m = 1, the sort rows; topk: m = topk, each pick's weight on its
        bucket) and, topk only, the weights (B, nr, topk, 1, Hs, 1) of the null bucket (else None)."""
        sums = self._sums(k, nb - 1, cache)
        if not self.topk_mode:
            return self._blend_rows(sums, r0, nb)[:, :, :, None], None  # (B, Hs, nr, 1, J)
        top, j = self.topk, nb - 1
        picks, weights = self._pick_rows(k, sums, r0, nb)  # (B, Hs, nr, top)
        null = picks < top
        real = weights.masked_fill(null, 0.0)
        onehot = torch.zeros(*picks.shape, j + 1, device=k.device, dtype=weights.dtype)
        onehot = onehot.scatter(-1, (picks - top).clamp(min=0)[..., None], real[..., None])[..., :j]
        w_null = weights.masked_fill(~null, 0.0).permute(0, 2, 3, 1)[:, :, :, None, :, None]
        return onehot, w_null

    def _combine(self, w, w_null, past: torch.Tensor, learned) -> torch.Tensor:
        """The selection from :meth:`_selection_weights`' weights over past buckets (B, J, n, Hkv, D) (J may
        stop at the last bucket any of the rows reads) and the null bucket ``learned`` (Hs, D) (topk):
        (B, nr, m * n, Hs, D)."""
        chosen = self._mix(w, past)  # (B, nr, m, n, Hs, D)
        if w_null is not None:
            chosen = chosen + w_null.to(past.dtype) * learned.to(past.dtype)
        return chosen.flatten(2, 3)

    def _selected_noncausal(self, k, v, b0: int, nb: int):
        """Non-causal: the sorted buckets of query buckets b0.. (B, nq, n, Hs, D) and the (B, nq, Hs, n)
        mask of their slots that hold any key, or None when every slot does."""
        n, length = self.bucket_size, k.shape[1]
        p = self._sinkhorn(k, nb)[:, :, b0:]  # (B, Hs, nq, nb)
        pad = nb * n - length
        kb, vb = (F.pad(t, (0, 0, 0, 0, 0, pad)).unflatten(1, (nb, n)) for t in (k, v))
        return self._sorted_noncausal(p, kb, vb, length)

    def _sorted_noncausal(self, p, kb, vb, length: int):
        """Non-causal: the sorted buckets for sort rows p (B, Hs, nr, nb) over the zero-padded buckets
        kb, vb (B, nb, n, Hkv, D) of ``length`` keys, and the mask of their slots (see above)."""
        nb, n = kb.shape[1], self.bucket_size
        sel_k, sel_v = self._mix(p[:, :, :, None], kb).squeeze(2), self._mix(p[:, :, :, None], vb).squeeze(2)
        if nb * n == length:
            return sel_k, sel_v, None  # whole buckets: rows of p sum to 1 in every slot
        scale, slot_ok = self._slot_scale(p, length)
        scale = scale[..., None]
        return sel_k * scale.to(sel_k.dtype), sel_v * scale.to(sel_v.dtype), slot_ok

    def _slot_scale(self, p, length: int):
        """Non-causal, a padded last bucket: slot s of the sorted bucket averages slot s of the buckets, so it is
        renormalised by the weight the sort rows p (B, Hs, nq, nb) put on buckets real at slot s. Returns the
        scale (B, nq, n, Hs), 0 where no real key is at the slot, and the slots that hold one (B, nq, Hs, n)."""
        nb, n = p.shape[-1], self.bucket_size
        valid = (torch.arange(nb * n, device=p.device) < length).view(nb, n)
        mass = torch.einsum("bhij,js->bihs", p, valid.float())  # (B, nq, Hs, n)
        slot_ok = mass > 1e-6
        return (1.0 / mass.clamp(min=1e-6)).masked_fill(~slot_ok, 0.0).transpose(2, 3), slot_ok

    @staticmethod
    def _noncausal_mask(own: torch.Tensor, slot_ok: "torch.Tensor | None", b: int, hs: int) -> torch.Tensor:
        """Mask of non-causal sorting heads from the own-bucket masks (nq, r, n) and the sorted slots that hold
        a key (B, nq, Hs, n), or None if all do: (nq, r, 2n), or (B * nq, Hs, r, 2n) per head."""
        nq, r, n = own.shape
        if slot_ok is None:
            return F.pad(own, (0, n), value=True)
        return torch.cat([own[None, :, None].expand(b, nq, hs, r, n),
                          slot_ok[:, :, :, None, :].expand(b, nq, hs, r, n)], -1).flatten(0, 1)

    # ------------------------------------------------------------------------------------ attention

    def _attend(self, q, k, v, mask):
        """One softmax per query over its block's keys, by SDPA (its flash kernel keeps no probabilities for
        backward): q (B, nq, r, h, D); k, v (B, nq, K, hk, D) (views welcome) with h a multiple of hk (query
        head i reads kv head i // (h // hk)); mask bool, True = may attend: (r, K) shared by every bucket,
        (nq, r, K) per bucket, or (B * nq, h, r, K). Returns (B, nq, r, h, D)."""
        b, nq, r, h, d = q.shape
        if nq * r <= 16 and not (self.training and self.spec.dropout > 0):
            # a few query rows (a decode step): plain products, cheaper than setting up the flash kernel
            rep = h // k.shape[3]
            if rep > 1:
                k, v = k.repeat_interleave(rep, 3), v.repeat_interleave(rep, 3)
            mask = mask.reshape(b, nq, h, r, -1) if mask.dim() == 4 else mask[:, None] if mask.dim() == 3 else mask
            scores = torch.einsum("bnrhd,bnkhd->bnhrk", q.float(), k.float()) / math.sqrt(d)
            probs = scores.masked_fill(~mask, torch.finfo(scores.dtype).min).softmax(-1)
            return torch.einsum("bnhrk,bnkhd->bnrhd", probs, v.float()).to(q.dtype)
        q4, k4, v4 = (t.flatten(0, 1).transpose(1, 2) for t in (q, k, v))  # (B * nq, heads, len, D)
        if mask.dim() == 3:
            mask = mask[:, None]
            if b > 1:
                mask = mask.expand(b, *mask.shape).flatten(0, 1)
        dropout = self.spec.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, dropout_p=dropout,
                                             enable_gqa=k4.shape[1] != h)
        return out.transpose(1, 2).unflatten(0, (b, nq))

    def _head_kv(self, t: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
        """The kv heads of query heads h0 .. h1 - 1 of t (..., Hkv, D): a slice (for SDPA's GQA) when the
        heads cover whole kv groups, else one kv head per query head (copied)."""
        rep = self.spec.heads // t.shape[-2]
        if h0 % rep == 0 and h1 % rep == 0:
            return t[..., h0 // rep:h1 // rep, :]
        return t[..., self.kv_of_head[h0:h1], :]

    def forward(self, q, k, v, *, cache: KVCache | None = None, x=None):
        # q: (B, T, H, D); k, v: (B, T, Hkv, D)
        if cache is None:
            return self._forward(q, k, v, None, lean=self._lean(q, k, v))
        if not isinstance(cache, SinkhornCache):  # a plain key/value cache: rows of equal length
            k, v = cache.append(k, v)
            return self._forward(q, k, v, None)
        t = q.shape[1]
        before = list(cache.lengths)
        k, v, _ = cache.append_rows(k, v, self.spec.causal)  # (B, L, Hkv, D): each row's tokens at its place
        causal = self.spec.causal
        runs = _runs(before)
        if causal and t == 1 and len(runs) > 1 and not (self.training and self.spec.dropout > 0):
            return self._decode_rows(q, k, v, cache, before)  # a decode step of rows at different positions
        outs = []
        for a, b in runs:  # rows of equal length: one call on views of their keys and state
            end = before[a] + t
            state = cache.rows(a, b, before[a]) if causal else None
            outs.append(self._forward(q[a:b], k[a:b, :end], v[a:b, :end], state))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _decode_rows(self, q, k, v, cache: SinkhornCache, before: list[int]):
        """Causal, one new query per row, rows at different positions (``before``, each row's new position):
        one batched step. Each row reads a window of the cache gathered at its own bucket (local heads: the
        previous and own bucket; sorting heads: the own bucket) and its kept selection; a row whose new token
        starts a bucket (or whose selection a rewind dropped) first computes its selection on its own, as in
        :meth:`_forward`. q (B, 1, H, D); k, v (B, L, Hkv, D), the cache's keys after the write."""
        n, nl, h = self.bucket_size, self.n_local, q.shape[2]
        b, dev, last = q.shape[0], q.device, k.shape[1] - 1
        pos = host_values(before, torch.long, dev)[:, None]  # (B, 1)
        start = pos - pos % n  # each row's own bucket
        rows = torch.arange(b, device=dev)[:, None]
        qb = q[:, None]  # (B, nq=1, r=1, H, D)
        outs = []
        if nl:
            idx = start - n + torch.arange(2 * n, device=dev)  # (B, 2n): the previous and the own bucket
            ok = (idx >= 0) & (idx <= pos)
            idx = idx.clamp(0, last)
            keys, vals = (self._head_kv(z, 0, nl)[rows, idx][:, None] for z in (k, v))  # (B, 1, 2n, hk, D)
            outs.append(self._attend(qb[..., :nl, :], keys, vals, ok[:, None, None].expand(b, nl, 1, 2 * n)))
        if nl < h:
            bucket = [p // n for p in before]
            for r, (p, i) in enumerate(zip(before, bucket)):  # rows that need their bucket's selection
                if int(cache.sel_bucket[r]) != i and (self.topk_mode or i > 0):
                    self._causal_selection(k[r:r + 1, :p + 1], v[r:r + 1, :p + 1], i, i + 1, cache.rows(r, r + 1, p))
            idx = start + torch.arange(n, device=dev)  # (B, n): the own bucket
            ok = idx <= pos
            idx = idx.clamp(max=last)
            heads = self.kv_of_head[nl:]
            m = cache.sel_k.shape[1]
            # blend rows in bucket 0 have none; host values: no wait for the device
            held = host_values([int(s) == i for s, i in zip(cache.sel_bucket.tolist(), bucket)], torch.bool, dev)
            keys, vals = (torch.cat([z[rows, idx][:, :, heads], sel.to(z.dtype)], 1)[:, None]
                          for z, sel in ((k, cache.sel_k), (v, cache.sel_v)))  # (B, 1, n + m, Hs, D)
            mask = torch.cat([ok, held[:, None].expand(b, m)], 1)
            outs.append(self._attend(qb[..., nl:, :], keys, vals, mask[:, None, None].expand(b, h - nl, 1, n + m)))
        out = torch.cat(outs, 3) if len(outs) > 1 else outs[0]  # (B, 1, 1, H, D)
        return out.flatten(1, 2).to(q.dtype)

    def _lean(self, q, k, v) -> bool:
        """Whether a call without a cache takes :class:`_BucketAttention`: when a gradient is wanted and
        attention dropout is off (dropout runs SDPA's own path)."""
        if not torch.is_grad_enabled() or (self.training and self.spec.dropout > 0):
            return False
        return any(t.requires_grad for t in (q, k, v)) or any(p.requires_grad for p in self.parameters())

    def _forward(self, q, k, v, state: "_RowState | None", lean: bool = False):
        """Rows of equal length: the new queries q (B, T, H, D) against every key so far k, v (B, L, Hkv, D)
        (with a cache, views of it), the queries sitting at the last T positions. ``lean``: a call without a
        cache that wants a gradient: with several buckets it takes :class:`_BucketAttention` (the same
        attention, computed as :meth:`_local_heads` and :meth:`_sorting_heads` do, with less memory kept)."""
        t = q.shape[1]
        length = k.shape[1]
        start = length - t  # absolute position of the first new query
        n, nl, h = self.bucket_size, self.n_local, q.shape[2]
        nb = -(-length // n)
        b0 = start // n  # first bucket holding a new query; only buckets b0.. are computed
        nq = nb - b0
        off = start - b0 * n
        if nq == 1:  # the new queries all sit in one bucket: only they are computed
            qb, qpos = q[:, None], torch.arange(off, off + t, device=q.device)
        else:  # whole buckets (zero queries before the first new one and after the last; dropped)
            qb = F.pad(q, (0, 0, 0, 0, off, nb * n - length)).unflatten(1, (nq, n))
            qpos = torch.arange(n, device=q.device)
        geo = _Geometry(n, length, b0, nb, qpos, self.spec.causal)
        if lean and nq > 1:  # several whole buckets, no cache, a gradient wanted
            out = self._lean_heads(qb, k, v, geo)
        else:
            outs = []
            if nl:
                outs.append(self._local_heads(qb[..., :nl, :], k, v, geo))
            if nl < h:
                outs.append(self._sorting_heads(qb[..., nl:, :], k, v, geo, state))
            out = torch.cat(outs, 3) if len(outs) > 1 else outs[0]  # (B, nq, r, H, D)
        out = out.flatten(1, 2)
        if nq > 1:
            out = out[:, off:off + t]
        return out.to(q.dtype)  # (B, T, H, D)

    def _lean_heads(self, q, k, v, geo: "_Geometry"):
        """Every head of a call without a cache by :class:`_BucketAttention`: the same blocks, masks and
        selections as :meth:`_local_heads` and :meth:`_sorting_heads`, bucket 0 included (its missing previous
        bucket and, causal ``blend``, its empty selection masked). q (B, nq, r, H, D) of several buckets."""
        n, b0, nb, causal = geo.n, geo.b0, geo.nb, geo.causal
        b, nq, r, h = q.shape[:4]
        nl = self.n_local
        whole = k.shape[2] == h  # one kv head per query head: the groups' kv heads are slices

        def mask_of(parts):  # per query bucket, the (r, width) masks of a block's parts: (nq, r, K)
            return torch.stack([torch.cat(parts(i), -1) for i in range(b0, nb)])

        groups = []
        w = w_null = scale = None
        if nl:
            ones = torch.ones(r, n, dtype=torch.bool, device=q.device)
            if causal:  # previous bucket (none for bucket 0), own bucket up to the query
                local = mask_of(lambda i: [ones & (i > 0), geo.own_mask(i)])
            else:  # previous, own and next bucket, their real keys
                local = mask_of(lambda i: [ones & (i > 0), geo.own_mask(i), geo.valid_keys(i + 1)])
            groups.append(_Group(0, nl, slice(0, nl) if whole else self.kv_of_head[:nl], b0, 1, 0 if causal else 1,
                                 0, None, lambda a, e: local[a:e]))
        if nl < h:
            kv = slice(nl, h) if whole else self.kv_of_head[nl:]
            if causal:
                w, w_null = self._selection_weights(k, b0, nb, None)
                m = w.shape[3]
                if w_null is not None:
                    w_null = w_null[:, :, :, 0, :, 0]  # (B, nq, m, Hs)
                ones = torch.ones(r, m * n, dtype=torch.bool, device=q.device)
                # own bucket up to the query; the selection (blend bucket 0 has none)
                sort = mask_of(lambda i: [geo.own_mask(i), ones & (i > 0 or self.topk_mode)])
                groups.append(_Group(nl, h, kv, b0, 0, 0, m, lambda a: min(nb - 1, b0 + a), lambda a, e: sort[a:e]))
            else:
                p = self._sinkhorn(k, nb)[:, :, b0:]  # (B, Hs, nq, nb)
                w, slot_ok = p[:, :, :, None], None
                if nb * n > geo.length:  # the slots of the padded last bucket: renormalised
                    scale, slot_ok = self._slot_scale(p, geo.length)  # (B, nq, n, Hs), (B, nq, Hs, n)
                own = torch.stack([geo.own_mask(i) for i in range(b0, nb)])  # (nq, r, n)
                groups.append(_Group(nl, h, kv, b0, 0, 0, 1, lambda a: nb, lambda a, e: self._noncausal_mask(
                    own[a:e], None if slot_ok is None else slot_ok[:, a:e], b, h - nl)))
        null_k, null_v = (self.null_key, self.null_value) if w_null is not None else (None, None)
        flash = _CPU_FLASH and q.device.type == "cpu"
        chunk = max(1, min(_CHUNK_TOKENS, geo.length // _CHUNKS) // n)  # buckets per chunk
        return _BucketAttention.apply(groups, n, chunk, flash, q, k, v, w, w_null, null_k, null_v, scale)

    def _local_heads(self, q, k, v, geo: "_Geometry"):
        """Local heads: one softmax over the previous, own (and, non-causal, next) bucket. The windows are
        overlapping views of the keys (``unfold``), not copies; bucket 0, which has no previous bucket,
        is computed on its own, so every other bucket shares one mask. q (B, nq, r, nl, D)."""
        n, b0, nb, causal = geo.n, geo.b0, geo.nb, geo.causal
        nl = q.shape[3]
        width = 2 if causal else 3
        lo = max(b0 - 1, 0)
        if causal and q.shape[1] == 1:  # one bucket (a decode step): the window is a plain view of the keys
            keys, vals = (self._head_kv(z, 0, nl)[:, lo * n:geo.length, None] for z in (k, v))
            span = torch.arange(geo.length - lo * n, device=q.device)
            mask = span[None, :] <= (b0 - lo) * n + geo.qpos[:, None]  # the previous bucket, own up to the query
            return self._attend(q, keys.transpose(1, 2), vals.transpose(1, 2), mask)
        kl, vl = (geo.whole(self._head_kv(z, 0, nl)[:, lo * n:], 0 if causal else n) for z in (k, v))
        outs = []
        if b0 == 0:  # bucket 0: own (and next) bucket only
            m = 1 if causal else 2
            mask = torch.cat([geo.own_mask(0)] + ([] if causal else [geo.valid_keys(1)]), -1)
            outs.append(self._attend(q[:, :1], kl[:, None, :m * n], vl[:, None, :m * n], mask))
            q = q[:, 1:]
        if q.shape[1]:
            win_k, win_v = (z.unfold(1, width * n, n).movedim(-1, 2) for z in (kl, vl))  # (B, nq', width*n, .)
            i0 = max(b0, 1)
            if causal:  # previous bucket (complete) + own bucket up to the query: the same for every bucket
                mask = torch.cat([torch.ones_like(geo.own_mask(i0)), geo.own_mask(i0)], -1)
            else:
                mask = torch.stack([torch.cat([torch.ones_like(geo.own_mask(i)), geo.own_mask(i),
                                               geo.valid_keys(i + 1)], -1) for i in range(i0, nb)])
            outs.append(self._attend(q, win_k, win_v, mask))
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]

    def _sorting_heads(self, q, k, v, geo: "_Geometry", state: "_RowState | None"):
        """Sorting heads: one softmax over the own bucket and the sorted (blend) or picked (topk) bucket(s).
        Causal ``blend`` bucket 0 has no past bucket: it is computed on its own (own bucket only), so every
        other bucket shares one mask. q (B, nq, r, Hs, D)."""
        n, b0, nb, causal = geo.n, geo.b0, geo.nb, geo.causal
        b, nq, r, hs = q.shape[:4]
        nl = self.n_local
        rep = self.spec.heads // k.shape[2]
        if causal and nq == 1:  # one bucket (a decode step): its keys so far, no padding
            own_k, own_v = k[:, None, b0 * n:], v[:, None, b0 * n:]
        else:
            own_k, own_v = (geo.whole(z[:, b0 * n:]).unflatten(1, (nq, n)) for z in (k, v))  # (B, nq, n, Hkv, D)
        if rep == 1:
            own_k, own_v = own_k[..., nl:, :], own_v[..., nl:, :]
        elif not causal or self.topk_mode or nb > max(b0, 1):  # the selection is per query head: so the own bucket
            idx = self.kv_of_head[nl:]
            own_k, own_v = own_k[..., idx, :], own_v[..., idx, :]
        else:  # only causal blend bucket 0: own bucket alone, by kv group
            own_k, own_v = self._head_kv(own_k, nl, self.spec.heads), self._head_kv(own_v, nl, self.spec.heads)
        if not causal:
            sel_k, sel_v, slot_ok = self._selected_noncausal(k, v, b0, nb)
            own = torch.stack([geo.own_mask(i) for i in range(b0, nb)])  # (nq, r, n)
            mask = self._noncausal_mask(own, slot_ok, b, hs)
            return self._attend(q, torch.cat([own_k, sel_k.to(own_k.dtype)], 2),
                                torch.cat([own_v, sel_v.to(own_v.dtype)], 2), mask)
        outs = []
        if b0 == 0 and not self.topk_mode:  # blend bucket 0: no past bucket, own bucket only
            outs.append(self._attend(q[:, :1], own_k[:, :1], own_v[:, :1], geo.own_mask(0)))
            q, own_k, own_v = q[:, 1:], own_k[:, 1:], own_v[:, 1:]
        if q.shape[1]:
            i0 = b0 if self.topk_mode else max(b0, 1)
            sel_k, sel_v = self._causal_selection(k, v, i0, nb, state)  # (B, nq', m, Hs, D)
            own = geo.own_mask(i0)
            mask = F.pad(own, (0, sel_k.shape[2]), value=True)  # past buckets (and null ones): every slot
            outs.append(self._attend(q, torch.cat([own_k, sel_k.to(own_k.dtype)], 2),
                                     torch.cat([own_v, sel_v.to(own_v.dtype)], 2), mask))
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]

    def _causal_selection(self, k, v, r0: int, nb: int, state: "_RowState | None"):
        """The selection of query buckets r0 .. nb - 1; with a cache, bucket r0's is taken from it when every
        row holds it, and the last bucket's is kept for the next call."""
        parts = []
        if state is not None and state.holds(r0):
            parts.append((state.sel_k[:, None], state.sel_v[:, None]))
            r0 += 1
        if r0 < nb:
            parts.append(self._selected(k, v, r0, nb, state))
        sel_k = torch.cat([p[0] for p in parts], 1) if len(parts) > 1 else parts[0][0]
        sel_v = torch.cat([p[1] for p in parts], 1) if len(parts) > 1 else parts[0][1]
        if state is not None and r0 < nb:  # a new selection: keep the last bucket's
            state.keep(nb - 1, sel_k[:, -1], sel_v[:, -1])
        return sel_k, sel_v


# Training without a cache: every head's blocks (local windows, own bucket + selection) are built chunk by chunk
# and not kept for backward (see _BucketAttention). A chunk is 1 / _CHUNKS of the sequence, at most _CHUNK_TOKENS
# query tokens (at least one bucket): what one chunk holds while it runs (its blocks, their gradients, masks) is
# several times its share of the queries, so a chunk of the whole sequence would cost more than it saves.
# _CPU_FLASH: on CPU, call the flash kernel's forward and backward ops directly (what SDPA runs there), so backward
# recomputes no attention; False (and off CPU): SDPA, and backward recomputes each chunk's attention. Module
# switches, so that tests reach every path.
_CHUNKS = 8
_CHUNK_TOKENS = 2048
_CPU_FLASH = True


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask (True = may attend) as the additive float mask SDPA turns it into."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


@dataclass
class _Group:
    """Query heads h0 .. h1 - 1 of a :class:`_BucketAttention` call. Query bucket a (absolute bucket i0 + a)
    attends to a window of whole buckets of keys, ``before`` buckets before its own and ``after`` after it
    (zero beyond the keys), followed, for sorting heads, by its selection: ``m`` mixes, slot by slot, of the
    past buckets 0 .. reach(a) - 1 with the call's weights ``w``, plus the null bucket (weights ``w_null``),
    times ``scale`` per slot. ``kv``: the kv heads of these query heads (a slice, or a long tensor with one per
    query head). ``mask(a, e)``: bool, True = may attend, of query buckets a .. e - 1: (e - a, r, K) or
    (B * (e - a), h1 - h0, r, K)."""

    h0: int
    h1: int
    kv: "slice | torch.Tensor"
    i0: int
    before: int
    after: int
    m: int
    reach: object
    mask: object


class _BucketAttention(torch.autograd.Function):
    """Training without a cache: every head's attention, query bucket by query bucket, over its block of keys
    (see :class:`_Group`: the local heads' window, the sorting heads' own bucket and selection), computed chunk
    by chunk of ``chunk`` buckets with the CPU flash kernel's own forward and backward ops (``flash``; what SDPA
    runs on CPU) or SDPA (backward then recomputes each chunk's attention). Kept for backward: the inputs
    (queries, keys, values, selection weights, null bucket, slot scales), the output and the log-sum-exp;
    never a block or a window: backward builds each chunk's blocks again and takes the gradients of the
    selection by hand (it is linear in the past buckets and in its weights), reading the past buckets in place
    one head at a time. While it runs it holds one chunk's blocks; every gradient is added up in place into
    those of q, k, v.

    q (B, nq, r, H, D); k, v (B, L, Hkv, D); w (B, Hs, nq, m, J) float32 or None; w_null (B, nq, m, Hs) or None;
    null_k, null_v (Hs, D) or None; scale (B, nq, n, Hs) or None (m = 1). Returns (B, nq, r, H, D)."""

    @staticmethod
    def _span(grp, n, a, e):
        """The key positions lo .. hi - 1 of the windows of query buckets a .. e - 1 (may reach beyond the keys)."""
        return (grp.i0 + a - grp.before) * n, (grp.i0 + e + grp.after) * n

    @staticmethod
    def _past(grp, n, z, hh, j):
        """The past buckets 0 .. j - 1 of the kv head of the group's head hh, slot-major: (B, n, j, D), a view
        (a copy, zero-padded, where they reach beyond the keys: non-causal, a partial last bucket)."""
        part = z[:, :j * n, _BucketAttention._kv(grp, hh)]
        if part.shape[1] < j * n:
            part = F.pad(part, (0, 0, 0, j * n - part.shape[1]))
        return part.unflatten(1, (j, n)).transpose(1, 2)

    @staticmethod
    def _kv(grp, hh) -> int:
        return grp.kv.start + hh if isinstance(grp.kv, slice) else int(grp.kv[hh])

    @staticmethod
    def _weights(grp, w, hh, a, e, j, dtype):
        """The selection weights of head hh and query buckets a .. e - 1 over j past buckets: (B, 1, c * m, j)."""
        return w[:, hh, a:e, :, :j].flatten(1, 2)[:, None].to(dtype)

    @staticmethod
    def _block(grp, n, z, a, e, w, w_null, learned, scale):
        """Keys or values z (B, L, Hkv, D) of query buckets a .. e - 1: the block (B, c, h, K, D) and, for
        sorting heads, the mix of the past buckets (B, h, c, m, n, D). The past buckets are read in place, one
        head at a time (slot-major views: no copy of the keys)."""
        b, length, _, d = z.shape
        c, width = e - a, (grp.before + 1 + grp.after) * n
        lo, hi = _BucketAttention._span(grp, n, a, e)
        part = z[:, max(lo, 0):min(hi, length), grp.kv]  # (B, span, h, D), zero-padded beyond the keys
        if part.shape[1] < hi - lo:
            part = F.pad(part, (0, 0, 0, 0, max(-lo, 0), hi - max(lo, 0) - part.shape[1]))
        own = part.transpose(1, 2).unfold(2, width, n).movedim(-1, 3)  # (B, h, c, W, D)
        if not grp.m:
            return own.transpose(1, 2), None
        hg, j = grp.h1 - grp.h0, grp.reach(e - 1)
        mix = torch.stack([torch.matmul(_BucketAttention._weights(grp, w, hh, a, e, j, z.dtype),
                                        _BucketAttention._past(grp, n, z, hh, j))  # (B, n, c * m, D)
                           for hh in range(hg)], 1).unflatten(3, (c, grp.m)).permute(0, 1, 3, 4, 2, 5)
        sel = mix  # (B, h, c, m, n, D)
        if w_null is not None:  # (B, c, m, Hs) -> (B, Hs, c, m, 1, 1)
            nw = w_null[:, a:e].permute(0, 3, 1, 2)[..., None, None].to(z.dtype)
            sel = sel + nw * learned[None, :, None, None, None].to(z.dtype)
        if scale is not None:  # (B, c, n, Hs) -> (B, Hs, c, 1, n, 1)
            sel = sel * scale[:, a:e].permute(0, 3, 1, 2)[:, :, :, None, :, None].to(z.dtype)
        return torch.cat([own, sel.flatten(3, 4)], 3).transpose(1, 2), mix

    @staticmethod
    def _add(gz, kv, lo, val):
        """gz[:, lo + s, kv] += val[:, s] (val (B, S, h, D)) for the positions s that hold a key."""
        s0, s1 = max(lo, 0), min(lo + val.shape[1], gz.shape[1])
        if s1 <= s0:
            return
        val = val[:, s0 - lo:s1 - lo]
        if isinstance(kv, slice):
            gz[:, s0:s1, kv] += val
        else:
            gz[:, s0:s1].index_add_(2, kv, val)

    @staticmethod
    def _mask(grp, a, e, b, dtype, flash):
        mask = grp.mask(a, e)
        if mask.dim() == 3:
            mask = mask[None].expand(b, *mask.shape).flatten(0, 1)[:, None]
        return _additive(mask, dtype) if flash else mask

    @staticmethod
    def forward(ctx, groups, n, chunk, flash, q, k, v, w, w_null, null_k, null_v, scale):
        b, nq, r, h, d = q.shape
        out = q.new_empty(b, nq, r, h, d)
        lse = q.new_empty(b, nq, h, r, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32) \
            if flash else None
        for grp in groups:
            for a in range(0, nq, chunk):
                e = min(a + chunk, nq)
                kb = _BucketAttention._block(grp, n, k, a, e, w, w_null, null_k, scale)[0].flatten(0, 1)
                vb = _BucketAttention._block(grp, n, v, a, e, w, w_null, null_v, scale)[0].flatten(0, 1)
                q4 = q[:, a:e, :, grp.h0:grp.h1].flatten(0, 1).transpose(1, 2)  # (B * c, h, r, D)
                mask = _BucketAttention._mask(grp, a, e, b, q.dtype, flash)
                if flash:
                    o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, kb, vb, 0.0, False,
                                                                                   attn_mask=mask)
                    lse[:, a:e, grp.h0:grp.h1] = l.unflatten(0, (b, e - a))
                else:
                    o = F.scaled_dot_product_attention(q4, kb, vb, attn_mask=mask)
                out[:, a:e, :, grp.h0:grp.h1] = o.transpose(1, 2).unflatten(0, (b, e - a))
        ctx.groups, ctx.n, ctx.chunk, ctx.flash = groups, n, chunk, flash
        ctx.save_for_backward(q, k, v, w, w_null, null_k, null_v, scale, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, w, w_null, null_k, null_v, scale, out, lse = ctx.saved_tensors
        n, chunk, flash = ctx.n, ctx.chunk, ctx.flash
        b, nq, r, h, d = q.shape
        gq, gk, gv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        gw = torch.zeros_like(w) if w is not None else None
        gw_null = torch.zeros_like(w_null) if w_null is not None else None
        g_null = [torch.zeros_like(null_k), torch.zeros_like(null_v)] if null_k is not None else [None, None]
        g_scale = torch.zeros_like(scale) if scale is not None else None
        for grp in ctx.groups:
            m, width, hg = grp.m, (grp.before + 1 + grp.after) * n, grp.h1 - grp.h0
            for a in range(0, nq, chunk):
                e = min(a + chunk, nq)
                c = e - a
                kb, mix_k = _BucketAttention._block(grp, n, k, a, e, w, w_null, null_k, scale)
                vb, mix_v = _BucketAttention._block(grp, n, v, a, e, w, w_null, null_v, scale)
                kb, vb = kb.flatten(0, 1), vb.flatten(0, 1)
                q4 = q[:, a:e, :, grp.h0:grp.h1].flatten(0, 1).transpose(1, 2)
                g4 = grad[:, a:e, :, grp.h0:grp.h1].flatten(0, 1).transpose(1, 2)
                mask = _BucketAttention._mask(grp, a, e, b, q.dtype, flash)
                if flash:
                    o4 = out[:, a:e, :, grp.h0:grp.h1].flatten(0, 1).transpose(1, 2)
                    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                        g4, q4, kb, vb, o4, lse[:, a:e, grp.h0:grp.h1].flatten(0, 1), 0.0, False, attn_mask=mask)
                else:  # the chunk's attention again, under autograd
                    leaves = [t.detach().requires_grad_() for t in (q4, kb, vb)]
                    with torch.enable_grad():
                        o = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
                    dq, dk, dv = torch.autograd.grad(o, leaves, g4)
                gq[:, a:e, :, grp.h0:grp.h1] = dq.transpose(1, 2).unflatten(0, (b, c))
                lo = _BucketAttention._span(grp, n, a, e)[0]
                for z, dz, gz, mix, i in ((k, dk, gk, mix_k, 0), (v, dv, gv, mix_v, 1)):
                    dz = dz.unflatten(0, (b, c)).transpose(1, 2)  # (B, h, c, K, D)
                    for p in range(0, width, n):  # the window, bucket by bucket
                        _BucketAttention._add(gz, grp.kv, lo + p, dz[:, :, :, p:p + n].flatten(2, 3).transpose(1, 2))
                    if not m:
                        continue
                    gsel = dz[:, :, :, width:].unflatten(3, (m, n))  # (B, h, c, m, n, D)
                    if scale is not None:  # non-causal: no null bucket, sel = mix * scale
                        g_scale[:, a:e] += (gsel * mix).sum((3, 5)).permute(0, 2, 3, 1).to(g_scale.dtype)
                        gsel = gsel * scale[:, a:e].permute(0, 3, 1, 2)[:, :, :, None, :, None].to(gsel.dtype)
                    if w_null is not None:
                        per_pick = gsel.sum(4)  # (B, h, c, m, D)
                        learned = (null_k, null_v)[i][None, :, None, None].to(per_pick.dtype)
                        gw_null[:, a:e] += (per_pick * learned).sum(-1).permute(0, 2, 3, 1).to(gw_null.dtype)
                        nw = w_null[:, a:e].permute(0, 3, 1, 2)[..., None].to(per_pick.dtype)
                        g_null[i] += (per_pick * nw).sum((0, 2, 3)).to(g_null[i].dtype)
                    j = grp.reach(e - 1)
                    for hh in range(hg if j else 0):  # the selection is linear in the past and in its weights
                        past = _BucketAttention._past(grp, n, z, hh, j)  # (B, n, j, D)
                        gmix = gsel[:, hh].flatten(1, 2).transpose(1, 2)  # (B, n, c * m, D)
                        gw[:, hh, a:e, :, :j] += torch.matmul(gmix, past.transpose(2, 3)).sum(1) \
                            .unflatten(1, (c, m)).to(gw.dtype)
                        g_past = torch.matmul(_BucketAttention._weights(grp, w, hh, a, e, j, z.dtype).transpose(2, 3),
                                              gmix)  # (B, n, j, D)
                        top = min(j * n, gz.shape[1])
                        gz[:, :top, _BucketAttention._kv(grp, hh)] += g_past.transpose(1, 2).flatten(1, 2)[:, :top]
        return None, None, None, None, gq, gk, gv, gw, gw_null, g_null[0], g_null[1], g_scale


def _runs(lengths: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive rows of equal length."""
    runs, a = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] != lengths[a]:
            runs.append((a, i))
            a = i
    return runs


@dataclass
class _Geometry:
    """Where the queries of one call sit: bucket size n, keys so far, buckets b0 .. nb - 1 computed, and the
    positions ``qpos`` of the computed query rows within their bucket."""

    n: int
    length: int
    b0: int
    nb: int
    qpos: torch.Tensor
    causal: bool

    def valid_keys(self, i: int) -> torch.Tensor:
        """(r, n) bool: the slots of bucket i that hold a key (none beyond the last bucket)."""
        slots = torch.arange(self.n, device=self.qpos.device)
        return (slots < self.length - i * self.n)[None, :].expand(len(self.qpos), self.n)

    def own_mask(self, i: int) -> torch.Tensor:
        """(r, n) bool: the keys of its own bucket i a query row reads: up to itself (causal; this excludes
        padding for every real query), or every real key. Causal with one bucket computed: (r, keys so far
        in it), as its keys are then not padded."""
        if self.causal:
            width = self.length - self.b0 * self.n if self.nb - self.b0 == 1 else self.n
            return torch.arange(width, device=self.qpos.device)[None, :] <= self.qpos[:, None]
        return self.valid_keys(i)

    def whole(self, z: torch.Tensor, extra: int = 0) -> torch.Tensor:
        """Keys (B, from bucket boundary .. length, ...) zero-padded to whole buckets plus ``extra`` slots
        (a view when nothing is padded)."""
        pad = (-z.shape[1]) % self.n + extra
        return F.pad(z, (0, 0, 0, 0, 0, pad)) if pad else z

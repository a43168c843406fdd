"""Local (sliding-window) attention: causal softmax attention in which each query sees itself and the
``window_size - 1`` tokens before it.

Cost is linear in the sequence length: queries go in blocks of ``max(window_size, MIN_QUERY_BLOCK)``
positions, and a block reads only the keys its window can reach (the block's own positions plus the
``window_size - 1`` before its first query), so no (T x T) score matrix is ever built.

Decoding uses the plain :class:`KVCache`: the new keys are appended and the window is a mask over the
cached ones, so prefill, chunked prefill and one-token steps compute exactly what the full forward does.
Rows of different lengths (``supports_ragged``) take the cache's per-row visibility mask, narrowed to
each row's own window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from efftx.attention.base import AttentionBackend, AttentionSpec
from efftx.attention.cache import KVCache
from efftx.attention.registry import register
from efftx.errors import ConfigError
from efftx.host import host_values

MIN_QUERY_BLOCK = 16  # queries per block at least: tiny windows would otherwise mean one SDPA call per token


@dataclass
class LocalOptions:
    """attention.kind=local: causal sliding-window softmax attention."""

    window_size: int = 128  # keys each query sees: itself and the window_size - 1 before it

    def validate(self, spec: AttentionSpec) -> None:
        """Checks of this section; errors name the keys."""
        if self.window_size < 1:
            raise ConfigError(f"attention.local.window_size must be > 0, got {self.window_size}")


def band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """True where a query at ``q_pos`` may read a key at ``k_pos`` (broadcast): ``q - window < k <= q``."""
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


@register("local", options=LocalOptions)
class LocalAttention(AttentionBackend):
    supports_ragged = True
    contract_options = {"window_size": 6}  # shorter than the contract's sequences, and several query blocks

    def __init__(self, spec: AttentionSpec):
        super().__init__(spec)
        if not self.spec.causal:
            raise ConfigError("attention.kind=local is causal only")
        self.window = self.spec.options.window_size

    def forward(self, q, k, v, *, cache: KVCache | None = None, x=None):
        # q: (B, T, H, D); k, v: (B, T, Hkv, D)
        t_q = q.shape[1]
        rows = None
        if cache is not None:
            k, v, rows = cache.append_rows(k, v, True)  # (B, L, Hkv, D), L = longest row so far
        if rows is not None:  # rows of different lengths: their visibility, narrowed to each row's window
            q_pos = host_values(cache.lengths, torch.long, q.device)[:, None] - t_q + torch.arange(t_q, device=q.device)
            mask = rows & band_mask(q_pos[..., None], torch.arange(k.shape[1], device=q.device), self.window)
            return self._attend(q, k, v, mask[:, None])  # (B, 1, T, L)
        start = k.shape[1] - t_q  # absolute position of the first query
        block = max(self.window, MIN_QUERY_BLOCK)
        outs = []
        for a in range(0, t_q, block):
            b = min(a + block, t_q)
            lo = max(0, start + a - self.window + 1)  # the first key the block's first query sees
            q_pos = torch.arange(start + a, start + b, device=q.device)[:, None]
            mask = band_mask(q_pos, torch.arange(lo, start + b, device=q.device), self.window)
            outs.append(self._attend(q[:, a:b], k[:, lo:start + b], v[:, lo:start + b], mask))
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]

    def _attend(self, q, k, v, mask):
        """Masked SDPA: q (B, Tq, H, D), k/v (B, Tk, Hkv, D), bool mask broadcast to (B, H, Tq, Tk) -> (B, Tq, H, D).
        Every query sees at least its own key, so no row of the softmax is empty."""
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        dropout = self.spec.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)

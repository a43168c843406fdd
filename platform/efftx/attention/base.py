"""What every attention backend receives and must provide."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from efftx.attention.cache import KVCache


_RECOMPUTING = contextvars.ContextVar("efftx_recomputing", default=False)


@contextlib.contextmanager
def recomputing():
    """Marks a forward pass that recomputes an earlier one (reversible backward, checkpointing):
    backends must not advance internal state (counters, redraws) during it."""
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


def is_recomputing() -> bool:
    return _RECOMPUTING.get()


@dataclass(frozen=True)
class AttentionSpec:
    kind: str
    dim: int  # model width (for backends that look at x)
    heads: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    causal: bool = True
    dropout: float = 0.0
    layer_index: int = 0
    options: Any = None  # the backend's own section of the config (cfg.attention.<kind>), if it has one
    seed: int = 0  # train.seed: backends that draw random numbers (Performer features) derive them from it

    @classmethod
    def from_config(cls, cfg: Any, layer_index: int = 0, kind: str | None = None) -> "AttentionSpec":
        m = cfg.model
        kind = kind or cfg.attention.kind
        return cls(
            kind=kind,
            dim=m.dim,
            heads=m.heads,
            kv_heads=m.kv_heads or m.heads,
            head_dim=m.head_dim or m.dim // m.heads,
            max_seq_len=m.max_seq_len,
            dropout=cfg.attention.dropout,
            layer_index=layer_index,
            options=getattr(cfg.attention, kind, None),
            seed=cfg.train.seed,
        )


class AttentionBackend(nn.Module):
    """Inner attention math. Projections, rotary and the output projection live outside."""

    name = "?"
    supports_ragged = False  # accepts caches whose rows hold different numbers of tokens (see cache.py)

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.spec = spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cache: Any = None,
                x: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def new_cache(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> Any:
        """Default: a key/value cache. Backends with other decoding state override this."""
        s = self.spec
        return KVCache(batch_size, max_len, s.kv_heads, s.head_dim, device=device, dtype=dtype)

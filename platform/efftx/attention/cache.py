"""Decoding state: a per-layer key/value cache and the model-level cache that holds one per layer.

Every cache type has ``length`` (tokens already seen) and ``rewind(n)`` (forget the last ``n``
tokens). Speculative decoding relies on rewind to drop rejected draft tokens.
"""

from __future__ import annotations

from typing import Any

import torch


class KVCache:
    """Pre-allocated keys/values, (B, max_len, Hkv, D); ``length`` valid positions."""

    def __init__(self, batch_size: int, max_len: int, kv_heads: int, head_dim: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        shape = (batch_size, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, T, Hkv, D) new keys/values; return all valid keys/values so far."""
        t = k.shape[1]
        end = self.length + t
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.max_len}")
        self.k[:, self.length:end] = k.to(self.k.dtype)
        self.v[:, self.length:end] = v.to(self.v.dtype)
        self.length = end
        return self.k[:, :end], self.v[:, :end]

    def rewind(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot rewind {n} tokens from a cache holding {self.length}")
        self.length -= n


class ModelCache:
    """One cache per layer; the model reads ``length`` as the position offset of new tokens."""

    def __init__(self, layers: list[Any]):
        self.layers = layers

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    def rewind(self, n: int) -> None:
        for layer in self.layers:
            layer.rewind(n)

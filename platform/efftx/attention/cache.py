"""Decoding state: a per-layer key/value cache and the model-level cache that holds one per layer.

Every cache type has ``length`` (tokens already seen) and ``rewind(n)`` (forget the last ``n``
tokens). Speculative decoding relies on rewind to drop rejected draft tokens.

Rows of one batch may hold different numbers of tokens ("ragged"): prompts of different lengths,
or speculative decoding where each row keeps its own accepted tokens. ``rewind`` then takes one
count per row. Only backends with ``supports_ragged = True`` accept a ragged cache: they place new
tokens at each row's own position (``positions``) and mask the slots beyond each row's length.
Reading ``length`` of a ragged cache is an error, so a backend that assumes equal rows cannot
silently mix them up.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from efftx.host import host_values


class RaggedCacheError(RuntimeError):
    """A cache whose rows differ in length reached code that needs equal rows."""


class RowLengths:
    """Tokens seen per row, kept on the host (rewind counts come from host-side decisions anyway)."""

    def __init__(self, batch_size: int, device: torch.device | str):
        self.lengths = [0] * batch_size
        self.device = torch.device(device)

    @property
    def ragged(self) -> bool:
        return len(set(self.lengths)) > 1

    @property
    def length(self) -> int:
        if self.ragged:
            raise RaggedCacheError(f"the cache's rows hold different numbers of tokens {self.lengths}; "
                                   "this code path needs rows of equal length")
        return self.lengths[0] if self.lengths else 0

    @property
    def end(self) -> int:
        """Slots in use: the longest row."""
        return max(self.lengths, default=0)

    def offset(self) -> int | torch.Tensor:
        """Position of each row's next token: an int when rows are equal, else (B, 1) long."""
        if not self.ragged:
            return self.length
        return host_values(self.lengths, torch.long, self.device).unsqueeze(1)

    def _grow(self, t: int, capacity: int, what: str) -> None:
        if self.end + t > capacity:
            raise ValueError(f"{what} overflow: {self.end + t} positions > capacity {capacity}")
        self.lengths = [n + t for n in self.lengths]

    def rewind(self, n: int | Sequence[int]) -> None:
        """Forget the last ``n`` tokens of every row, or ``n[b]`` tokens of row b."""
        counts = [int(n)] * len(self.lengths) if isinstance(n, int) else [int(c) for c in n]
        if len(counts) != len(self.lengths):
            raise ValueError(f"rewind got {len(counts)} counts for {len(self.lengths)} rows")
        for c, have in zip(counts, self.lengths):
            if not 0 <= c <= have:
                raise ValueError(f"cannot rewind {c} tokens from a cache holding {have}")
        old = self.lengths
        self.lengths = [have - c for c, have in zip(counts, old)]
        if old != self.lengths:
            self._rewound(old)

    def _rewound(self, old: list[int]) -> None:
        """Hook for caches whose state must be rebuilt after a rewind."""


def visible_keys(lengths: Sequence[int], t: int, causal: bool, device: torch.device) -> torch.Tensor:
    """(B, t, L) bool, True = query i of row b may read key slot j, for ``t`` new tokens written at
    each row's own position (``lengths`` before the write); L = the longest row after it."""
    before = host_values(lengths, torch.long, device)[:, None, None]  # (B, 1, 1)
    end = max(lengths) + t
    j = torch.arange(end, device=device)[None, None, :]
    if causal:
        return j <= before + torch.arange(t, device=device)[None, :, None]
    return j < before + t


class KVCache(RowLengths):
    """Pre-allocated keys/values, (B, max_len, Hkv, D); each row's first ``lengths[b]`` slots valid."""

    def __init__(self, batch_size: int, max_len: int, kv_heads: int, head_dim: int, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        super().__init__(batch_size, device)
        shape = (batch_size, max_len, kv_heads, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int]) -> "KVCache":
        """A cache over given (B, max_len, Hkv, D) buffers (views: nothing copied) whose rows hold ``lengths``."""
        if k.shape != v.shape or len(lengths) != k.shape[0] or not all(0 <= int(n) <= k.shape[1] for n in lengths):
            raise ValueError(f"a cache over keys {tuple(k.shape)} and values {tuple(v.shape)} cannot hold rows of "
                             f"lengths {list(lengths)}")
        cache = cls.__new__(cls)
        RowLengths.__init__(cache, k.shape[0], k.device)
        cache.k, cache.v, cache.lengths = k, v, [int(n) for n in lengths]
        return cache

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store (B, T, Hkv, D) new keys/values after rows of equal length; return all keys/values so far."""
        start = self.length  # raises on a ragged cache
        self._grow(k.shape[1], self.max_len, "KV cache")
        end = start + k.shape[1]
        self.k[:, start:end] = k.to(self.k.dtype)
        self.v[:, start:end] = v.to(self.v.dtype)
        return self.k[:, :end], self.v[:, :end]

    def append_rows(self, k: torch.Tensor, v: torch.Tensor, causal: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Like :meth:`append`, for rows of any lengths: each row's tokens go to its own position.

        Returns keys, values (B, L, Hkv, D) and the (B, T, L) visibility mask, or ``None`` when the
        rows were equal (the caller's usual causal masking then applies).
        """
        if not self.ragged:
            return (*self.append(k, v), None)
        before = list(self.lengths)
        self.write_rows(k, v)
        end = self.end
        return self.k[:, :end], self.v[:, :end], visible_keys(before, k.shape[1], causal, self.k.device)

    def write_rows(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write new keys/values (B, T, Hkv, D) at each row's own position and advance the rows; -> the rows'
        lengths before, a (B,) long tensor on the cache's device. Raises, nothing written, when they do not fit."""
        t = k.shape[1]
        before = host_values(self.lengths, torch.long, self.k.device)
        self._grow(t, self.max_len, "KV cache")
        slots = before[:, None] + torch.arange(t, device=self.k.device)
        rows = torch.arange(k.shape[0], device=self.k.device)[:, None]
        self.k[rows, slots] = k.to(self.k.dtype)
        self.v[rows, slots] = v.to(self.v.dtype)
        return before


def cache_offset(cache: Any) -> int | torch.Tensor:
    """Position of the next token: int for equal rows, (B, 1) for ragged caches, 0 without a cache."""
    if cache is None:
        return 0
    return cache.offset() if hasattr(cache, "offset") else cache.length


def cache_limit(cache: Any, t: int) -> int | None:
    """One past the last position of ``t`` new tokens, from a cache that keeps its row lengths on the host (its
    longest row + t), or a bound on it that its owner checked on the host before the pass (compiled decoding's
    device cache: its ``bound``, the capacity, at most the model's max_seq_len); None where neither is known (no
    cache: positions are 0..t-1, checked as ints anyway)."""
    if cache is None:
        return None
    end = getattr(cache, "end", None)
    if isinstance(end, int):
        return end + t
    bound = getattr(cache, "bound", None)
    return bound if isinstance(bound, int) else None


class ModelCache:
    """One cache per layer; the model reads its offset as the position of new tokens."""

    def __init__(self, layers: list[Any]):
        self.layers = layers
        # compiled continuous batching (efftx.generation.device_slots): the rows' lengths as a device tensor, filled
        # from the host before each pass. It stays with these buffers (pooled with them: decode.give_back), so slots
        # that take them again pass the very tensors a CUDA graph was recorded over.
        self.device_lengths: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def lengths(self) -> list[int]:
        if not self.layers:
            return [0]
        first = self.layers[0]
        return list(first.lengths) if hasattr(first, "lengths") else [first.length]

    @property
    def end(self) -> int:
        return max(self.lengths)

    def offset(self) -> int | torch.Tensor:
        return cache_offset(self.layers[0]) if self.layers else 0

    def rewind(self, n: int | Sequence[int]) -> None:
        for layer in self.layers:
            layer.rewind(n)

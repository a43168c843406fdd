"""What every attention backend receives and must provide."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from efftx.attention.cache import KVCache
from efftx.errors import ConfigError


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
    """One attention layer's shape and options. The rules every backend shares are checked here, once,
    when a spec is made; errors name the config keys the values come from."""

    kind: str
    dim: int  # model width (for backends that look at x)
    heads: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    causal: bool = True
    dropout: float = 0.0
    layer_index: int = 0
    # The backend's own section of the config (cfg.attention.<kind>), if it has one; a backend fills in its
    # defaults when this is None (AttentionBackend.check), so it never repeats them.
    options: Any = None
    seed: int = 0  # train.seed: backends that draw random numbers (Performer features) derive them from it

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise ConfigError(f"model.heads must be > 0, got {self.heads}")
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise ConfigError(f"model.heads={self.heads} must be a multiple of model.kv_heads={self.kv_heads}")
        if self.head_dim < 1:
            raise ConfigError(f"the head dimension (model.head_dim, or model.dim // model.heads when it is 0) "
                              f"must be > 0, got {self.head_dim}")

    @classmethod
    def from_config(cls, model: Any, attention: Any, *, layer_index: int = 0, kind: str | None = None,
                    seed: int = 0) -> "AttentionSpec":
        """The spec of one layer from the model-only sections (``model.*``, ``attention.*``); ``seed`` is the
        init seed of backends that draw random numbers (the run's ``train.seed``)."""
        kind = kind or attention.kind
        head_dim = model.head_dim
        if not head_dim and model.heads > 0:
            if model.dim % model.heads:
                raise ConfigError(f"model.dim={model.dim} is not divisible by model.heads={model.heads}; "
                                  f"set model.head_dim")
            head_dim = model.dim // model.heads
        return cls(
            kind=kind,
            dim=model.dim,
            heads=model.heads,
            kv_heads=model.kv_heads or model.heads,
            head_dim=head_dim,
            max_seq_len=model.max_seq_len,
            dropout=attention.dropout,
            layer_index=layer_index,
            options=getattr(attention, kind, None),
            seed=seed,
        )


class AttentionBackend(nn.Module):
    """Inner attention math. Projections, rotary and the output projection live outside."""

    name: ClassVar[str] = "?"  # set by registry.register
    options_class: ClassVar[type | None] = None  # the dataclass of attention.<name>, set by registry.register
    supports_ragged: ClassVar[bool] = False  # accepts caches whose rows hold different numbers of tokens (cache.py)
    # Options (keys of attention.<name>) that make the tiny models of tests/test_attention_contract.py exercise
    # this backend's structure (several buckets, chunks, windows) at the short lengths used there.
    contract_options: ClassVar[dict[str, Any]] = {}

    def __init__(self, spec: AttentionSpec):
        super().__init__()
        self.spec = self.check(spec)

    @classmethod
    def check(cls, spec: AttentionSpec) -> AttentionSpec:
        """``spec`` with this backend's default options when it has none, after checking them (run by
        Config.validate and by the constructor, so a bad config fails before any worker starts)."""
        if cls.options_class is None:
            return spec
        if spec.options is None:
            spec = dataclasses.replace(spec, options=cls.options_class())
        spec.options.validate(spec)
        return spec

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cache: Any = None,
                x: torch.Tensor | None = None) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def new_cache(self, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype) -> Any:
        """Default: a key/value cache. Backends with other decoding state override this."""
        s = self.spec
        return KVCache(batch_size, max_len, s.kv_heads, s.head_dim, device=device, dtype=dtype)

"""The attention plug point.

Every backend is a module registered under a name and called as::

    out = backend(q, k, v, cache=None, x=None)   # q: (B, T, H, D); k, v: (B, T, Hkv, D) -> (B, T, H, D)

``Hkv`` may divide ``H`` (grouped-query attention). ``x`` is the normed hidden state (B, T, dim)
for backends whose routing/gating depends on the input. A backend that decodes token by token
owns its cache type: ``new_cache(batch, max_len, device, dtype)`` returns an object with a
``length`` (tokens seen) and ``rewind(n)`` (forget the last n tokens, for speculative decoding).

Backends are chosen by ``attention.kind`` in the run config; the registry is the only place that
maps a name to a class (no string if/elif chains elsewhere).
"""

from __future__ import annotations

from efftx.attention.base import AttentionBackend, AttentionSpec
from efftx.attention.cache import KVCache, ModelCache
from efftx.errors import ConfigError

_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register(name: str):
    """Class decorator: ``@register("full")``."""

    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention backend {name!r} registered twice")
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str) -> type[AttentionBackend]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"attention.kind={name!r} is not a registered backend; choose from {', '.join(names())}") from None


def build(spec: AttentionSpec) -> AttentionBackend:
    return get(spec.kind)(spec)


# Importing a backend module registers it.
from efftx.attention import full, nsa, patterns, performer, sinkhorn  # noqa: E402,F401

__all__ = ["AttentionBackend", "AttentionSpec", "KVCache", "ModelCache", "build", "get", "names", "register"]

"""The attention plug point.

Every backend is a module registered under a name and called as::

    out = backend(q, k, v, cache=None, x=None)   # q: (B, T, H, D); k, v: (B, T, Hkv, D) -> (B, T, H, D)

``Hkv`` may divide ``H`` (grouped-query attention). ``x`` is the normed hidden state (B, T, dim)
for backends whose routing/gating depends on the input. A backend that decodes token by token
owns its cache type: ``new_cache(batch, max_len, device, dtype)`` returns an object with a
``length`` (tokens seen) and ``rewind(n)`` (forget the last n tokens, for speculative decoding).

Backends are chosen by ``attention.kind`` in the run config; the registry (registry.py) is the only place
that maps a name to a class (no string if/elif chains elsewhere). A backend is one module of this package:
it registers itself and its options dataclass (the config section ``attention.<name>``) with
``@register(name, options=...)``, and importing this package imports every module in it, so adding a
backend is adding its file.
"""

from __future__ import annotations

import importlib
import pkgutil

from efftx.attention.base import AttentionBackend, AttentionSpec
from efftx.attention.cache import KVCache, ModelCache
from efftx.attention.registry import build, check, get, names, option_sections, register

# Importing a backend module registers it.
for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["AttentionBackend", "AttentionSpec", "KVCache", "ModelCache", "build", "check", "get", "names",
           "option_sections", "register"]

"""Name -> attention backend class, and each backend's options section.

A backend module registers itself with ``@register("name", options=NameOptions)``; the options dataclass
becomes the config section ``attention.<name>`` (efftx.config assembles ``AttentionConfig`` from
:func:`option_sections`). Backend modules import this module, never the :mod:`efftx.attention` package
(whose import discovers them) nor :mod:`efftx.config` (which reads this registry): so no import cycle.
"""

from __future__ import annotations

from typing import Callable

from efftx.attention.base import AttentionBackend, AttentionSpec
from efftx.errors import ConfigError

_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register(name: str, *, options: type | None = None) -> Callable[[type[AttentionBackend]], type[AttentionBackend]]:
    """Class decorator: ``@register("nsa", options=NSAOptions)``. ``options`` is the dataclass of the
    backend's config section (a ``validate(spec)`` method, defaults for every field), or None."""

    def deco(cls: type[AttentionBackend]) -> type[AttentionBackend]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"attention backend {name!r} registered twice")
        _REGISTRY[name] = cls
        cls.name = name
        cls.options_class = options
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


def check(spec: AttentionSpec) -> AttentionSpec:
    """Config-time checks of ``spec`` for its backend, without building it (see AttentionBackend.check)."""
    return get(spec.kind).check(spec)


def option_sections() -> dict[str, type]:
    """Backend name -> its options dataclass, for the backends that have one, sorted by name."""
    return {n: _REGISTRY[n].options_class for n in names() if _REGISTRY[n].options_class is not None}


__all__ = ["build", "check", "get", "names", "option_sections", "register"]

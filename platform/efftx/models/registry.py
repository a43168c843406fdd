"""The model registry: ``model.family`` -> the function that builds that family's model.

A builder reads the model-only sections of a run config (``model.*``, ``attention.*``, and for images
``vae.*``, ``dalle.*``) plus ``train.seed`` as the init seed of backends that draw random numbers; it
never reads data, engine or tracking settings. So :func:`build` rebuilds any export's model from its
``config.json`` alone, and inference code (:mod:`efftx.export`, generation, Serve) never imports training.
Families register next to their model class (``@register("lm")`` in ``lm.py``).
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from efftx.errors import ConfigError

Builder = Callable[[Any], nn.Module]
_BUILDERS: dict[str, Builder] = {}


def register(family: str) -> Callable[[Builder], Builder]:
    def deco(fn: Builder) -> Builder:
        if family in _BUILDERS and _BUILDERS[family] is not fn:
            raise ValueError(f"model family {family!r} registered twice")
        _BUILDERS[family] = fn
        return fn

    return deco


def families() -> list[str]:
    return sorted(_BUILDERS)


def build(cfg: Any) -> nn.Module:
    """The model of ``cfg.model.family``, freshly initialised (load weights with ``load_state_dict``)."""
    try:
        builder = _BUILDERS[cfg.model.family]
    except KeyError:
        raise ConfigError(f"model.family={cfg.model.family!r} has no model; choose from {', '.join(families())}") from None
    return builder(cfg)


def numel(p) -> int:
    """Elements of a parameter, also when ZeRO-3 has partitioned it (then ``p.numel()`` is 0: its full size is
    DeepSpeed's ``ds_numel``)."""
    return getattr(p, "ds_numel", p.numel())

"""Named run configs. ``get(name)`` returns a fresh :class:`Config`; ``--set`` overrides apply on top.

``*_debug`` recipes are tiny: they train in seconds on a CPU and are what the tests run.
"""

from __future__ import annotations

import difflib
from typing import Callable

from efftx.config import Config
from efftx.errors import ConfigError

_RECIPES: dict[str, Callable[[], Config]] = {}


def recipe(fn: Callable[[], Config]) -> Callable[[], Config]:
    _RECIPES[fn.__name__] = fn
    return fn


def names() -> list[str]:
    return sorted(_RECIPES)


def get(name: str) -> Config:
    if name not in _RECIPES:
        close = difflib.get_close_matches(name, names(), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown recipe {name!r}{hint}; available: {', '.join(names())}")
    cfg = _RECIPES[name]()
    cfg.recipe = name
    return cfg


@recipe
def lm_debug() -> Config:
    """2-layer byte LM with GQA: a full 2-worker DeepSpeed run in well under a minute on CPU."""
    return Config().override({
        "model.dim": 64, "model.depth": 2, "model.heads": 4, "model.kv_heads": 2, "model.max_seq_len": 128,
        "data.seq_len": 64,
        "train.steps": 40, "train.micro_batch_size": 4, "train.grad_accum": 2, "train.lr": 3e-3,
        "train.warmup_steps": 5, "train.log_every": 5, "train.eval_every": 20, "train.eval_batches": 4,
        "train.sample_every": 0, "train.sample_prompt_len": 32, "train.sample_length": 48,
        "train.checkpoint_every": 20,
        "scaling.cpus_per_worker": 0.5,
    })


@recipe
def lm_small() -> Config:
    """The demo: a 4-layer byte LM on the bundled corpus, a few minutes on a 2-core CPU."""
    return Config().override({
        "model.dim": 192, "model.depth": 4, "model.heads": 6, "model.kv_heads": 2, "model.max_seq_len": 256,
        "data.seq_len": 128,
        "train.steps": 300, "train.micro_batch_size": 16, "train.grad_accum": 1, "train.lr": 2e-3,
        "train.warmup_steps": 30, "train.log_every": 20, "train.eval_every": 50, "train.eval_batches": 8,
        "train.sample_every": 150, "train.sample_prompt_len": 64, "train.sample_length": 128,
        "train.checkpoint_every": 100,
    })


@recipe
def lm_enwik8() -> Config:
    """A 8-layer, 512-wide byte LM on enwik8 (give the file: --set data.corpus=PATH/enwik8.gz)."""
    return Config().override({
        "model.dim": 512, "model.depth": 8, "model.heads": 8, "model.max_seq_len": 1024,
        "data.corpus": "data/enwik8.gz", "data.seq_len": 1024,
        "train.steps": 100_000, "train.micro_batch_size": 4, "train.grad_accum": 4, "train.lr": 2e-4,
        "train.warmup_steps": 1000, "train.grad_clip": 0.5, "train.log_every": 10, "train.eval_every": 100,
        "train.eval_batches": 16, "train.sample_every": 500, "train.sample_prompt_len": 128,
        "train.sample_length": 512, "train.checkpoint_every": 1000, "engine.precision": "bf16",
    })

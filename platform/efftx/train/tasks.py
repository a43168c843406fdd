"""Tasks: how a model family joins the one train loop.

A Task turns the run config into a model and batches, a batch into a loss, a fixed validation set
into metrics, and a model into samples. The loop knows nothing about text or images.

    prepare(cfg) -> dict                      (driver, once: build/check data; plain data for workers)
    Task(cfg, prepared)                       (each worker)
    build_model(cfg) -> nn.Module          (static: an export's config alone rebuilds the model)
    train_batch(step, micro, rank) -> batch   (a pure function of its arguments: resume is exact)
    loss(model, batch) -> (loss, metrics)
    eval_batches(rank, world) -> [batch]      (this rank's share of the fixed validation set)
    evaluate(model, batches) -> {name: mean}, weight
    sample(model, step) -> {artifact name: text}
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from efftx.data.bytes import ByteData, CorpusInfo, prepare as prepare_corpus
from efftx.errors import ConfigError
from efftx.generation.decode import decode_bytes, generate

_TASKS: dict[str, type["Task"]] = {}


def register(name: str):
    def deco(cls):
        _TASKS[name] = cls
        cls.name = name
        return cls

    return deco


def get(family: str) -> type["Task"]:
    try:
        return _TASKS[family]
    except KeyError:
        raise ConfigError(f"model.family={family!r} has no task; choose from {', '.join(sorted(_TASKS))}") from None


def batch_rng(seed: int, rank: int, step: int, micro: int) -> np.random.Generator:
    """The data RNG of one micro batch: a function of its coordinates, so a resumed run sees the same data."""
    return np.random.default_rng([seed, rank, step, micro])


class Task:
    name = "?"

    def __init__(self, cfg, prepared: dict[str, Any]):
        self.cfg = cfg
        self.prepared = prepared

    @classmethod
    def prepare(cls, cfg) -> dict[str, Any]:  # pragma: no cover - interface
        raise NotImplementedError


@register("lm")
class LMTask(Task):
    """Next-byte prediction on a byte corpus; metrics in nats and bits per byte."""

    @classmethod
    def prepare(cls, cfg) -> dict[str, Any]:
        info = prepare_corpus(cfg.data.corpus, cfg.data.cache_dir, cfg.data.seq_len)
        return {"corpus": info.to_dict()}

    def __init__(self, cfg, prepared):
        super().__init__(cfg, prepared)
        self.data = ByteData(CorpusInfo(**prepared["corpus"]))
        self.seq_len = cfg.data.seq_len

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.cfg.train.micro_batch_size * self.seq_len

    @staticmethod
    def build_model(cfg):
        from efftx.models.lm import LM

        return LM(cfg)

    def train_batch(self, step: int, micro: int, rank: int) -> torch.Tensor:
        t = self.cfg.train
        return self.data.train_batch(t.micro_batch_size, self.seq_len, batch_rng(t.seed, rank, step, micro))

    def loss(self, model, batch: torch.Tensor):
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        return loss, {}

    def eval_batches(self, rank: int, world: int) -> list[torch.Tensor]:
        t = self.cfg.train
        windows = self.data.val_windows(t.eval_batches * t.micro_batch_size, self.seq_len)
        mine = windows[rank::world]
        return list(mine.split(t.micro_batch_size)) if len(mine) else []

    @torch.no_grad()
    def evaluate(self, model, batches):
        total, n = 0.0, 0
        for batch in batches:
            loss, _ = self.loss(model, batch)
            total += loss.item() * batch.shape[0]
            n += batch.shape[0]
        mean = total / n if n else 0.0
        return {"val_loss": mean, "val_bpb": mean / math.log(2)}, n

    @torch.no_grad()
    def sample(self, model, step: int) -> dict[str, str]:
        t = self.cfg.train
        prompt_len = min(t.sample_prompt_len, self.seq_len)
        length = max(1, min(t.sample_length, model.max_seq_len - prompt_len))
        prompt = self.data.val_windows(1, prompt_len)[:, :prompt_len]
        device = next(model.parameters()).device
        out = generate(model, prompt.to(device), length, temperature=t.sample_temperature,
                       top_k=t.sample_top_k, seed=t.seed + step)
        prompt_text, text = decode_bytes(prompt[0]), decode_bytes(out[0])
        return {f"samples/step_{step:06d}.txt": f"{prompt_text}\n{'-' * 40}\n{text}\n"}

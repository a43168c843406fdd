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
    sample(model, step) -> ({artifact name: text}, {metric: value})
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from efftx.data.bytes import ByteData, CorpusInfo, prepare as prepare_corpus
from efftx.errors import ConfigError
from efftx.generation.decode import decode_bytes, generate
from efftx.generation.speculative import speculative_generate

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
        if cfg.speculative.draft:  # a bad draft is a clear error now, not a crash at the first sample
            from efftx.train.checkpoint import read_export_config

            draft_cfg, _ = read_export_config(cfg.speculative.draft)
            if draft_cfg.model.vocab_size != cfg.model.vocab_size:
                raise ConfigError(f"speculative.draft has a vocabulary of {draft_cfg.model.vocab_size}, "
                                  f"the target {cfg.model.vocab_size}: they must be the same")
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
    def sample(self, model, step: int) -> tuple[dict[str, str], dict[str, float]]:
        """A sample from a validation prompt; with ``speculative.draft`` set, base vs speculative decoding
        of the same prompt, timed, with the draft's mean accepted tokens (as the speculative seed logs)."""
        t = self.cfg.train
        prompt_len = min(t.sample_prompt_len, self.seq_len)
        room = model.max_seq_len - prompt_len - (self.cfg.speculative.gamma + 1 if self.cfg.speculative.draft else 0)
        length = max(1, min(t.sample_length, room))
        prompt = self.data.val_windows(1, prompt_len)[:, :prompt_len]
        device = next(model.parameters()).device
        sampling = {"temperature": t.sample_temperature, "top_k": t.sample_top_k}
        t0 = time.perf_counter()
        out = generate(model, prompt.to(device), length, seed=t.seed + step, **sampling)
        base_s = time.perf_counter() - t0
        prompt_text, text = decode_bytes(prompt[0]), decode_bytes(out[0])
        report = f"{prompt_text}\n{'-' * 40}\n{text}\n"
        metrics: dict[str, float] = {}
        draft = self._draft(device)
        if draft is not None:
            gamma = self.cfg.speculative.gamma
            t0 = time.perf_counter()
            spec, stats = speculative_generate(model, draft, prompt.to(device), length, gamma=gamma,
                                               seed=t.seed + step, **sampling)
            spec_s = time.perf_counter() - t0
            metrics = {"decode_base_ms": base_s * 1e3, "decode_spec_ms": spec_s * 1e3,
                       "spec_speedup": base_s / spec_s, "spec_mean_accepted": stats.mean_accepted}
            report += (f"{'-' * 40} speculative (gamma {gamma}): {stats.mean_accepted:.2f} accepted per step, "
                       f"{spec_s * 1e3:.0f} ms vs base {base_s * 1e3:.0f} ms\n{decode_bytes(spec[0])}\n")
        return {f"samples/step_{step:06d}.txt": report}, metrics

    def _draft(self, device):
        """The draft model of ``speculative.draft``, loaded once per worker."""
        path = self.cfg.speculative.draft
        if not path:
            return None
        if getattr(self, "_draft_model", None) is None:
            from efftx.train.checkpoint import load_export

            self._draft_model, _, _ = load_export(path, device)
        return self._draft_model

"""The DeepSpeed engine, built from the run config: ZeRO stage, precision, accumulation, clipping.

The optimizer is torch's AdamW (DeepSpeed's own fused Adam needs a compile step and CUDA for its
fast path); the schedule is linear warmup then cosine decay to ``lr * min_lr_ratio``. Both go to
``deepspeed.initialize`` so their state is saved and restored with the DeepSpeed checkpoint.
"""

from __future__ import annotations

import math
import os

import torch


def select_device(cfg) -> str:
    want = cfg.scaling.device
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return want


def set_accelerator_env(device: str) -> None:
    """DeepSpeed picks its accelerator from DS_ACCELERATOR at import: must run before importing it."""
    os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"


def deepspeed_config(cfg) -> dict:
    t, e = cfg.train, cfg.engine
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": {"stage": e.zero_stage},
        "steps_per_print": 10**9,  # the loop does its own logging
        "wall_clock_breakdown": False,
    }
    if e.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif e.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": e.initial_scale_power,
                      "loss_scale_window": e.loss_scale_window, "hysteresis": 2, "min_loss_scale": 1}
    return ds


def lr_lambda(cfg):
    """Multiplier of train.lr at optimizer step s: linear warmup, then cosine to min_lr_ratio."""
    t = cfg.train

    def fn(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases or gains)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def initialize(model: torch.nn.Module, cfg):
    """-> (engine, optimizer, scheduler). Needs torch.distributed initialised (Ray Train does it)."""
    import deepspeed  # after set_accelerator_env

    t = cfg.train
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg))
    return engine, optimizer, scheduler

"""The DeepSpeed engine, built from the run config: ZeRO stage, precision, accumulation, clipping, optimizer.

The optimizer (``engine.optimizer``) is torch's AdamW built here (``torch_adamw``, the default), or DeepSpeed's
by name (``adam`` | ``adamw`` | ``lamb``), which DeepSpeed builds from the "optimizer" section of the config this
module writes. On CUDA that is DeepSpeed's FusedAdam / FusedLamb (not tested on this project's CPU machines). On
CPU DeepSpeed's FusedAdam is a C++ op compiled at first use and FusedLamb needs CUDA, so ``adam`` / ``adamw``
ask DeepSpeed for torch's Adam / AdamW (its ``torch_adam`` option: the same config path, no compile step) and
``lamb`` is refused (:func:`check_optimizer`). Weight decay applies to matrices only (:func:`param_groups`)
whichever builds the optimizer.

ZeRO-Offload (``engine.offload_optimizer=cpu``, ``engine.offload_param=cpu``; :func:`zero_config`) keeps the
optimizer states and fp32 master weights (and with ZeRO-3 the parameters) in host memory and steps there with
DeepSpeed's CPU Adam (DeepSpeed requires it): built by DeepSpeed for ``adam`` / ``adamw``, by efftx in AdamW
mode for ``torch_adamw``. Its C++ op compiles once per venv (:mod:`efftx.train.ops`).

The schedule (:class:`Schedule`, a LambdaLR) is, by ``train.schedule``: a linear warmup, then cosine decay to
``lr * min_lr_ratio`` or the plateau rule; or DeepSpeed's WarmupLR (``warmup``) / WarmupDecayLR
(``warmup_decay``) formulas, step for step (:func:`lr_lambda`). Optimizer and schedule go to
``deepspeed.initialize`` so their state is saved and restored with the DeepSpeed checkpoint (DeepSpeed's own
scheduler objects are not used: efftx's carries the plateau state and the learning rate it logs).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from typing import Any, Callable

import torch


def select_device(cfg) -> str:
    want = cfg.scaling.device
    if want == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return want


def set_accelerator_env(device: str) -> None:
    """DeepSpeed picks its accelerator from DS_ACCELERATOR at import: must run before importing it. Its compiled
    ops are cached with the venv (efftx.train.ops)."""
    from efftx.train.ops import remember_cpu_info, use_venv_cache

    os.environ["DS_ACCELERATOR"] = "cuda" if device == "cuda" else "cpu"
    use_venv_cache()
    remember_cpu_info()


def deepspeed_config(cfg) -> dict:
    t, e = cfg.train, cfg.engine
    ds = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "gradient_clipping": t.grad_clip,
        "zero_optimization": zero_config(cfg),
        "steps_per_print": 10**9,  # the loop does its own logging
        "wall_clock_breakdown": False,
    }
    if e.optimizer != "torch_adamw":
        check_optimizer(e.optimizer, select_device(cfg), e.zero_stage)
        params = {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.eps, "weight_decay": t.weight_decay}
        if e.optimizer != "lamb":
            params["adam_w_mode"] = e.optimizer == "adamw"
            if e.offload_optimizer == "none" and (select_device(cfg) == "cpu" or not cuda_compiler()):
                # torch's Adam / AdamW: DeepSpeed's FusedAdam compiles an op on first use (on a GPU with nvcc: a
                # worker without the CUDA toolkit could not build it); with offload DeepSpeed builds its CPU Adam,
                # which ZeRO-Offload requires
                params["torch_adam"] = True
        ds["optimizer"] = {"type": {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb"}[e.optimizer], "params": params}
    if e.precision == "bf16":
        ds["bf16"] = {"enabled": True}
    elif e.precision == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": e.initial_scale_power,
                      "loss_scale_window": e.loss_scale_window, "hysteresis": 2, "min_loss_scale": 1}
    return ds


def zero_config(cfg) -> dict:
    """The "zero_optimization" section: the stage, and ZeRO-Offload's targets (pinned host memory on CUDA)."""
    e = cfg.engine
    zero: dict = {"stage": e.zero_stage}
    pin = select_device(cfg) == "cuda"
    if e.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": e.offload_optimizer, "pin_memory": pin}
    if e.offload_param != "none":
        zero["offload_param"] = {"device": e.offload_param, "pin_memory": pin}
    return zero


def offload_label(cfg) -> str:
    """' (offload: optimizer -> cpu, params -> cpu)' for the start-of-run log line; '' without offload."""
    e = cfg.engine
    parts = [f"{what} -> {where}" for what, where in (("optimizer", e.offload_optimizer), ("params", e.offload_param))
             if where != "none"]
    return f" (offload: {', '.join(parts)})" if parts else ""


def check_optimizer(name: str, device: str, zero_stage: int = 0) -> None:
    """engine.optimizer=lamb is DeepSpeed's FusedLamb: a CUDA op, and not among the optimizers DeepSpeed runs
    under ZeRO (it asserts, unless told to allow untested optimizers)."""
    from efftx.errors import ConfigError

    if name == "lamb" and device != "cuda":
        raise ConfigError("engine.optimizer=lamb (DeepSpeed's FusedLamb) needs CUDA GPUs; on CPU use adam, adamw "
                          "or torch_adamw")
    if name == "lamb" and zero_stage >= 1:
        raise ConfigError(f"engine.optimizer=lamb (DeepSpeed's FusedLamb) is not one DeepSpeed runs under ZeRO "
                          f"(engine.zero_stage={zero_stage}); use engine.zero_stage=0, or adam, adamw or torch_adamw")


def cuda_compiler() -> bool:
    """Whether DeepSpeed can build its CUDA ops here (FusedAdam, FusedLamb compile on first use): nvcc on the PATH
    or a CUDA_HOME."""
    return bool(shutil.which("nvcc") or os.environ.get("CUDA_HOME"))


def lr_lambda(cfg):
    """Multiplier of train.lr at optimizer step s (0 = the first): linear warmup, then cosine to min_lr_ratio (or
    1 with ``train.schedule=plateau``, whose cuts :class:`Schedule` applies on top); or DeepSpeed's WarmupLR /
    WarmupDecayLR (:func:`deepspeed_warmup_lambda`)."""
    t = cfg.train
    if t.schedule in ("warmup", "warmup_decay"):
        return deepspeed_warmup_lambda(cfg)

    def fn(step: int) -> float:
        if t.warmup_steps and step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        if t.schedule == "plateau":
            return 1.0
        progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


def deepspeed_warmup_lambda(cfg):
    """DeepSpeed's WarmupLR / WarmupDecayLR (deepspeed/runtime/lr_schedules.py), as a multiplier of train.lr.

    DeepSpeed's scheduler starts at iteration -1 (lr = warmup_min_lr) and the engine steps it after every
    optimizer step, so optimizer step s runs at its iteration i = s - 1. With W = max(2, warmup_steps) and
    gamma(i) = log(i + 1) / log(W) ("log") or i / W ("linear") for i < W, else 1 (WarmupLR) or
    max(0, (steps - i) / max(1, steps - W)) (WarmupDecayLR, to warmup_min_lr at train.steps), the learning
    rate is warmup_min_lr + (lr - warmup_min_lr) * gamma(i), and gamma(-1) = 0. So the first two steps run at
    warmup_min_lr, as under DeepSpeed.
    """
    t = cfg.train
    w = max(2, t.warmup_steps)
    low = t.warmup_min_lr / t.lr

    def gamma(i: int) -> float:
        if i < 0:
            return 0.0
        if i < w:
            return math.log(i + 1) / math.log(w) if t.warmup_type == "log" else i / w
        if t.schedule == "warmup":
            return 1.0
        return max(0.0, (t.steps - i) / max(1, t.steps - w))

    return lambda step: low + (1 - low) * gamma(step - 1)


class Plateau:
    """The plateau rule of ``train.schedule=plateau`` (torch's ReduceLROnPlateau in "min" mode with a
    relative threshold), fed one validation loss per evaluation; ``scale`` multiplies ``train.lr``.

    An evaluation improves when ``value < best * (1 - plateau_threshold)``. After more than
    ``plateau_patience`` evaluations in a row without improvement the scale is multiplied by
    ``plateau_factor`` (floored at ``plateau_min_lr / lr``), and the next ``plateau_cooldown`` evaluations
    count no bad ones. Every rank sees the same (all-reduced) losses, so every rank decides the same.
    """

    def __init__(self, train_cfg):
        t = train_cfg
        self.factor, self.patience, self.cooldown, self.threshold = (
            t.plateau_factor, t.plateau_patience, t.plateau_cooldown, t.plateau_threshold)
        self.min_scale = t.plateau_min_lr / t.lr
        self.scale, self.best, self.bad, self.cooldown_left = 1.0, math.inf, 0, 0

    def observe(self, value: float) -> bool:
        """Record one evaluation; True when it cut the learning rate."""
        if value < self.best * (1 - self.threshold):
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self.bad = 0
        if self.bad > self.patience:
            self.bad, self.cooldown_left = 0, self.cooldown
            new = max(self.scale * self.factor, self.min_scale)
            if self.scale - new > 1e-12:
                self.scale = new
                return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "best": self.best, "bad": self.bad, "cooldown_left": self.cooldown_left}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale, self.best, self.bad, self.cooldown_left = (
            state["scale"], state["best"], state["bad"], state["cooldown_left"])


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """``train.lr`` x :func:`lr_lambda` (warmup, then cosine or constant) x the plateau scale.

    ``observe(val_loss)`` is called by the loop after every evaluation; it does nothing under the cosine
    schedule. A cut takes effect at once (the current learning rate is recomputed). ``state_dict`` carries
    the plateau state, so DeepSpeed's checkpoint restores it with the rest on resume.
    """

    def __init__(self, optimizer, cfg):
        self.plateau = Plateau(cfg.train) if cfg.train.schedule == "plateau" else None
        base = lr_lambda(cfg)
        super().__init__(optimizer, lambda step: base(step) * (self.plateau.scale if self.plateau else 1.0))

    def observe(self, value: float) -> bool:
        if self.plateau is None or not self.plateau.observe(value):
            return False
        for group, base_lr, fn in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["lr"] = base_lr * fn(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        return True

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.plateau is not None:
            state["plateau"] = self.plateau.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        plateau = state.pop("plateau", None)
        super().load_state_dict(state)
        if self.plateau is not None and plateau is not None:
            self.plateau.load_state_dict(plateau)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only (not on norms, biases or gains)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def torch_adamw(groups: list[dict], train_cfg) -> torch.optim.AdamW:
    """``engine.optimizer=torch_adamw``: torch's AdamW with its fused kernel (one pass over each parameter, its
    gradient and both moments; on CPU torch's default is a loop of six elementwise ops per parameter, which was
    ~15-25% of a seq-512 train step of the full-attention recipes)."""
    t = train_cfg
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, fused=True)


def initialize(model: torch.nn.Module, cfg):
    """-> (engine, optimizer, scheduler). Needs torch.distributed initialised (Ray Train does it)."""
    import deepspeed  # after set_accelerator_env

    t = cfg.train
    groups = param_groups(model, t.weight_decay)
    if cfg.engine.optimizer == "torch_adamw":
        if cfg.engine.offload_optimizer != "none":  # ZeRO-Offload steps on the host, with DeepSpeed's CPU Adam
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer = DeepSpeedCPUAdam(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, adamw_mode=True)
        else:
            optimizer = torch_adamw(groups, t)
        scheduler = Schedule(optimizer, cfg)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg))
    else:  # DeepSpeed builds its optimizer from the config's "optimizer" section; the schedule wraps it
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=groups, lr_scheduler=lambda opt: Schedule(opt, cfg),
            config=deepspeed_config(cfg))
    return engine, optimizer, scheduler


# ------------------------------------------------------------------------------------------ torch.compile

_log = logging.getLogger(__name__)


def compile_reason(cfg, device: str) -> str | None:
    """None when ``engine.compile`` compiles the model on ``device``, else why it runs eager (for the log line).

    ``auto`` compiles on CUDA only. On CPU (spec_target_enwik8, batch 1, seq 512, 2 threads, a heavily loaded
    machine) the compiled step measured 0.78x eager in one run and 1.48x in another (bench/train_throughput.py
    --compile), and compiling costs ~100 s per worker: not shown to pay, so CPU runs opt in with ``on``."""
    mode = cfg.engine.compile
    if mode == "off":
        return "engine.compile=off"
    if mode == "auto" and device != "cuda":
        return "engine.compile=auto compiles on CUDA only (on CPU it has not been shown to pay; set it to on)"
    if device == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
        return "no C++ compiler on PATH (torch.compile's CPU backend needs one)"
    return None


class CompiledTraining:
    """A model's forward: torch.compile'd in training mode (the train steps, whose shapes never change), eager in
    eval mode (evaluation, sampling and cached decoding, whose shapes and caches vary). If compiling fails the
    error is logged and the model runs eager from then on (the failing call is rerun eagerly)."""

    def __init__(self, model: torch.nn.Module, log: Callable[[str], None]):
        self.model, self.eager, self.log = model, model.forward, log
        self.compiled = torch.compile(model.forward)
        self.failed: str | None = None

    def __call__(self, *args, **kwargs):
        if self.failed is None and self.model.training:
            try:
                return self.compiled(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any compile failure means: run eager
                lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
                # the first line, and the next when the first only introduces it ("backend='inductor' raised:")
                said = " ".join(lines[:2] if lines and lines[0].endswith(":") else lines[:1])
                self.failed = f"{type(exc).__name__}: {said}"[:300]
                self.log(f"engine.compile: torch.compile failed, running eager ({self.failed})")
        return self.eager(*args, **kwargs)


def compile_model(model: torch.nn.Module, cfg, device: str, log: Callable[[str], None] = _log.info) -> bool:
    """Apply ``engine.compile`` to ``model`` in place (its forward is replaced, so parameters, state_dict keys,
    checkpoints and exports are unchanged); returns whether it compiles. A run that asked for compilation and
    does not get it logs why."""
    reason = compile_reason(cfg, device)
    if reason is not None:
        if cfg.engine.compile != "off":
            log(f"engine.compile={cfg.engine.compile}: running eager ({reason})")
        return False
    model.forward = CompiledTraining(model, log)
    log(f"engine.compile={cfg.engine.compile}: the training forward is compiled with torch.compile (first step "
        f"compiles)")
    return True


def replay_cpu_adam_steps(engine) -> int:
    """After a checkpoint load: bring DeepSpeed's CPU Adam (ZeRO-Offload) to the bias-correction state of the
    uninterrupted run, so the resumed run is bit-exact; returns the step replayed to (0 = nothing to do).

    Its C++ side keeps beta1**step and beta2**step as float32 products, multiplied once per step, and the step's
    own counter restored from the checkpoint makes it jump straight to ``pow(beta, step)`` instead: a different
    rounding (a ~1e-7 relative change of the next update). Stepping the C++ counter 1..step over empty tensors
    rebuilds the same products and changes no parameter or moment.
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    optimizer = next((o for o in (getattr(engine, "basic_optimizer", None), engine.optimizer,
                                  getattr(engine.optimizer, "optimizer", None)) if isinstance(o, DeepSpeedCPUAdam)),
                     None)
    if optimizer is None:
        return 0
    steps = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    if not steps:
        return 0
    step, group, empty = max(steps), optimizer.param_groups[0], torch.empty(0)
    beta1, beta2 = group["betas"]
    for k in range(1, step + 1):
        optimizer.ds_opt_adam.adam_update(optimizer.opt_id, k, group["lr"], beta1, beta2, group["eps"],
                                          group["weight_decay"], group["bias_correction"], empty, empty, empty,
                                          empty)
    return step

"""Bringing your own DeepSpeed config: ``engine.deepspeed_config=PATH`` (``--deepspeed-config PATH``).

The file is read and checked on the driver, in :func:`efftx.train.launch.resolve` (so ``--print-config`` shows
the result), before Ray starts. Its values are written into the run config, which stays the one description of
the run: MLflow params, checkpoints, the resume check and exports see the real values, and each worker builds
its DeepSpeed config from the run config (:func:`efftx.train.engine.deepspeed_config`) without reading the
file (which may not exist on a worker's node).

Merge rule: THE FILE WINS over the recipe and ``--set``. A key (or section) the file has sets the run-config
keys below; one it lacks leaves them as they are. A section the file has is taken whole: a parameter missing
from it takes DeepSpeed's default (as DeepSpeed would), not the run config's.

==============================================  ===========================================================
DeepSpeed key                                   run config
==============================================  ===========================================================
train_micro_batch_size_per_gpu                  train.micro_batch_size
gradient_accumulation_steps                     train.grad_accum
train_batch_size                                checked: = micro batch x accumulation x scaling.num_workers;
                                                without train_micro_batch_size_per_gpu it is derived
                                                (train_batch_size / (grad_accum x workers)), without
                                                gradient_accumulation_steps (but with the micro batch)
                                                grad_accum is; not integral = an error naming the values
gradient_clipping                               train.grad_clip
max_grad_norm (top level; legacy)               train.grad_clip (DeepSpeed itself ignores it at top level;
                                                the original enwik8 examples' files use it)
fp16.enabled / bf16.enabled (or bfloat16)       engine.precision fp16 / bf16; both off = fp32
fp16.initial_scale_power, loss_scale_window     engine.initial_scale_power, engine.loss_scale_window
                                                (loss_scale must be 0 = dynamic, hysteresis 2,
                                                min_loss_scale 1: the values efftx uses)
zero_optimization.stage (false = 0, true = 1)   engine.zero_stage
zero_optimization.offload_optimizer.device,     engine.offload_optimizer, engine.offload_param: cpu or none
zero_optimization.offload_param.device          (nvme is refused); pin_memory is accepted and set by efftx
                                                (true on CUDA); no other ZeRO key
optimizer.type Adam | AdamW | Lamb              engine.optimizer adam (Adam with adam_w_mode=false) |
                                                adamw (AdamW, or Adam with DeepSpeed's default
                                                adam_w_mode=true) | lamb
optimizer.params lr, betas, eps, weight_decay   train.lr, train.beta1 / beta2, train.eps,
                                                train.weight_decay (defaults 1e-3, [0.9, 0.999], 1e-8, 0)
scheduler.type WarmupLR | WarmupDecayLR         train.schedule warmup | warmup_decay
scheduler.params warmup_min_lr, warmup_max_lr,  train.warmup_min_lr, train.lr (the scheduler's max wins
warmup_num_steps, warmup_type,                  over optimizer.params.lr, as in DeepSpeed),
total_num_steps                                 train.warmup_steps, train.warmup_type, train.steps
                                                (defaults 0, the optimizer's lr (WarmupLR) or 1e-3
                                                (WarmupDecayLR), 1000, "log"; total_num_steps required)
steps_per_print, wall_clock_breakdown=false     accepted and ignored (efftx logs every train.log_every)
==============================================  ===========================================================

Any other top-level key, section key or optimizer/scheduler type is an error naming it; malformed JSON is an
error naming the file, line and column. The schedule stays efftx's own (:class:`efftx.train.engine.Schedule`, a
LambdaLR checkpointed with the engine, so resume is exact) with DeepSpeed's WarmupLR / WarmupDecayLR formulas:
the learning rate of every optimizer step equals the one DeepSpeed's scheduler class would give.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

from efftx.errors import ConfigError

KEY = "engine.deepspeed_config"

# Top-level keys read from the file (anything else is an error).
SUPPORTED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "gradient_clipping", "max_grad_norm", "optimizer", "scheduler", "fp16", "bf16", "bfloat16",
             "zero_optimization", "steps_per_print", "wall_clock_breakdown")
# DeepSpeed keys efftx has elsewhere or does not support, with what to do instead.
HINTS = {
    "activation_checkpointing": "activation checkpointing is a model.* key in efftx, not a DeepSpeed one",
    "zero_allow_untested_optimizer": "efftx runs only DeepSpeed's ZeRO-tested optimizers under ZeRO "
                                     "(engine.optimizer=lamb: zero_stage 0)",
    "amp": "use fp16 or bf16 (engine.precision)",
}
OPTIMIZER_TYPES = {"adam": "adam", "adamw": "adamw", "lamb": "lamb"}  # DeepSpeed type (lower case) -> engine.optimizer
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode")
OPTIMIZER_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}  # FusedAdam / FusedLamb
SCHEDULER_TYPES = {"warmuplr": "warmup", "warmupdecaylr": "warmup_decay"}
SCHEDULER_PARAMS = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps")
ZERO_KEYS = ("stage", "offload_optimizer", "offload_param")
OFFLOAD_KEYS = ("device", "pin_memory")
FP16_KEYS = ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale")
FP16_FIXED = {"loss_scale": 0, "hysteresis": 2, "min_loss_scale": 1}  # what efftx's engine always uses


def read(path: str) -> dict[str, Any]:
    """The file as a dict; a missing file, malformed JSON or a non-object is a ConfigError naming the file."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{KEY}: no such file {str(file)!r}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{KEY} {str(file)!r} is not valid JSON: {exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{KEY}: cannot read {str(file)!r}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{KEY} {str(file)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def apply(cfg) -> dict[str, Any]:
    """Read ``cfg.engine.deepspeed_config`` (if set; made absolute) and write its values into ``cfg`` (in
    place). Returns {run-config key: value} of what the file set ({} without a file)."""
    if not cfg.engine.deepspeed_config:
        return {}
    cfg.engine.deepspeed_config = str(Path(cfg.engine.deepspeed_config).expanduser().resolve())
    values = run_keys(read(cfg.engine.deepspeed_config), cfg, where=_where(cfg.engine.deepspeed_config))
    for key, value in values.items():
        cfg.set(key, value)
    return values


def keys_set(cfg) -> list[str]:
    """The run-config keys that ``cfg.engine.deepspeed_config`` sets ([] without a file)."""
    if not cfg.engine.deepspeed_config:
        return []
    return list(run_keys(read(cfg.engine.deepspeed_config), cfg, where=_where(cfg.engine.deepspeed_config)))


def run_keys(ds: dict[str, Any], cfg, where: str = "the DeepSpeed config") -> dict[str, Any]:
    """{run-config key: value} that the DeepSpeed config ``ds`` sets, given the run config ``cfg`` (for the
    worker count, and the values the file does not set)."""
    for key in ds:
        if key not in SUPPORTED:
            _unknown(where, key, SUPPORTED)
    out: dict[str, Any] = {}
    _batch(ds, cfg, where, out)
    clip = {k: _number(where, k, ds[k], low=0) for k in ("gradient_clipping", "max_grad_norm") if k in ds}
    if len(set(clip.values())) > 1:
        raise ConfigError(f"{where}: gradient_clipping={clip['gradient_clipping']} and max_grad_norm="
                          f"{clip['max_grad_norm']} disagree (max_grad_norm is the legacy name); keep one")
    if clip:
        out["train.grad_clip"] = next(iter(clip.values()))
    if ds.get("wall_clock_breakdown", False) is not False:
        raise ConfigError(f"{where}: wall_clock_breakdown must be false (efftx logs tokens/s and MFU itself)")
    if "steps_per_print" in ds:
        _number(where, "steps_per_print", ds["steps_per_print"], integer=True, low=1)
    _precision(ds, where, out)
    if "zero_optimization" in ds:
        _zero(ds["zero_optimization"], where, out)
    if "optimizer" in ds:
        _optimizer(ds["optimizer"], where, out)
    if "scheduler" in ds:
        _scheduler(ds["scheduler"], where, out, lr=out.get("train.lr", cfg.train.lr))
    return out


# ------------------------------------------------------------------------------------------------ sections

def _batch(ds, cfg, where, out) -> None:
    workers = cfg.scaling.num_workers
    micro = _number(where, "train_micro_batch_size_per_gpu", ds["train_micro_batch_size_per_gpu"], integer=True,
                    low=1) if "train_micro_batch_size_per_gpu" in ds else None
    accum = _number(where, "gradient_accumulation_steps", ds["gradient_accumulation_steps"], integer=True,
                    low=1) if "gradient_accumulation_steps" in ds else None
    if "train_batch_size" in ds:
        total = _number(where, "train_batch_size", ds["train_batch_size"], integer=True, low=1)
        if micro is not None and accum is None:  # DeepSpeed derives the accumulation
            if total % (micro * workers):
                raise ConfigError(f"{where}: train_batch_size={total} is not a multiple of "
                                  f"train_micro_batch_size_per_gpu={micro} x scaling.num_workers={workers}, so "
                                  f"no gradient_accumulation_steps fits")
            accum = total // (micro * workers)
        accum_now = accum if accum is not None else cfg.train.grad_accum
        if micro is None:
            if total % (accum_now * workers):
                raise ConfigError(f"{where}: train_batch_size={total} is not divisible by gradient_accumulation_steps"
                                  f"={accum_now} x scaling.num_workers={workers}, so no "
                                  f"train_micro_batch_size_per_gpu fits; change one of them")
            micro = total // (accum_now * workers)
        if micro * accum_now * workers != total:
            raise ConfigError(f"{where}: train_batch_size={total} must equal train_micro_batch_size_per_gpu={micro} x "
                              f"gradient_accumulation_steps={accum_now} x scaling.num_workers={workers} = "
                              f"{micro * accum_now * workers}")
    if micro is not None:
        out["train.micro_batch_size"] = micro
    if accum is not None:
        out["train.grad_accum"] = accum


def _precision(ds, where, out) -> None:
    if "bf16" in ds and "bfloat16" in ds:
        raise ConfigError(f"{where}: has both bf16 and bfloat16 (its legacy name); keep one")
    fp16 = _section(where, "fp16", ds["fp16"], FP16_KEYS) if "fp16" in ds else None
    bf16_key = "bf16" if "bf16" in ds else "bfloat16"
    bf16 = _section(where, bf16_key, ds[bf16_key], ("enabled",)) if bf16_key in ds else None
    if fp16 is None and bf16 is None:
        return
    fp16_on = _bool(where, "fp16.enabled", fp16.get("enabled", False)) if fp16 is not None else False
    bf16_on = _bool(where, f"{bf16_key}.enabled", bf16.get("enabled", False)) if bf16 is not None else False
    if fp16_on and bf16_on:
        raise ConfigError(f"{where}: fp16.enabled and {bf16_key}.enabled are both true; enable one")
    out["engine.precision"] = "fp16" if fp16_on else "bf16" if bf16_on else "fp32"
    if fp16 is not None:
        for key, fixed in FP16_FIXED.items():
            if key in fp16 and _number(where, f"fp16.{key}", fp16[key]) != fixed:
                raise ConfigError(f"{where}: fp16.{key}={fp16[key]} is not supported; efftx uses {fixed} "
                                  f"(dynamic loss scaling)")
        out["engine.initial_scale_power"] = _number(where, "fp16.initial_scale_power",
                                                    fp16.get("initial_scale_power", 16), integer=True, low=0)
        out["engine.loss_scale_window"] = _number(where, "fp16.loss_scale_window",
                                                  fp16.get("loss_scale_window", 1000), integer=True, low=1)


def _zero(zero, where, out) -> None:
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true = stage 1
        out["engine.zero_stage"] = int(zero)
        return
    zero = _section(where, "zero_optimization", zero, ZERO_KEYS,
                    hint="efftx reads zero_optimization.stage, offload_optimizer and offload_param (no ZeRO "
                         "tuning keys: DeepSpeed's defaults apply)")
    stage = _number(where, "zero_optimization.stage", zero.get("stage", 0), integer=True, low=0)
    if stage > 3:
        raise ConfigError(f"{where}: zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    out["engine.zero_stage"] = stage
    for name in ZERO_KEYS[1:]:
        key = f"zero_optimization.{name}"
        section = _section(where, key, zero.get(name, {}), OFFLOAD_KEYS)
        device = section.get("device", "none")
        if device not in ("none", "cpu"):
            raise ConfigError(f"{where}: {key}.device must be 'cpu' or 'none', got {device!r}"
                              + (" (NVMe offload is not supported by efftx)" if device == "nvme" else ""))
        if "pin_memory" in section:
            _bool(where, f"{key}.pin_memory", section["pin_memory"])
        out[f"engine.{name}"] = device


def _optimizer(section, where, out) -> None:
    section = _section(where, "optimizer", section, ("type", "params"))
    kind = section.get("type")
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZER_TYPES:
        raise ConfigError(f"{where}: optimizer.type {kind!r} is not supported; efftx takes Adam, AdamW or Lamb "
                          f"(engine.optimizer), or drop the optimizer section for torch's AdamW")
    kind = kind.lower()
    params = _section(where, "optimizer.params", section.get("params", {}), OPTIMIZER_PARAMS if kind != "lamb" else
                      OPTIMIZER_PARAMS[:-1], hint=_optimizer_hint)
    p = {**OPTIMIZER_DEFAULTS, **params}
    name = OPTIMIZER_TYPES[kind]
    if "adam_w_mode" in params:
        w_mode = _bool(where, "optimizer.params.adam_w_mode", params["adam_w_mode"])
        if kind == "adamw" and not w_mode:
            raise ConfigError(f"{where}: optimizer AdamW with adam_w_mode=false is contradictory (DeepSpeed ignores "
                              f"it); use type Adam for L2 weight decay")
        if kind == "adam":
            name = "adamw" if w_mode else "adam"
    elif kind == "adam":
        name = "adamw"  # DeepSpeed's Adam decouples weight decay unless adam_w_mode=false
    betas = p["betas"]
    if not (isinstance(betas, list) and len(betas) == 2):
        raise ConfigError(f"{where}: optimizer.params.betas must be a list of two numbers, got {betas!r}")
    out.update({
        "engine.optimizer": name,
        "train.lr": _number(where, "optimizer.params.lr", p["lr"], low=0, strict=True),
        "train.beta1": _number(where, "optimizer.params.betas[0]", betas[0], low=0),
        "train.beta2": _number(where, "optimizer.params.betas[1]", betas[1], low=0),
        "train.eps": _number(where, "optimizer.params.eps", p["eps"], low=0, strict=True),
        "train.weight_decay": _number(where, "optimizer.params.weight_decay", p["weight_decay"], low=0),
    })


_optimizer_hint = ("efftx takes lr, betas, eps, weight_decay (and adam_w_mode for Adam/AdamW); gradient "
                   "clipping is the top-level gradient_clipping; torch's optimizer: drop the section "
                   "(engine.optimizer=torch_adamw)")


def _scheduler(section, where, out, lr: float) -> None:
    section = _section(where, "scheduler", section, ("type", "params"))
    kind = section.get("type")
    if not isinstance(kind, str) or kind.lower() not in SCHEDULER_TYPES:
        raise ConfigError(f"{where}: scheduler.type {kind!r} is not supported; efftx takes WarmupLR or "
                          f"WarmupDecayLR (or drop the section: train.schedule cosine / plateau)")
    schedule = SCHEDULER_TYPES[kind.lower()]
    params = _section(where, "scheduler.params", section.get("params", {}), SCHEDULER_PARAMS)
    if schedule == "warmup" and "total_num_steps" in params:
        raise ConfigError(f"{where}: scheduler.params.total_num_steps belongs to WarmupDecayLR, not WarmupLR")
    if schedule == "warmup_decay" and "total_num_steps" not in params:
        raise ConfigError(f"{where}: WarmupDecayLR needs scheduler.params.total_num_steps (the run's train.steps)")
    max_lr = params.get("warmup_max_lr", lr if schedule == "warmup" else 1e-3)  # DeepSpeed's defaults
    warmup_type = params.get("warmup_type", "log")
    if warmup_type not in ("log", "linear"):
        raise ConfigError(f"{where}: scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    out.update({
        "train.schedule": schedule,
        "train.lr": _number(where, "scheduler.params.warmup_max_lr", max_lr, low=0, strict=True),
        "train.warmup_min_lr": _number(where, "scheduler.params.warmup_min_lr", params.get("warmup_min_lr", 0.0),
                                       low=0),
        "train.warmup_steps": _number(where, "scheduler.params.warmup_num_steps",
                                      params.get("warmup_num_steps", 1000), integer=True, low=1),
        "train.warmup_type": warmup_type,
    })
    if schedule == "warmup_decay":
        out["train.steps"] = _number(where, "scheduler.params.total_num_steps", params["total_num_steps"],
                                     integer=True, low=1)


# ------------------------------------------------------------------------------------------------ helpers

def _where(path: str) -> str:
    return f"{KEY} {path!r}"


def _unknown(where: str, key: str, known, hint: str = "") -> None:
    close = difflib.get_close_matches(key.split(".")[-1], known, n=2, cutoff=0.6)
    extra = HINTS.get(key) or hint or f"efftx reads {', '.join(known)}"
    raise ConfigError(f"{where}: DeepSpeed key {key!r} is not supported"
                      + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else "") + f"; {extra}")


def _section(where: str, name: str, value: Any, keys: tuple[str, ...], hint: str = "") -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {name} must be a JSON object, got {value!r}")
    for key in value:
        if key not in keys:
            if name == "optimizer.params" and key == "max_grad_norm":
                raise ConfigError(f"{where}: optimizer.params.max_grad_norm is not an optimizer parameter "
                                  f"(DeepSpeed refuses it too); use the top-level gradient_clipping")
            _unknown(where, f"{name}.{key}", keys, hint)
    return value


def _bool(where: str, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
    return value


def _number(where: str, key: str, value: Any, *, integer: bool = False, low: float | None = None,
            strict: bool = False) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok:
        raise ConfigError(f"{where}: {key} must be {'an integer' if integer else 'a number'}, got {value!r}")
    value = int(value) if integer else float(value)
    if low is not None and (value <= low if strict else value < low):
        raise ConfigError(f"{where}: {key} must be {'>' if strict else '>='} {low:g}, got {value}")
    return value

"""The one typed run config.

A run is described by :class:`Config`: seven sections (model, attention, data, train, engine,
tracking, scaling), each a dataclass of plain values. Every field has a dotted key
(``train.lr``) which is, all at once:

* the CLI override (``--set train.lr=3e-4``),
* the Tune search-space key,
* the MLflow param name,
* the key inside the ``config.json`` stored with every checkpoint and export.

Unknown keys and values of the wrong type are errors that name the key (and close matches).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from efftx.errors import ConfigError


@dataclass
class ModelConfig:
    family: str = "lm"  # which Task trains it (efftx.train.tasks registry)
    vocab_size: int = 256  # bytes
    dim: int = 256
    depth: int = 4
    heads: int = 4
    kv_heads: int = 0  # 0 = same as heads; fewer = grouped-query attention
    head_dim: int = 0  # 0 = dim // heads
    mlp_mult: float = 4.0
    max_seq_len: int = 1024
    norm: str = "rmsnorm"  # efftx.models.layers.NORMS
    rotary: bool = True
    rotary_base: float = 10000.0
    dropout: float = 0.0  # residual / MLP dropout
    tie_embeddings: bool = True
    emb_dim: int = 0  # 0 = dim; smaller = factorised token embedding (vocab x emb_dim, then emb_dim -> dim)
    reversible: bool = False  # reversible blocks: activation memory independent of depth
    ff_chunks: int = 1  # feed-forward applied to this many sequence chunks in turn (lower peak memory)


@dataclass
class SinkhornOptions:
    """attention.kind=sinkhorn: learned bucket sorting (Tay et al., 2020)."""

    bucket_size: int = 64  # tokens per bucket; sequences are padded to a multiple inside the backend
    n_local_attn_heads: int = 0  # heads doing local (windowed) attention instead of sorted-bucket attention
    sinkhorn_iters: int = 8  # row/column normalisation rounds
    temperature: float = 0.75  # of the sort scores before Sinkhorn normalisation


@dataclass
class PerformerOptions:
    """attention.kind=performer: FAVOR+ positive orthogonal random features (Choromanski et al., 2021)."""

    nb_features: int = 256  # random features per head
    feature_redraw_interval: int = 1000  # training forward passes between feature redraws; 0 = never
    chunk_size: int = 128  # causal prefix sums are computed chunk by chunk (memory linear in T)


@dataclass
class AttentionConfig:
    kind: str = "full"  # efftx.attention registry name
    dropout: float = 0.0  # dropout on attention probabilities (training only)
    sinkhorn: SinkhornOptions = field(default_factory=SinkhornOptions)
    performer: PerformerOptions = field(default_factory=PerformerOptions)


@dataclass
class SpeculativeConfig:
    """Speculative decoding measured while training a target: base vs speculative at every sample."""

    draft: str = ""  # export folder of a draft model sharing the vocabulary ("" = no measurement)
    gamma: int = 5  # draft tokens proposed per step


@dataclass
class DataConfig:
    corpus: str = "bundled"  # "bundled", or a path: enwik8(.zip/.gz), any text file, a folder of them
    seq_len: int = 256
    cache_dir: str = ""  # where decompressed corpora are cached; "" = <efftx home>/data


@dataclass
class TrainConfig:
    steps: int = 200  # optimizer steps in the whole run
    micro_batch_size: int = 8  # sequences per worker per forward/backward
    grad_accum: int = 1  # micro batches per optimizer step
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    seed: int = 0
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 8  # fixed validation set size, in micro batches (split across workers)
    sample_every: int = 100  # 0 = only at the end
    sample_prompt_len: int = 64
    sample_length: int = 128
    sample_temperature: float = 0.8
    sample_top_k: int = 32
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    max_failures: int = 1  # worker failures Ray Train recovers from (restarts from the last checkpoint)
    # Fault injection for tests and drills: at this step (0 = never) a worker fails, unless the
    # attempt started from a checkpoint. "raise" = Python error, "exit" = the process dies.
    fail_at_step: int = 0
    fail_mode: str = "raise"


@dataclass
class EngineConfig:
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    precision: str = "fp32"  # fp32 | bf16 | fp16 (CUDA only; dynamic loss scaling) | auto (fp16 on CUDA, else fp32)
    initial_scale_power: int = 16  # fp16 only: initial loss scale 2**power
    loss_scale_window: int = 1000  # fp16 only


@dataclass
class TrackingConfig:
    uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else sqlite:///<efftx home>/mlflow.db
    experiment: str = "efftx"
    register_model: bool = True
    model_name: str = ""  # registered model name; "" = the recipe name


@dataclass
class ScalingConfig:
    num_workers: int = 2
    device: str = "auto"  # auto | cpu | cuda
    cpus_per_worker: float = 1.0
    storage_path: str = ""  # Ray Train storage (checkpoints, exports); "" = <efftx home>/runs


@dataclass
class Config:
    recipe: str = "custom"
    name: str = ""  # run name: Ray Train run directory, MLflow run name, resume key
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    # ----------------------------------------------------------------- dict round trip
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Config":
        """Strict: every key must be known, every value of the right type."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, got {type(data).__name__}")
        cfg = cls()
        for key, value in _flatten_dict(data).items():
            cfg.set(key, value)
        return cfg

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, the form used for MLflow params and Tune spaces."""
        return _flatten_dict(self.to_dict())

    def copy(self) -> "Config":
        return Config.from_dict(self.to_dict())

    # ----------------------------------------------------------------- dotted access
    def get(self, key: str) -> Any:
        obj, name, _ = self._resolve(key)
        return getattr(obj, name)

    def set(self, key: str, value: Any) -> None:
        """Set a dotted key, converting strings (from the CLI) to the field's type."""
        obj, name, typ = self._resolve(key)
        setattr(obj, name, _coerce(key, value, typ))

    def override(self, assignments: list[str] | dict[str, Any]) -> "Config":
        """Apply ``key=value`` strings (CLI) or a {key: value} mapping (Tune) in place."""
        items = assignments.items() if isinstance(assignments, dict) else map(_split_assignment, assignments)
        for key, value in items:
            self.set(key, value)
        return self

    def _resolve(self, key: str) -> tuple[Any, str, Any]:
        """(object holding the field, field name, field type) of a dotted key, at any depth."""
        obj, parts = self, key.split(".")
        for i, part in enumerate(parts):
            types_ = _field_types(type(obj))
            if part not in types_:
                break
            if i == len(parts) - 1:
                if dataclasses.is_dataclass(types_[part]):
                    raise ConfigError(f"'{key}' is a config section, not a key; set one of its keys "
                                      f"({', '.join(k for k in all_keys() if k.startswith(key + '.'))})")
                return obj, part, types_[part]
            obj = getattr(obj, part)
            if not dataclasses.is_dataclass(obj):
                break
        close = difflib.get_close_matches(key, all_keys(), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(f"unknown config key '{key}'{hint}")

    # ----------------------------------------------------------------- checks
    def validate(self) -> "Config":
        """Cross-field checks; each error names the keys involved."""
        m, t, e, s, d = self.model, self.train, self.engine, self.scaling, self.data
        positive = {
            "model.vocab_size": m.vocab_size, "model.dim": m.dim, "model.depth": m.depth,
            "model.heads": m.heads, "model.max_seq_len": m.max_seq_len, "data.seq_len": d.seq_len,
            "train.steps": t.steps, "train.micro_batch_size": t.micro_batch_size,
            "train.grad_accum": t.grad_accum, "train.log_every": t.log_every,
            "train.eval_every": t.eval_every, "train.eval_batches": t.eval_batches,
            "train.checkpoint_every": t.checkpoint_every, "train.keep_checkpoints": t.keep_checkpoints,
            "scaling.num_workers": s.num_workers, "train.lr": t.lr,
            "scaling.cpus_per_worker": s.cpus_per_worker, "model.ff_chunks": m.ff_chunks,
            "speculative.gamma": self.speculative.gamma,
        }
        for key, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        non_negative = {
            "model.kv_heads": m.kv_heads, "model.head_dim": m.head_dim, "train.warmup_steps": t.warmup_steps,
            "train.weight_decay": t.weight_decay, "train.grad_clip": t.grad_clip,
            "train.sample_every": t.sample_every, "train.sample_length": t.sample_length,
            "train.sample_temperature": t.sample_temperature, "train.sample_top_k": t.sample_top_k,
            "train.max_failures": t.max_failures, "train.fail_at_step": t.fail_at_step,
            "model.dropout": m.dropout, "attention.dropout": self.attention.dropout, "model.emb_dim": m.emb_dim,
        }
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if m.head_dim == 0 and m.dim % m.heads:
            raise ConfigError(f"model.dim={m.dim} is not divisible by model.heads={m.heads}; set model.head_dim")
        kv = m.kv_heads or m.heads
        if m.heads % kv:
            raise ConfigError(f"model.heads={m.heads} must be a multiple of model.kv_heads={kv}")
        if d.seq_len > m.max_seq_len:
            raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        if t.warmup_steps > t.steps:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} exceeds train.steps={t.steps}")
        if e.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"engine.zero_stage must be 0, 1, 2 or 3, got {e.zero_stage}")
        _choice("engine.precision", e.precision, ("fp32", "bf16", "fp16", "auto"))
        _choice("scaling.device", s.device, ("auto", "cpu", "cuda"))
        _choice("train.fail_mode", t.fail_mode, ("raise", "exit"))
        if not self.name:
            raise ConfigError("the run has no name (set 'name' or pass --run-name)")
        if "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"run name {self.name!r} must not contain '/' or start with '.'")
        if self.attention.dropout >= 1 or m.dropout >= 1:
            raise ConfigError("model.dropout and attention.dropout must be < 1")
        return self


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")


def all_keys(cls: type = None, prefix: str = "") -> list[str]:
    """Every dotted key of the config, sections descended into."""
    keys = []
    for name, typ in _field_types(cls or Config).items():
        if dataclasses.is_dataclass(typ):
            keys += all_keys(typ, f"{prefix}{name}.")
        else:
            keys.append(prefix + name)
    return keys


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _flatten_dict(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten_dict(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _split_assignment(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key=value (for example train.lr=3e-4)")
    return key.strip(), value.strip()


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Convert ``value`` to ``typ`` (int, float, bool, str, optionally ``X | None``)."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = args[0]
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{key} expects true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key} expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                as_float = float(value)
            except ValueError:
                as_float = None
            if as_float is not None and as_float.is_integer():
                return int(as_float)
        raise ConfigError(f"{key} expects an integer, got {value!r}")
    if typ is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} expects a number, got {value!r}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key} expects a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported field type {typ!r}")

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

import copy
import dataclasses
import difflib
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from efftx import attention
from efftx.attention.base import AttentionSpec
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
    # Training keeps only each block's input and recomputes the block's forward in backward (same dropout
    # masks; ~1/3 more compute): activation memory per block is one (B, T, dim) tensor. An alternative to reversible.
    activation_checkpointing: bool = False
    ff_chunks: int = 1  # feed-forward applied to this many sequence chunks in turn (lower peak memory)
    # Initialisation (efftx/models/lm.py, init_weights; docs/models.md, "Initialisation and learning per step"):
    # init="normal": every Linear weight ~ N(0, init_std), biases 0; the token embedding (the tied head too) and
    # learned positions ~ N(0, emb_init_std); with residual_init_scale the projections that write into the residual
    # stream (attention out, MLP down) are drawn with init_std / sqrt(2 * depth) (GPT-2). init="torch": PyTorch's
    # own defaults (Linear: uniform +-1/sqrt(fan_in); Embedding: N(0, 1)), as the original implementations leave
    # them (untied heads only). Before issue 20 the embedding was drawn with 0.02 like every weight: the token
    # signal drowned under the blocks' outputs and every family learned more slowly per step (0.1: measured fix).
    init: str = "normal"
    init_std: float = 0.02
    emb_init_std: float = 0.1
    residual_init_scale: bool = False

    # Memory only, the same gradients (bit for bit on CPU, tests/test_activation_checkpointing.py): a run may
    # resume with checkpointing turned on (or off).
    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"activation_checkpointing"})

    def validate(self) -> None:
        """Checks between model keys that need no other section; errors name the keys."""
        _choice("model.init", self.init, ("normal", "torch"))
        for key in ("init_std", "emb_init_std"):
            if not 0 < getattr(self, key) <= 10:
                raise ConfigError(f"model.{key} must be in (0, 10] (a standard deviation), got {getattr(self, key)}")
        if self.init == "torch" and self.tie_embeddings:
            raise ConfigError("model.init=torch draws the token embedding N(0, 1), which as the tied output head gives "
                              "logits of std sqrt(model.dim); set model.tie_embeddings=false, or model.init=normal")
        if self.reversible and self.activation_checkpointing:
            raise ConfigError("model.reversible and model.activation_checkpointing are alternatives (both save "
                              "activation memory by recomputing blocks in backward); set one of them to false")


# attention.kind and attention.dropout, then one section per registered backend that has options, named as
# the backend: the backend's module owns its options dataclass (and its checks), see efftx/attention/registry.py.
AttentionConfig = dataclasses.make_dataclass(
    "AttentionConfig",
    [("kind", str, field(default="full")),  # efftx.attention registry name
     ("dropout", float, field(default=0.0)),  # dropout on attention probabilities (training only)
     *((name, options, field(default_factory=options)) for name, options in attention.option_sections().items())],
)
AttentionConfig.__module__ = __name__  # pickled (Ray) and compared by its importable name


@dataclass
class SpeculativeConfig:
    """Speculative decoding measured while training a target: base vs speculative at every sample."""

    draft: str = ""  # export folder of a draft model sharing the vocabulary ("" = no measurement)
    gamma: int = 5  # draft tokens proposed per step

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"*"})  # a measurement beside training, not part of it


@dataclass
class DistillConfig:
    """distill.*: train a language model on a frozen teacher's distribution (DistillSpec, Zhou et al. 2023): a
    speculative draft distilled from its target proposes what the target would, so more drafts are accepted.

    The loss is ``alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(next token)``, KL per predicted
    token (forward KL: the student covers the teacher's whole distribution, which is what sampled speculative
    acceptance, sum_x min(p, q), rewards), teacher and student softened by ``temperature`` T (T^2 keeps the
    gradient scale of the KL term independent of T). The teacher is frozen: computed in eval mode, without
    gradients, on each worker's device (efftx.train.tasks.LMTask).
    """

    teacher: str = ""  # the teacher: an export folder or models:/NAME/VERSION ("" = no distillation)
    alpha: float = 1.0  # weight of the KL term; 1 - alpha on the usual next-token loss
    temperature: float = 1.0  # softmax temperature of teacher and student in the KL term

    RESUMABLE: ClassVar[frozenset[str]] = frozenset()  # the loss itself: a resumed run must keep it

    def validate(self) -> None:
        """Checks of this section (the teacher export itself is checked when the run prepares); errors name the
        keys."""
        if not 0 <= self.alpha <= 1:
            raise ConfigError(f"distill.alpha must be in [0, 1] (the weight of the KL term), got {self.alpha}")
        if not self.temperature > 0:
            raise ConfigError(f"distill.temperature must be > 0, got {self.temperature}")
        if not self.teacher and (self.alpha != 1.0 or self.temperature != 1.0):
            raise ConfigError("distill.alpha and distill.temperature apply with distill.teacher, which is empty: set "
                              "the teacher (an export folder or models:/NAME/VERSION) or leave them at 1.0")


@dataclass
class ImageDataConfig:
    """data.image.*: image + caption data of the dVAE and DALL-E (efftx/data/images.py).

    The image side and channels (the dVAE's) and text_seq_len (DALL-E's) are model keys, passed to
    ImageTextData by the task, so data and model cannot disagree about them.
    """

    source: str = "shapes"  # "shapes" (synthetic, made in data.cache_dir) | folder | .tar | folder of shards | brace pattern
    format: str = "auto"  # auto | folder | wds (auto: .tar, brace pattern, URL or a folder of only shards = wds)
    wds_keys: str = "png,txt"  # WebDataset image,caption keys (the seed's --wds img,cap); "jpg;png,txt" = either image key
    resize_crop_lower_ratio: float = 0.75  # random resized crop keeps at least this fraction of the area (1 = whole image)
    truncate_captions: bool = False  # cut captions longer than text_seq_len; false = an error naming the caption's file
    bpe_path: str = ""  # Hugging Face tokenizers JSON (the seed's --bpe_path --hug); "" = bytes (id = byte + 1, 0 = pad)
    val_fraction: float = 0.05  # fixed validation hold-out, chosen by a hash of each sample's key
    shapes_n: int = 2048  # source=shapes: number of images
    shapes_size: int = 64  # source=shapes: image side in pixels
    shapes_seed: int = 0  # source=shapes: generator seed
    sample_images: int = 4  # the first N validation images the dVAE reconstructs / captions DALL-E draws, per sample
    # Streaming (efftx/data/streaming.py): read shards one by one with bounded memory per worker instead of loading
    # every sample. auto = stream a URL, or a source larger on disk than stream_above_mb; true / false = always / never
    streaming: str = "auto"
    stream_above_mb: float = 1024.0  # streaming=auto: stream a local source larger than this on disk
    shuffle_buffer: int = 1000  # streaming: samples held in each worker's shuffle buffer (its memory bound)
    interleave: int = 4  # streaming: shards each worker reads at once, a sample from each in turn
    folder_shard_size: int = 1000  # streaming a folder: images per virtual shard (shard i goes to worker i % W)

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"sample_images"})

    def validate(self) -> None:
        """Checks of this section; errors name the keys."""
        k = "data.image."
        _choice(f"{k}format", self.format, ("auto", "folder", "wds"))
        if not self.source:
            raise ConfigError(f"{k}source is empty: use 'shapes', a folder, a .tar, or a brace pattern of shards")
        if not 0 < self.resize_crop_lower_ratio <= 1:
            raise ConfigError(f"{k}resize_crop_lower_ratio must be in (0, 1], got {self.resize_crop_lower_ratio}")
        if not 0 <= self.val_fraction < 1:
            raise ConfigError(f"{k}val_fraction must be in [0, 1), got {self.val_fraction}")
        parts = self.wds_keys.split(",")
        if len(parts) != 2 or not all(p.strip(" ;") for p in parts):
            raise ConfigError(f"{k}wds_keys must be 'IMAGE_KEY,CAPTION_KEY' (e.g. 'png,txt'), got {self.wds_keys!r}")
        if self.shapes_n < 1 or self.shapes_size < 8 or self.shapes_seed < 0:
            raise ConfigError(f"{k}shapes_n must be >= 1, {k}shapes_size >= 8 and {k}shapes_seed >= 0; got "
                              f"{self.shapes_n}, {self.shapes_size}, {self.shapes_seed}")
        if self.sample_images < 1:
            raise ConfigError(f"{k}sample_images must be >= 1, got {self.sample_images}")
        _choice(f"{k}streaming", self.streaming, ("auto", "true", "false"))
        if self.stream_above_mb < 0:
            raise ConfigError(f"{k}stream_above_mb must be >= 0, got {self.stream_above_mb}")
        for name in ("shuffle_buffer", "interleave", "folder_shard_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{k}{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class DataConfig:
    corpus: str = "bundled"  # "bundled", or a path: enwik8(.zip/.gz), any text file, a folder of them
    seq_len: int = 256  # in tokens (bytes when data.tokenizer is "")
    cache_dir: str = ""  # where decompressed corpora are cached; "" = <efftx home>/data
    # The language models' tokenizer: "" = UTF-8 bytes (model.vocab_size 256), else a Hugging Face tokenizers JSON
    # (python -m efftx.data.train_tokenizer makes one); model.vocab_size then comes from it. efftx/data/lm_tokenizer.py
    tokenizer: str = ""
    # How the prepared text corpus reaches the workers (efftx/data/bytes.py, share): "object_store" = the driver puts
    # its arrays in Ray's object store, each node maps them zero-copy; "path" = workers memory-map the driver's cache
    # file (one machine, or data.cache_dir on a filesystem every node shares); "auto" = object_store when the Ray
    # cluster has more than one node, else path
    handoff: str = "auto"
    image: ImageDataConfig = field(default_factory=ImageDataConfig)

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"cache_dir", "handoff"})

    def validate(self) -> None:
        """Checks of this section (the tokenizer file itself is read when the run is configured); errors name
        the keys."""
        from efftx.data.lm_tokenizer import check_key
        from efftx.errors import DataError

        try:
            check_key(self.tokenizer)
        except DataError as exc:
            raise ConfigError(str(exc)) from None
        _choice("data.handoff", self.handoff, ("auto", "object_store", "path"))
        self.image.validate()


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
    eps: float = 1e-8  # Adam's epsilon
    grad_clip: float = 1.0  # 0 = no clipping
    # Learning-rate schedule after the warmup: "cosine" decays to lr * min_lr_ratio over the run; "plateau"
    # (the DALL-E seed's lr_decay, ReduceLROnPlateau) keeps lr and multiplies it by plateau_factor whenever
    # val_loss has not improved (by a relative plateau_threshold) for more than plateau_patience evaluations
    # in a row, then waits plateau_cooldown evaluations; never below plateau_min_lr. "warmup" / "warmup_decay" are
    # DeepSpeed's WarmupLR (warmup from warmup_min_lr to lr, then constant) / WarmupDecayLR (then linear decay to
    # warmup_min_lr at train.steps), step for step, with warmup_type "log" (DeepSpeed's default) or "linear";
    # a DeepSpeed config's scheduler section sets them (train/ds_config.py). See train/engine.py.
    schedule: str = "cosine"
    warmup_type: str = "linear"  # log: schedules warmup / warmup_decay only
    warmup_min_lr: float = 0.0  # schedules warmup / warmup_decay only: the learning rate the warmup starts from
    plateau_factor: float = 0.5
    plateau_patience: int = 10  # evaluations (train.eval_every steps apart), not epochs as in the seed
    plateau_cooldown: int = 10
    plateau_min_lr: float = 1e-6
    plateau_threshold: float = 1e-4
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

    # Keys that may change when a run resumes (how long it runs, how often it logs, samples and checkpoints,
    # and fault handling); every other key must match the run's first attempt (efftx.train.launch).
    RESUMABLE: ClassVar[frozenset[str]] = frozenset({
        "steps", "log_every", "eval_every", "eval_batches", "sample_every", "sample_prompt_len", "sample_length",
        "sample_temperature", "sample_top_k",
        "checkpoint_every", "keep_checkpoints", "max_failures", "fail_at_step", "fail_mode"})


@dataclass
class EngineConfig:
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    precision: str = "fp32"  # fp32 | bf16 | fp16 (CUDA only; dynamic loss scaling) | auto (fp16 on CUDA, else fp32)
    initial_scale_power: int = 16  # fp16 only: initial loss scale 2**power
    loss_scale_window: int = 1000  # fp16 only
    # torch_adamw: torch's AdamW, built by efftx. adam | adamw | lamb: DeepSpeed's optimizer by name, built by
    # DeepSpeed from its config (FusedAdam / FusedLamb on CUDA; on CPU adam / adamw are torch's Adam / AdamW
    # through DeepSpeed's torch_adam option, and lamb is refused). See train/engine.py.
    optimizer: str = "torch_adamw"
    # A DeepSpeed config JSON (--deepspeed-config): read on the driver when the run resolves, its values are
    # written into this config (the file wins; train/ds_config.py), so the path itself may change on resume.
    deepspeed_config: str = ""
    # ZeRO-Offload (none | cpu). offload_optimizer=cpu keeps the optimizer states and fp32 master weights in host
    # memory and runs the optimizer step there with DeepSpeed's CPU Adam (a C++ op compiled once, cached with
    # the venv: python -m efftx.train.ops); needs zero_stage >= 1 and an Adam (torch_adamw becomes CPU Adam in
    # AdamW mode). offload_param=cpu also keeps the parameters in host memory between uses (zero_stage 3 only).
    offload_optimizer: str = "none"
    offload_param: str = "none"
    # torch.compile of the model's training forward: off | auto (CUDA only: on CPU not shown to pay)
    # | on; a failed compile falls back to eager with a log line saying why (efftx.train.engine.compile_model)
    compile: str = "off"

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"deepspeed_config", "compile"})  # compile: speed only

    def validate(self) -> None:
        """Checks between engine keys; errors name the keys. (Precision and optimizer against the device are
        checked where the device is known: efftx.train.launch.)"""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"engine.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        _choice("engine.precision", self.precision, ("fp32", "bf16", "fp16", "auto"))
        _choice("engine.optimizer", self.optimizer, ("torch_adamw", "adam", "adamw", "lamb"))
        _choice("engine.offload_optimizer", self.offload_optimizer, ("none", "cpu"))
        _choice("engine.offload_param", self.offload_param, ("none", "cpu"))
        _choice("engine.compile", self.compile, ("off", "auto", "on"))
        if self.offload_optimizer != "none" and self.zero_stage < 1:
            raise ConfigError(f"engine.offload_optimizer={self.offload_optimizer} is ZeRO-Offload: it needs "
                              f"engine.zero_stage 1, 2 or 3, got {self.zero_stage}")
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ConfigError(f"engine.offload_param={self.offload_param} partitions parameters: it needs "
                              f"engine.zero_stage=3, got {self.zero_stage}")
        if self.offload_optimizer != "none" and self.optimizer == "lamb":
            raise ConfigError("engine.offload_optimizer runs DeepSpeed's CPU Adam, which has no Lamb: use "
                              "engine.optimizer adam, adamw or torch_adamw with offload")


@dataclass
class TrackingConfig:
    uri: str = ""  # "" = $MLFLOW_TRACKING_URI, else sqlite:///<efftx home>/mlflow.db
    experiment: str = "efftx"
    register_model: bool = True
    model_name: str = ""  # registered model name; "" = the recipe name

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"*"})  # where a run is recorded never changes what it trains


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")


@dataclass
class ScalingConfig:
    """scaling.*: how many Ray Train workers, where, and where the run folder lives.

    Elastic training: ``min_workers`` > 0 makes the worker count a range, Ray Train's ``num_workers=(min, max)``
    = ``(scaling.min_workers, scaling.num_workers)``. The run starts with as many workers as the cluster has room
    for (at least ``min_workers``); when a worker or its node dies it restarts at once from the last checkpoint
    on the workers that fit (a restart counts against ``train.max_failures``), and while healthy it grows back
    towards ``num_workers`` when capacity appears (checked every ``resize_interval_s``). What changes with the
    world size W: the global batch (micro batch x grad_accum x W) and so tokens per step; the data of
    (step, micro batch, rank) does not (a function of train.seed), nor the validation set (split over the W
    ranks, the metric a weighted mean). DeepSpeed cannot load ZeRO-1/2/3 optimizer partitions saved by another
    world size, so elastic runs need engine.zero_stage=0 (the optimizer state is whole in rank 0's file).
    """

    num_workers: int = 2  # fixed size: exactly this many; elastic: at most this many
    min_workers: int = 0  # 0 = fixed size; 1..num_workers = elastic, Ray Train's (min_workers, num_workers)
    # Ray's placement group strategy for the workers: PACK (as few nodes as possible), SPREAD (across nodes when
    # possible), STRICT_SPREAD (one worker per node, else the run waits for nodes), STRICT_PACK (one node)
    placement_strategy: str = "PACK"
    resize_interval_s: float = 60.0  # elastic: how often a healthy run checks whether more workers fit
    # How long a (re)start waits for its workers to be placed before it gives up and decides again (Ray Train's
    # RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S; 0 = that variable, else Ray's 60 s). Elastic runs: Ray marks a lost
    # node dead only after missed health checks, and Ray Train's view of the cluster lags up to 20 s more, so the
    # first restart after a node loss may still ask for the lost node's worker; it waits this long, then restarts
    # with the workers that fit. A fixed-size run keeps waiting for capacity in rounds of this length.
    start_timeout_s: float = 0.0
    device: str = "auto"  # auto | cpu | cuda
    cpus_per_worker: float = 1.0
    storage_path: str = ""  # Ray Train storage (checkpoints, exports): a path or URI (s3://, gs://, file://, ...;
    # efftx/storage.py); "" = <efftx home>/runs
    storage_endpoint: str = ""  # S3-compatible stores: http(s)://host[:port]; "" = $AWS_ENDPOINT_URL or AWS

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"cpus_per_worker", "storage_path", "storage_endpoint", "device",
                                                     "min_workers", "placement_strategy", "resize_interval_s",
                                                     "start_timeout_s"})

    @property
    def elastic(self) -> bool:
        return self.min_workers > 0

    @property
    def ray_num_workers(self) -> int | tuple[int, int]:
        """Ray Train's ``ScalingConfig(num_workers=...)``: an int, or (min, max) when elastic."""
        return (self.min_workers, self.num_workers) if self.elastic else self.num_workers

    def validate(self) -> None:
        from efftx import storage

        if self.num_workers < 1:
            raise ConfigError(f"scaling.num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.min_workers <= self.num_workers:
            raise ConfigError(f"scaling.min_workers must be between 0 (a fixed number of workers) and "
                              f"scaling.num_workers={self.num_workers} (elastic: at least min_workers, at most "
                              f"num_workers), got {self.min_workers}")
        _choice("scaling.placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        for key in ("resize_interval_s", "start_timeout_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"scaling.{key} must be >= 0, got {getattr(self, key)}")
        storage.check_keys(self.storage_path, self.storage_endpoint)

    def check_engine(self, zero_stage: int) -> None:
        """Elastic runs restore checkpoints saved by another world size: DeepSpeed refuses ZeRO >= 1 then."""
        if self.elastic and self.min_workers < self.num_workers and zero_stage > 0:
            raise ConfigError(f"scaling.min_workers={self.min_workers} < scaling.num_workers={self.num_workers} "
                              f"(elastic) needs engine.zero_stage=0: DeepSpeed cannot load ZeRO-{zero_stage} optimizer "
                              f"partitions saved by another number of workers; set engine.zero_stage=0, or "
                              f"scaling.min_workers=0 for a fixed size")


@dataclass
class VAEConfig:
    """vae.*: the discrete VAE (efftx/models/dvae.py). A DALL-E config carries this section too, so one
    DALL-E export rebuilds its frozen dVAE. Defaults: the original repository's train_vae.py."""

    image_size: int = 128  # pixels per side
    channels: int = 3  # 1 (L), 3 (RGB) or 4 (RGBA)
    num_layers: int = 2  # stride-2 downsamplings: the token grid is image_size / 2**num_layers per side
    hidden_dim: int = 256  # channels of the conv encoder/decoder
    num_resnet_blocks: int = 2  # residual blocks at the token resolution, in the encoder and the decoder
    num_tokens: int = 8192  # codebook entries = DALL-E's image vocabulary
    codebook_dim: int = 512
    temperature: float = 1.0  # Gumbel-softmax temperature at step 0, annealed: temperature(step) =
    temperature_min: float = 0.5  # max(temperature * exp(-temperature_anneal * step), temperature_min)
    temperature_anneal: float = 1e-6
    straight_through: bool = False  # hard one-hot codes forward, soft gradients backward
    kl_weight: float = 0.0  # weight of KL(code distribution || uniform)
    recon_loss: str = "mse"  # mse | smooth_l1
    norm_means: str = "0.5,0.5,0.5,0.0"  # per-channel input normalisation (x - mean) / std; the first
    norm_stds: str = "0.5,0.5,0.5,1.0"  # `channels` values are used

    @property
    def fmap_size(self) -> int:
        """Image tokens per side."""
        return self.image_size // 2 ** self.num_layers

    @property
    def image_seq_len(self) -> int:
        return self.fmap_size ** 2

    def normalization(self) -> tuple[list[float], list[float]]:
        """(means, stds) for the image channels, parsed from norm_means / norm_stds."""
        out = []
        for key, text in (("vae.norm_means", self.norm_means), ("vae.norm_stds", self.norm_stds)):
            try:
                values = [float(v) for v in text.split(",")]
            except ValueError:
                raise ConfigError(f"{key} must be comma-separated numbers, got {text!r}") from None
            if len(values) < self.channels:
                raise ConfigError(f"{key} has {len(values)} values, vae.channels={self.channels} needs that many")
            out.append(values[:self.channels])
        if min(out[1]) <= 0:
            raise ConfigError(f"vae.norm_stds must be > 0, got {self.norm_stds!r}")
        return out[0], out[1]

    def validate(self) -> None:
        """Checks of this section; errors name the keys."""
        positive = {"image_size": self.image_size, "num_layers": self.num_layers, "hidden_dim": self.hidden_dim,
                    "num_tokens": self.num_tokens, "codebook_dim": self.codebook_dim,
                    "temperature": self.temperature, "temperature_min": self.temperature_min}
        for key, value in positive.items():
            if not value > 0:
                raise ConfigError(f"vae.{key} must be > 0, got {value}")
        for key in ("num_resnet_blocks", "kl_weight", "temperature_anneal"):
            if getattr(self, key) < 0:
                raise ConfigError(f"vae.{key} must be >= 0, got {getattr(self, key)}")
        if self.channels not in (1, 3, 4):
            raise ConfigError(f"vae.channels must be 1, 3 or 4, got {self.channels}")
        if self.image_size % 2 ** self.num_layers:
            raise ConfigError(f"vae.image_size={self.image_size} must be divisible by 2**vae.num_layers="
                              f"{2 ** self.num_layers}")
        if self.temperature_min > self.temperature:
            raise ConfigError(f"vae.temperature_min={self.temperature_min} exceeds vae.temperature={self.temperature}")
        _choice("vae.recon_loss", self.recon_loss, ("mse", "smooth_l1"))
        self.normalization()


@dataclass
class DalleConfig:
    """dalle.*: what is DALL-E's own (efftx/models/dalle.py). The transformer is the LMs' Blocks, so its
    width, depth, heads, head dim, norm, rotary, reversible, feed-forward dropout and input/output embedding
    sharing are model.* keys (model.tie_embeddings = the seed's share_input_output_emb); attention dropout is
    attention.dropout; the text vocabulary, pad id 0 included, is model.vocab_size; the image side and
    vocabulary come from vae.*."""

    text_seq_len: int = 256  # caption tokens (padded with 0)
    loss_img_weight: float = 7.0  # loss = (loss_text + w * loss_img) / (w + 1)
    attn_types: str = "full"  # comma-separated, cycled over the layers: full, axial_row, axial_col, conv_like, sparse
    shared_attn_ids: str = ""  # comma-separated ids cycled over the layers: layers with the same id share their
    shared_ff_ids: str = ""  # attention (resp. feed-forward) weights; "" = nothing shared
    shift_tokens: bool = False  # mix in features of the previous text token / the image tokens above and left
    stable_softmax: bool = False  # fp16-minded numerics, see efftx/models/dalle.py
    null_cond_prob: float = 0.0  # training: probability of dropping a caption (classifier-free guidance)
    sample_filter_thres: float = 0.9  # samples: top-k keeps the top (1 - thres) of image codes (the seed's 0.9)
    sample_cond_scale: float = 1.0  # samples: classifier-free guidance scale (1 = none)
    vae_path: str = ""  # the trained dVAE (export folder or models:/NAME/VERSION), frozen inside DALL-E; its vae.*
    #                     replace this config's at launch. "" = jobs/train_dalle.py trains one first

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"sample_filter_thres", "sample_cond_scale"})

    def layer_plan(self, depth: int) -> list[tuple[str, str, str]]:
        """(attention type, attention id, feed-forward id) of each of ``depth`` layers; ids default to the
        layer index. Layers sharing an attention id must have the same attention type."""
        types = _csv("dalle.attn_types", self.attn_types)
        attn_ids = _csv("dalle.shared_attn_ids", self.shared_attn_ids) if self.shared_attn_ids else None
        ff_ids = _csv("dalle.shared_ff_ids", self.shared_ff_ids) if self.shared_ff_ids else None
        plan, kind_of_id = [], {}
        for i in range(depth):
            kind = types[i % len(types)]
            attn_id = attn_ids[i % len(attn_ids)] if attn_ids else str(i)
            ff_id = ff_ids[i % len(ff_ids)] if ff_ids else str(i)
            if kind_of_id.setdefault(attn_id, kind) != kind:
                raise ConfigError(f"dalle.shared_attn_ids gives layer {i} the attention of id {attn_id!r}, which is "
                                  f"{kind_of_id[attn_id]!r}, but dalle.attn_types makes it {kind!r}: shared layers "
                                  f"must have one type")
            plan.append((kind, attn_id, ff_id))
        return plan

    def validate(self, depth: int) -> None:
        if self.text_seq_len < 1:
            raise ConfigError(f"dalle.text_seq_len must be >= 1, got {self.text_seq_len}")
        if self.loss_img_weight < 0:
            raise ConfigError(f"dalle.loss_img_weight must be >= 0, got {self.loss_img_weight}")
        if not 0 <= self.null_cond_prob <= 1:
            raise ConfigError(f"dalle.null_cond_prob must be in [0, 1], got {self.null_cond_prob}")
        if not 0 <= self.sample_filter_thres <= 1:
            raise ConfigError(f"dalle.sample_filter_thres must be in [0, 1], got {self.sample_filter_thres}")
        if not self.sample_cond_scale >= 0:
            raise ConfigError(f"dalle.sample_cond_scale must be >= 0, got {self.sample_cond_scale}")
        for kind in _csv("dalle.attn_types", self.attn_types):
            if kind not in attention.names():
                raise ConfigError(f"dalle.attn_types: {kind!r} is not a registered attention backend; choose "
                                  f"from {', '.join(attention.names())}")
        self.layer_plan(depth)


def _csv(key: str, text: str) -> list[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ConfigError(f"{key} must be a comma-separated list without empty items, got {text!r}")
    return items


# Keys that moved to the section of the component that uses them: old key -> new key. Stored configs
# (checkpoints, exports, run records) written before the move load with their values under the new keys.
MOVED_KEYS = {
    "train.sample_images": "data.image.sample_images",  # the image tasks' sample set (dVAE and DALL-E)
    "train.sample_filter_thres": "dalle.sample_filter_thres",  # DALL-E's sampling
    "train.sample_cond_scale": "dalle.sample_cond_scale",
}


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
    distill: DistillConfig = field(default_factory=DistillConfig)
    vae: VAEConfig = field(default_factory=VAEConfig)
    dalle: DalleConfig = field(default_factory=DalleConfig)

    RESUMABLE: ClassVar[frozenset[str]] = frozenset({"name"})  # sections declare their own

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
            cfg.set(MOVED_KEYS.get(key, key), value)  # configs written before a key moved still load
        return cfg

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value, the form used for MLflow params and Tune spaces."""
        return _flatten_dict(self.to_dict())

    def copy(self) -> "Config":
        return copy.deepcopy(self)

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
        if key in MOVED_KEYS:
            raise ConfigError(f"config key '{key}' is now '{MOVED_KEYS[key]}'")
        close = difflib.get_close_matches(key, all_keys(), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(f"unknown config key '{key}'{hint}")

    def resumable(self, key: str) -> bool:
        """Whether ``key`` may differ from the run's first attempt when it resumes: declared by each section
        (its ``RESUMABLE`` field names; "*" = all of them)."""
        obj, name, _ = self._resolve(key)
        allowed = getattr(type(obj), "RESUMABLE", frozenset())
        return "*" in allowed or name in allowed

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
            "scaling.num_workers": s.num_workers, "train.lr": t.lr, "train.eps": t.eps,
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
            "train.plateau_patience": t.plateau_patience, "train.plateau_cooldown": t.plateau_cooldown,
            "train.plateau_min_lr": t.plateau_min_lr, "train.plateau_threshold": t.plateau_threshold,
            "model.dropout": m.dropout, "attention.dropout": self.attention.dropout, "model.emb_dim": m.emb_dim,
            "train.warmup_min_lr": t.warmup_min_lr,
        }
        for key, value in non_negative.items():
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if d.seq_len > m.max_seq_len:
            raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        if t.warmup_steps > t.steps:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} exceeds train.steps={t.steps}")
        _choice("scaling.device", s.device, ("auto", "cpu", "cuda"))
        _choice("train.fail_mode", t.fail_mode, ("raise", "exit"))
        _choice("train.schedule", t.schedule, ("cosine", "plateau", "warmup", "warmup_decay"))
        _choice("train.warmup_type", t.warmup_type, ("linear", "log"))
        for key, beta in (("train.beta1", t.beta1), ("train.beta2", t.beta2)):
            if not 0 <= beta < 1:
                raise ConfigError(f"{key} must be in [0, 1), got {beta}")
        if t.schedule in ("warmup", "warmup_decay"):  # DeepSpeed's WarmupLR / WarmupDecayLR
            if t.warmup_steps < 1:
                raise ConfigError(f"train.schedule={t.schedule} needs train.warmup_steps >= 1 (DeepSpeed's "
                                  f"warmup_num_steps), got {t.warmup_steps}")
            if t.warmup_min_lr > t.lr:
                raise ConfigError(f"train.warmup_min_lr={t.warmup_min_lr} exceeds train.lr={t.lr}")
        elif t.warmup_type != "linear" or t.warmup_min_lr:
            raise ConfigError(f"train.warmup_type and train.warmup_min_lr apply to train.schedule=warmup or "
                              f"warmup_decay (DeepSpeed's WarmupLR / WarmupDecayLR); train.schedule={t.schedule} "
                              f"warms up linearly from 0 (leave them at 'linear' and 0)")
        if not 0 < t.plateau_factor < 1:
            raise ConfigError(f"train.plateau_factor must be in (0, 1), got {t.plateau_factor}")
        if not self.name:
            raise ConfigError("the run has no name (set 'name' or pass --run-name)")
        if "/" in self.name or self.name.startswith("."):
            raise ConfigError(f"run name {self.name!r} must not contain '/' or start with '.'")
        if self.attention.dropout >= 1 or m.dropout >= 1:
            raise ConfigError("model.dropout and attention.dropout must be < 1")
        m.validate()
        e.validate()
        s.validate()
        s.check_engine(e.zero_stage)
        d.validate()
        self.vae.validate()
        self.dalle.validate(m.depth)
        self.distill.validate()
        # The backends a model may use check the shared rules (heads, head dim; in AttentionSpec) and their own
        # options section; the sections of the other backends are not checked.
        for kind in self.attention_kinds():
            attention.check(AttentionSpec.from_config(m, self.attention, kind=kind))
        return self

    def attention_kinds(self) -> list[str]:
        """The attention backends a model may use: attention.kind (language models) and each of
        dalle.attn_types (DALL-E's layer types, "full" unless set), whatever the family."""
        types = _csv("dalle.attn_types", self.dalle.attn_types)
        return [self.attention.kind, *(k for k in dict.fromkeys(types) if k != self.attention.kind)]


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


@functools.lru_cache(maxsize=None)
def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> type of a config section (cached: sections are fixed classes; callers must not mutate it)."""
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

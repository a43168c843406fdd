"""Tasks: how a model family joins the one train loop, and everything else that is family-specific.

A Task turns the run config into batches, a batch into a loss, a fixed validation set into metrics, and a
model into samples; the loop, the launcher, Tune and the job scripts know nothing about text or images and
ask the task (:class:`Task` is the whole contract). The model itself comes from the model registry
(:func:`efftx.models.build`), so inference never imports this module.

A batch is a tensor or a tuple / list / dict of tensors (the loop moves it with ``loop.to_device``).
``tokens_per_micro_batch`` is the unit of the loop's tokens/s and MFU (the model's ``flops_per_token``
counts the same unit: for the dVAE, an image).

Tasks: ``lm`` (:class:`LMTask`), ``dvae`` (:class:`DVAETask`), ``dalle`` (:class:`DALLETask`).
"""

from __future__ import annotations

import abc
import math
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from efftx.data.bytes import ByteData, CorpusInfo, prepare as prepare_corpus
from efftx.data.lm_tokenizer import ByteCodec, TokenizerCodec, configure_vocab, load_codec, same_tokenizer
from efftx.data.token_corpus import TokenData, prepare_tokens
from efftx.errors import ConfigError
from efftx.export import TOKENIZER_FILE
from efftx.generation.decode import generate
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


def names() -> list[str]:
    return sorted(_TASKS)


def validate_run(cfg):
    """What every run config passes before it launches (or becomes a Tune trial): ``Config.validate``, then its
    family's own checks (:meth:`Task.validate`). Returns ``cfg``."""
    cfg.validate()
    get(cfg.model.family).validate(cfg)
    return cfg


# Data below TINY_COUNT units (images, or seq_len windows of text), or that a run draws TINY_EPOCHS times or more
# over, gets one warning on the driver (Task.warn_if_tiny): such a run memorises rather than learns.
TINY_COUNT = 16
TINY_EPOCHS = 20


def batch_rng(seed: int, rank: int, step: int, micro: int) -> np.random.Generator:
    """The data RNG of one micro batch: a function of its coordinates, so a resumed run sees the same data."""
    return np.random.default_rng([seed, rank, step, micro])


class Task(abc.ABC):
    """The contract of a model family. Class-level (driver side, no instance):

    * ``metric`` / ``mode``: the headline validation metric and whether lower or higher is better: what Tune
      optimises and ASHA stops on, and the first number of the end-of-run summary.
    * ``summary_metrics``: the validation metrics the end-of-run summary carries (:meth:`summary`).
    * ``pretrained_key``: the config key naming a frozen pretrained export the model trains on ("" = none);
      a job may train that export first (jobs/train_dalle.py).
    * :meth:`configure` (keys derived from elsewhere, before validation), :meth:`validate` (family-only checks,
      after ``Config.validate``), :meth:`prepare` (build/check data once; plain data for the workers),
      :meth:`epilogue` (what a job prints after the run).

    Per worker: ``Task(cfg, prepared)``, then :meth:`load_pretrained`, :meth:`train_batch` (a pure function of
    its arguments, so resume is exact), :meth:`loss`, :meth:`eval_batches`, :meth:`evaluate`, :meth:`sample`,
    :meth:`export_files`.
    """

    name: ClassVar[str] = "?"
    metric: ClassVar[str] = "val_loss"
    mode: ClassVar[str] = "min"
    summary_metrics: ClassVar[tuple[str, ...]] = ("val_loss",)
    pretrained_key: ClassVar[str] = ""

    def __init__(self, cfg, prepared: dict[str, Any]):
        self.cfg = cfg
        self.prepared = prepared

    # ------------------------------------------------------------------ driver side
    @classmethod
    def configure(cls, cfg):
        """Derive keys that come from elsewhere (DALL-E: ``vae.*`` from its dVAE export); default: none."""
        return cfg

    @classmethod
    def validate(cls, cfg) -> None:
        """Checks only this family needs, after ``Config.validate``; errors name the keys. Default: none."""

    @classmethod
    @abc.abstractmethod
    def prepare(cls, cfg) -> dict[str, Any]:
        """Build or check the data once, on the driver; returns plain data handed to every worker."""

    @classmethod
    def share(cls, cfg, prepared: dict[str, Any]) -> dict[str, Any]:
        """On the driver once Ray has started (launch): hand what :meth:`prepare` made to the workers, e.g. put
        data in Ray's object store so that no worker opens a driver-only path; returns the prepared data the
        workers get. Default: as it is."""
        return prepared

    @staticmethod
    def warn_if_tiny(cfg, what: str, available: int, drawn_per_step: int, key: str) -> str | None:
        """One warning line (printed, and returned) when the training data is tiny for the run: fewer than
        ``TINY_COUNT`` units, or a run that goes over them ``TINY_EPOCHS`` times or more; else None."""
        epochs = cfg.train.steps * drawn_per_step / max(available, 1)
        if available >= TINY_COUNT and epochs < TINY_EPOCHS:
            return None
        line = (f"[efftx] warning: the training data is tiny for this run: {available:,} {what}, each drawn about "
                f"{epochs:,.0f} times ({cfg.train.steps} steps x {drawn_per_step:,} per step); the model will "
                f"memorise it rather than learn: give more data ({key})")
        print(line, flush=True)
        return line

    @classmethod
    def summary(cls, metrics: dict[str, Any]) -> dict[str, Any]:
        """The family's part of the end-of-run summary: the headline metric and ``summary_metrics``."""
        return {"metric": cls.metric, "mode": cls.mode,
                **{k: metrics.get(k) for k in dict.fromkeys((cls.metric, *cls.summary_metrics))}}

    @classmethod
    def epilogue(cls, summary: dict[str, Any]) -> list[str]:
        """Lines a job prints after the run: where the run and its export are, and what to do next."""
        from efftx.tracking import ui_command

        value = summary.get(cls.metric)
        lines = [f"run:            {summary['run_name']} (step {summary['final_step']}"
                 + (f", {cls.metric} {value:.4f}" if value is not None else "") + cls._speed(summary) + ")",
                 f"MLflow run:     {summary['mlflow_run_id']} in {summary['tracking_uri']}",
                 f"MLflow UI:      {ui_command(summary['tracking_uri'])}"]
        if summary.get("registered_model"):
            lines.append(f"registered as:  {summary['registered_model']}")
        return lines + [f"exported model: {summary.get('export_path')}"]

    @staticmethod
    def _speed(summary: dict[str, Any]) -> str:
        tok_s = summary.get("tokens_per_s")
        return f", {tok_s:,.0f} tokens/s" if tok_s else ""

    # ------------------------------------------------------------------ worker side
    @property
    @abc.abstractmethod
    def tokens_per_micro_batch(self) -> int:
        """The unit of tokens/s and MFU, per micro batch."""

    def load_pretrained(self, model) -> None:
        """Load weights the run does not train (before training, on each worker); default: none."""

    @abc.abstractmethod
    def train_batch(self, step: int, micro: int, rank: int) -> Any:
        """The batch of (step, micro batch, rank): a pure function of its arguments (exact resume)."""

    @abc.abstractmethod
    def loss(self, model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(loss, metrics): metrics are 0-d tensors, logged as means every ``train.log_every`` steps."""

    @abc.abstractmethod
    def eval_batches(self, rank: int, world: int) -> list[Any]:
        """This rank's share of the fixed validation set."""

    @abc.abstractmethod
    def evaluate(self, model, batches) -> tuple[dict[str, float], int]:
        """({name: mean}, weight) over ``batches``; runs on every rank (may be collective); reports
        ``val_loss`` and the task's ``metric``."""

    @abc.abstractmethod
    def sample(self, model, step: int) -> tuple[dict[str, Any], dict[str, float]]:
        """({artifact name: text | PNG bytes | Pillow image}, {metric: value})."""

    def export_files(self) -> dict[str, str | bytes]:
        """Files saved beside the export's weights; default: none."""
        return {}


def bits_per_byte(nats_per_token: float, tokens_per_byte: float) -> float:
    """Bits per byte of text from the mean nats per predicted token and the predicted tokens per byte they
    cover: (total nats / tokens) x (tokens / bytes) / ln 2 = total nats / bytes / ln 2."""
    return nats_per_token * tokens_per_byte / math.log(2)


def distill_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Forward KL(teacher || student) per predicted token (mean over every position of every row) of the
    distributions softened by ``temperature``, times temperature^2 (Hinton et al.: the gradient scale of the
    term then does not depend on the temperature). Logits: (..., V); 0 exactly when the two are equal."""
    v = student_logits.shape[-1]
    log_p = F.log_softmax(teacher_logits.reshape(-1, v) / temperature, -1)
    log_q = F.log_softmax(student_logits.reshape(-1, v) / temperature, -1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean") * temperature ** 2


def _synchronized_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the device has finished its queued work: CUDA kernels run asynchronously,
    so a clock read without a synchronize under-measures GPU time."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@register("lm")
class LMTask(Task):
    """Next-token prediction on a corpus of bytes, or of a tokenizer's tokens (``data.tokenizer``).

    ``val_loss`` is in nats per token; ``val_bpb`` (the headline metric) in bits per byte of text: the nats of
    every predicted validation token, summed, over the UTF-8 bytes those tokens cover, over ln 2. For a byte model
    every token is one byte and ``val_bpb`` is ``val_loss / ln 2``; a token model is validated on the same text
    split (efftx/data/token_corpus.py), so the two compare."""

    metric = "val_bpb"
    summary_metrics = ("val_loss", "val_bpb")

    @classmethod
    def configure(cls, cfg):
        """``model.vocab_size`` from ``data.tokenizer`` (a value set on purpose that differs is an error)."""
        if cfg.data.tokenizer:
            from efftx import recipes

            try:
                recipe_vocab = recipes.get(cfg.recipe).model.vocab_size
            except ConfigError:  # not a named recipe
                recipe_vocab = None
            configure_vocab(cfg, load_codec(cfg.data.tokenizer), recipe_vocab)
        return cfg

    @classmethod
    def epilogue(cls, summary: dict[str, Any]) -> list[str]:
        """A sample from the export (prompt ``def ``), then the run, and how to generate more."""
        from efftx.export import read_export_config
        from efftx.generate import sample_text

        export = summary.get("export_path")
        lines = []
        if export:
            prompt = "def "
            room = read_export_config(export)[0].model.max_seq_len - len(prompt)
            text = sample_text(export, prompt=prompt, max_new_tokens=min(200, room), temperature=0.8, top_k=32, seed=0)
            lines.append(f"\n--- sample from the exported model (prompt {prompt!r}) ---\n{prompt}{text}\n---")
        return lines + super().epilogue(summary) + [
            f"generate:       .venv/bin/python -m efftx.generate --model {export} --prompt 'def ' --max-new-tokens 200"]

    @classmethod
    def prepare(cls, cfg) -> dict[str, Any]:
        """The byte corpus; with ``data.tokenizer``, its tokens too (cached by corpus and tokenizer SHA-256).
        ``params``: MLflow params the driver logs with the run (the tokenizer's hash and vocabulary)."""
        info = prepare_corpus(cfg.data.corpus, cfg.data.cache_dir, cfg.data.seq_len)
        codec = load_codec(cfg.data.tokenizer)
        if codec.vocab_size != cfg.model.vocab_size and cfg.data.tokenizer:  # configure sets it; a stale config
            raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} but data.tokenizer={cfg.data.tokenizer} has "
                              f"a vocabulary of {codec.vocab_size}")
        if cfg.speculative.draft:  # a bad draft is a clear error now, not a crash at the first sample
            from efftx.data.lm_tokenizer import export_codec
            from efftx.export import read_export_config, resolve_export

            folder = resolve_export(cfg.speculative.draft, cfg.tracking.uri)
            draft_cfg, _ = read_export_config(folder)
            if draft_cfg.model.vocab_size != cfg.model.vocab_size:
                raise ConfigError(f"speculative.draft has a vocabulary of {draft_cfg.model.vocab_size}, "
                                  f"the target {cfg.model.vocab_size}: they must be the same")
            problem = same_tokenizer(codec, export_codec(folder, draft_cfg), ("target", "speculative.draft"))
            if problem:
                raise ConfigError(f"{problem} (data.tokenizer={cfg.data.tokenizer or '(bytes)'})")
        extra = {"teacher_export": cls._check_teacher(cfg, codec)} if cfg.distill.teacher else {}
        t = cfg.train
        drawn = t.micro_batch_size * t.grad_accum * cfg.scaling.num_workers
        if isinstance(codec, TokenizerCodec):
            tokens = prepare_tokens(info, codec, cfg.data.cache_dir, cfg.data.seq_len, cfg.data.tokenizer)
            print(f"[efftx] tokenized corpus: {tokens.train_tokens:,} training and {tokens.val_tokens:,} validation "
                  f"tokens ({tokens.bytes_per_token:.2f} bytes per token, vocabulary {codec.vocab_size:,}; "
                  f"cached in {tokens.path})", flush=True)
            cls.warn_if_tiny(cfg, "training windows of data.seq_len tokens", tokens.train_tokens // cfg.data.seq_len,
                             drawn, "data.corpus")
            params = {"data.tokenizer_sha256": codec.sha256, "data.tokenizer_vocab": codec.vocab_size,
                      "data.bytes_per_token": round(tokens.bytes_per_token, 4)}
            return {"corpus": info.to_dict(), "tokens": tokens.to_dict(), "params": params, **extra}
        cls.warn_if_tiny(cfg, "training windows of data.seq_len bytes", info.train_bytes // cfg.data.seq_len,
                         drawn, "data.corpus")
        return {"corpus": info.to_dict(), **extra}

    @staticmethod
    def _check_teacher(cfg, codec) -> str:
        """The local folder of ``distill.teacher`` (a models:/ URI is downloaded), checked on the driver: a
        language model with the student's vocabulary and tokenizer that reads whole training windows. Errors
        name the key. Returned absolute, for the workers (:meth:`_teacher`)."""
        from efftx.data.lm_tokenizer import export_codec
        from efftx.errors import ExportError
        from efftx.export import read_export_config, resolve_export

        key = f"distill.teacher={cfg.distill.teacher}"
        try:
            folder = resolve_export(cfg.distill.teacher, cfg.tracking.uri)
            teacher_cfg, _ = read_export_config(folder)
        except ExportError as exc:
            raise ConfigError(f"{key}: {exc}") from None
        if teacher_cfg.model.family != "lm":
            raise ConfigError(f"{key} is a {teacher_cfg.model.family!r} export: the teacher of a language model "
                              f"must be a language model (model.family=lm)")
        if teacher_cfg.model.vocab_size != cfg.model.vocab_size:
            raise ConfigError(f"{key} has a vocabulary of {teacher_cfg.model.vocab_size}, the student (model."
                              f"vocab_size) {cfg.model.vocab_size}: they must be the same")
        try:
            teacher_codec = export_codec(folder, teacher_cfg)
        except ExportError as exc:
            raise ConfigError(f"{key}: {exc}") from None
        problem = same_tokenizer(codec, teacher_codec, ("student", "distill.teacher"))
        if problem:
            raise ConfigError(f"{problem} (data.tokenizer={cfg.data.tokenizer or '(bytes)'})")
        if teacher_cfg.model.max_seq_len < cfg.data.seq_len:
            raise ConfigError(f"{key} reads at most {teacher_cfg.model.max_seq_len} tokens (its model.max_seq_len), "
                              f"fewer than a training window (data.seq_len={cfg.data.seq_len})")
        return str(Path(folder).resolve())  # absolute: the workers' working directory is not the driver's

    @classmethod
    def share(cls, cfg, prepared: dict[str, Any]) -> dict[str, Any]:
        """The corpus (bytes, or token ids) through Ray's object store when ``data.handoff`` asks for it (auto: a
        cluster of more than one node), so a worker on another node never opens the driver's data.cache_dir
        (efftx/data/bytes.py explains the choice). ``shared``: the ObjectRef, kept alive by the run's payload."""
        import ray

        from efftx.data.bytes import use_object_store

        if not use_object_store(cfg.data.handoff):
            return prepared
        data = TokenData(prepared["tokens"]) if prepared.get("tokens") else ByteData(prepared["corpus"])
        return {**prepared, "shared": ray.put(data.arrays())}

    def __init__(self, cfg, prepared):
        super().__init__(cfg, prepared)
        self.seq_len = cfg.data.seq_len
        shared = prepared.get("shared")  # an ObjectRef of the arrays (share), else the driver's path is opened
        if prepared.get("tokens"):
            self.data = TokenData(prepared["tokens"], shared)
            self.codec = TokenizerCodec(self.data.tokenizer_json(), source=cfg.data.tokenizer)
        else:
            self.data = ByteData(CorpusInfo(**prepared["corpus"]), shared)
            self.codec = ByteCodec()
        # tokens per byte over the whole validation set (every rank knows every window): evaluate turns nats per
        # token into bits per byte with it, so the ranks' weighted mean is total nats / total bytes / ln 2.
        # Bytes: exactly 1.0, so val_bpb is val_loss / ln 2 to the bit.
        t = cfg.train
        n_windows = t.eval_batches * t.micro_batch_size
        n_tokens, n_bytes = n_windows * self.seq_len, self.data.val_target_bytes(n_windows, self.seq_len)
        self.val_tokens_per_byte = 1.0 if n_tokens == n_bytes else n_tokens / n_bytes

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.cfg.train.micro_batch_size * self.seq_len

    def train_batch(self, step: int, micro: int, rank: int) -> torch.Tensor:
        t = self.cfg.train
        return self.data.train_batch(t.micro_batch_size, self.seq_len, batch_rng(t.seed, rank, step, micro))

    def loss(self, model, batch: torch.Tensor):
        """Next-token cross-entropy; with ``distill.teacher``, mixed with the KL to the frozen teacher's
        distribution on the same batch (:func:`distill_kl`): both parts are logged (``distill_ce``, ``distill_kl``)."""
        x, y = batch[:, :-1], batch[:, 1:]
        logits = model(x).float()  # (B, T, V)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        teacher = self._teacher(x.device)
        if teacher is None:
            return ce, {}
        d = self.cfg.distill
        with torch.no_grad():
            teacher_logits = teacher(x).float()
        kl = distill_kl(logits, teacher_logits, d.temperature)
        return d.alpha * kl + (1 - d.alpha) * ce, {"distill_ce": ce.detach(), "distill_kl": kl.detach()}

    def _teacher(self, device):
        """The frozen teacher of ``distill.teacher`` (eval mode, no gradients), loaded once per worker on its
        device; None without one."""
        if not self.cfg.distill.teacher:
            return None
        if getattr(self, "_teacher_model", None) is None:
            from efftx.export import load_export, resolve_export

            folder = self.prepared.get("teacher_export") or ""
            if not Path(folder).is_dir():  # a worker that cannot see the driver's folder fetches it again
                folder = resolve_export(self.cfg.distill.teacher, self.cfg.tracking.uri)
            teacher, _, _ = load_export(folder, device)
            self._teacher_model = teacher.eval().requires_grad_(False)
        return self._teacher_model

    def eval_batches(self, rank: int, world: int) -> list[torch.Tensor]:
        t = self.cfg.train
        windows = self.data.val_windows(t.eval_batches * t.micro_batch_size, self.seq_len)
        mine = windows[rank::world]
        return list(mine.split(t.micro_batch_size)) if len(mine) else []

    @torch.no_grad()
    def evaluate(self, model, batches):
        """``val_loss`` is the next-token loss whatever the training loss (so distilled and plain runs compare);
        with ``distill.teacher``, ``val_kl`` too: the mean KL to the teacher (temperature 1) per token."""
        teacher = self._teacher(next(model.parameters()).device)
        total, total_kl, n = 0.0, 0.0, 0
        for batch in batches:
            x, y = batch[:, :-1], batch[:, 1:]
            logits = model(x).float()
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item() * batch.shape[0]
            if teacher is not None:
                total_kl += distill_kl(logits, teacher(x).float()).item() * batch.shape[0]
            n += batch.shape[0]
        mean = total / n if n else 0.0
        metrics = {"val_loss": mean, "val_bpb": bits_per_byte(mean, self.val_tokens_per_byte)}
        if teacher is not None:
            metrics["val_kl"] = total_kl / n if n else 0.0
        return metrics, n

    @torch.no_grad()
    def sample(self, model, step: int) -> tuple[dict[str, str], dict[str, float]]:
        """A sample from a validation prompt; with ``speculative.draft`` set, base vs speculative decoding
        of the same prompt, timed, with the draft's mean accepted tokens (as the speculative seed logs)."""
        t = self.cfg.train
        prompt_len = min(t.sample_prompt_len, self.seq_len)
        speculating = self.cfg.speculative.draft or self.cfg.distill.teacher  # room for the drafted tokens
        room = model.max_seq_len - prompt_len - (self.cfg.speculative.gamma + 1 if speculating else 0)
        length = max(1, min(t.sample_length, room))
        prompt = self.data.val_windows(1, prompt_len)[:, :prompt_len]
        device = next(model.parameters()).device
        sampling = {"temperature": t.sample_temperature, "top_k": t.sample_top_k}
        t0 = _synchronized_clock(device)
        out = generate(model, prompt.to(device), length, seed=t.seed + step, **sampling)
        base_s = _synchronized_clock(device) - t0
        prompt_ids = prompt[0].tolist()
        prompt_text, text = self.codec.decode(prompt_ids), self.codec.continuation(prompt_ids, out[0].tolist())
        report = f"{prompt_text}\n{'-' * 40}\n{text}\n"
        metrics: dict[str, float] = {}
        draft = self._draft(device)
        if draft is not None:
            gamma = self.cfg.speculative.gamma
            t0 = _synchronized_clock(device)
            spec, stats = speculative_generate(model, draft, prompt.to(device), length, gamma=gamma,
                                               seed=t.seed + step, **sampling)
            spec_s = _synchronized_clock(device) - t0
            metrics = {"decode_base_ms": base_s * 1e3, "decode_spec_ms": spec_s * 1e3,
                       "spec_speedup": base_s / spec_s, "spec_mean_accepted": stats.mean_accepted}
            report += (f"{'-' * 40} speculative (gamma {gamma}): {stats.mean_accepted:.2f} accepted per step, "
                       f"{spec_s * 1e3:.0f} ms vs base {base_s * 1e3:.0f} ms\n"
                       f"{self.codec.continuation(prompt_ids, list(spec[0]))}\n")
        teacher = self._teacher(device)
        if teacher is not None and draft is None and prompt_len + length + self.cfg.speculative.gamma < \
                teacher.max_seq_len:  # a distilled draft: how many of its drafts its teacher accepts, as it trains
            gamma = self.cfg.speculative.gamma
            _, stats = speculative_generate(teacher, model, prompt.to(device), length, gamma=gamma,
                                            seed=t.seed + step, **sampling)
            metrics["distill_mean_accepted"] = stats.mean_accepted
            report += (f"{'-' * 40} as a draft of distill.teacher (gamma {gamma}): {stats.mean_accepted:.2f} "
                       f"accepted per step\n")
        return {f"samples/step_{step:06d}.txt": report}, metrics

    def export_files(self) -> dict[str, str | bytes]:
        """A token LM's export carries its tokenizer (generation and Serve decode with it)."""
        return {TOKENIZER_FILE: self.codec.to_json()} if isinstance(self.codec, TokenizerCodec) else {}

    def _draft(self, device):
        """The draft model of ``speculative.draft``, loaded once per worker."""
        path = self.cfg.speculative.draft
        if not path:
            return None
        if getattr(self, "_draft_model", None) is None:
            from efftx.export import load_export

            self._draft_model, _, _ = load_export(path, device)
        return self._draft_model


# ------------------------------------------------------------------------------------------ image tasks

def _param_dtype(model) -> torch.dtype:
    """The dtype the model computes in (DeepSpeed casts it for bf16/fp16): images are cast to it."""
    return next(p for p in model.parameters() if p.is_floating_point()).dtype


def _param_device(model) -> torch.device:
    return next(model.parameters()).device


class _ImageTask(Task):
    """What the dVAE and DALL-E tasks share: the image + caption data of ``data.image`` (efftx/data/images.py),
    sized by the model (``vae.image_size``, ``vae.channels``, and DALL-E's ``dalle.text_seq_len``), and a fixed
    sample set (the first ``data.image.sample_images`` validation samples, the same on every rank)."""

    @classmethod
    def _text_seq_len(cls, cfg) -> int:
        return 0  # the dVAE reads no captions

    @classmethod
    def _data(cls, cfg, streaming: bool = False):
        """The data of ``data.image``: in memory (efftx/data/images.py), or streamed shard by shard with bounded
        memory (efftx/data/streaming.py); the same batch and validation methods either way."""
        from efftx.data.images import ImageTextData
        from efftx.data.streaming import StreamingImageData

        kind = StreamingImageData if streaming else ImageTextData
        return kind(cfg.data, image_size=cfg.vae.image_size, channels=cfg.vae.channels,
                    text_seq_len=cls._text_seq_len(cfg), seed=cfg.train.seed, grad_accum=cfg.train.grad_accum)

    @classmethod
    def _streams(cls, cfg) -> bool:
        """Whether the run streams its images (``data.image.streaming``; auto: a URL, or a large source)."""
        from efftx.data.images import resolve_source
        from efftx.data.streaming import use_streaming

        return use_streaming(cfg.data, *resolve_source(cfg.data))

    @classmethod
    def prepare(cls, cfg) -> dict[str, Any]:
        """Check the data once on the driver: an unusable source or too few images (in-memory) or shards
        (streaming) for the workers is a DataError here, before any worker starts. In memory the whole source
        is scanned and the skip counts printed; streaming only lists the shards and reads the validation head."""
        t = cfg.train
        if cls._streams(cfg):
            data = cls._data(cfg, streaming=True)
            info = data.check(cfg.scaling.num_workers,
                              max(t.eval_batches * t.micro_batch_size, cfg.data.image.sample_images))
            size = f", {info['bytes'] / 2**20:,.1f} MB" if info["bytes"] is not None else ""
            print(f"[efftx] image data: streaming {info['shards']} shard(s){size} from {data.location} over "
                  f"{cfg.scaling.num_workers} worker(s), shuffle buffer {cfg.data.image.shuffle_buffer} "
                  f"(data.image.streaming={cfg.data.image.streaming})", flush=True)
            return {"images": info, "streaming": True}
        data = cls._data(cfg).load()
        data.indices(0, 0, t.micro_batch_size, 0, cfg.scaling.num_workers)  # every worker gets images
        print(f"[efftx] image data: {data.stats.summary()} ({len(data.train_ids)} for training, "
              f"{len(data.val_ids)} for validation)", flush=True)
        cls.warn_if_tiny(cfg, "training images", len(data.train_ids),
                         t.micro_batch_size * t.grad_accum * cfg.scaling.num_workers, "data.image.source")
        return {"images": data.stats.to_dict(), "train_images": int(len(data.train_ids)),
                "val_images": int(len(data.val_ids))}

    def __init__(self, cfg, prepared):
        super().__init__(cfg, prepared)
        # in memory: scanned lazily, on the first batch; streaming: shards opened as the batches need them
        self.data = self._data(cfg, streaming=bool(prepared.get("streaming")))
        self.world = cfg.scaling.num_workers

    def _micro_batch(self, step: int, micro: int, rank: int):
        return self.data.batch(step, micro, self.cfg.train.micro_batch_size, rank, self.world)

    def _val_batches(self, rank: int, world: int):
        t = self.cfg.train
        return self.data.val_batches(t.micro_batch_size, rank, world, limit=t.eval_batches * t.micro_batch_size)

    def _sample_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, captions) of the first ``data.image.sample_images`` validation samples (central crops)."""
        n = self.cfg.data.image.sample_images
        return self.data.val_batches(n, 0, 1, limit=n)[0]

    @staticmethod
    def _weighted_means(batches, names: tuple[str, ...], metrics_of) -> tuple[dict[str, float], int]:
        """Per-sample means over ``batches`` of ``metrics_of(batch) -> (batch size, {name: value})``. Every
        name is present (0 with weight 0 on a rank without validation samples): the loop all-reduces them."""
        sums = dict.fromkeys(names, 0.0)
        n = 0
        for batch in batches:
            size, metrics = metrics_of(batch)
            for k in names:
                sums[k] += float(metrics[k]) * size
            n += size
        return {k: v / n if n else 0.0 for k, v in sums.items()}, n


@register("dvae")
class DVAETask(_ImageTask):
    """The discrete VAE: reconstruct images through the codebook. The training batch carries the Gumbel
    temperature of its step (``vae.temperature`` annealed, :func:`efftx.models.dvae.temperature`), so the
    loss is a function of the batch alone. Validation reports the losses and the codebook usage of the
    whole validation set (code histograms summed over ranks): ``val_perplexity``, ``val_dead_codes``.
    Samples: validation images beside their reconstructions, as one PNG grid. A "token" of tokens/s is an image."""

    summary_metrics = ("val_loss", "val_recon_loss", "val_perplexity", "val_dead_codes")

    @classmethod
    def epilogue(cls, summary: dict[str, Any]) -> list[str]:
        return super().epilogue(summary) + [
            f"train DALL-E:   .venv/bin/python jobs/train_dalle.py --vae {summary.get('export_path')}"]

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.cfg.train.micro_batch_size

    def train_batch(self, step: int, micro: int, rank: int) -> dict[str, Any]:
        from efftx.models.dvae import temperature

        images, _ = self._micro_batch(step, micro, rank)
        return {"images": images, "temperature": temperature(self.cfg.vae, step)}

    def loss(self, model, batch: dict[str, Any]):
        tau = batch.get("temperature")
        loss, metrics = model(batch["images"].to(_param_dtype(model)), temperature=tau)
        return loss, ({**metrics, "temperature": tau} if tau is not None else metrics)

    def eval_batches(self, rank: int, world: int) -> list[dict[str, torch.Tensor]]:
        return [{"images": images} for images, _ in self._val_batches(rank, world)]

    @torch.no_grad()
    def evaluate(self, model, batches):
        """Losses (means over this rank's images) and the codebook usage of all ranks' validation images.
        Collective (the histogram is summed over ranks): the loop calls it on every rank."""
        num_tokens = self.cfg.vae.num_tokens
        counts = torch.zeros(num_tokens, dtype=torch.float64, device=_param_device(model))

        def metrics_of(batch):
            images = batch["images"].to(_param_dtype(model))
            loss, m = model(images)
            counts.add_(torch.bincount(model.get_codebook_indices(images).flatten(), minlength=num_tokens))
            return images.shape[0], {"val_loss": loss, "val_recon_loss": m["recon_loss"], "val_kl": m["kl"]}

        means, n = self._weighted_means(batches, ("val_loss", "val_recon_loss", "val_kl"), metrics_of)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        p = counts / counts.sum().clamp(min=1)
        means["val_perplexity"] = float(torch.exp(-torch.special.xlogy(p, p).sum()))
        means["val_dead_codes"] = float((counts == 0).sum())
        return means, n

    @torch.no_grad()
    def sample(self, model, step: int):
        from efftx.generation.png import grid, png_bytes

        images, _ = self._sample_set()
        images = images.to(_param_device(model), _param_dtype(model))
        recon = model.reconstruct(images)
        pairs = [im for pair in zip(images, recon) for im in pair]  # original, reconstruction, original, ...
        picture = grid(pairs, ["original", "reconstruction"] * len(images), columns=8,
                       cell=max(96, self.cfg.vae.image_size))
        return {f"samples/step_{step:06d}.png": png_bytes(picture)}, {}


@register("dalle")
class DALLETask(_ImageTask):
    """DALL-E on captions + the codes of a trained, frozen dVAE (``dalle.vae_path``).

    :meth:`configure` takes ``vae.*`` from the dVAE export and ``model.vocab_size`` from the caption
    tokenizer (``data.image.bpe_path``, else bytes), so an export's config rebuilds both models and the
    text ids always fit; :meth:`load_pretrained` loads the dVAE's weights into ``model.vae``. The export
    holds the DALL-E and dVAE weights, and ``tokenizer.json`` when a tokenizers JSON was used.
    Samples: images generated for validation captions (``train.sample_*``), with their captions, one PNG grid.
    """

    summary_metrics = ("val_loss", "val_loss_text", "val_loss_img")
    pretrained_key = "dalle.vae_path"

    @classmethod
    def validate(cls, cfg) -> None:
        if cfg.model.emb_dim:
            raise ConfigError("model.emb_dim (factorised embedding) is not supported by the DALL-E model; set it to 0")

    @classmethod
    def epilogue(cls, summary: dict[str, Any]) -> list[str]:
        return super().epilogue(summary) + [
            f"generate:       .venv/bin/python -m efftx.generate_images --model {summary.get('export_path')} "
            f"--prompt 'a red circle on a blue background' --num-images 4 --out outputs"]

    @classmethod
    def _text_seq_len(cls, cfg) -> int:
        return cfg.dalle.text_seq_len

    @classmethod
    def configure(cls, cfg):
        from efftx.data.text_tokens import load_tokenizer
        from efftx.errors import ExportError
        from efftx.export import read_export_config

        source = cfg.dalle.vae_path
        if not source:
            raise ConfigError("dalle.vae_path is empty: DALL-E learns the codes of a trained dVAE; give its export "
                              "folder or models:/NAME/VERSION (jobs/train_dalle.py --vae), or run "
                              "jobs/train_dalle.py without --vae, which trains one first")
        vae_cfg, _ = read_export_config(cls._vae_export(cfg))
        if vae_cfg.model.family != "dvae":
            raise ExportError(f"dalle.vae_path={source} is a {vae_cfg.model.family!r} export, not a dVAE "
                              f"(model.family=dvae)")
        cfg.vae = vae_cfg.vae
        cfg.model.vocab_size = load_tokenizer(cfg.data.image.bpe_path).vocab_size
        return cfg

    @staticmethod
    def _vae_export(cfg) -> str:
        """The local folder of ``dalle.vae_path`` (a models:/ URI is downloaded); ExportError naming the key."""
        from efftx.errors import ExportError
        from efftx.export import resolve_export

        try:
            return str(resolve_export(cfg.dalle.vae_path, cfg.tracking.uri))
        except ExportError as exc:
            raise ExportError(f"dalle.vae_path: {exc}") from None

    @classmethod
    def prepare(cls, cfg) -> dict[str, Any]:
        return {**super().prepare(cfg), "vae_export": cls._vae_export(cfg)}

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.cfg.train.micro_batch_size * (self.cfg.dalle.text_seq_len + self.cfg.vae.image_seq_len)

    def load_pretrained(self, model) -> None:
        """The dVAE's trained weights into ``model.vae`` (from the driver's folder, or fetched again on a
        worker that cannot see it)."""
        from efftx.errors import ExportError
        from efftx.export import load_export

        folder = self.prepared["vae_export"]
        vae, vae_cfg, _ = load_export(folder if Path(folder).is_dir() else self._vae_export(self.cfg))
        if vae_cfg.vae != self.cfg.vae:
            raise ExportError(f"the dVAE export of dalle.vae_path={self.cfg.dalle.vae_path} changed since the run "
                              f"was configured (its vae.* differ)")
        model.vae.load_state_dict(vae.state_dict())

    def train_batch(self, step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._micro_batch(step, micro, rank)  # (images (B, C, S, S), captions (B, text_seq_len))

    def loss(self, model, batch):
        images, text = batch
        return model(text, images.to(_param_dtype(model)))

    def eval_batches(self, rank: int, world: int):
        return self._val_batches(rank, world)

    @torch.no_grad()
    def evaluate(self, model, batches):
        def metrics_of(batch):
            images, text = batch
            loss, m = model(text, images.to(_param_dtype(model)))
            return images.shape[0], {"val_loss": loss, "val_loss_text": m["loss_text"], "val_loss_img": m["loss_img"]}

        return self._weighted_means(batches, ("val_loss", "val_loss_text", "val_loss_img"), metrics_of)

    @torch.no_grad()
    def sample(self, model, step: int):
        from efftx.data.text_tokens import decode_tokens
        from efftx.generation.images import generate_images
        from efftx.generation.png import grid, png_bytes

        t = self.cfg.train
        _, text = self._sample_set()
        images, _ = generate_images(model, text.to(_param_device(model)), filter_thres=self.cfg.dalle.sample_filter_thres,
                                    temperature=t.sample_temperature, cond_scale=self.cfg.dalle.sample_cond_scale, seed=t.seed + step)
        captions = [decode_tokens(self.data.tokenizer, row) for row in text]
        picture = grid(images, captions, columns=4, cell=max(128, self.cfg.vae.image_size))
        return {f"samples/step_{step:06d}.png": png_bytes(picture)}, {}

    def export_files(self) -> dict[str, str | bytes]:
        from efftx.data.text_tokens import HFTokenizer

        tokenizer = self.data.tokenizer
        return {TOKENIZER_FILE: tokenizer.to_json()} if isinstance(tokenizer, HFTokenizer) else {}

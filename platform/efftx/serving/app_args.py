"""The arguments of the text app (:func:`efftx.serving.text.build`), as a pydantic model.

Ray Serve's documented way to take application arguments: the builder's one parameter is annotated with a
pydantic model, and Serve validates the arguments against it before calling the builder, whichever way they
come in:

* ``serve run efftx.serving.text:build target=PATH max_batch_size=16 limits='{"max_new_tokens": 64}'``: every
  value is a string; pydantic converts it to the field's type (``"16"`` -> 16; the JSON of ``limits`` /
  ``image_limits`` is decoded by a validator below).
* a config file's ``args:`` mapping (``serve run serve/text.yaml``, ``serve deploy``): YAML values, nested
  mappings for the limits.
* Python (tests, benchmarks): ``build(TextAppArgs(...))`` or ``build({...})`` with a plain dict, validated the
  same way.

An unknown argument is an error naming it (``extra="forbid"``), and so is every bad value (pydantic's
``ValidationError``, a ``ValueError``: its message lists each bad argument's name, then what is wrong with it).
An empty value (``draft=`` on the command line, ``batching:`` with no value in YAML) means "not given": the
default applies. Checks that depend on the machine (``device=cuda`` with no CUDA device in sight) are made when
the app is built (:func:`efftx.serving.devices.resolve_build_devices`).
"""

from __future__ import annotations

import json
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from efftx.generation.compiled import COMPILE_CHOICES
from efftx.kernels.linear_cpu import WEIGHTS
from efftx.serving.continuous import slowdown_ok
from efftx.serving.devices import DEVICES
from efftx.serving.engine_process import ENGINES
from efftx.serving.images import ImageLimits
from efftx.serving.schemas import Limits

Batching = Literal["continuous", "static"]
Device = Literal["auto", "cpu", "cuda"]
assert get_args(Device) == DEVICES, "Device and efftx.serving.devices.DEVICES disagree"

# efftx.serving.continuous.Scheduler's knobs, as given
PRIORITY = ("short_tokens", "fast_rows", "long_every", "prefill_rows", "short_slowdown", "prefill_chunk",
            "group_prefills", "steps_per_round", "pipeline")
CONTINUOUS_ONLY = (*PRIORITY, "warm_up_rows", "compile", "compile_rows", "cache_mib",
                   "cache_fraction", "engine")  # settings of continuous batching alone
Compile = Literal["auto", "on", "off"]
Engine = Literal["thread", "process"]
assert get_args(Engine) == ENGINES, "Engine and efftx.serving.engine_process.ENGINES disagree"
assert get_args(Compile) == COMPILE_CHOICES, "Compile and efftx.generation.compiled.COMPILE_CHOICES disagree"
Weights = Literal["float32", "bfloat16"]
assert get_args(Weights) == WEIGHTS, "Weights and efftx.kernels.linear_cpu.WEIGHTS disagree"

_PATH = ("an export folder or an MLflow registered-model URI (models:/NAME@champion, models:/NAME/VERSION or "
         "models:/NAME/latest)")


class TextAppArgs(BaseModel):
    """Arguments of ``efftx.serving.text:build``: the models, batching, devices and request limits."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # ---------------------------------------------------------------- models
    target: str = Field(min_length=1, description=f"The target model (required): {_PATH}.")
    draft: str | None = Field(None, description=f"The draft model for speculative decoding: {_PATH}. Without it "
                                                "only base decoding is served.")
    name: str | None = Field(None, description="The model name of the OpenAI API (``<name>`` base, "
                                               "``<name>-speculative`` speculative decoding); default: the "
                                               "target's recipe.")
    # ---------------------------------------------------------------- batching
    batching: Batching = Field("continuous", description=(
        "``continuous``: iteration-level scheduling, requests join the running batch at the next decoding step and "
        "leave when they have their tokens. ``static``: ``@serve.batch`` groups requests and a batch is answered "
        "when its longest request is done."))
    max_batch_size: int | None = Field(None, gt=0, description=(
        "continuous: the rows of a running batch (default 32); static: the requests of a batch (default 8)."))
    batch_wait_timeout_s: float | None = Field(None, ge=0, description=(
        "continuous: how long the first request of an idle replica waits for others to start with it (default 0); "
        "static: ``@serve.batch``'s wait (default 0.02 s)."))
    short_tokens: int | None = Field(None, ge=0, description=(
        "continuous: requests asking for at most this many new tokens are short and get priority (default 16; 0: no "
        "priority). See :mod:`efftx.serving.continuous`."))
    fast_rows: int | None = Field(None, gt=0, description=(
        "continuous: while short requests decode, the rows stepped every round: every short one, and long ones while "
        "there are fewer than this (default 4) and, with short_slowdown, while the short ones can afford them."))
    long_every: int | None = Field(None, gt=0, description=(
        "continuous: while short requests decode or wait, the long ones step, and long arrivals are prefilled, once "
        "every this many rounds (default 16)."))
    short_slowdown: float | None = Field(None, description=(
        "continuous: while short requests decode or wait, the long ones also step, and long arrivals are prefilled, "
        "in the rounds every short request can afford: by the replica's measured step and prefill times it still "
        "finishes within this many times its latency alone (default 1.2; 0: only every long_every rounds). On a GPU, "
        "where a step costs about the same at any row count, that is nearly every round."))
    prefill_rows: int | None = Field(None, ge=0, description=(
        "continuous: at most this many waiting requests are prefilled per decoding round, short ones first "
        "(default 2; 0: no limit), so that a burst of arrivals does not stall the running rows for one long round. "
        "With short_slowdown on, more join where the replica's measured costs say they cost next to nothing (a "
        "GPU's prefills and steps of a few more rows)."))
    prefill_chunk: int | None = Field(None, ge=0, description=(
        "continuous: a prompt longer than this many tokens is prefilled this many tokens per decoding round (a chunked "
        "prefill), so that a long prompt does not stall the running requests for its whole prefill (default 0: whole "
        "prompts; for contexts whose prefill costs many decoding steps). A request's output is the same with any other "
        "requests running."))
    group_prefills: bool | None = Field(None, description=(
        "continuous: the requests that join in one decoding round are prefilled in the passes the replica's measured "
        "prefill times say cost least, prompts of like length together (default true); false: in one pass, every "
        "prompt padded to the longest. A request's output is the same either way."))
    steps_per_round: int | None = Field(None, gt=0, description=(
        "continuous: while nothing waits to join and every row steps, a batch runs up to this many decoding steps "
        "in one scheduling round (never past a row's last token), each fed the last one's tokens: the host "
        "schedules once per round, and reads base decoding's tokens once per round (speculative decoding reads "
        "each step's acceptance) (default 1). A request's output is the same; an arrival ends the round's steps "
        "after the one running, and joins in the next round."))
    pipeline: bool | None = Field(None, description=(
        "continuous: base decoding's next step is queued on the device, fed the tokens of the step before, before "
        "the host reads those tokens, so that the device runs while the host hands tokens over and schedules "
        "(default: on where the replica decodes on a CUDA device, off on a CPU, where nothing runs ahead of the "
        "host). A request's output is the same; its tokens reach it one decoding round later."))
    engine: Engine | None = Field(None, description=(
        "continuous: where each replica's scheduler decodes: ``thread`` (the default), a thread of the replica, "
        "sharing its interpreter lock with the request handling (Serve's request path, FastAPI, the streams' events), "
        "or ``process``, a decoding process of the replica's own (:mod:`efftx.serving.engine_process`), which loads "
        "the models itself. The tokens are the same. Should the decoding process exit, its requests fail with a 503 "
        "and Serve replaces the replica."))
    warm_up_rows: int | None = Field(None, ge=0, description=(
        "continuous: at start, each replica decodes throwaway batches of this many requests, half as many, ..., 1 "
        "(default 16, at most max_batch_size; 0: none), so that its first burst of real requests does not pay a "
        "fresh model's one-time costs. GET /models/info reports the rows and seconds."))
    compile: Compile | None = Field(None, description=(
        "continuous: decoding passes of up to ``compile_rows`` rows run compiled (``torch.compile``; CUDA graphs on "
        "a GPU) for models with dense attention in every layer (:mod:`efftx.generation.device_slots`): ``on`` (an "
        "error naming why where it cannot), ``auto`` (compiled where it can, else eagerly, the reason logged), "
        "``off`` (the default). The tokens are the eager path's. Each replica compiles its graphs as it warms up "
        "(seconds per graph: one per power-of-two row count and tokens per row; the warm-up then covers every row "
        "count a compiled pass may take, unless warm_up_rows=0)."))
    compile_rows: int | None = Field(None, gt=0, description=(
        "continuous, with ``compile``: passes over more rows than this run eagerly (default: none; 2 on a CPU where "
        "efftx's C++ decode attention kernel cannot be built, as a compiled pass then attends over the whole context "
        "and pays for a row or two only)."))
    cache_mib: float | None = Field(None, gt=0, description=(
        "continuous: the most memory, in MiB, each replica's decoding caches may hold (its running batches' slots, "
        "each a row's cache of as many positions as the batch's longest request needs, rounded up to a power of two "
        "from 64 (full attention, eager passes; other caches and compiled passes: the model's whole context), and "
        "caches kept for reuse): requests beyond it wait for "
        "rows to leave, before the device runs out of memory (default: no limit but the device's). It must hold "
        "at least one row of the target's cache and the draft's; GET /models/info reports what is held."))
    cache_fraction: float | None = Field(None, gt=0, le=1, description=(
        "continuous: like ``cache_mib``, as a share of the replica's device memory (on a GPU, of the replica's part "
        "of it: ``num_gpus`` of the GPU's total memory, all of it for 1 or more; on a CPU, of the machine's "
        "memory): for example 0.5 on a GPU whose other half holds weights and activations. Replicas sharing a GPU "
        "each take their fraction of their own part (two replicas of num_gpus=0.5 and cache_fraction=0.5 hold a "
        "quarter of the GPU each)."))
    limits: Limits | None = Field(None, description=(
        "Request limits of the text endpoints (:class:`efftx.serving.schemas.Limits`; unset fields keep their "
        "defaults): a mapping, or its JSON text. GET /openapi.json states them as the bounds of the fields."))
    decode_weights: Weights | None = Field(None, description=(
        "The Linear weights of the target and draft as the replicas hold them on a CPU: ``float32`` (the default) or "
        "``bfloat16`` (weight-only: activations, norms, embeddings and caches stay float32; half the weights' memory "
        "and bytes to read a decoding step, :func:`efftx.kernels.linear_cpu.bf16_weights`). Outputs follow the "
        "weights rounded to bfloat16. A CPU option: refused on a CUDA device."))
    # ---------------------------------------------------------------- devices
    device: Device = Field("auto", description=(
        "Where the models run. ``auto``: CUDA when the replica was given a GPU share and torch sees a CUDA device, "
        "else the CPU. ``cuda`` with no CUDA device in sight fails when the app is built; without ``num_gpus`` / "
        "``image_num_gpus`` it asks half a GPU per deployment."))
    num_gpus: float | None = Field(None, ge=0, description=(
        "The GPU share of each text replica (``ray_actor_options.num_gpus``; fractions let replicas share a GPU). "
        "Not given: the deployment's own (none)."))
    image_num_gpus: float | None = Field(None, ge=0, description="The GPU share of each image replica, like "
                                                                 "``num_gpus``.")
    num_cpus: float | None = Field(None, gt=0, description=(
        "The CPU share of each text replica (``ray_actor_options.num_cpus``). Not given: the deployment's own "
        "(0.25)."))
    threads: int | None = Field(None, gt=0, description=(
        "torch's intra-op threads in every thread a text replica decodes in (default 1): a batch's products spread "
        "over this many cores. Give the replica as many CPUs (``num_cpus``) on a shared cluster."))
    # ---------------------------------------------------------------- images
    dalle: str | None = Field(None, description=(
        f"A DALL-E model: {_PATH}. With it the app serves POST /images/generate and /v1/images/generations from an "
        "ImageGenerator deployment behind the text one."))
    image_limits: ImageLimits | None = Field(None, description=(
        "Request limits of the image endpoints (:class:`efftx.serving.images.ImageLimits`): a mapping, or its JSON "
        "text."))
    image_max_batch_size: int = Field(8, gt=0, description="The images deployment's ``@serve.batch`` size.")
    image_batch_wait_timeout_s: float = Field(0.05, ge=0, description="The images deployment's ``@serve.batch`` "
                                                                      "wait, in seconds.")

    @model_validator(mode="before")
    @classmethod
    def _empty_is_not_given(cls, data: Any) -> Any:
        """``draft=`` (an empty string) or a YAML key with no value: the field's default. Unknown keys are kept,
        so that they are still refused by name."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (k in cls.model_fields and (v is None or (isinstance(v, str) and not v.strip())))}
        return data

    @model_validator(mode="after")
    def _priority_needs_continuous(self) -> "TextAppArgs":
        given = [k for k in CONTINUOUS_ONLY if getattr(self, k) is not None]
        if given and self.batching != "continuous":
            raise ValueError(f"{', '.join(given)}: only with batching=continuous (got batching={self.batching})")
        if self.cache_mib is not None and self.cache_fraction is not None:
            raise ValueError("cache_mib and cache_fraction: give one of them (both bound the same caches)")
        if self.compile_rows is not None and self.compile in (None, "off"):
            raise ValueError(f"compile_rows: only with compile=on or compile=auto (got compile={self.compile})")
        return self

    @field_validator("short_slowdown")
    @classmethod
    def _slowdown(cls, value: float | None) -> float | None:
        if value is not None and not slowdown_ok(value):
            raise ValueError(f"must be 0 (off) or a number >= 1, got {value}")
        return value

    def priority(self) -> dict[str, int | float | bool]:
        """The continuous-batching priority settings given (the scheduler's defaults for the others)."""
        return {k: getattr(self, k) for k in PRIORITY if getattr(self, k) is not None}

    @field_validator("batching", "device", "compile", "decode_weights", "engine", mode="before")
    @classmethod
    def _normalized(cls, value: Any) -> Any:
        return value.strip().lower() if isinstance(value, str) else value

    @field_validator("limits", "image_limits", mode="before")
    @classmethod
    def _json_text(cls, value: Any) -> Any:
        """The command line passes every argument as a string: the limits come as their JSON text."""
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not a JSON object ({exc}); for example '{{\"max_new_tokens\": 64}}'") from None
        return value

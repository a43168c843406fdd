"""Request and response bodies of the text endpoints, and the limits requests are checked against.

Every check names the offending field; FastAPI turns a failed check into a 422 whose body lists
``{"loc": [..., field], "msg": ...}`` entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


@dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int = 512
    max_new_tokens: int = 256
    min_gamma: int = 1
    max_gamma: int = 8
    max_temperature: float = 2.0


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.8, ge=0.0)
    top_k: int = Field(default=0, ge=0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    mode: Literal["base", "speculative", "both"] = "base"
    gamma: int = Field(default=5, ge=1)


class ModeResult(BaseModel):
    text: str
    tokens: int
    latency_ms: float
    tokens_per_s: float
    batch_size: int = 1  # requests decoded together in this batch (latency is the batch's)
    mean_accepted: float | None = None
    acceptance_histogram: list[int] | None = None
    draft_calls: int | None = None
    target_calls: int | None = None


class GenerateResponse(BaseModel):
    prompt: str
    results: dict[str, ModeResult]


class StreamRequest(GenerateRequest):
    """``POST /generate/stream``: the fields of ``/generate``, one mode per stream (the playground opens two)."""

    mode: Literal["base", "speculative"] = "base"


class StreamStep(BaseModel):
    """Server-sent event ``step``: the tokens one decoding step emitted.

    In speculative decoding a step's tokens are the draft's proposals the target accepted followed by
    the one token the target drew itself (a resample at the first rejection, or the bonus token when all
    were accepted); a step cut at ``max_new_tokens`` may end before the target's token (``from_target``
    0). In base decoding every step is one token from the target. ``text`` is ``draft_text +
    target_text``; a UTF-8 character split between the two parts counts for the part that completes it.
    """

    mode: str
    step: int  # 1, 2, ...
    text: str
    draft_text: str
    target_text: str
    drafted_accepted: int  # tokens of this step drafted and accepted
    from_target: int  # 0 or 1
    tokens: int  # tokens emitted so far, this step included
    elapsed_ms: float  # since the request started decoding (prefill included)


class StreamDone(ModeResult):
    """Server-sent event ``done``: the totals of a stream (``ModeResult`` plus the mode and step count)."""

    mode: str
    steps: int
    tail: str = ""  # an incomplete UTF-8 character held back at the end (as U+FFFD): the steps' texts + tail == text


class ModelCard(BaseModel):
    """One loaded model, as ``GET /models/info`` lists it."""

    role: Literal["target", "draft", "image"]
    id: str  # the name requests use (GET /v1/models)
    source: str  # the export folder or models:/ URI the app was started with
    mlflow_model: str | None = None  # for a models:/NAME/VERSION source
    mlflow_version: str | None = None  # resolved at load time when the URI says "latest"
    recipe: str
    parameters: int
    details: dict[str, int | float | str] = Field(default_factory=dict)  # e.g. attention kind, context length


class ModelsInfo(BaseModel):
    """``GET /models/info``: what the app serves and the limits requests are checked against."""

    name: str  # the base text model's id; "<name>-speculative" when a draft is loaded
    speculative: bool
    images: bool
    models: list[ModelCard]
    limits: dict[str, int | float]
    image_limits: dict[str, int | float] | None = None


class CompletionRequest(BaseModel):
    """The subset of the OpenAI completions API this server implements (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: str = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)

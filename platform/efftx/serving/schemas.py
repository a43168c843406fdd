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

"""Request and response bodies of the text endpoints, and the limits requests are checked against.

Every check names the offending field; FastAPI turns a failed check into a 422 whose body lists
``{"loc": [..., field], "msg": ...}`` entries.

**Types are strict**: an integer field takes a JSON integer only (``"seed": false`` or ``"seed": 1.0`` is a
422), a number field a JSON number, a string field a string; NaN and infinities are refused.

**Limits.** The static bounds are in the models below. The configured :class:`Limits` (``limits=JSON`` of the
app) are enforced by the app and written into its OpenAPI schema (``GET /openapi.json``) as ``maximum`` /
``maxLength`` / ``enum`` of the fields they bound (:func:`apply_field_limits`), so the schema states every
limit the app enforces. A few rules join two fields and so are in the fields' descriptions only: the prompt's
UTF-8 byte count (``maxLength`` bounds its characters), the model's context (prompt + new tokens, + gamma + 1
when speculative) and, for images, ``seed + n - 1 <= 2**63 - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from efftx.generation.sampling import MIN_TEMPERATURE

TOP_K_MAX = 2**63 - 1  # top_k reaches the sampling kernel as a 64-bit integer; the vocabulary's size or more keeps all
SEED_MAX = 2**63 - 1  # seeds are 0..2**63-1 (torch.Generator.manual_seed takes 64 bits; this leaves room)


@dataclass(frozen=True)
class Limits:
    max_prompt_bytes: int = 512
    max_new_tokens: int = 256
    min_gamma: int = 1
    max_gamma: int = 8
    max_temperature: float = 2.0
    max_body_bytes: int = 65536  # larger request bodies get a 413 before they are parsed (every route)


def encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800") decodes from JSON but has no UTF-8 form
        raise ValueError(f"the text is not valid Unicode ({exc.reason} at character {exc.start})") from None
    return text


def _floor_temperature(t: float) -> float:
    return 0.0 if t < MIN_TEMPERATURE else t


STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
Prompt = Annotated[str, Field(min_length=1, description="UTF-8 text; its byte count is limited by "
                                                        "limits.max_prompt_bytes (maxLength bounds its characters)"),
                   AfterValidator(encodable)]
Temperature = Annotated[float, Field(ge=0.0, description=f"0 = greedy; values below {MIN_TEMPERATURE:g} "
                                                        "are greedy too (the sampling temperature floor)"),
                        AfterValidator(_floor_temperature)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX, description="0..2**63-1; null = unseeded")]
TopP = Annotated[float, Field(gt=0.0, le=1.0, description="nucleus sampling; the most probable token is always kept")]


class GenerateRequest(BaseModel):
    model_config = STRICT

    prompt: Prompt
    max_new_tokens: int = Field(default=64, ge=1, description="at most limits.max_new_tokens, and prompt bytes + "
                                                               "max_new_tokens (+ gamma + 1 when speculative) "
                                                               "within the model's context")
    temperature: Temperature = 0.8
    top_k: int = Field(default=0, ge=0, le=TOP_K_MAX, description="0 = no top-k filter; the vocabulary's size "
                                                                 "or more keeps every token too")
    top_p: TopP = 1.0
    seed: Seed | None = None
    mode: Literal["base", "speculative", "both"] = "base"
    gamma: int = Field(default=5, ge=1, description="draft tokens per speculative step, in "
                                                    "[limits.min_gamma, limits.max_gamma] (checked in every mode)")
    adaptive_gamma: bool = Field(default=False, description=(
        "speculative: each step's draft length follows this request's acceptance, starting at gamma: one more "
        "after a step that accepted every draft, one fewer after a rejection, between 1 and limits.max_gamma "
        "(the context must then hold prompt + max_new_tokens + limits.max_gamma + 1); the tokens are the same "
        "distribution, only the passes differ"))
    coupled: bool = Field(default=False, description=(
        "speculative: coupled acceptance: the tokens are exactly those base decoding gives this request with the same "
        "seed and settings (each position's token raced with that position's noise; a draft is accepted where it is "
        "that token, a little less often than by the ratio test); with continuous batching the server then drafts "
        "at most gamma tokens a step, as many as its load makes pay (none in a full batch on a CPU)"))

    def adaptive(self, max_gamma: int) -> dict:
        """The library's speculative-decoding arguments for this request's gamma schedule (capped at ``max_gamma``)
        and acceptance: none for a fixed gamma and the ratio test."""
        return ({"adaptive_gamma": True, "max_gamma": max_gamma} if self.adaptive_gamma else {}) | (
            {"coupled": True} if self.coupled else {})

    def draft_cap(self, max_gamma: int) -> int:
        """The most tokens a speculative step of this request drafts (its acceptance histogram's last bin)."""
        return max_gamma if self.adaptive_gamma else self.gamma


class ModeResult(BaseModel):
    text: str
    tokens: int
    latency_ms: float
    tokens_per_s: float
    batch_size: int = 1  # requests decoded together: static batching, the batch (latency is the batch's);
    # continuous batching, the most rows of the running batch it shared a decoding step with
    first_token_ms: float | None = None  # continuous batching: from arrival to the first token
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
    device: str = "cpu"  # where the replica holds and runs it: "cpu", "cuda:0", ...
    details: dict[str, int | float | str] = Field(default_factory=dict)  # e.g. attention kind, context length


class DraftLengths(BaseModel):
    """A coupled speculative batch's draft lengths (:meth:`efftx.generation.draft_length.DraftLength.report`)."""

    acceptance: float  # measured: drafts accepted over drafts tried, recent steps weighing most
    steps: list[int]  # steps run at each draft length 0..gamma (a replica's warm-up's included)
    step_ms: dict[str, dict[str, float]]  # per draft length, the measured ms of a step per row count


class ModelsInfo(BaseModel):
    """``GET /models/info``: what the app serves and the limits requests are checked against."""

    name: str  # the base text model's id; "<name>-speculative" when a draft is loaded
    speculative: bool
    images: bool
    models: list[ModelCard]
    limits: dict[str, int | float]
    image_limits: dict[str, int | float] | None = None
    batching: dict[str, int | float | str | bool] | None = None  # mode (continuous | static), max_batch_size, ...
    replica: dict[str, str] | None = None  # the replica that answered: its Serve id and its Ray node id
    threads: int | None = None  # torch's intra-op threads in the replica's decoding threads
    # continuous batching, per running batch (base, speculative gamma=...): its measured step times in ms per row
    # count, prefill times in ms per prompt tokens, tokens a step gives a row (efftx.serving.continuous.StepCosts);
    # a coupled speculative batch's draft lengths too
    costs: dict[str, dict[str, dict[str, float] | float | DraftLengths]] | None = None
    # continuous batching with cache_mib / cache_fraction: MiB of the budget (limit_mib), of what the running batches'
    # slots hold (held_mib) and of the caches kept for reuse (pooled_mib)
    cache_memory: dict[str, float] | None = None
    # continuous batching: where its rounds' time went, per round (efftx.serving.continuous.Scheduler.timing):
    # round_us, pass_us (the batches' passes), host_us (the scheduling besides them), host_share, rounds
    scheduling: dict[str, float] | None = None


class CompletionRequest(BaseModel):
    """The subset of the OpenAI completions API this server implements (others are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str
    prompt: Prompt
    max_tokens: int = Field(default=16, ge=1)
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stream: bool = False
    n: int = Field(default=1, ge=1, le=1)
    # efftx's own fields (the OpenAI API has none such; its clients send them with ``extra_body``): the speculative
    # model's draft length, checked against the limits in every mode as /generate's is
    gamma: int | None = Field(default=None, ge=1, description=(
        "the speculative model's draft tokens per step, in [limits.min_gamma, limits.max_gamma]; null = 5 (within "
        "the limits)"))
    adaptive_gamma: bool = Field(default=False, description=(
        "the speculative model: each step's draft length follows this request's acceptance, as /generate's "
        "adaptive_gamma"))
    coupled: bool = Field(default=False, description=(
        "the speculative model: coupled acceptance, as /generate's coupled (the tokens are the base model's with the "
        "same seed)"))


# ---------------------------------------------------------------------------------------------- the schema
def constrain(schema: dict, model: str, field: str, **keywords: Any) -> None:
    """Add JSON-schema keywords to ``model.field`` in an OpenAPI document (for an optional field, to its non-null
    branch)."""
    prop = schema["components"]["schemas"][model]["properties"][field]
    branches = [b for b in prop.get("anyOf", []) if b.get("type") != "null"]
    (branches[0] if branches else prop).update(keywords)


def text_field_limits(lim: Limits, context: int, models: list[str], speculative: bool) -> dict[str, dict]:
    """``{model: {field: JSON-schema keywords}}``: the configured limits of the text requests, as the app enforces
    them (``context`` is the target's ``max_seq_len``; ``models`` the ids ``/v1/completions`` serves)."""
    common = {"prompt": {"maxLength": lim.max_prompt_bytes}, "temperature": {"maximum": lim.max_temperature}}
    generate = {**common, "max_new_tokens": {"maximum": min(lim.max_new_tokens, context - 1)},
                "gamma": {"minimum": lim.min_gamma, "maximum": lim.max_gamma}}
    out = {"GenerateRequest": dict(generate), "StreamRequest": dict(generate),
           "CompletionRequest": {**common, "max_tokens": {"maximum": min(lim.max_new_tokens, context - 1)},
                                 "model": {"enum": list(models)},
                                 "gamma": {"minimum": lim.min_gamma, "maximum": lim.max_gamma}}}
    if not speculative:  # no draft: base decoding only
        out["GenerateRequest"]["mode"] = {"enum": ["base"]}
        out["StreamRequest"]["mode"] = {"enum": ["base"]}
    return out


def apply_field_limits(schema: dict, limits: dict[str, dict]) -> dict:
    for model, fields in limits.items():
        if model in schema.get("components", {}).get("schemas", {}):
            for field, keywords in fields.items():
                constrain(schema, model, field, **keywords)
    return schema


def exact_integer_bounds(schema: dict) -> dict:
    """FastAPI writes every ``minimum``/``maximum`` as a float (``2**63 - 1`` becomes ``9.223372036854776e+18``,
    i.e. 2**63): integer fields get integer bounds back, and seeds and top_k their exact maximum."""
    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    if isinstance(node.get(key), float) and node[key].is_integer():
                        node[key] = int(node[key])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    for model in schema.get("components", {}).get("schemas", {}).values():
        for field, top in (("seed", SEED_MAX), ("top_k", TOP_K_MAX)):
            prop = model.get("properties", {}).get(field)
            for branch in [] if prop is None else prop.get("anyOf", [prop]):
                if branch.get("type") == "integer":
                    branch.update(minimum=0, maximum=top)
    return schema


def declare_body_limit(schema: dict, max_body_bytes: int) -> dict:
    """Every operation with a request body may answer 413: say so, with the limit."""
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            if isinstance(op, dict) and "requestBody" in op:
                op.setdefault("responses", {})["413"] = {
                    "description": f"The request body is larger than {max_body_bytes} bytes "
                                   "(limits.max_body_bytes); refused before it is parsed."}
    return schema

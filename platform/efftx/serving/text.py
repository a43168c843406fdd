"""Text generation on Ray Serve: base vs speculative decoding over HTTP.

    serve run efftx.serving.text:build target=PATH [draft=PATH] [dalle=PATH] [key=value ...]
        (PATH: an export folder or models:/NAME/VERSION)
    serve run serve/text.yaml

The arguments are the typed fields of :class:`~efftx.serving.app_args.TextAppArgs` (a pydantic model: Ray Serve
converts ``key=value`` strings and YAML values to the fields' types and refuses unknown arguments by name).

Endpoints (FastAPI; OpenAPI docs at /docs and /openapi.json):

* ``POST /generate``: ``{prompt, max_new_tokens, temperature, top_k, top_p, seed, mode, gamma, adaptive_gamma,
  coupled}``
  with ``mode`` = ``base`` | ``speculative`` | ``both``; per mode the text, latency, tokens/s and, for
  speculative decoding, the acceptance statistics.
* ``POST /v1/completions``: the OpenAI completions API (``stream: true`` answers server-sent events); the
  model name chooses base (``<name>``) or speculative (``<name>-speculative``) decoding; efftx's own ``gamma``,
  ``adaptive_gamma`` and ``coupled`` fields set the speculative model's draft schedule and acceptance.
* ``POST /generate/stream``: one mode's decoding as server-sent events, step by step, the draft-accepted
  tokens told apart from the target's (:mod:`efftx.serving.streaming`).
* ``GET /v1/models``, ``GET /models/info`` (sources, MLflow versions, recipes, parameter counts, limits),
  ``GET /healthz``.
* ``GET /playground`` (``/`` redirects there): a web page comparing base and speculative decoding side by
  side, and drawing images when there is an image model (:mod:`efftx.serving.playground`).
* With a DALL-E (``dalle=PATH``): ``POST /images/generate`` and ``POST /v1/images/generations`` (the OpenAI
  images API), served by an :class:`~efftx.serving.images.ImageGenerator` deployment behind this one.

**Batching** (``batching=continuous|static``, default ``continuous``):

* ``continuous``: iteration-level scheduling (:mod:`efftx.serving.continuous`). Each replica keeps running
  batches (base decoding; speculative decoding per ``gamma``) decoded by one background thread; a request, a
  stream included, joins at the next decoding step and leaves the moment it has its tokens.
  ``max_batch_size`` (default 32) bounds the rows of a running batch; ``batch_wait_timeout_s`` (default 0) is
  how long the first request of an idle replica waits for others to start with it. Short requests get priority
  (``short_tokens``, ``fast_rows``, ``long_every``, ``prefill_rows``, ``short_slowdown``: the scheduler's knobs;
  ``prefill_chunk`` prefills long prompts a chunk a round; ``group_prefills`` prefills a round's arrivals in the
  passes their measured costs say cost least; ``steps_per_round`` runs several decoding steps a round while
  nothing waits; ``pipeline`` queues base decoding's next step before the host reads the last one's tokens, by
  default on a CUDA device). A replica warms up before it takes requests: throwaway batches of ``warm_up_rows``
  (default 16), half as many, ..., 1 requests (:func:`efftx.serving.continuous.warm_up`), so its first burst does
  not pay a fresh model's one-time costs.
  ``compile=on|auto`` runs decoding passes of up to ``compile_rows`` rows compiled (CUDA graphs on a GPU; dense
  models; :mod:`efftx.generation.device_slots`), the graphs compiled as the replica warms up. ``cache_mib`` (or
  ``cache_fraction`` of the replica's part of its device's memory) bounds what the decoding caches hold: requests
  beyond it wait for rows to leave, before the device runs out of memory (``GET /models/info``: ``cache_memory``).
  ``engine=thread|process``: the scheduler runs on a thread of the replica (the default), or in a decoding
  process of its own (:mod:`efftx.serving.engine_process`), whose interpreter lock the replica's request handling
  does not share; the same rounds, the same tokens.
* ``static``: ``@serve.batch`` groups requests (``max_batch_size`` default 8, ``batch_wait_timeout_s`` default
  0.02) and a batch is answered when its longest request is done; streams decode alone.

Either way a request's output, and in speculative decoding its acceptance, is exactly what it gets alone.

**Devices** (:mod:`efftx.serving.devices`): ``num_gpus`` / ``image_num_gpus`` (fractions allowed) are the GPU
share of each text / image replica, ``device=auto|cpu|cuda`` where the models run (``auto``: CUDA when the
replica was given a GPU and torch sees one); ``GET /models/info`` names each model's device.

Bad input gets a 4xx naming the field (422 for values, 400 for bodies that are not UTF-8 JSON); no
request can take the replica down, and no request can fail another:

* **Limits.** The configured limits (``limits=JSON``: :class:`~efftx.serving.schemas.Limits`;
  ``image_limits=JSON``: :class:`~efftx.serving.images.ImageLimits`) are written into ``GET /openapi.json``
  as the bounds of the fields they limit, so the schema states every limit the app enforces
  (:func:`~efftx.serving.schemas.text_field_limits`). Temperatures below the sampling floor
  (``efftx.generation.sampling.MIN_TEMPERATURE``) are greedy, like 0. Seeds are 0..2**63-1.
* **Body size.** A request body over ``limits.max_body_bytes`` gets a 413 before it is parsed
  (:class:`~efftx.serving.isolation.BodyLimit`).
* **Containment.** A batch whose decoding raises is decoded again request by request, so only the request
  at fault fails (a 422 when the decoder refused its input, else a 500); its batch-mates get exactly the
  output they get alone (:func:`~efftx.serving.isolation.contained`). A stream that fails after it has begun
  ends with an ``error`` event.
  With continuous batching a step that raises is undone and run row by row the same way.
* **Responsiveness.** Decoding runs off the replica's event loop (the scheduler's thread; with static batching
  ``asyncio.to_thread`` for batches and Starlette's thread pool for streams), so ``/healthz`` and the other
  routes answer while a batch decodes.
"""


import asyncio
import base64
import copy
import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi.utils import is_body_allowed_for_status_code
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from efftx.data.lm_tokenizer import export_codec, same_tokenizer
from efftx.generation.decode import iter_generate
from efftx.generation.device_slots import compile_knobs
from efftx.generation.speculative import SpecStats, iter_speculative, iter_speculative_rows
from efftx.kernels.linear_cpu import use_weights
from efftx.serving import metrics
from efftx.serving.app_args import TextAppArgs
from efftx.serving.continuous import Job, Sampling, Scheduler, start_scheduler
from efftx.serving.engine_process import ENGINES, EngineProcess
from efftx.serving.devices import (cache_budget, replica_device, replica_gpu_share, resolve_build_devices,
                                   with_resources, with_threads)
from efftx.serving.images import (ImageGenerator, ImageLimits, ImageRequest, OpenAIImageRequest, as_image_request,
                                  check_request, field_error, image_field_limits, openai_size)
from efftx.serving.faults import FaultLatch
from efftx.serving.isolation import RETRY_AFTER_S, BodyLimit, RowFailure, contained
from efftx.serving.playground import image_card, model_card
from efftx.serving.playground import router as playground_router
from efftx.serving.schemas import (CompletionRequest, GenerateRequest, GenerateResponse, Limits, ModelsInfo, ModeResult,
                                   StreamRequest, apply_field_limits, declare_body_limit, exact_integer_bounds,
                                   text_field_limits)
from efftx.serving.streaming import job_events, sse, sse_async, stream_events

BATCHING = ("continuous", "static")

# /openapi.json and /docs are routes of the deployment below: the schema carries the replica's configured limits
app = FastAPI(title="efftx text generation", description=__doc__.split("\n\n")[0], openapi_url=None, docs_url=None,
              redoc_url=None)
app.include_router(playground_router)  # the page and its static files


def _body_limit() -> int:
    """The serving replica's ``limits.max_body_bytes`` (the default outside a replica)."""
    try:
        return serve.get_replica_context().servable_object.limits.max_body_bytes
    except Exception:  # noqa: BLE001 - not in a replica (or not a TextGenerator): the default
        return Limits().max_body_bytes


class ServedBy:
    """ASGI middleware: every answer names the model that produced it in ``X-Efftx-Model`` (``NAME/VERSION`` of a
    registered model, else the export folder's name), streams included. During a redeploy onto a new version both
    old and new replicas answer for a while: a client (or test) can tell which version served each request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            value = serve.get_replica_context().servable_object.served_by
        except Exception:  # noqa: BLE001 - not in a replica: nothing to name
            value = b""
        if scope["type"] != "http" or not value:
            return await self.app(scope, receive, send)

        async def send_named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-efftx-model", value)]}
            await send(message)

        await self.app(scope, receive, send_named)


app.add_middleware(ServedBy)
app.add_middleware(BodyLimit, limit=_body_limit)
app.add_middleware(metrics.RequestMetrics)  # outermost: counts every answer (413s and handlers' 4xx included)


class _AsciiJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error may echo input that has no UTF-8 form (a lone surrogate such as
    ``"\\ud800"`` is valid JSON), which the default rendering cannot encode (it answered 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


@app.exception_handler(UnicodeDecodeError)
async def _not_utf8(request: Request, exc: UnicodeDecodeError):
    return JSONResponse(status_code=400, content={"detail": [{"loc": ["body"], "msg": "the body is not valid UTF-8"}]})


@app.exception_handler(RequestValidationError)
async def _invalid(request: Request, exc: RequestValidationError):
    return _AsciiJSON(status_code=422, content={"detail": jsonable_encoder(exc.errors())})


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException):
    if not is_body_allowed_for_status_code(exc.status_code):
        return Response(status_code=exc.status_code, headers=exc.headers)
    return _AsciiJSON(status_code=exc.status_code, content={"detail": jsonable_encoder(exc.detail)},
                      headers=exc.headers)


_field_error = field_error


# Module-level helpers the deployment uses are defined before it: Serve serializes the class where it is
# defined, so names defined after it would be missing in the replica.
def batch_defaults(batching: str, max_batch_size, batch_wait_timeout_s) -> tuple[int, float]:
    """``max_batch_size`` / ``batch_wait_timeout_s`` with the defaults of the batching mode (continuous: 32 rows,
    no wait; static: 8 requests, 0.02 s)."""
    continuous = batching == "continuous"
    size = int(max_batch_size) if max_batch_size not in (None, "") else (32 if continuous else 8)
    wait = float(batch_wait_timeout_s) if batch_wait_timeout_s not in (None, "") else (0.0 if continuous else 0.02)
    if size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {size}")
    if not wait >= 0:
        raise ValueError(f"batch_wait_timeout_s must be >= 0, got {wait}")
    return size, wait


def _resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _mode_result(job: Job, text: str) -> ModeResult:
    """A continuous-batching row's result (latency from its arrival to its last token); ``text``: its decoded tokens."""
    secs = max(job.latency_s, 1e-9)
    extra = {} if job.stats is None else job.stats.result_fields()
    first = job.first_token_s
    return ModeResult(text=text, tokens=len(job.out), latency_ms=secs * 1e3,
                      tokens_per_s=len(job.out) / secs, batch_size=max(job.batch_size, 1),
                      first_token_ms=None if first is None else first * 1e3, **extra)


def _completion_error(exc: BaseException) -> str:
    kind = "invalid_request_error" if isinstance(exc, ValueError) else "server_error"
    error = {"message": f"decoding failed: {type(exc).__name__}: {exc}", "type": kind}
    return f"event: error\ndata: {json.dumps({'error': error})}\n\n"


# A replica being replaced (a redeploy onto a new model version, a scale-down) stops taking requests and waits for
def warm_up_size(warm_up_rows: int, max_batch_size: int, compiled: dict[str, Any]) -> int:
    """The rows of a replica's largest warm-up batch: ``warm_up_rows``, at most ``max_batch_size``; with compiled
    passes at least the most rows a compiled pass may take (``compile_rows``, else ``max_batch_size``), so that
    every bucket's graph is compiled before requests come (a graph compiled at a request's step would hold every
    running row for seconds). ``warm_up_rows=0`` warms up nothing."""
    rows = min(int(warm_up_rows), int(max_batch_size))
    if rows and compiled.get("compile", "off") != "off":
        rows = max(rows, min(int(compiled.get("compile_rows") or max_batch_size), int(max_batch_size)))
    return rows


# its running ones to finish for up to graceful_shutdown_timeout_s: long CPU generations must not be cut off.
@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32, graceful_shutdown_timeout_s=120,
                  graceful_shutdown_wait_loop_s=0.5)
@serve.ingress(app)
class TextGenerator:
    def __init__(self, target: str, draft: str | None = None, name: str | None = None,
                 limits: dict[str, Any] | None = None, max_batch_size: int | None = None,
                 batch_wait_timeout_s: float | None = None, images=None, image_limits: dict[str, Any] | None = None,
                 device: str = "auto", batching: str = "continuous", priority: dict[str, int | float] | None = None,
                 warm_up_rows: int = 16, threads: int = 1, compile: str = "off", compile_rows: int | None = None,
                 cache_mib: float | None = None, cache_fraction: float | None = None, weights: str = "float32",
                 engine: str = "thread"):
        from efftx.export import export_skeleton, load_export, resolve_export

        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {threads!r}")
        self.threads = threads  # every decoding thread sets it (a new thread starts at the process default)
        self.latch = FaultLatch()  # the device's fault, once met: static batching's, or the scheduler's (below)
        torch.set_num_threads(threads)  # the scheduler's thread takes it from here
        if batching not in BATCHING:
            raise ValueError(f"batching must be one of {', '.join(BATCHING)}; got {batching!r}")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}; got {engine!r}")
        if engine == "process" and batching != "continuous":
            raise ValueError(f"engine=process: only with batching=continuous (got batching={batching})")
        max_batch_size, batch_wait_timeout_s = batch_defaults(batching, max_batch_size, batch_wait_timeout_s)
        self.device = replica_device(device)  # efftx.serving.devices: CUDA when this replica was given a GPU
        # engine=process: the decoding process loads the models; the replica builds them on the meta device (their
        # settings and shapes, for the request checks and model cards), reading no weights
        load = export_skeleton if engine == "process" else (lambda path: load_export(path, self.device))
        target_dir = resolve_export(target)
        self.target, self.target_cfg, _ = load(target_dir)
        # text <-> ids: UTF-8 bytes, or the tokenizer.json a token LM's export carries (efftx.data.lm_tokenizer)
        self.codec = export_codec(target_dir, self.target_cfg)
        draft_dir = resolve_export(draft) if draft else None
        self.draft, draft_cfg, _ = load(draft_dir) if draft else (None, None, None)
        for model in (self.target, self.draft) if engine == "thread" else ():  # decode_weights: bfloat16 Linear
            if model is not None:                                              # weights on a CPU (the decoding
                use_weights(model, weights)                                    # process's own, there)
        if self.draft is not None:
            problem = same_tokenizer(self.codec, export_codec(draft_dir, draft_cfg))
            if problem is None and self.draft.vocab_size != self.target.vocab_size:
                problem = "target and draft vocabularies differ"
            if problem:
                raise ValueError(f"draft={draft} cannot draft for target={target}: {problem}")
        self.name = name or self.target_cfg.recipe
        self.sources = {"target": target, "draft": draft}
        where = str(self.device)  # engine=process: the decoding process's device, not that of the copies here
        self.model_cards = [model_card("target", self.target, self.target_cfg, target, self.name, where)] + (
            [model_card("draft", self.draft, draft_cfg, draft, f"{self.name}-speculative", where)]
            if self.draft is not None
            else [])
        try:  # which replica, on which node, answers (GET /models/info): several replicas share one address
            import ray

            self.replica = {"id": serve.get_replica_context().replica_id.unique_id,
                            "node_id": ray.get_runtime_context().get_node_id()}
        except Exception:  # noqa: BLE001 - built outside a Serve replica (tests)
            self.replica = None
        card = self.model_cards[0]
        self.served_by = (f"{card.mlflow_model}/{card.mlflow_version}" if card.mlflow_model
                          else Path(str(target)).name).encode("ascii", "replace")
        self.limits = Limits(**(limits or {}))
        self.batching = {"mode": batching, "max_batch_size": int(max_batch_size),
                         "batch_wait_timeout_s": float(batch_wait_timeout_s)}
        self.scheduler: Scheduler | EngineProcess | None = None
        if batching == "continuous":
            # throwaway requests first (efftx.serving.continuous.warm_up): the first burst of real ones does not pay
            # the one-time costs of a fresh model; speculative with the requests' default gamma, within the limits,
            # coupled too (its draft lengths' costs measured: coupled requests choose by them from the first)
            gamma = min(max(GenerateRequest.model_fields["gamma"].default, self.limits.min_gamma),
                        self.limits.max_gamma)
            compiled = compile_knobs(compile, compile_rows, self.device)
            # compiled: adaptive-gamma requests too (their verify pass feeds max_gamma + 1 tokens: a graph of its own)
            adaptive = self.limits.max_gamma if compiled["compile"] != "off" else None
            cache = {"cache_mib": cache_mib, "cache_fraction": cache_fraction, "gpu_share": replica_gpu_share()}
            # bytes, or None; engine=process: the decoding process works it out on its device (a GPU's memory is
            # read there, and this process never touches the GPU)
            budget = cache_budget(cache["cache_mib"], cache["cache_fraction"], self.device, cache["gpu_share"]) \
                if engine == "thread" else None
            warm = dict(rows=warm_up_size(warm_up_rows, max_batch_size, compiled), gamma=gamma, max_gamma=adaptive,
                        cache_budget=budget, pipeline=(priority or {}).get("pipeline"), coupled=True, **compiled)
            knobs = dict(max_rows=max_batch_size, admit_wait_s=batch_wait_timeout_s, **(priority or {}), **compiled,
                         cache_budget=budget)
            observe = lambda kind, rows: metrics.batch("continuous", kind, rows)  # noqa: E731
            if engine == "process":
                self.scheduler = EngineProcess(
                    {"target": str(target_dir), "draft": str(draft_dir) if draft_dir else None,
                     "device": str(self.device), "weights": weights, "threads": threads, "warm": warm,
                     "knobs": knobs, "cache": cache}, observe=observe)
                started = dict(self.scheduler.info)
                for card, kinds in zip(self.model_cards, started.pop("linear_weights")):  # the child's, as it holds them
                    card.details["linear_weights"] = kinds
            else:
                self.scheduler, started = start_scheduler(
                    self.target, self.draft, warm=warm, knobs=knobs, observe=observe,
                    hook=lambda kind, jobs: self._step_hook(kind, [j.tag for j in jobs]))
            self.latch = self.scheduler.latch
            self.batching.update(**compiled, **started, engine=engine)
        else:
            self._batched.set_max_batch_size(max_batch_size)
            self._batched.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.images = images  # a handle to the ImageGenerator deployment, or None
        self.image_limits = ImageLimits(**(image_limits or {}))
        self._image_info: dict | None = None
        self._schema: dict | None = None

    # ------------------------------------------------------------------ checks
    def _check(self, prompt: str, max_new: int, temperature: float, gamma: int, speculative: bool,
               names: dict[str, str], adaptive: bool = False) -> list[int]:
        lim = self.limits
        size = len(prompt.encode("utf-8"))
        if size > lim.max_prompt_bytes:
            raise _field_error(names["prompt"], f"the prompt has {size} bytes; the limit is {lim.max_prompt_bytes}")
        tokens = self.codec.encode(prompt)
        if not tokens:
            raise _field_error(names["prompt"], "the prompt encodes to no tokens")
        if max_new > lim.max_new_tokens:
            raise _field_error(names["max_new_tokens"], f"at most {lim.max_new_tokens}, got {max_new}")
        if temperature > lim.max_temperature:
            raise _field_error("temperature", f"at most {lim.max_temperature}, got {temperature}")
        if not lim.min_gamma <= gamma <= lim.max_gamma:  # in every mode, as the schema says
            raise _field_error("gamma", f"must be in [{lim.min_gamma}, {lim.max_gamma}], got {gamma}")
        if speculative and self.draft is None:
            raise _field_error("mode", "speculative decoding needs a draft model; this server has none")
        drafts = lim.max_gamma if adaptive else gamma  # the most tokens a step may draft
        room = self.target.max_seq_len - (drafts + 1 if speculative else 0)
        if len(tokens) + max_new > room:
            raise _field_error(names["max_new_tokens"], f"prompt ({len(tokens)} {self.codec.unit}) + {max_new} new "
                                                        f"tokens exceed the model's context of {room}")
        return tokens

    # ------------------------------------------------------------------ decoding
    # A batch of requests decodes together: one batched forward pass per token (base) or per draft
    # token and verification (speculative), each row at its own position and, for speculative
    # decoding, with its own acceptance. Rows must share the sampling settings (they set one
    # distribution transform), so requests are grouped by them; seeds and lengths are per row.
    def _base_rows(self, reqs: list[GenerateRequest]) -> list[ModeResult]:
        t0 = time.perf_counter()
        out: list[list[int]] = [[] for _ in reqs]
        first = reqs[0]
        prompts = [self.codec.encode(r.prompt) for r in reqs]
        steps = iter_generate(self.target, prompts, max(r.max_new_tokens for r in reqs),
                              temperature=first.temperature, top_k=first.top_k, top_p=first.top_p,
                              seed=[r.seed for r in reqs])
        for tokens in steps:
            for row, r, tok in zip(out, reqs, tokens.tolist()):
                if len(row) < r.max_new_tokens:
                    row.append(tok)
        secs = time.perf_counter() - t0
        return [ModeResult(text=self.codec.continuation(prompt, row), tokens=len(row), latency_ms=secs * 1e3,
                           tokens_per_s=len(row) / secs, batch_size=len(reqs)) for prompt, row in zip(prompts, out)]

    def _speculative_rows(self, reqs: list[GenerateRequest]) -> list[ModeResult]:
        first = reqs[0]
        adaptive = first.adaptive(self.limits.max_gamma)
        row_stats = [SpecStats(gamma=first.draft_cap(self.limits.max_gamma)) for _ in reqs]
        out: list[list[int]] = [[] for _ in reqs]
        t0 = time.perf_counter()
        prompts = [self.codec.encode(r.prompt) for r in reqs]
        steps = iter_speculative_rows(
            self.target, self.draft, prompts, [r.max_new_tokens for r in reqs],
            gamma=first.gamma, temperature=first.temperature, top_k=first.top_k, top_p=first.top_p,
            seed=[r.seed for r in reqs], row_stats=row_stats, **adaptive)
        for step in steps:
            for row, toks in zip(out, step):
                row.extend(toks)
        secs = time.perf_counter() - t0
        return [ModeResult(text=self.codec.continuation(prompt, row), tokens=len(row), latency_ms=secs * 1e3,
                           tokens_per_s=len(row) / secs, batch_size=len(reqs), **st.result_fields())
                for prompt, row, st in zip(prompts, out, row_stats)]

    def _run(self, requests: list[GenerateRequest]) -> list[GenerateResponse | RowFailure]:
        torch.set_num_threads(self.threads)  # a worker thread of asyncio's pool
        results: list[dict[str, ModeResult]] = [{} for _ in requests]
        failed: dict[int, RowFailure] = {}
        for mode, run in (("base", self._base_rows), ("speculative", self._speculative_rows)):
            groups: dict[tuple, list[int]] = {}
            for i, r in enumerate(requests):
                if r.mode in (mode, "both") and i not in failed:
                    key = (r.temperature, r.top_k, r.top_p) + ((r.gamma, r.adaptive_gamma, r.coupled)
                                                               if mode == "speculative" else ())
                    groups.setdefault(key, []).append(i)
            for rows in groups.values():  # a failing group is decoded again request by request: only its culprit fails
                metrics.batch("static", mode, len(rows))
                parts = contained(run, [requests[i] for i in rows], f"{mode} decoding", self.latch)
                for i, res in zip(rows, parts):
                    if isinstance(res, RowFailure):
                        failed[i] = res
                    else:
                        results[i][mode] = res
                        metrics.decoded(mode, res.tokens, res.latency_ms / 1e3, res.mean_accepted, res.draft_calls or 0)
        return [failed.get(i) or GenerateResponse(prompt=r.prompt, results=res)
                for i, (r, res) in enumerate(zip(requests, results))]

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _batched(self, requests: list[GenerateRequest]) -> list[GenerateResponse | RowFailure]:
        return await asyncio.to_thread(self._run, requests)  # off the event loop: /healthz answers meanwhile

    async def _decode(self, req: GenerateRequest) -> GenerateResponse:
        if self.scheduler is not None:
            return await self._decode_continuous(req)
        res = await self._batched(req)
        if isinstance(res, RowFailure):
            raise res.exception()
        return res

    # ------------------------------------------------------------------ continuous batching
    def _job(self, req: GenerateRequest, mode: str, on_step=None) -> Job:
        """The scheduler's row for one mode of a request (its ``tag`` is the request: hooks see it)."""
        speculative = mode == "speculative"
        return Job(self.codec.encode(req.prompt), req.max_new_tokens, Sampling(req.temperature, req.top_k, req.top_p),
                   req.seed, req.gamma if speculative else None, on_step=on_step, tag=req,
                   max_gamma=self.limits.max_gamma if speculative and req.adaptive_gamma else None,
                   coupled=speculative and req.coupled)

    def _step_hook(self, mode: str, requests: list) -> None:
        """Called on the decoding thread before every prefill and step with the requests it covers (tests
        override it to inject faults); a raise fails that pass, which is then run request by request."""

    async def _run_job(self, job: Job) -> Job:
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        job.on_done = lambda j: loop.call_soon_threadsafe(_resolve, done, j)
        self.scheduler.submit(job)
        try:
            job = await done
        except asyncio.CancelledError:  # the client went away: the row leaves the batch at the next step
            self.scheduler.cancel(job)
            raise
        metrics.decoded_job(job)
        return job

    async def _decode_continuous(self, req: GenerateRequest) -> GenerateResponse:
        modes = ("base", "speculative") if req.mode == "both" else (req.mode,)
        jobs = await asyncio.gather(*(self._run_job(self._job(req, m)) for m in modes))
        for job in jobs:
            if job.failure is not None:
                raise job.failure.exception()
        return GenerateResponse(prompt=req.prompt, results={
            job.mode: _mode_result(job, self.codec.continuation(job.prompt, job.out)) for job in jobs})

    async def _job_steps(self, req: GenerateRequest, mode: str):
        """A row of the running batch as an async stream: ``("step", tokens, accepted)`` per decoding step, then
        ``("done", job, None)``; the row's failure is raised. Closing the stream early cancels the row."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def put(item):
            loop.call_soon_threadsafe(queue.put_nowait, item)

        job = self._job(req, mode, on_step=lambda toks, accepted: put(("step", toks, accepted)))
        job.on_done = lambda j: put(("done", j, None))
        self.scheduler.submit(job)
        try:
            while True:
                item = await queue.get()
                if item[0] == "done":
                    if job.error is not None:
                        raise job.error
                    if job.cancelled:
                        raise RuntimeError("the decoding was cancelled")
                    metrics.decoded_job(job)
                    yield item
                    return
                yield item
        finally:
            if not job.done:
                self.scheduler.cancel(job)

    # ------------------------------------------------------------------ schema
    async def openapi_schema(self, app: FastAPI, root_path: str = "") -> dict:
        """The app's OpenAPI document with this replica's limits written into the request schemas."""
        if self._schema is None:
            info = await self.image_info()
            names = [self.name] + ([f"{self.name}-speculative"] if self.draft is not None else [])
            schema = exact_integer_bounds(copy.deepcopy(app.openapi()))
            apply_field_limits(schema, text_field_limits(self.limits, self.target.max_seq_len, names,
                                                         self.draft is not None))
            if info is not None:
                apply_field_limits(schema, image_field_limits(self.image_limits, info["id"]))
            else:  # no image model: its routes only answer 404
                for path in ("/images/generate", "/v1/images/generations"):
                    schema["paths"].pop(path, None)
            declare_body_limit(schema, self.limits.max_body_bytes)
            self._schema = schema
        if root_path:
            return {**self._schema, "servers": [{"url": root_path}]}
        return self._schema

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.openapi_schema(request.app, request.scope.get("root_path", "").rstrip("/")))

    @app.get("/docs", include_in_schema=False)
    async def docs(self, request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "").rstrip("/")
        return get_swagger_ui_html(openapi_url=f"{root}/openapi.json", title=f"{request.app.title} - docs")

    # ------------------------------------------------------------------ endpoints
    def fault(self) -> BaseException | None:
        """The device's failure, once decoding met one (the replica's
        :class:`~efftx.serving.faults.FaultLatch`: static batching's, or continuous batching's scheduler's)."""
        return self.latch.fault

    def check_health(self) -> None:
        """Serve's health check of the replica: after a device fault it raises, so Serve replaces the replica (a CUDA
        error is sticky: nothing decodes on this process any more)."""
        self.latch.check_health()

    @app.get("/healthz")
    async def healthz(self):
        fault = self.fault()
        if fault is not None:
            return JSONResponse(status_code=503, content={"status": "failed", "model": self.name, "detail": str(fault)},
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok", "model": self.name, "speculative": self.draft is not None,
                "images": self.images is not None}

    async def image_info(self) -> dict | None:
        if self.images is not None and self._image_info is None:
            self._image_info = await self.images.info.remote()
        return self._image_info

    @app.get("/v1/models")
    async def models(self) -> dict:
        names = [self.name] + ([f"{self.name}-speculative"] if self.draft is not None else [])
        info = await self.image_info()
        names += [info["id"]] if info else []
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "efftx"} for n in names]}

    async def _images(self, req: ImageRequest):
        if self.images is None:
            raise HTTPException(status_code=404, detail="this server has no image model (start it with dalle=PATH)")
        check_request(req, self.image_limits)
        res = await self.images.generate.remote(req)
        if isinstance(res, RowFailure):
            raise res.exception()
        return res

    @app.post("/images/generate")
    async def images_generate(self, req: ImageRequest):
        """One image as ``image/png``; several (or ``response_format: b64_json``) as JSON with base64 PNGs."""
        res = await self._images(req)
        if req.n == 1 and req.response_format == "png":
            return Response(content=base64.b64decode(res.images[0].b64_png), media_type="image/png",
                            headers={"X-Latency-Ms": f"{res.latency_ms:.1f}", "X-Batch-Size": str(res.batch_size)})
        return res

    @app.post("/v1/images/generations")
    async def openai_images(self, req: OpenAIImageRequest) -> dict:
        info = await self.image_info()
        if info and req.model not in (None, info["id"]):
            raise _field_error("model", f"unknown image model {req.model!r}; GET /v1/models lists them")
        res = await self._images(as_image_request(prompt=req.prompt, n=req.n, seed=req.seed,
                                                  size=openai_size(req.size), response_format="b64_json"))
        return {"created": int(time.time()), "data": [{"b64_json": im.b64_png, "revised_prompt": req.prompt}
                                                      for im in res.images]}

    @app.get("/models/info", response_model=ModelsInfo)
    async def models_info(self) -> ModelsInfo:
        """The loaded models (source, MLflow name and version, recipe, parameter count), the request limits, the
        batching settings and, with continuous batching, the scheduler's measured step and prefill times."""
        info = await self.image_info()
        return ModelsInfo(name=self.name, speculative=self.draft is not None, images=info is not None,
                          models=self.model_cards + ([image_card(info)] if info else []),
                          limits=dataclasses.asdict(self.limits),
                          image_limits=self.image_limits.model_dump() if info else None, batching=self.batching,
                          replica=self.replica, threads=self.threads,
                          **(await asyncio.to_thread(self.scheduler.report) if self.scheduler is not None else {}))

    @app.post("/generate/stream")
    async def generate_stream(self, req: StreamRequest) -> StreamingResponse:
        """Server-sent events: ``step`` per decoding step, then ``done`` with the timings (see efftx.serving.streaming)."""
        tokens = self._check(req.prompt, req.max_new_tokens, req.temperature, req.gamma, req.mode == "speculative",
                             {"prompt": "prompt", "max_new_tokens": "max_new_tokens"}, req.adaptive_gamma)
        if self.scheduler is not None:  # a row of the running batch; its steps are pushed as they are decoded
            t0 = time.perf_counter()
            return StreamingResponse(sse_async(job_events(self._job_steps(req, req.mode), req.mode, t0, self.codec,
                                                          tokens)), media_type="text/event-stream")
        return StreamingResponse(sse(with_threads(stream_events(self.target, self.draft, tokens, req, self.codec,
                                                                self.limits.max_gamma), self.threads)),
                                 media_type="text/event-stream")

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        self._check(req.prompt, req.max_new_tokens, req.temperature, req.gamma, req.mode != "base",
                    {"prompt": "prompt", "max_new_tokens": "max_new_tokens"}, req.adaptive_gamma)
        return await self._decode(req)

    def _completion_steps(self, tokens: list[int], req: GenerateRequest, stats: SpecStats | None = None):
        """The tokens of each decoding step of a streamed completion (``req``: its /generate form; a lazy generator:
        decoding happens as the response is iterated, in Starlette's thread pool); ``stats``: speculative
        decoding's acceptance."""
        sampling = {"temperature": req.temperature, "top_p": req.top_p, "seed": req.seed}
        if req.mode == "speculative":
            return iter_speculative(self.target, self.draft, tokens, req.max_new_tokens, gamma=req.gamma, stats=stats,
                                    **sampling, **req.adaptive(self.limits.max_gamma))
        return ([int(t[0])] for t in iter_generate(self.target, [tokens], req.max_new_tokens, **sampling))

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest):
        speculative = req.model == f"{self.name}-speculative"
        if req.model != self.name and not speculative:
            raise _field_error("model", f"unknown model {req.model!r}; GET /v1/models lists them")
        gamma = max(self.limits.min_gamma, min(5, self.limits.max_gamma)) if req.gamma is None else req.gamma
        tokens = self._check(req.prompt, req.max_tokens, req.temperature, gamma, speculative,
                             {"prompt": "prompt", "max_new_tokens": "max_tokens"}, req.adaptive_gamma)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def body(text: str, finish: str | None, usage: dict | None = None) -> dict:
            out = {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                   "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if usage:
                out["usage"] = usage
            return out

        usage = {"prompt_tokens": len(tokens), "completion_tokens": req.max_tokens,
                 "total_tokens": len(tokens) + req.max_tokens}
        mode = "speculative" if speculative else "base"
        gen = GenerateRequest(prompt=req.prompt, max_new_tokens=req.max_tokens, temperature=req.temperature,
                              top_p=req.top_p, seed=req.seed, mode=mode, gamma=gamma,
                              adaptive_gamma=req.adaptive_gamma, coupled=req.coupled)
        if not req.stream:  # joins the batch of /generate requests
            return body((await self._decode(gen)).results[mode].text, "length", usage)

        if self.scheduler is not None:  # a row of the running batch, its tokens sent as they are decoded
            async def chunks():
                decoder = self.codec.decoder(tokens)  # a character may span tokens and steps
                try:
                    async for kind, toks, _ in self._job_steps(gen, mode):
                        piece = decoder.decode(toks) if kind == "step" else ""
                        if piece:
                            yield f"data: {json.dumps(body(piece, None))}\n\n"
                except Exception as exc:  # noqa: BLE001 - the 200 has gone out: the client learns of it here
                    yield _completion_error(exc)
                    return
                yield f"data: {json.dumps(body(decoder.flush(), 'length', usage))}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(chunks(), media_type="text/event-stream")

        stats = SpecStats(gamma=gen.draft_cap(self.limits.max_gamma))
        steps = with_threads(self._completion_steps(tokens, gen, stats), self.threads)

        def events():  # a sync generator: Starlette runs it in its thread pool, off the event loop
            decoder = self.codec.decoder(tokens)  # a character may span tokens and steps
            t0, n = time.perf_counter(), 0
            try:
                for step in steps:
                    n += len(step)
                    piece = decoder.decode(step)
                    if piece:
                        yield f"data: {json.dumps(body(piece, None))}\n\n"
            except Exception as exc:  # noqa: BLE001 - the 200 has gone out: the client learns of it in the stream
                yield _completion_error(exc)
                return
            metrics.batch("static", mode, 1)  # a stream decodes alone
            metrics.decoded(mode, n, time.perf_counter() - t0, stats.mean_accepted if speculative else None,
                            stats.draft_calls)
            yield f"data: {json.dumps(body(decoder.flush(), 'length', usage))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def build(args: TextAppArgs) -> serve.Application:
    """App builder for ``serve run efftx.serving.text:build target=... [draft=...] [dalle=...]`` and YAML configs
    (``import_path: efftx.serving.text:build``, ``args:`` a mapping).

    The arguments are :class:`~efftx.serving.app_args.TextAppArgs`: Ray Serve validates them against it (the
    annotation above) before calling this, converting the command line's strings to the fields' types; an unknown
    argument or a bad value is a ``pydantic.ValidationError`` (a ``ValueError``) naming it. Called from Python it
    takes a plain mapping too (validated the same way). Ray Serve calls a builder with exactly one parameter:
    :func:`build_with` also takes the deployments to bind."""
    return build_with(args)


def build_with(args: TextAppArgs | dict[str, Any], *, text_deployment=TextGenerator,
               image_deployment=ImageGenerator) -> serve.Application:
    """The app for ``args`` (a :class:`~efftx.serving.app_args.TextAppArgs`, or a mapping validated into one).

    Checked here, before any replica starts: ``device=cuda`` with no CUDA device in sight is a ``ValueError``
    naming ``device`` (see :func:`efftx.serving.devices.resolve_build_devices`).

    ``text_deployment`` / ``image_deployment``: the deployments to bind (tests pass subclasses of these)."""
    args = TextAppArgs.model_validate(args)  # a TextAppArgs is returned as it is
    device, text_gpus, image_gpus = resolve_build_devices(args.device, args.num_gpus, args.image_num_gpus)
    if args.decode_weights == "bfloat16" and device == "cuda":
        raise ValueError("decode_weights=bfloat16 is a CPU option (weight-only bfloat16 for CPU decoding); "
                         "the text replicas would run on cuda")
    max_batch_size, batch_wait_timeout_s = batch_defaults(args.batching, args.max_batch_size,
                                                          args.batch_wait_timeout_s)
    images = None
    if args.dalle:
        images = with_resources(image_deployment, num_gpus=image_gpus).bind(
            args.dalle, args.image_max_batch_size, args.image_batch_wait_timeout_s, device=device)
    # the limits go to the replicas as plain mappings (the deployments' constructors build their own)
    limits = None if args.limits is None else dataclasses.asdict(args.limits)
    image_limits = None if args.image_limits is None else args.image_limits.model_dump()
    return with_resources(text_deployment, num_gpus=text_gpus, num_cpus=args.num_cpus).bind(
        args.target, args.draft, args.name, limits, max_batch_size, batch_wait_timeout_s, images, image_limits,
        device=device, batching=args.batching, **({"priority": args.priority()} if args.priority() else {}),
        **({"warm_up_rows": args.warm_up_rows} if args.warm_up_rows is not None else {}),
        **({"threads": args.threads} if args.threads is not None else {}),
        **({"weights": args.decode_weights} if args.decode_weights is not None else {}),
        **{k: getattr(args, k) for k in ("compile", "compile_rows", "cache_mib", "cache_fraction", "engine")
           if getattr(args, k) is not None})

"""Text generation on Ray Serve: base vs speculative decoding over HTTP.

    serve run efftx.serving.text:build target=PATH [draft=PATH] [dalle=PATH]
        (PATH: an export folder or models:/NAME/VERSION)

Endpoints (FastAPI; OpenAPI docs at /docs and /openapi.json):

* ``POST /generate``: ``{prompt, max_new_tokens, temperature, top_k, top_p, seed, mode, gamma}`` with
  ``mode`` = ``base`` | ``speculative`` | ``both``; per mode the text, latency, tokens/s and, for
  speculative decoding, the acceptance statistics. Requests are grouped with ``@serve.batch``.
* ``POST /v1/completions``: the OpenAI completions API (``stream: true`` answers server-sent events); the
  model name chooses base (``<name>``) or speculative (``<name>-speculative``) decoding.
* ``POST /generate/stream``: one mode's decoding as server-sent events, step by step, the draft-accepted
  tokens told apart from the target's (:mod:`efftx.serving.streaming`).
* ``GET /v1/models``, ``GET /models/info`` (sources, MLflow versions, recipes, parameter counts, limits),
  ``GET /healthz``.
* ``GET /playground`` (``/`` redirects there): a web page comparing base and speculative decoding side by
  side, and drawing images when there is an image model (:mod:`efftx.serving.playground`).
* With a DALL-E (``dalle=PATH``): ``POST /images/generate`` and ``POST /v1/images/generations`` (the OpenAI
  images API), served by an :class:`~efftx.serving.images.ImageGenerator` deployment behind this one.

Bad input gets a 4xx naming the field (422 for values, 400 for bodies that are not UTF-8 JSON); no
request can take the replica down.
"""


import base64
import codecs
import dataclasses
import json
import time
import uuid
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from efftx.generation.decode import decode_bytes, encode_text, iter_generate
from efftx.generation.speculative import SpecStats, iter_speculative, iter_speculative_rows
from efftx.serving.images import (ImageGenerator, ImageLimits, ImageRequest, OpenAIImageRequest, check_request,
                                  field_error, openai_size)
from efftx.serving.playground import image_card, model_card
from efftx.serving.playground import router as playground_router
from efftx.serving.schemas import (CompletionRequest, GenerateRequest, GenerateResponse, Limits, ModelsInfo, ModeResult,
                                   StreamRequest)
from efftx.serving.streaming import sse, stream_events

app = FastAPI(title="efftx text generation", description=__doc__.split("\n\n")[0])
app.include_router(playground_router)  # the page and its static files


@app.exception_handler(UnicodeDecodeError)
async def _not_utf8(request: Request, exc: UnicodeDecodeError):
    return JSONResponse(status_code=400, content={"detail": [{"loc": ["body"], "msg": "the body is not valid UTF-8"}]})


_field_error = field_error


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32)
@serve.ingress(app)
class TextGenerator:
    def __init__(self, target: str, draft: str | None = None, name: str | None = None,
                 limits: dict[str, Any] | None = None, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.02,
                 images=None, image_limits: dict[str, Any] | None = None):
        from efftx.train.checkpoint import load_export, resolve_export

        torch.set_num_threads(1)
        self.target, self.target_cfg, _ = load_export(resolve_export(target))
        self.draft = load_export(resolve_export(draft))[0] if draft else None
        if self.draft is not None and self.draft.vocab_size != self.target.vocab_size:
            raise ValueError("target and draft vocabularies differ")
        self.name = name or self.target_cfg.recipe
        self.sources = {"target": target, "draft": draft}
        self.model_cards = [model_card("target", self.target, target, self.name)] + (
            [model_card("draft", self.draft, draft, f"{self.name}-speculative")] if self.draft is not None else [])
        self.limits = Limits(**(limits or {}))
        self._batched.set_max_batch_size(max_batch_size)
        self._batched.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.images = images  # a handle to the ImageGenerator deployment, or None
        self.image_limits = ImageLimits(**(image_limits or {}))
        self._image_info: dict | None = None

    # ------------------------------------------------------------------ checks
    def _check(self, prompt: str, max_new: int, temperature: float, gamma: int, speculative: bool,
               names: dict[str, str]) -> list[int]:
        lim = self.limits
        tokens = encode_text(prompt)
        if len(tokens) > lim.max_prompt_bytes:
            raise _field_error(names["prompt"], f"the prompt has {len(tokens)} bytes; the limit is {lim.max_prompt_bytes}")
        if max_new > lim.max_new_tokens:
            raise _field_error(names["max_new_tokens"], f"at most {lim.max_new_tokens}, got {max_new}")
        if temperature > lim.max_temperature:
            raise _field_error("temperature", f"at most {lim.max_temperature}, got {temperature}")
        if speculative:
            if self.draft is None:
                raise _field_error("mode", "speculative decoding needs a draft model; this server has none")
            if not lim.min_gamma <= gamma <= lim.max_gamma:
                raise _field_error("gamma", f"must be in [{lim.min_gamma}, {lim.max_gamma}], got {gamma}")
        room = self.target.max_seq_len - (gamma + 1 if speculative else 0)
        if len(tokens) + max_new > room:
            raise _field_error(names["max_new_tokens"], f"prompt ({len(tokens)} bytes) + {max_new} new tokens "
                                                        f"exceed the model's context of {room}")
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
        steps = iter_generate(self.target, [encode_text(r.prompt) for r in reqs], max(r.max_new_tokens for r in reqs),
                              temperature=first.temperature, top_k=first.top_k, top_p=first.top_p,
                              seed=[r.seed for r in reqs])
        for tokens in steps:
            for row, r, tok in zip(out, reqs, tokens.tolist()):
                if len(row) < r.max_new_tokens:
                    row.append(tok)
        secs = time.perf_counter() - t0
        return [ModeResult(text=decode_bytes(row), tokens=len(row), latency_ms=secs * 1e3,
                           tokens_per_s=len(row) / secs, batch_size=len(reqs)) for row in out]

    def _speculative_rows(self, reqs: list[GenerateRequest]) -> list[ModeResult]:
        first = reqs[0]
        row_stats = [SpecStats(gamma=first.gamma) for _ in reqs]
        out: list[list[int]] = [[] for _ in reqs]
        t0 = time.perf_counter()
        steps = iter_speculative_rows(
            self.target, self.draft, [encode_text(r.prompt) for r in reqs], [r.max_new_tokens for r in reqs],
            gamma=first.gamma, temperature=first.temperature, top_k=first.top_k, top_p=first.top_p,
            seed=[r.seed for r in reqs], row_stats=row_stats)
        for step in steps:
            for row, toks in zip(out, step):
                row.extend(toks)
        secs = time.perf_counter() - t0
        return [ModeResult(text=decode_bytes(row), tokens=len(row), latency_ms=secs * 1e3,
                           tokens_per_s=len(row) / secs, batch_size=len(reqs), mean_accepted=st.mean_accepted,
                           acceptance_histogram=st.histogram, draft_calls=st.draft_calls,
                           target_calls=st.target_calls)
                for row, st in zip(out, row_stats)]

    def _run(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        results: list[dict[str, ModeResult]] = [{} for _ in requests]
        for mode, run in (("base", self._base_rows), ("speculative", self._speculative_rows)):
            groups: dict[tuple, list[int]] = {}
            for i, r in enumerate(requests):
                if r.mode in (mode, "both"):
                    key = (r.temperature, r.top_k, r.top_p) + ((r.gamma,) if mode == "speculative" else ())
                    groups.setdefault(key, []).append(i)
            for rows in groups.values():
                for i, res in zip(rows, run([requests[i] for i in rows])):
                    results[i][mode] = res
        return [GenerateResponse(prompt=r.prompt, results=res) for r, res in zip(requests, results)]

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.02)
    async def _batched(self, requests: list[GenerateRequest]) -> list[GenerateResponse]:
        return self._run(requests)

    # ------------------------------------------------------------------ endpoints
    @app.get("/healthz")
    async def healthz(self) -> dict:
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
        return await self.images.generate.remote(req)

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
        if req.response_format != "b64_json":
            raise _field_error("response_format", "only b64_json is served (this server keeps no image URLs)")
        info = await self.image_info()
        if info and req.model not in (None, info["id"]):
            raise _field_error("model", f"unknown image model {req.model!r}; GET /v1/models lists them")
        res = await self._images(ImageRequest(prompt=req.prompt, n=req.n, seed=req.seed, size=openai_size(req.size),
                                              response_format="b64_json"))
        return {"created": int(time.time()), "data": [{"b64_json": im.b64_png, "revised_prompt": req.prompt}
                                                      for im in res.images]}

    @app.get("/models/info", response_model=ModelsInfo)
    async def models_info(self) -> ModelsInfo:
        """The loaded models (source, MLflow name and version, recipe, parameter count) and the request limits."""
        info = await self.image_info()
        return ModelsInfo(name=self.name, speculative=self.draft is not None, images=info is not None,
                          models=self.model_cards + ([image_card(info)] if info else []),
                          limits=dataclasses.asdict(self.limits),
                          image_limits=self.image_limits.model_dump() if info else None)

    @app.post("/generate/stream")
    async def generate_stream(self, req: StreamRequest) -> StreamingResponse:
        """Server-sent events: ``step`` per decoding step, then ``done`` with the timings (see efftx.serving.streaming)."""
        tokens = self._check(req.prompt, req.max_new_tokens, req.temperature, req.gamma, req.mode == "speculative",
                             {"prompt": "prompt", "max_new_tokens": "max_new_tokens"})
        return StreamingResponse(sse(stream_events(self.target, self.draft, tokens, req)),
                                 media_type="text/event-stream")

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        self._check(req.prompt, req.max_new_tokens, req.temperature, req.gamma, req.mode != "base",
                    {"prompt": "prompt", "max_new_tokens": "max_new_tokens"})
        return await self._batched(req)

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest):
        speculative = req.model == f"{self.name}-speculative"
        if req.model != self.name and not speculative:
            raise _field_error("model", f"unknown model {req.model!r}; GET /v1/models lists them")
        gamma = min(5, self.limits.max_gamma)
        tokens = self._check(req.prompt, req.max_tokens, req.temperature, gamma, speculative,
                             {"prompt": "prompt", "max_new_tokens": "max_tokens"})
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def body(text: str, finish: str | None, usage: dict | None = None) -> dict:
            out = {"id": cid, "object": "text_completion", "created": created, "model": req.model,
                   "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}
            if usage:
                out["usage"] = usage
            return out

        usage = {"prompt_tokens": len(tokens), "completion_tokens": req.max_tokens,
                 "total_tokens": len(tokens) + req.max_tokens}
        if not req.stream:  # joins the batch of /generate requests
            mode = "speculative" if speculative else "base"
            gen = GenerateRequest(prompt=req.prompt, max_new_tokens=req.max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, seed=req.seed, mode=mode, gamma=gamma)
            return body((await self._batched(gen)).results[mode].text, "length", usage)

        sampling = {"temperature": req.temperature, "top_p": req.top_p, "seed": req.seed}
        if speculative:
            steps = iter_speculative(self.target, self.draft, tokens, req.max_tokens, gamma=gamma, **sampling)
        else:
            steps = ([int(t[0])] for t in iter_generate(self.target, [tokens], req.max_tokens, **sampling))

        def events():
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            for step in steps:
                piece = decoder.decode(bytes(step))
                if piece:
                    yield f"data: {json.dumps(body(piece, None))}\n\n"
            yield f"data: {json.dumps(body(decoder.decode(b'', final=True), 'length', usage))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


def build(args: dict[str, str]) -> serve.Application:
    """App builder for ``serve run efftx.serving.text:build target=... [draft=...] [dalle=...]`` and YAML configs."""
    known = {"target", "draft", "name", "limits", "max_batch_size", "batch_wait_timeout_s", "dalle", "image_limits",
             "image_max_batch_size", "image_batch_wait_timeout_s"}
    unknown = set(args) - known
    if unknown or "target" not in args:
        raise ValueError(f"arguments: target=PATH (required), draft=PATH, name=..., max_batch_size=N, "
                         f"batch_wait_timeout_s=S, limits=JSON, dalle=PATH, image_limits=JSON, "
                         f"image_max_batch_size=N, image_batch_wait_timeout_s=S; got {sorted(args)}")

    def as_dict(value):
        return json.loads(value) if isinstance(value, str) else value

    images = None
    if args.get("dalle"):
        images = ImageGenerator.bind(args["dalle"], int(args.get("image_max_batch_size", 8)),
                                     float(args.get("image_batch_wait_timeout_s", 0.05)))
    return TextGenerator.bind(
        args["target"], args.get("draft") or None, args.get("name"), as_dict(args.get("limits")),
        int(args.get("max_batch_size", 8)), float(args.get("batch_wait_timeout_s", 0.02)),
        images, as_dict(args.get("image_limits")))

"""Image generation on Ray Serve: an exported DALL-E (its frozen dVAE inside) behind the text app's HTTP routes.

:class:`ImageGenerator` is a deployment without routes of its own: the text app's ingress
(:mod:`efftx.serving.text`) holds a handle to it and serves

* ``POST /images/generate``: ``{prompt, n, filter_thres, top_p, temperature, cond_scale, seed, size,
  response_format}`` -> ``image/png`` for one image, else (``n > 1`` or ``response_format: "b64_json"``)
  JSON with base64 PNGs and timings;
* ``POST /v1/images/generations``: the OpenAI images API (``response_format: "b64_json"``), so the
  official client's ``images.generate`` works against the same base URL as the completions.

The replica's device: ``device`` (``auto`` | ``cpu`` | ``cuda``) and ``image_num_gpus`` of the app builder
(:mod:`efftx.serving.devices`).

Requests are grouped with ``@serve.batch``: requests sharing the sampling settings decode together,
one batched forward pass per image token, every image with its own seed (``seed + i`` for image i of
a request), so an image does not depend on the batch it landed in. A group whose batched generation
raises is generated again request by request, so only the request at fault fails
(:func:`efftx.serving.isolation.contained`); generation runs in a worker thread, off the replica's event loop.
"""

import asyncio
import base64
import re
import time
from typing import Annotated, Any, Literal

import torch
from fastapi import HTTPException
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from ray import serve

from efftx.generation.png import png_bytes, to_pil
from efftx.serving import metrics
from efftx.serving.devices import replica_device
from efftx.serving.faults import FaultLatch
from efftx.serving.isolation import RowFailure, contained
from efftx.serving.schemas import SEED_MAX, Seed, Temperature, TopP, encodable


class ImageLimits(BaseModel):
    """Per-request limits (``limits`` of the image deployment); over-limit values are a 4xx naming the field."""

    model_config = ConfigDict(extra="forbid")

    max_prompt_chars: int = 256
    max_images: int = 8  # n
    max_cond_scale: float = 10.0
    max_size: int = 1024  # pixels per side of a returned image (resized from the model's own size)


def _has_text(prompt: str) -> str:
    encodable(prompt)
    if not prompt.strip():
        raise ValueError("the prompt holds no text")
    return prompt


ImagePrompt = Annotated[str, Field(min_length=1, description="some text besides whitespace; at most "
                                                             "image_limits.max_prompt_chars characters",
                                   json_schema_extra={"pattern": r"\S"}),
                        AfterValidator(_has_text)]
ImageSeed = Annotated[Seed, Field(description="image i is drawn with seed + i: seed + n - 1 <= 2**63 - 1")]
SIZE_PATTERN = r"^(auto|([89]|[1-9][0-9]+)x\2)$"  # "auto" or a square "NxN" with N >= 8 (no leading zeros)


def _openai_size(size: str) -> str:
    if not re.fullmatch(SIZE_PATTERN, size):
        raise ValueError(f"size must be 'auto' or a square 'NxN' with N >= 8 (for example '256x256'), got {size!r}")
    return size


def _b64_only(fmt: str) -> str:
    if fmt != "b64_json":
        raise ValueError("only b64_json is served (this server keeps no image URLs)")
    return fmt


class ImageRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    prompt: ImagePrompt
    n: int = Field(default=1, ge=1, description="images; at most image_limits.max_images")
    filter_thres: float = Field(default=0.9, ge=0.0, le=1.0)
    top_p: TopP = 1.0
    temperature: Temperature = 1.0
    cond_scale: float = Field(default=1.0, ge=0.0, description="at most image_limits.max_cond_scale")
    seed: ImageSeed | None = None
    size: int | None = Field(default=None, ge=8, description="side of the returned images in pixels, at most "
                                                             "image_limits.max_size; null = the model's own")
    response_format: Literal["png", "b64_json"] = "png"  # png: one image as image/png; n > 1 is always JSON


class OpenAIImageRequest(BaseModel):
    """The subset of the OpenAI images API this server implements (other fields are ignored)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    prompt: ImagePrompt
    model: str | None = None
    n: int = Field(default=1, ge=1, description="images; at most image_limits.max_images")
    size: Annotated[str, Field(json_schema_extra={"pattern": SIZE_PATTERN},
                               description="'auto' or a square 'NxN', 8 <= N <= image_limits.max_size"),
                    AfterValidator(_openai_size)] | None = None
    response_format: Annotated[str, Field(json_schema_extra={"enum": ["b64_json"]}),
                               AfterValidator(_b64_only)] = "b64_json"
    seed: ImageSeed | None = None


class GeneratedImage(BaseModel):
    b64_png: str
    seed: int | None


class ImageResponse(BaseModel):
    prompt: str
    images: list[GeneratedImage]
    size: int
    latency_ms: float
    images_per_s: float
    batch_size: int  # requests decoded together
    prompt_truncated: bool


def field_error(field: str, msg: str) -> HTTPException:
    return HTTPException(status_code=422, detail=[{"loc": ["body", field], "msg": msg, "type": "value_error"}])


def check_request(req: ImageRequest, lim: ImageLimits) -> None:
    """Raise a 4xx naming the field for a request over the limits (run by the ingress, before batching)."""
    if len(req.prompt) > lim.max_prompt_chars:
        raise field_error("prompt", f"the prompt has {len(req.prompt)} characters; the limit is {lim.max_prompt_chars}")
    if req.n > lim.max_images:
        raise field_error("n", f"at most {lim.max_images} images per request, got {req.n}")
    if req.cond_scale > lim.max_cond_scale:
        raise field_error("cond_scale", f"at most {lim.max_cond_scale}, got {req.cond_scale}")
    if req.size is not None and req.size > lim.max_size:
        raise field_error("size", f"at most {lim.max_size} pixels per side, got {req.size}")
    if req.seed is not None and req.seed + req.n - 1 > SEED_MAX:
        raise field_error("seed", f"image i is drawn with seed + i: seed + n - 1 must be at most 2**63 - 1 "
                                  f"({SEED_MAX}), got seed {req.seed} with n {req.n}")


def image_field_limits(lim: ImageLimits, model_id: str | None) -> dict[str, dict]:
    """``{model: {field: JSON-schema keywords}}``: the configured image limits, as :func:`check_request` enforces
    them (``model_id``: the one image model ``/v1/images/generations`` serves)."""
    common = {"prompt": {"maxLength": lim.max_prompt_chars}, "n": {"maximum": lim.max_images}}
    out = {"ImageRequest": {**common, "cond_scale": {"maximum": lim.max_cond_scale}, "size": {"maximum": lim.max_size}},
           "OpenAIImageRequest": dict(common)}
    if model_id is not None:
        out["OpenAIImageRequest"]["model"] = {"enum": [model_id]}
    return out


def as_image_request(**fields: Any) -> ImageRequest:
    """An :class:`ImageRequest` from another request's fields; a field it refuses is a 422 naming the field."""
    try:
        return ImageRequest(**fields)
    except ValidationError as exc:
        raise HTTPException(status_code=422, detail=[{"loc": ["body", *err["loc"]], "msg": err["msg"],
                                                      "type": err["type"]} for err in exc.errors()]) from None


# A replica being replaced (a redeploy onto a new model version, a scale-down) stops taking requests and waits for
# its running ones to finish for up to graceful_shutdown_timeout_s: long CPU generations must not be cut off.
@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=32, graceful_shutdown_timeout_s=60,
                  graceful_shutdown_wait_loop_s=0.5)
class ImageGenerator:
    def __init__(self, model: str, max_batch_size: int = 8, batch_wait_timeout_s: float = 0.05, device: str = "auto"):
        from efftx.generation.text_to_image import DalleGenerator

        torch.set_num_threads(1)
        self.device = replica_device(device)  # efftx.serving.devices: CUDA when this replica was given a GPU
        self.gen = DalleGenerator.load(model, self.device)
        self.source = model
        self.name = self.gen.cfg.recipe
        self.generate.set_max_batch_size(max_batch_size)
        self.generate.set_batch_wait_timeout_s(batch_wait_timeout_s)
        self.latch = FaultLatch()  # a device fault: every request fails with it, and Serve replaces this replica

    def check_health(self) -> None:
        """Serve's health check: raises after a device fault (a sticky CUDA error), so Serve replaces the replica."""
        self.latch.check_health()

    def info(self) -> dict:
        return {"id": self.name, "kind": "image", "source": self.source, "recipe": self.gen.cfg.recipe,
                "parameters": self.gen.model.num_params(), "image_size": self.gen.image_size,
                "text_seq_len": self.gen.text_seq_len, "device": str(self.device)}

    def _draw(self, reqs: list[ImageRequest]) -> list[ImageResponse]:
        """One batched generation for requests sharing their sampling settings."""
        from efftx.generation.images import generate_images

        first = reqs[0]
        metrics.batch("static", "image", len(reqs))
        t0 = time.perf_counter()
        text, cut = self.gen.encode([r.prompt for r in reqs])
        counts = torch.tensor([r.n for r in reqs], device=self.device)
        captions = text.to(self.device).repeat_interleave(counts, dim=0)  # one row per image
        seeds = [None if r.seed is None else r.seed + i for r in reqs for i in range(r.n)]
        images, _ = generate_images(self.gen.model, captions, num_images=1, filter_thres=first.filter_thres,
                                    top_p=first.top_p, temperature=first.temperature,
                                    cond_scale=first.cond_scale, seed=seeds)
        images = images.float().cpu()  # PNG encoding happens on the host
        secs = time.perf_counter() - t0
        out, row = [], 0
        for r, was_cut in zip(reqs, cut):
            size = r.size or self.gen.image_size
            pngs = [_encode(images[row + i], size) for i in range(r.n)]
            row += r.n
            out.append(ImageResponse(
                prompt=r.prompt, size=size, latency_ms=secs * 1e3, images_per_s=r.n / secs, batch_size=len(reqs),
                prompt_truncated=was_cut,
                images=[GeneratedImage(b64_png=p, seed=None if r.seed is None else r.seed + i) for i, p in enumerate(pngs)]))
        return out

    def _draw_all(self, requests: list[ImageRequest]) -> list[ImageResponse | RowFailure]:
        results: list[ImageResponse | RowFailure | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.filter_thres, r.top_p, r.temperature, r.cond_scale), []).append(i)
        for rows in groups.values():  # a failing group is drawn again request by request: only its culprit fails
            for i, res in zip(rows, contained(self._draw, [requests[i] for i in rows], "image generation",
                                                 self.latch)):
                results[i] = res
                if isinstance(res, ImageResponse):
                    metrics.images(len(res.images))
        return results

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.05)
    async def generate(self, requests: list[ImageRequest]) -> list[ImageResponse | RowFailure]:
        """One result per request: its images, or a :class:`RowFailure` (the ingress answers it as an HTTP error).
        Generation runs in a worker thread, so the replica's event loop (``info``) answers meanwhile."""
        return await asyncio.to_thread(self._draw_all, requests)


def _encode(image: torch.Tensor, size: int) -> str:
    """(C, S, S) in [0, 1] -> base64 PNG, resized to size x size (nearest when enlarging keeps the pixels crisp)."""
    from PIL import Image

    pil = to_pil(image)
    if pil.size != (size, size):
        pil = pil.resize((size, size), Image.NEAREST if size > pil.size[0] else Image.LANCZOS)
    return base64.b64encode(png_bytes(pil)).decode()


def openai_size(size: str | None) -> int | None:
    """OpenAI's "NxN" size (validated by :class:`OpenAIImageRequest`) -> one side in pixels; None for "auto"."""
    if size is None or size == "auto":
        return None
    return int(size.partition("x")[0])


"""Serving limits at library level (fast, no Ray): the sampling floor, the request models, containment of a
failing batch, the body-size middleware and the limits written into the OpenAPI schema."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from pydantic import ValidationError

from efftx.generation.sampling import MIN_TEMPERATURE, filter_logits, probabilities, sample
from efftx.serving.images import ImageRequest, OpenAIImageRequest
from efftx.serving.isolation import BodyLimit, RowFailure, contained
from efftx.serving.schemas import (SEED_MAX, CompletionRequest, GenerateRequest, Limits, apply_field_limits,
                                   exact_integer_bounds, text_field_limits)


# ---------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324, MIN_TEMPERATURE / 2])
def test_temperatures_below_the_floor_are_greedy_not_nan(temperature):
    logits = torch.randn(3, 50) * 30
    p = probabilities(logits, temperature)
    assert torch.isfinite(p).all() and (p.argmax(-1) == logits.argmax(-1)).all() and (p.sum(-1) == 1).all()
    assert (sample(logits, temperature, generator=torch.Generator().manual_seed(0)) == logits.argmax(-1)).all()
    assert (logits.float() / temperature).isinf().any() or temperature == MIN_TEMPERATURE / 2  # why the floor


def test_a_vanishing_top_p_keeps_the_top_token():
    logits = torch.randn(4, 50)
    kept = torch.isfinite(filter_logits(logits, top_p=1e-300))  # 1e-300 is 0 in float32
    assert (kept.sum(-1) == 1).all() and kept[torch.arange(4), logits.argmax(-1)].all()
    assert (sample(logits, 1.0, top_p=1e-300, generator=torch.Generator().manual_seed(0)) == logits.argmax(-1)).all()


# ---------------------------------------------------------------------------------------------- request models
def test_request_models_are_strict_and_bound_seeds():
    ok = GenerateRequest(prompt="hi", seed=SEED_MAX, temperature=1e-40)
    assert ok.seed == SEED_MAX and ok.temperature == 0.0  # below the floor: greedy, as 0
    for bad in ({"seed": False}, {"seed": 1.0}, {"seed": SEED_MAX + 1}, {"seed": -1}, {"max_new_tokens": True},
                {"temperature": "0.5"}, {"temperature": float("nan")}, {"prompt": "\ud800"}):
        with pytest.raises(ValidationError) as err:
            GenerateRequest.model_validate({"prompt": "hi", **bad})
        assert err.value.errors()[0]["loc"][0] == next(iter(bad))
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "stream": "yes"})
    assert ImageRequest(prompt="a", temperature=1e-300).temperature == 0.0


@pytest.mark.parametrize("size, ok", [("auto", True), ("8x8", True), ("256x256", True), ("4x4", False),
                                      ("64x32", False), ("064x064", False), ("64X64", False), ("x", False)])
def test_openai_sizes(size, ok):
    if ok:
        assert OpenAIImageRequest(prompt="a", size=size).size == size
    else:
        with pytest.raises(ValidationError) as err:
            OpenAIImageRequest(prompt="a", size=size)
        assert err.value.errors()[0]["loc"] == ("size",)


# ---------------------------------------------------------------------------------------------- containment
def test_a_failing_batch_is_run_request_by_request():
    calls = []

    def run(reqs):
        calls.append(list(reqs))
        if "bad-input" in reqs:
            raise ValueError("refused")
        if "fault" in reqs:
            raise RuntimeError("boom")
        return [r.upper() for r in reqs]

    assert contained(run, ["a", "b"], "test") == ["A", "B"] and calls == [["a", "b"]]  # one call when it works
    calls.clear()
    out = contained(run, ["a", "bad-input", "b", "fault"], "test")
    assert out[0] == "A" and out[2] == "B"
    assert isinstance(out[1], RowFailure) and out[1].status == 422 and "refused" in json.dumps(out[1].detail)
    assert isinstance(out[3], RowFailure) and out[3].status == 500
    assert calls == [["a", "bad-input", "b", "fault"], ["a"], ["bad-input"], ["b"], ["fault"]]


@pytest.mark.parametrize("alone", [False, True], ids=["in-a-batch", "alone"])
def test_a_device_fault_latches_every_later_request_fails_with_a_503_and_health_checks_fail(alone):
    """Static batching and the image replica (``contained`` with a :class:`FaultLatch`): a sticky CUDA error in a
    batch (or in a request run alone after another's fault) is not retried request by request; it and every later
    batch fail with a 503 naming the device, nothing runs again, and the latch's health check (the replicas'
    ``check_health``, Serve's) raises. The image replica's check_health is the latch's. Power: without a latch,
    the batch ran again request by request and each failed with a 500."""
    from efftx.serving.images import ImageGenerator
    from efftx.serving.faults import FaultLatch

    calls = []

    def run(reqs):
        calls.append(list(reqs))
        if "fault" in reqs and ("bad-input" not in reqs or len(reqs) == 1):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
        if "bad-input" in reqs:
            raise ValueError("refused")
        return [r.upper() for r in reqs]

    latch = FaultLatch()
    latch.check_health()  # healthy
    first = ["bad-input", "fault"] if alone else ["a", "fault"]
    out = contained(run, first, "test", latch)
    assert all(isinstance(r, RowFailure) for r in out[1 if alone else 0:]) and out[-1].status == 503
    assert "the device failed (AcceleratorError: CUDA error: an illegal memory access" in out[-1].detail
    assert calls == ([first, ["bad-input"], ["fault"]] if alone else [first])  # nothing rerun after the fault
    later = contained(run, ["a", "b"], "test", latch)
    assert [r.status for r in later] == [503, 503] and len(calls) == (3 if alone else 1)  # nothing runs again
    with pytest.raises(RuntimeError, match="unhealthy: the device failed"):
        latch.check_health()
    images = ImageGenerator.func_or_class.__new__(ImageGenerator.func_or_class)  # its method, without Serve
    images.latch = latch
    with pytest.raises(RuntimeError, match="unhealthy"):
        images.check_health()
    assert [r.status for r in contained(run, ["a", "fault"], "test") if isinstance(r, RowFailure)] == [500]


# ---------------------------------------------------------------------------------------------- body limit
def call_asgi(app, body_chunks: list[bytes], content_length: bool) -> tuple[int, bytes, int]:
    """POST body_chunks to an ASGI app; (status, response body, chunks the app read)."""
    headers = [(b"content-type", b"application/json")]
    if content_length:
        headers.append((b"content-length", str(sum(map(len, body_chunks))).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/echo", "raw_path": b"/echo", "query_string": b"", "root_path": "", "headers": headers,
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1)}
    pending = list(body_chunks)
    read = 0
    sent: list[dict] = []

    async def receive():
        nonlocal read
        if not pending:
            return {"type": "http.disconnect"}
        read += 1
        chunk = pending.pop(0)
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), read


def test_bodies_over_the_limit_are_413_before_they_are_parsed():
    from fastapi import FastAPI

    app = FastAPI()
    app.add_middleware(BodyLimit, limit=lambda: 100)

    @app.post("/echo")
    async def echo(req: GenerateRequest) -> dict:
        return {"prompt": req.prompt}

    small = json.dumps({"prompt": "hi"}).encode()
    assert call_asgi(app, [small], content_length=True)[0] == 200
    big = json.dumps({"prompt": "x" * 200}).encode()
    status, body, read = call_asgi(app, [big], content_length=True)
    assert status == 413 and read == 0 and b"100 bytes" in body  # Content-Length said so: nothing was read
    status, body, read = call_asgi(app, [big[:60], big[60:120], big[120:]], content_length=False)
    assert status == 413 and read == 2  # streamed: refused at the chunk that passed the limit


# ---------------------------------------------------------------------------------------------- schema
def test_configured_limits_are_written_into_the_schema():
    from efftx.serving.text import app

    schema = exact_integer_bounds(copy.deepcopy(app.openapi()))
    lim = Limits(max_new_tokens=300, max_gamma=6, max_prompt_bytes=100)
    apply_field_limits(schema, text_field_limits(lim, context=128, models=["m"], speculative=False))
    props = schema["components"]["schemas"]["GenerateRequest"]["properties"]
    assert props["max_new_tokens"]["maximum"] == 127  # the context bounds it below the configured 300
    assert (props["gamma"]["minimum"], props["gamma"]["maximum"], props["prompt"]["maxLength"]) == (1, 6, 100)
    assert props["mode"]["enum"] == ["base"]  # no draft
    assert props["seed"]["anyOf"][0]["maximum"] == SEED_MAX and isinstance(props["seed"]["anyOf"][0]["maximum"], int)
    assert schema["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == ["m"]

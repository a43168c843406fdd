"""One request must never fail another: containment for the ``@serve.batch`` paths, and the request-body limit.

(Continuous batching, :mod:`efftx.serving.continuous`, contains failures the same way one decoding step at a
time: a step that raises is undone, caches and generators restored, and run row by row; its culprit gets a
:class:`RowFailure` from :func:`row_failure`.)

**Containment.** Requests that share sampling settings decode as one batch (one batched forward pass per
token). If that batch raises, :func:`contained` decodes each of its requests alone, so only the request that
caused the failure fails; its batch-mates get exactly the output they get alone (every row has its own seed,
so a row's tokens do not depend on its batch). The culprit gets a :class:`RowFailure`: a 422 when decoding
refused its input (a ``ValueError``: input the schema let through but the decoder cannot take), a 503 when the
device ran out of memory for it (the server's capacity: retry later), else a 500 (a genuine server fault, logged
with its traceback in the replica's log).

**Body limit.** :class:`BodyLimit` answers 413 to a request body over ``max_body_bytes`` before the body is
parsed: at once when ``Content-Length`` says so, else as soon as the streamed body passes the limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from fastapi import HTTPException
from pydantic import BaseModel
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from efftx.generation.faults import DeviceFault
from efftx.serving.faults import FaultLatch

logger = logging.getLogger("ray.serve")

RETRY_AFTER_S = 1  # a 503's Retry-After: rows leave, and free their memory, within about a second of decoding

R = TypeVar("R")
T = TypeVar("T")


class RowFailure(BaseModel):
    """The outcome of a request whose decoding failed (returned in its place from a batch)."""

    status: int
    detail: Any

    def exception(self) -> HTTPException:
        """The HTTP answer; a 503 (out of memory: the server's capacity) says when to retry (``Retry-After``)."""
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return HTTPException(status_code=self.status, detail=self.detail, headers=headers)


def row_failure(exc: BaseException, what: str) -> RowFailure:
    if isinstance(exc, HTTPException):
        return RowFailure(status=exc.status_code, detail=exc.detail)
    if isinstance(exc, DeviceFault):  # the device failed: this replica is replaced (a retry reaches another)
        return RowFailure(status=503, detail=f"{what} failed: {exc}")
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):  # the server's capacity, not the request: retry
        logger.warning("%s ran out of memory on one request: %s", what, exc)
        return RowFailure(status=503, detail=f"{what} ran out of memory for this request; retry later: {exc}")
    if isinstance(exc, ValueError):
        return RowFailure(status=422, detail=[{"loc": ["body"], "msg": f"{what} refused this request: {exc}",
                                               "type": "value_error"}])
    logger.error("%s failed on one request", what, exc_info=exc)
    return RowFailure(status=500, detail=f"{what} failed: {type(exc).__name__}")


def contained(run: Callable[[list[R]], list[T]], requests: list[R], what: str, latch: FaultLatch | None = None
              ) -> list[T | RowFailure]:
    """``run(requests)``, one result per request; if the batch raises, each request is run alone, and a request
    that fails alone gets a :class:`RowFailure` in its place. With a ``latch``: once the device failed (a sticky
    CUDA error), nothing runs again: every request fails with the fault (a 503)."""
    if latch is not None and latch.fault is not None:
        return [row_failure(latch.fault, what) for _ in requests]
    try:
        return list(run(requests))
    except Exception as exc:  # noqa: BLE001 - contained below
        if (fault := _latched(latch, exc)) is not None:  # each request alone would fail too
            return [row_failure(fault, what) for _ in requests]
        if len(requests) == 1:
            return [row_failure(exc, what)]
        logger.warning("%s of a batch of %d failed (%s: %s); decoding its requests one by one",
                       what, len(requests), type(exc).__name__, exc)
    out: list[T | RowFailure] = []
    for req in requests:
        if latch is not None and latch.fault is not None:
            out.append(row_failure(latch.fault, what))
            continue
        try:
            out.extend(run([req]))
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            out.append(row_failure(_latched(latch, exc) or exc, what))
    return out


def _latched(latch: FaultLatch | None, exc: BaseException) -> DeviceFault | None:
    """The replica's fault after ``exc`` (latched now if ``exc`` is the device's failure, or earlier); None without
    a latch or a fault."""
    return None if latch is None else latch.failed(exc) or latch.fault


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(status_code=413, detail=[{"loc": ["body"], "type": "body_too_large",
                                                   "msg": f"the request body is larger than {limit} bytes"}])


class BodyLimit:
    """ASGI middleware: a 413 for request bodies over ``limit()`` bytes, before they are parsed."""

    def __init__(self, app: ASGIApp, limit: Callable[[], int]):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit()
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > limit:
            await _refuse(limit, scope, receive, send)
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(limit)  # FastAPI re-raises HTTPExceptions met while reading the body
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, watching_send)
        except BodyTooLarge:  # read outside FastAPI's body parsing (e.g. by another middleware)
            if started:
                raise
            await _refuse(limit, scope, receive, send)


async def _refuse(limit: int, scope: Scope, receive: Receive, send: Send) -> None:
    exc = BodyTooLarge(limit)
    await JSONResponse(status_code=413, content={"detail": exc.detail}, headers={"Connection": "close"})(
        scope, receive, send)

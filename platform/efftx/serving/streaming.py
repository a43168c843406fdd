"""``POST /generate/stream``: one decoding run as server-sent events, step by step.

The playground opens one stream per mode and draws tokens as they arrive, marking in the speculative
column which tokens the target accepted from the draft and which it produced itself. The events:

* ``event: step`` with a :class:`~efftx.serving.schemas.StreamStep` (the step's text, split into its
  draft-accepted and target parts, and the counts ``drafted_accepted`` and ``from_target``);
* ``event: done`` with a :class:`~efftx.serving.schemas.StreamDone` (latency, tokens/s and, for
  speculative decoding, the acceptance statistics);
* ``event: error`` with ``{"detail": message}`` if decoding fails after the stream has begun (bad input
  is refused before that, with the usual 422 naming the field).

With continuous batching (the default, :mod:`efftx.serving.continuous`) a stream is a row of the replica's
running batch like any other request: it joins at the next decoding step and its tokens are pushed to the
client as the scheduler produces them (:func:`job_events`, an async generator fed from the decoding thread).
With ``batching=static`` a stream decodes alone (batch size 1, :func:`stream_events`): it does not join
``@serve.batch`` batches, and its synchronous event generator runs in Starlette's thread pool. Either way
decoding never runs on the replica's event loop (``/healthz`` answers meanwhile).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

from pydantic import BaseModel

from efftx.data.lm_tokenizer import ByteCodec
from efftx.generation.decode import iter_generate
from efftx.generation.speculative import SpecStats, iter_speculative
from efftx.serving import metrics
from efftx.serving.schemas import StreamDone, StreamRequest, StreamStep


def split_step(tokens: list[int], accepted: int | None) -> tuple[int, int]:
    """(drafted_accepted, from_target) of one step's emitted tokens.

    ``accepted`` is the number of drafted tokens the target accepted in the step (None in base decoding,
    where the target produces every token). A speculative step emits ``accepted`` drafted tokens and then
    the target's own token, unless the output was cut at ``max_new_tokens`` before it.
    """
    if accepted is None:
        return 0, len(tokens)
    drafted = min(accepted, len(tokens))
    return drafted, len(tokens) - drafted


class StepMarks:
    """Turns one decoding run's steps into :class:`StreamStep` events and its end into a :class:`StreamDone`.

    ``codec`` (efftx.data.lm_tokenizer: bytes by default, or the export's tokenizer) decodes incrementally after
    ``prompt``: a character whose bytes are spread over tokens or steps is sent once it is complete."""

    def __init__(self, mode: str, t0: float | None = None, codec=None, prompt: list[int] = ()):
        self.mode = mode
        self.t0 = time.perf_counter() if t0 is None else t0
        self.codec = codec or ByteCodec()
        self.prompt = list(prompt)
        self.decoder = self.codec.decoder(self.prompt)  # a character may span steps
        self.out: list[int] = []
        self.n = 0

    def step(self, toks: list[int], accepted: int | None) -> StreamStep:
        self.n += 1
        drafted, from_target = split_step(toks, accepted)
        draft_text = self.decoder.decode(toks[:drafted])
        target_text = self.decoder.decode(toks[drafted:])
        self.out.extend(toks)
        return StreamStep(mode=self.mode, step=self.n, text=draft_text + target_text, draft_text=draft_text,
                          target_text=target_text, drafted_accepted=drafted, from_target=from_target,
                          tokens=len(self.out), elapsed_ms=(time.perf_counter() - self.t0) * 1e3)

    def done(self, stats: SpecStats | None, **extra) -> StreamDone:
        secs = time.perf_counter() - self.t0
        if stats is not None:
            extra.update(stats.result_fields())
        return StreamDone(mode=self.mode, steps=self.n, text=self.codec.continuation(self.prompt, self.out),
                          tail=self.decoder.flush(), tokens=len(self.out), latency_ms=secs * 1e3,
                          tokens_per_s=len(self.out) / secs, **extra)


def stream_events(target, draft, prompt: list[int], req: StreamRequest, codec=None, max_gamma: int | None = None
                  ) -> Iterator[BaseModel]:
    """Decode ``prompt`` in ``req.mode``; yield a StreamStep per decoding step, then a StreamDone. ``codec``: the
    model's (bytes by default); ``max_gamma``: the cap of ``req.adaptive_gamma`` (default ``req.gamma``)."""
    sampling = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "seed": req.seed}
    speculative = req.mode == "speculative"
    adaptive = req.adaptive(max_gamma or req.gamma)
    stats = SpecStats(gamma=req.draft_cap(max_gamma or req.gamma))
    marks = StepMarks(req.mode, codec=codec, prompt=prompt)
    if speculative:
        steps: Iterable[list[int]] = iter_speculative(target, draft, prompt, req.max_new_tokens, gamma=req.gamma,
                                                      stats=stats, **sampling, **adaptive)
    else:
        steps = ([int(t[0])] for t in iter_generate(target, [prompt], req.max_new_tokens, **sampling))
    for toks in steps:
        yield marks.step(toks, stats.accepted[-1] if speculative else None)
    done = marks.done(stats if speculative else None)
    metrics.batch("static", req.mode, 1)  # a stream decodes alone
    metrics.decoded(req.mode, done.tokens, done.latency_ms / 1e3, stats.mean_accepted if speculative else None,
                    stats.draft_calls)
    yield done


async def job_events(steps: AsyncIterable[tuple], mode: str, t0: float | None = None, codec=None,
                     prompt: list[int] = ()) -> AsyncIterator[BaseModel]:
    """StreamStep events from a continuous-batching row's ``("step", tokens, accepted)`` items, then a StreamDone
    from its final ``("done", job, None)`` (a :class:`~efftx.serving.continuous.Job`)."""
    marks = StepMarks(mode, t0, codec, prompt)
    async for kind, a, b in steps:
        if kind == "step":
            yield marks.step(a, b)
        else:
            extra = {"batch_size": a.batch_size}
            if a.first_token_s is not None:
                extra["first_token_ms"] = a.first_token_s * 1e3
            yield marks.done(a.stats, **extra)


_EVENT_NAMES = {StreamStep: "step", StreamDone: "done"}


def _event(ev: BaseModel) -> str:
    return f"event: {_EVENT_NAMES[type(ev)]}\ndata: {ev.model_dump_json()}\n\n"


def _error_event(exc: Exception) -> str:
    return f"event: error\ndata: {json.dumps({'detail': f'{type(exc).__name__}: {exc}'})}\n\n"


def sse(events: Iterable[BaseModel]) -> Iterator[str]:
    """Server-sent events from StreamStep/StreamDone models; an exception mid-stream becomes an ``error`` event
    (the status line has gone out already, so the client learns of it in the stream)."""
    try:
        for ev in events:
            yield _event(ev)
    except Exception as exc:  # noqa: BLE001 - reported to the client, the replica keeps serving
        yield _error_event(exc)


async def sse_async(events: AsyncIterable[BaseModel]) -> AsyncIterator[str]:
    """:func:`sse` for an async event source."""
    try:
        async for ev in events:
            yield _event(ev)
    except Exception as exc:  # noqa: BLE001 - reported to the client, the replica keeps serving
        yield _error_event(exc)

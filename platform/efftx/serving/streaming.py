"""``POST /generate/stream``: one decoding run as server-sent events, step by step.

The playground opens one stream per mode and draws tokens as they arrive, marking in the speculative
column which tokens the target accepted from the draft and which it produced itself. The events:

* ``event: step`` with a :class:`~efftx.serving.schemas.StreamStep` (the step's text, split into its
  draft-accepted and target parts, and the counts ``drafted_accepted`` and ``from_target``);
* ``event: done`` with a :class:`~efftx.serving.schemas.StreamDone` (latency, tokens/s and, for
  speculative decoding, the acceptance statistics);
* ``event: error`` with ``{"detail": message}`` if decoding fails after the stream has begun (bad input
  is refused before that, with the usual 422 naming the field).

A stream decodes alone (batch size 1): it does not join ``@serve.batch`` batches, as its steps must
reach the client as they happen. The event generators are synchronous: Starlette's ``StreamingResponse``
iterates them in its thread pool, so decoding never runs on the replica's event loop (``/healthz`` answers
meanwhile).
"""

from __future__ import annotations

import codecs
import json
import time
from collections.abc import Iterable, Iterator

from pydantic import BaseModel

from efftx.generation.decode import decode_bytes, iter_generate
from efftx.generation.speculative import SpecStats, iter_speculative
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


def stream_events(target, draft, prompt: list[int], req: StreamRequest) -> Iterator[BaseModel]:
    """Decode ``prompt`` in ``req.mode``; yield a StreamStep per decoding step, then a StreamDone."""
    sampling = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "seed": req.seed}
    speculative = req.mode == "speculative"
    stats = SpecStats(gamma=req.gamma)
    t0 = time.perf_counter()
    if speculative:
        steps: Iterable[list[int]] = iter_speculative(target, draft, prompt, req.max_new_tokens, gamma=req.gamma,
                                                      stats=stats, **sampling)
    else:
        steps = ([int(t[0])] for t in iter_generate(target, [prompt], req.max_new_tokens, **sampling))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span steps
    out: list[int] = []
    n = 0
    for n, toks in enumerate(steps, 1):
        drafted, from_target = split_step(toks, stats.accepted[-1] if speculative else None)
        draft_text = decoder.decode(bytes(toks[:drafted]))
        target_text = decoder.decode(bytes(toks[drafted:]))
        out.extend(toks)
        yield StreamStep(mode=req.mode, step=n, text=draft_text + target_text, draft_text=draft_text,
                         target_text=target_text, drafted_accepted=drafted, from_target=from_target,
                         tokens=len(out), elapsed_ms=(time.perf_counter() - t0) * 1e3)
    secs = time.perf_counter() - t0
    extra = {}
    if speculative:
        extra = {"mean_accepted": stats.mean_accepted, "acceptance_histogram": stats.histogram,
                 "draft_calls": stats.draft_calls, "target_calls": stats.target_calls}
    yield StreamDone(mode=req.mode, steps=n, text=decode_bytes(out), tail=decoder.decode(b"", final=True),
                     tokens=len(out), latency_ms=secs * 1e3, tokens_per_s=len(out) / secs, **extra)


def sse(events: Iterable[BaseModel]) -> Iterator[str]:
    """Server-sent events from StreamStep/StreamDone models; an exception mid-stream becomes an ``error`` event
    (the status line has gone out already, so the client learns of it in the stream)."""
    names = {StreamStep: "step", StreamDone: "done"}
    try:
        for ev in events:
            yield f"event: {names[type(ev)]}\ndata: {ev.model_dump_json()}\n\n"
    except Exception as exc:  # noqa: BLE001 - reported to the client, the replica keeps serving
        yield f"event: error\ndata: {json.dumps({'detail': f'{type(exc).__name__}: {exc}'})}\n\n"

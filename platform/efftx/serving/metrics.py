"""Application metrics of the Serve app, in Prometheus format through Ray's metrics API (:mod:`ray.serve.metrics`).

One place defines the metric objects; they are created lazily, once per process (a Serve replica), on the first
record, so Ray Serve adds its ``deployment``, ``replica`` and ``application`` tags to every series. The
deployments call the small functions below; a failure to record is logged once and never fails a request.

Ray prefixes custom metrics with ``ray_`` and counters get a ``_total`` suffix: ``efftx_requests`` is scraped as
``ray_efftx_requests_total``, a histogram ``efftx_x`` as ``ray_efftx_x_bucket`` / ``_sum`` / ``_count``. Each Ray
node serves them at ``http://NODE_IP:METRICS_EXPORT_PORT/metrics`` (``ray start --metrics-export-port``;
``ray.nodes()[i]["MetricsExportPort"]``), refreshed every ``RAY_metrics_report_interval_ms`` (10 s by default).
Ray's histograms have exact buckets and counts, but their ``_sum`` is an approximation (each observation counted
at its bucket's midpoint): read means and quantiles from the buckets.

=================================  =========  ==================  ===============================================
name                               type       tags                meaning
=================================  =========  ==================  ===============================================
efftx_requests                     counter    endpoint, status    HTTP requests answered, by route and status code
efftx_generated_tokens             counter    mode                tokens generated (mode: base | speculative)
efftx_time_per_output_token_s      histogram  mode                a request's decoding time / its tokens, seconds
efftx_time_to_first_token_s        histogram  mode                continuous batching: a request's arrival to its
                                                                  first token, seconds (queue and prefill included)
efftx_batch_size                   histogram  batching, mode      rows per decoding step (continuous) or per batch
                                                                  (static; mode image: image requests per batch)
efftx_speculative_mean_accepted    histogram  -                   per speculative request, mean accepted per step
efftx_speculative_draft_calls      counter    -                   draft-model forward passes
efftx_images_generated             counter    -                   images generated
=================================  =========  ==================  ===============================================
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("ray.serve")

TPOT_BOUNDARIES = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
TTFT_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
ACCEPTED_BOUNDARIES = [0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0]

# the routes counted by name; any other path is counted as endpoint "other" (bounded tag values)
ENDPOINTS = frozenset({"/generate", "/generate/stream", "/v1/completions", "/v1/models", "/models/info", "/healthz",
                       "/images/generate", "/v1/images/generations", "/openapi.json", "/docs", "/playground", "/"})

NAMES = ("efftx_requests", "efftx_generated_tokens", "efftx_time_per_output_token_s",
         "efftx_time_to_first_token_s", "efftx_batch_size",
         "efftx_speculative_mean_accepted", "efftx_speculative_draft_calls", "efftx_images_generated")

_lock = threading.Lock()
_metrics: dict | None = None
_warned = False


def _create() -> dict:
    from ray.serve.metrics import Counter, Histogram

    return {
        "requests": Counter("efftx_requests", "HTTP requests answered, by endpoint and status code.",
                            tag_keys=("endpoint", "status")),
        "tokens": Counter("efftx_generated_tokens", "Tokens generated, by decoding mode (base | speculative).",
                          tag_keys=("mode",)),
        "tpot": Histogram("efftx_time_per_output_token_s",
                          "Time per output token (s): a request's decoding time divided by its generated tokens.",
                          boundaries=TPOT_BOUNDARIES, tag_keys=("mode",)),
        "ttft": Histogram("efftx_time_to_first_token_s",
                          "Continuous batching: time from a request's arrival to its first token (s), its wait in the "
                          "queue and its prefill included.", boundaries=TTFT_BOUNDARIES, tag_keys=("mode",)),
        "batch": Histogram("efftx_batch_size", "Rows per decoding step (continuous batching) or per decoded batch "
                                               "(static batching, images).",
                           boundaries=BATCH_BOUNDARIES, tag_keys=("batching", "mode")),
        "accepted": Histogram("efftx_speculative_mean_accepted",
                              "Per speculative request, its mean accepted draft tokens per step.",
                              boundaries=ACCEPTED_BOUNDARIES),
        "draft_calls": Counter("efftx_speculative_draft_calls", "Draft-model forward passes of speculative decoding."),
        "images": Counter("efftx_images_generated", "Images generated."),
    }


def _get() -> dict | None:
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _create()
    return _metrics


def _safe(fn):
    """Recording never fails a request: a failure is logged (once) and ignored."""

    def wrapper(*args, **kwargs):
        global _warned
        try:
            fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - metrics are best effort
            if not _warned:
                _warned = True
                logger.exception("efftx metrics: recording %s failed (further failures are not logged)",
                                 fn.__name__)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def endpoint_of(scope: dict) -> str:
    """The route of an ASGI request as an ``endpoint`` tag value (a path of :data:`ENDPOINTS`, else ``other``)."""
    path = scope.get("path", "")
    root = scope.get("root_path", "").rstrip("/")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    if path.startswith("/playground"):
        return "/playground"
    return path if path in ENDPOINTS else "other"


@_safe
def request(endpoint: str, status: int) -> None:
    _get()["requests"].inc(1, tags={"endpoint": endpoint, "status": str(int(status))})


@_safe
def decoded(mode: str, tokens: int, seconds: float, mean_accepted: float | None = None,
            draft_calls: int = 0, first_token_s: float | None = None) -> None:
    """One request's decoding in ``mode`` (base | speculative) is done: ``tokens`` generated in ``seconds``; for
    speculative decoding its mean accepted draft tokens per step and its draft passes; with continuous batching
    the time to its first token."""
    m = _get()
    tags = {"mode": mode}
    if tokens > 0:
        m["tokens"].inc(tokens, tags=tags)
        m["tpot"].observe(max(seconds, 0.0) / tokens, tags=tags)
    if first_token_s is not None:
        m["ttft"].observe(max(first_token_s, 0.0), tags=tags)
    if mode == "speculative":
        if mean_accepted is not None:
            m["accepted"].observe(float(mean_accepted))
        if draft_calls:
            m["draft_calls"].inc(draft_calls)


def decoded_job(job) -> None:
    """:func:`decoded` for a finished continuous-batching :class:`~efftx.serving.continuous.Job` (a failed or
    cancelled one is not counted)."""
    if job.failure is None and job.error is None and not job.cancelled:
        stats = job.stats
        decoded(job.mode, len(job.out), job.latency_s, None if stats is None else stats.mean_accepted,
                0 if stats is None else stats.draft_calls, job.first_token_s)


@_safe
def batch(batching: str, mode: str, rows: int) -> None:
    """A decoding step (continuous) or a decoded batch (static, images) of ``rows`` rows."""
    if rows > 0:
        _get()["batch"].observe(rows, tags={"batching": batching, "mode": mode})


@_safe
def images(n: int) -> None:
    if n > 0:
        _get()["images"].inc(n)


class RequestMetrics:
    """ASGI middleware counting every HTTP request by endpoint and status code (``efftx_requests``): 4xx from the
    exception handlers and 413s from :class:`~efftx.serving.isolation.BodyLimit` included when it is added after
    them (the outermost middleware). A request whose exception escapes the app is counted as a 500."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: list[int] = []

        async def sending(message):
            if message["type"] == "http.response.start" and not status:
                status.append(message["status"])
                request(endpoint_of(scope), message["status"])
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:  # not a client gone away (CancelledError): that has no status
            if not status:
                request(endpoint_of(scope), 500)
            raise


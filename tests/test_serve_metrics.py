"""The Serve app's application metrics (efftx.serving.metrics), scraped from Ray's Prometheus endpoint over HTTP.

Two apps on one Serve instance: ``text`` (continuous batching, with images) at ``/`` and ``static``
(``batching=static``) at ``/static``. Requests go to both over real HTTP; then the node's metrics endpoint
(``ray.nodes()[i]["MetricsExportPort"]``) is polled until every metric has moved by what the requests imply
(Ray exports application metrics periodically, every ``RAY_metrics_report_interval_ms``, 10 s by default).
"""

from __future__ import annotations

import json
import time

import pytest
import requests

from netutil import free_port

pytestmark = pytest.mark.slow

DEADLINE_S = 120  # Ray's export interval is 10 s by default; the first export of a new replica can take longer


# Names no other test's app has: Ray keeps exporting the counters of an app's earlier replicas in the session, and
# the test counts from zero.
TEXT, STATIC = "metrics-text", "metrics-static"

@pytest.fixture(scope="module")
def apps(ray_cluster, debug_exports):
    from ray import serve

    from efftx.serving.text import build

    paths = debug_exports
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"target": paths["target"], "draft": paths["draft"], "name": "tiny", "dalle": paths["dalle"]}),
              name=TEXT, route_prefix="/")
    serve.run(build({"target": paths["target"], "draft": paths["draft"], "name": "tiny", "batching": "static"}),
              name=STATIC, route_prefix="/static")
    yield f"http://127.0.0.1:{port}"
    serve.delete(STATIC)
    serve.shutdown()


def metrics_url() -> str:
    """The Prometheus endpoint of the (one) alive node of the test cluster."""
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 1, nodes
    return f"http://{nodes[0]['NodeManagerAddress']}:{nodes[0]['MetricsExportPort']}/metrics"


def scrape(url: str) -> list[tuple[str, dict, float]]:
    """(sample name, labels, value) of every ``ray_efftx_*`` sample."""
    from prometheus_client.parser import text_string_to_metric_families

    res = requests.get(url, timeout=30)
    res.raise_for_status()
    return [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(res.text)
            for s in fam.samples if s.name.startswith("ray_efftx_")]


def total(samples, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (replicas summed)."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == str(x) for k, x in labels.items()))


def post(url, **kwargs):
    return requests.post(url, timeout=120, **kwargs)


def sse_blocks(res) -> list[str]:
    assert res.status_code == 200, res.text
    return [b for b in res.text.split("\n\n") if b.strip()]


def test_metrics_move_after_requests(apps):
    url = metrics_url()
    before = scrape(url)
    for name in ("efftx_requests", "efftx_generated_tokens"):  # counters of fresh apps: nothing counted yet
        assert total(before, f"ray_{name}_total", application=TEXT) == 0

    # continuous batching (app "text"): base, speculative, one 4xx, two images
    base = post(f"{apps}/generate", json={"prompt": "def ", "max_new_tokens": 9, "temperature": 0, "mode": "base"})
    spec = post(f"{apps}/generate", json={"prompt": "def ", "max_new_tokens": 7, "temperature": 0,
                                          "mode": "speculative", "gamma": 3})
    bad = post(f"{apps}/generate", json={"prompt": "hi", "max_new_tokens": "many"})
    img = post(f"{apps}/images/generate", json={"prompt": "a red circle", "n": 2, "seed": 1,
                                                "response_format": "b64_json"})
    assert (base.status_code, spec.status_code, bad.status_code, img.status_code) == (200, 200, 422, 200), bad.text
    spec_res = spec.json()["results"]["speculative"]
    assert spec_res["tokens"] == 7 and spec_res["draft_calls"] > 0
    # static batching (app "static"): a batch of both modes, a stream, a streamed speculative completion
    both = post(f"{apps}/static/generate", json={"prompt": "x = ", "max_new_tokens": 5, "temperature": 0,
                                                 "mode": "both", "gamma": 2})
    assert both.status_code == 200, both.text
    stream = sse_blocks(post(f"{apps}/static/generate/stream", json={"prompt": "x", "max_new_tokens": 6,
                                                                     "mode": "speculative", "gamma": 2}))
    assert stream[-1].startswith("event: done"), stream[-1]
    completion = sse_blocks(post(f"{apps}/static/v1/completions", json={"model": "tiny-speculative", "prompt": "x",
                                                                        "max_tokens": 4, "stream": True}))
    assert completion[-1] == "data: [DONE]"

    def expected(now) -> dict[str, tuple[float, float]]:
        """What each series moved by (after - before), and what it must have moved by."""
        def moved(name, **labels):
            return total(now, name, **labels) - total(before, name, **labels)

        text, static = {"application": TEXT}, {"application": STATIC}
        return {
            "requests /generate 200": (moved("ray_efftx_requests_total", endpoint="/generate", status=200, **text), 2),
            "requests /generate 422": (moved("ray_efftx_requests_total", endpoint="/generate", status=422, **text), 1),
            "requests /images/generate 200": (moved("ray_efftx_requests_total", endpoint="/images/generate",
                                                    status=200, **text), 1),
            "static requests /generate/stream 200": (moved("ray_efftx_requests_total", endpoint="/generate/stream",
                                                           status=200, **static), 1),
            "tokens base": (moved("ray_efftx_generated_tokens_total", mode="base", **text), 9),
            "tokens speculative": (moved("ray_efftx_generated_tokens_total", mode="speculative", **text), 7),
            "static tokens base": (moved("ray_efftx_generated_tokens_total", mode="base", **static), 5),
            "static tokens speculative": (moved("ray_efftx_generated_tokens_total", mode="speculative", **static),
                                          5 + 6 + 4),
            "tpot base": (moved("ray_efftx_time_per_output_token_s_count", mode="base", **text), 1),
            "tpot speculative": (moved("ray_efftx_time_per_output_token_s_count", mode="speculative", **text), 1),
            "tpot seconds": (float(moved("ray_efftx_time_per_output_token_s_sum", mode="base", **text) > 0), 1),
            # continuous batching: each request's time to its first token (static batching does not record it)
            "ttft base": (moved("ray_efftx_time_to_first_token_s_count", mode="base", **text), 1),
            "ttft speculative": (moved("ray_efftx_time_to_first_token_s_count", mode="speculative", **text), 1),
            "static ttft": (moved("ray_efftx_time_to_first_token_s_count", **static), 0),
            # continuous: one observation per decoding step (9 base tokens: the prefill's + 8 steps)
            "continuous batch steps base": (moved("ray_efftx_batch_size_count", batching="continuous",
                                                  mode="base", **text), 8),
            # each of those steps had one row (Ray's histogram _sum is approximate, from bucket midpoints: the
            # buckets are exact)
            "continuous batch rows base": (moved("ray_efftx_batch_size_bucket", batching="continuous", mode="base",
                                                 le="1.0", **text), 8),
            "continuous batch steps speculative": (float(moved("ray_efftx_batch_size_count", batching="continuous",
                                                               mode="speculative", **text) >= 1), 1),
            "static batches": (moved("ray_efftx_batch_size_count", batching="static", **static), 4),
            "image batches": (moved("ray_efftx_batch_size_count", batching="static", mode="image", **text), 1),
            "mean accepted": (moved("ray_efftx_speculative_mean_accepted_count", **text), 1),
            "static mean accepted": (moved("ray_efftx_speculative_mean_accepted_count", **static), 3),
            "draft calls": (moved("ray_efftx_speculative_draft_calls_total", **text), spec_res["draft_calls"]),
            "images": (moved("ray_efftx_images_generated_total"), 2),
        }

    t0 = time.monotonic()
    deadline = t0 + DEADLINE_S
    while True:
        now = scrape(url)
        got = expected(now)
        if all(m == want for m, want in got.values()) or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(f"metrics moved after {time.monotonic() - t0:.1f} s")
    assert {k: m for k, (m, want) in got.items()} == {k: want for k, (m, want) in got.items()}, json.dumps(
        [(n, {k: v for k, v in lab.items() if k in ("application", "mode", "batching", "le")}, v) for n, lab, v in now
         if "batch_size" in n or "time_per" in n], default=str)[:6000]
    # the 422 is counted with its status only: no 5xx, nothing under "other"
    for app in (TEXT, STATIC):  # this test's apps (other tests' apps in the session answer 500s on purpose)
        assert total(now, "ray_efftx_requests_total", status=500, application=app) == 0
        assert total(now, "ray_efftx_requests_total", endpoint="other", application=app) == 0


def test_static_batching_serves_coupled_requests_as_base_decoding(apps, debug_exports):
    """``coupled`` with ``batching=static``: a batch of two such requests (and a stream) get the base tokens of
    their seeds, as the library's base decoding samples them."""
    from concurrent.futures import ThreadPoolExecutor

    from efftx.export import load_export
    from efftx.generation.decode import decode_bytes, generate

    target = load_export(debug_exports["target"])[0]
    body = {"max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "mode": "speculative", "gamma": 3,
            "coupled": True}
    reqs = [{**body, "prompt": "x = ", "seed": 3}, {**body, "prompt": "def f(", "seed": 4}]
    with ThreadPoolExecutor(2) as pool:  # one @serve.batch
        results = list(pool.map(lambda b: post(f"{apps}/static/generate", json=b), reqs))
    texts = [decode_bytes(generate(target, [list(r["prompt"].encode())], 16, temperature=1.0, top_k=20,
                                   seed=r["seed"])[0].tolist()) for r in reqs]
    for res, text in zip(results, texts):
        assert res.status_code == 200, res.text
        assert res.json()["results"]["speculative"]["text"] == text
    stream = sse_blocks(post(f"{apps}/static/generate/stream", json=reqs[0]))
    assert json.loads(stream[-1].split("data: ", 1)[1])["text"] == texts[0]


def test_static_batching_serves_an_adaptive_gamma_as_the_library_decodes_it(apps, debug_exports):
    """``adaptive_gamma`` with ``batching=static``: a batch of two such requests and a stream decode as the
    library's adaptive speculative decoding (cap: the limits' max_gamma, 8), each request its own seed."""
    from efftx.export import load_export
    from efftx.generation.decode import decode_bytes
    from efftx.generation.speculative import speculative_generate

    target, draft = load_export(debug_exports["target"])[0], load_export(debug_exports["draft"])[0]
    body = {"max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "mode": "speculative", "gamma": 2,
            "adaptive_gamma": True}
    reqs = [{**body, "prompt": "x = ", "seed": 3}, {**body, "prompt": "def f(", "seed": 4}]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:  # one @serve.batch
        results = list(pool.map(lambda b: post(f"{apps}/static/generate", json=b), reqs))
    for req, res in zip(reqs, results):
        assert res.status_code == 200, res.text
        out, stats = speculative_generate(target, draft, [list(req["prompt"].encode())], 16, gamma=2,
                                          temperature=1.0, top_k=20, seed=req["seed"], adaptive_gamma=True,
                                          max_gamma=8)
        got = res.json()["results"]["speculative"]
        assert got["text"] == decode_bytes(out[0]) and got["acceptance_histogram"] == stats.histogram
        assert got["draft_calls"] >= stats.draft_calls  # the batch's passes it took part in (its own, or more)
    stream = sse_blocks(post(f"{apps}/static/generate/stream", json=reqs[0]))
    assert json.loads(stream[-1].split("data: ", 1)[1])["acceptance_histogram"] == \
        speculative_generate(target, draft, [list(b"x = ")], 16, gamma=2, temperature=1.0, top_k=20, seed=3,
                             adaptive_gamma=True, max_gamma=8)[1].histogram
    # a streamed completion (the static path decodes it alone) with the same schedule
    completion = sse_blocks(post(f"{apps}/static/v1/completions", json={
        "model": "tiny-speculative", "prompt": "x = ", "max_tokens": 16, "temperature": 1.0, "seed": 3, "gamma": 2,
        "adaptive_gamma": True, "stream": True}))
    text = "".join(json.loads(b.split("data: ", 1)[1])["choices"][0]["text"] for b in completion[:-1])
    assert text == decode_bytes(speculative_generate(target, draft, [list(b"x = ")], 16, gamma=2, temperature=1.0,
                                                     seed=3, adaptive_gamma=True, max_gamma=8)[0][0])

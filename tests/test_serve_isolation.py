"""Serving isolation: one request never fails another, decoding never blocks the replica, and a fuzz of the API.

One Serve instance holds three apps built by :func:`efftx.serving.text.build` over the debug models:

* ``/`` the real app (continuous batching; the fuzz runs against it, and it decodes the "alone" references);
* ``/poisoned`` the same app whose deployments are subclasses with deliberately failing rows, so containment
  itself is tested (validation now refuses the inputs that used to poison a batch, so the poison is forced past
  it here): a prompt starting with ``POISON-SEED`` is decoded with seed 2**64 (the decoder raises a ValueError:
  the culprit gets a 422), ``POISON-FAULT`` raises a RuntimeError in speculative decoding / image drawing (a
  server fault: a 500), and ``SLOW`` holds its batch until the test releases it (a long batch in flight).
  Every batch the poisoned deployments decode is recorded (its prompts: with continuous batching every prefill
  and decoding step), so the tests can tell the poisoned request really shared a batch with the valid ones;
* ``/poisoned-static`` the poisoned text app with ``batching=static`` (``@serve.batch``), so both batching modes
  are shown to contain a failing request.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from netutil import free_port

pytestmark = pytest.mark.slow

LIMITS = {"max_new_tokens": 40, "max_prompt_bytes": 64, "max_body_bytes": 8192}
IMAGE_LIMITS = {"max_images": 4, "max_cond_scale": 5}


def poisoned_deployments(gate: str):
    """Subclasses of the app's deployments with the failing rows described above (defined here, in a function,
    so that Ray pickles them by value). ``gate``: a folder for the batch log and the SLOW handshake."""
    from efftx.serving.images import ImageGenerator
    from efftx.serving.text import TextGenerator

    def record(kind: str, prompts: list[str]) -> None:
        with open(Path(gate) / f"{kind}-batches.jsonl", "a") as f:
            f.write(json.dumps(prompts) + "\n")

    def hold(prompts: list[str]) -> None:
        if any(p.startswith("SLOW") for p in prompts):
            (Path(gate) / "started").touch()
            deadline = time.monotonic() + 60  # never hang for good, whatever happens to the test
            while not (Path(gate) / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.01)  # blocking, as a long decoding step is

    def poison(req):
        return req.model_copy(update={"seed": 2**64}) if req.prompt.startswith("POISON-SEED") else req

    def fault(reqs) -> None:
        if any(r.prompt.startswith("POISON-FAULT") for r in reqs):
            raise RuntimeError("injected fault")

    class PoisonedText(TextGenerator.func_or_class):
        # continuous batching: every prefill and step goes through _step_hook; every row is made by _job
        def _job(self, req, mode, on_step=None):
            return super()._job(poison(req), mode, on_step)

        def _step_hook(self, mode, reqs):
            record(f"{mode}-{self.batching['mode']}", [r.prompt for r in reqs])
            if mode == "base":
                hold([r.prompt for r in reqs])
            else:
                fault(reqs)

        def queued(self) -> int:  # requests waiting to join the running batch (the test polls it)
            return len(self.scheduler._queue) if self.scheduler is not None else 0

        # static batching
        def _base_rows(self, reqs):
            record("base-static", [r.prompt for r in reqs])
            hold([r.prompt for r in reqs])
            return super()._base_rows([poison(r) for r in reqs])

        def _speculative_rows(self, reqs):
            record("speculative-static", [r.prompt for r in reqs])
            fault(reqs)
            return super()._speculative_rows([poison(r) for r in reqs])

        def _completion_steps(self, tokens, req, stats=None):
            return super()._completion_steps(tokens, poison(req), stats)

    class PoisonedImages(ImageGenerator.func_or_class):
        def _draw(self, reqs):
            record("images", [r.prompt for r in reqs])
            hold([r.prompt for r in reqs])
            fault(reqs)
            return super()._draw([poison(r) for r in reqs])

    return (TextGenerator.options(func_or_class=PoisonedText),
            ImageGenerator.options(func_or_class=PoisonedImages))


@pytest.fixture(scope="module")
def apps(ray_cluster, debug_exports, tmp_path_factory):
    from ray import serve

    from efftx.serving.text import build, build_with

    gate = tmp_path_factory.mktemp("gate")
    args = {"target": debug_exports["target"], "draft": debug_exports["draft"], "name": "tiny",
            "limits": json.dumps(LIMITS), "dalle": debug_exports["dalle"], "image_limits": json.dumps(IMAGE_LIMITS)}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(args), name="real", route_prefix="/")
    text, images = poisoned_deployments(str(gate))
    # a long batch window and room for 8 valid + 2 poisoned requests in one batch (in the fast lane too: short and
    # long requests alike share its passes while it has room; prefilled together: no per-round prefill limit, and
    # long arrivals not held for a round of the slow lane while short ones run: every round is one)
    serve.run(build_with({**args, "max_batch_size": "16", "fast_rows": "16", "batch_wait_timeout_s": "1.0",
                          "prefill_rows": "0", "long_every": "1", "image_max_batch_size": "16",
                          "image_batch_wait_timeout_s": "1.0"}, text_deployment=text, image_deployment=images),
              name="poisoned", route_prefix="/poisoned")
    static = {k: v for k, v in args.items() if k not in ("dalle", "image_limits")}
    serve.run(build_with({**static, "batching": "static", "max_batch_size": "16", "batch_wait_timeout_s": "1.0"},
                         text_deployment=text, image_deployment=images),
              name="poisoned-static", route_prefix="/poisoned-static")
    yield {"real": f"http://127.0.0.1:{port}", "poisoned": f"http://127.0.0.1:{port}/poisoned",
           "poisoned-static": f"http://127.0.0.1:{port}/poisoned-static", "gate": gate}
    serve.shutdown()


def post(url, **kwargs):
    return requests.post(url, timeout=120, **kwargs)


def concurrently(calls):
    """Run (url, body) posts at once; the responses in order."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(lambda c: post(c[0], json=c[1]), calls))


def batches(gate: Path, kind: str) -> list[list[str]]:
    path = gate / f"{kind}-batches.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------------------------------- containment
@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_poisoned_text_request_fails_alone(apps, batching):
    """8 valid requests (6 /generate in both modes, 2 /v1/completions) share a batch with a request whose seed
    overflows in the decoder and one whose speculative decoding faults: the 8 get 200 and exactly the output they
    get alone; the culprits get 422 (input the decoder refused) and 500 (server fault). With static batching the
    batch is ``@serve.batch``'s (a 1 s window). With continuous batching a ``SLOW`` request holds the decoding
    thread until all ten have queued (HTTP arrivals on a loaded machine can spread past any window), so they
    join the running batch as one cohort."""
    app = apps["poisoned"] if batching == "continuous" else apps["poisoned-static"]
    sampling = {"temperature": 1.0, "top_p": 1.0}
    valid = [("/generate", {"prompt": p, "max_new_tokens": n, "seed": s, "mode": "both", "gamma": 3, **sampling})
             for p, n, s in (("import os", 20, 1), ("x", 12, 2), ("class Foo(object):", 16, 3), ("def", 20, 4),
                             ("for i in", 8, 5), ("while True:", 14, 6))]
    valid += [("/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 10, "seed": s, **sampling})
              for p, s in (("return ", 7), ("print(", 8))]
    poisoned = [("/generate", {"prompt": "POISON-SEED x", "max_new_tokens": 10, "seed": 9, "mode": "both",
                               "gamma": 3, **sampling}),
                ("/generate", {"prompt": "POISON-FAULT y", "max_new_tokens": 10, "seed": 10, "mode": "both",
                               "gamma": 3, **sampling})]
    kind = f"base-{batching}"
    before = len(batches(apps["gate"], kind))
    calls = [(app + path, body) for path, body in valid + poisoned]
    if batching == "static":
        results = concurrently(calls)
    else:
        from ray import serve

        handle = serve.get_deployment_handle("TextGenerator", app_name="poisoned")
        rows = sum(2 if body.get("mode") == "both" else 1 for _, body in calls)
        pool = ThreadPoolExecutor(len(calls))

        def queue_all():  # while SLOW holds the decoding thread: send them all, wait until every row is queued
            futures = [pool.submit(post, url, json=body) for url, body in calls]
            deadline = time.monotonic() + 50
            while handle.queued.remote().result(timeout_s=20) < rows:
                assert time.monotonic() < deadline, "the requests never all queued"
                time.sleep(0.05)
            return futures

        futures, _, slow = released_after(apps, lambda: post(app + "/generate", json={"prompt": "SLOW",
                                                                                       "max_new_tokens": 8}), queue_all)
        results = [f.result() for f in futures]
        pool.shutdown()
        assert slow.status_code == 200, slow.text
    ok = [r.status_code == 200 for r in results[:8]]
    print(f"\npoisoned text batch ({batching}): {sum(ok)} of 8 valid requests succeeded; culprits answered "
          f"{[r.status_code for r in results[8:]]}")
    # they did share a batch: one base batch held every request
    shared = [b for b in batches(apps["gate"], kind)[before:] if len(b) == len(valid) + len(poisoned)]
    assert shared, batches(apps["gate"], kind)[before:]
    assert all(ok), [(r.status_code, r.text[:200]) for r in results[:8]]
    seed_culprit, fault_culprit = results[8:]
    assert seed_culprit.status_code == 422 and "a seed must be an integer" in seed_culprit.text, seed_culprit.text
    assert fault_culprit.status_code == 500 and "RuntimeError" in fault_culprit.text, fault_culprit.text
    for (path, body), res in zip(valid, results):
        alone = post(apps["real"] + path, json=body).json()
        if path == "/generate":
            got = {m: r["text"] for m, r in res.json()["results"].items()}
            assert got == {m: r["text"] for m, r in alone["results"].items()}, body
        else:
            assert res.json()["choices"][0]["text"] == alone["choices"][0]["text"], body


def test_a_poisoned_image_request_fails_alone(apps):
    valid = [{"prompt": p, "seed": s, "response_format": "b64_json"}
             for s, p in enumerate(("a red circle", "a blue square", "a green triangle", "a small pink circle",
                                    "a big yellow square", "two circles", "a triangle on the left", "a square"))]
    poisoned = [{"prompt": "POISON-SEED", "seed": 1, "response_format": "b64_json"},
                {"prompt": "POISON-FAULT", "seed": 2, "response_format": "b64_json"}]
    before = len(batches(apps["gate"], "images"))
    results = concurrently([(apps["poisoned"] + "/images/generate", b) for b in valid + poisoned])
    ok = [r.status_code == 200 for r in results[:8]]
    print(f"\npoisoned image batch: {sum(ok)} of 8 valid requests succeeded; culprits answered "
          f"{[r.status_code for r in results[8:]]}")
    assert any(len(b) == 10 for b in batches(apps["gate"], "images")[before:]), batches(apps["gate"], "images")
    assert all(ok), [(r.status_code, r.text[:200]) for r in results[:8]]
    assert [r.status_code for r in results[8:]] == [422, 500], [r.text for r in results[8:]]
    for body, res in zip(valid, results):
        alone = post(apps["real"] + "/images/generate", json=body).json()
        assert [im["b64_png"] for im in res.json()["images"]] == [im["b64_png"] for im in alone["images"]]


@pytest.mark.parametrize("app", ["poisoned", "poisoned-static"])
def test_a_failing_completion_stream_ends_with_an_error_event(apps, app):
    """Was a 200 with an empty body (the connection dropped): now the stream's last event is an ``error``, which
    the openai client raises as an APIError."""
    from openai import APIError, OpenAI

    body = {"model": "tiny", "prompt": "POISON-SEED", "max_tokens": 8, "stream": True}
    res = requests.post(apps[app] + "/v1/completions", json=body, stream=True, timeout=120)
    assert res.status_code == 200
    blocks = [b for b in res.text.split("\n\n") if b.strip()]
    last = dict(line.split(": ", 1) for line in blocks[-1].split("\n"))
    message = json.loads(last["data"])["error"]["message"]
    assert last["event"] == "error" and "a seed must be an integer" in message, blocks
    client = OpenAI(base_url=apps[app] + "/v1", api_key="unused")
    with pytest.raises(APIError, match="a seed must be an integer"):
        list(client.completions.create(model="tiny", prompt="POISON-SEED", max_tokens=8, stream=True))


# ---------------------------------------------------------------------------------------------- responsiveness
def released_after(apps, long_call, probe):
    """Start ``long_call`` (held in its decoder until released), run ``probe`` while it is held, then release it.
    Returns (probe's result, whether the long call was still running when the probe returned, long call's result)."""
    gate = apps["gate"]
    for name in ("started", "release"):
        (gate / name).unlink(missing_ok=True)
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(long_call)
        deadline = time.monotonic() + 60
        while not (gate / "started").exists():
            assert time.monotonic() < deadline and not long.done(), "the long request never started decoding"
            time.sleep(0.01)
        try:
            probed = probe()
            running = not long.done()
        finally:
            (gate / "release").touch()
        return probed, running, long.result()


@pytest.mark.parametrize("app", ["poisoned", "poisoned-static"])
def test_healthz_answers_while_a_batch_decodes(apps, app):
    url = apps[app]

    def probe():
        return [requests.get(f"{url}{path}", timeout=20) for path in ("/healthz", "/v1/models", "/models/info")]

    probed, running, long = released_after(
        apps, lambda: post(f"{url}/generate", json={"prompt": "SLOW", "max_new_tokens": 8}), probe)
    assert [r.status_code for r in probed] == [200, 200, 200] and probed[0].json()["status"] == "ok"
    assert running  # the answers came while the batch was still decoding
    assert long.status_code == 200, long.text


def test_the_image_replica_answers_while_it_draws(apps):
    from ray import serve

    handle = serve.get_deployment_handle("ImageGenerator", app_name="poisoned")
    probed, running, long = released_after(
        apps, lambda: post(apps["poisoned"] + "/images/generate", json={"prompt": "SLOW", "seed": 1}),
        lambda: handle.info.remote().result(timeout_s=20))
    assert probed["id"] == "dalle_shapes_debug" and running
    assert long.status_code == 200, long.text


# ---------------------------------------------------------------------------------------------- fuzz
# per operation and generation mode (positive, negative); EFFTX_FUZZ_EXAMPLES=N runs a longer search
FUZZ_EXAMPLES = int(os.environ.get("EFFTX_FUZZ_EXAMPLES", "100"))


def test_fuzz_every_operation_no_5xx_and_still_healthy(apps):
    """Property-based fuzz (schemathesis) of every operation in the real app's OpenAPI schema, over HTTP, with
    data that fits the schema and data that does not: never a 5xx, and negative data is refused with a 4xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import negative_data_rejection

    url = apps["real"]
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", timeout=30)
    ops = [result.ok() for result in schema.get_all_operations()]
    counts: dict[str, int] = {}
    t0 = time.perf_counter()
    for op in ops:
        takes_input = bool(op.body) or bool(list(op.iter_parameters()))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if takes_input else (GenerationMode.POSITIVE,):
            @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=False,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case):
                res = case.call(base_url=url, timeout=120)
                case.validate_response(res, checks=[not_a_server_error, negative_data_rejection])
                counts[f"{op.label} {mode.value}"] = counts.get(f"{op.label} {mode.value}", 0) + 1

            run()
    secs = time.perf_counter() - t0
    print(f"\nfuzz: {len(ops)} operations, {sum(counts.values())} cases in {secs:.0f} s")
    for label, n in sorted(counts.items()):
        print(f"  {n:4d}  {label}")
    assert len(ops) == 8 and all(counts.get(f"{op.label} positive") for op in ops)
    health = requests.get(f"{url}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok"

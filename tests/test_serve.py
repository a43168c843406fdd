"""The text app on Ray Serve, started on 127.0.0.1 and queried over real HTTP (and with the openai client)."""

from __future__ import annotations

import json

import pytest
import requests

from netutil import free_port

pytestmark = pytest.mark.slow

LIMITS = {"max_new_tokens": 40, "max_prompt_bytes": 64, "max_body_bytes": 4096}
IMAGE_LIMITS = {"max_images": 4, "max_cond_scale": 5}
CACHE_MIB = 0.5  # the debug pair's caches: 0.047 MiB a base row of 64 positions (the fewest the slots take; 0.094 of
# the context's 128), 0.0625 a speculative one: ten base rows of short requests at most


# every test here runs against both engines: the scheduler on a thread of the replica, and in a decoding process of
# its own (efftx.serving.engine_process)
@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, ray_cluster, debug_exports):
    from ray import serve

    from efftx.serving.text import build

    paths = debug_exports
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"target": paths["target"], "draft": paths["draft"], "name": "tiny",
                     "limits": json.dumps(LIMITS),
                     "batch_wait_timeout_s": "0.25",  # long enough for concurrent test requests to meet
                     "cache_mib": str(CACHE_MIB),
                     "dalle": paths["dalle"], "image_batch_wait_timeout_s": "0.25",
                     "image_limits": json.dumps(IMAGE_LIMITS), "engine": request.param}),
              name="text", route_prefix="/")
    yield Server(f"http://127.0.0.1:{port}", request.param)
    serve.shutdown()


class Server(str):
    """The app's address, which knows its engine."""

    def __new__(cls, url: str, engine: str):
        self = super().__new__(cls, url)
        self.engine = engine
        return self


def post(url, **kwargs):
    return requests.post(url, timeout=120, **kwargs)


def test_health_models_and_docs(server):
    assert requests.get(f"{server}/healthz", timeout=30).json() == {"status": "ok", "model": "tiny", "speculative": True,
                                                                  "images": True}
    ids = [m["id"] for m in requests.get(f"{server}/v1/models", timeout=30).json()["data"]]
    assert ids == ["tiny", "tiny-speculative", "dalle_shapes_debug"]
    assert requests.get(f"{server}/docs", timeout=30).status_code == 200
    assert "/generate" in requests.get(f"{server}/openapi.json", timeout=30).json()["paths"]


def test_models_info_names_the_device_and_the_batching(server):
    info = requests.get(f"{server}/models/info", timeout=30).json()
    assert [(m["role"], m["device"]) for m in info["models"]] == [("target", "cpu"), ("draft", "cpu"), ("image", "cpu")]
    warmed = info["batching"].pop("warm_up_s")
    assert info["batching"] == {"mode": "continuous", "max_batch_size": 32, "batch_wait_timeout_s": 0.25,
                                # base, speculative and coupled speculative: 16, 8, ..., 1
                                "warm_up_rows": 3 * (16 + 8 + 4 + 2 + 1),
                                "compile": "off", "steps_per_round": 1, "pipeline": False,
                                "engine": server.engine}
    assert warmed > 0
    assert info["threads"] == 1  # the replica's torch threads (the default)


def test_models_info_reports_the_schedulers_measured_costs(server):
    """After a request of each mode, the continuous-batching scheduler's measured step and prefill times per running
    batch: positive milliseconds per row count and per prompt tokens; and its rounds' time, split into the passes'
    and the scheduling's."""
    r = post(f"{server}/generate", json={"prompt": "abc", "max_new_tokens": 6, "temperature": 0, "mode": "both",
                                        "gamma": 2})
    assert r.status_code == 200, r.text
    info = requests.get(f"{server}/models/info", timeout=30).json()
    costs, timing = info["costs"], info["scheduling"]
    # where the rounds' time went: the passes' and the scheduling's besides, per round (the rounds it ran)
    assert timing["rounds"] >= 3 and timing["pass_us"] > 0 and timing["host_us"] > 0
    assert timing["round_us"] == pytest.approx(timing["pass_us"] + timing["host_us"], abs=0.2)
    assert 0 < timing["host_share"] < 1
    assert {"base", "speculative gamma=2"} <= set(costs)
    for batch in ("base", "speculative gamma=2"):
        assert costs[batch]["step_ms"]["1"] > 0 and costs[batch]["prefill_ms"]
        assert all(ms > 0 for ms in costs[batch]["prefill_ms"].values())
    assert costs["base"]["tokens_per_step"] == 1.0 and costs["speculative gamma=2"]["tokens_per_step"] >= 1.0
    assert costs["base"]["positions"] == 64  # the fewest a slot takes: the debug model's 128 hold twice these rows
    # this request's steps are of one row; the others come from the warm-up's batches (16, 8, ... rows): the
    # replica's scheduler started from the costs its warm-up measured
    assert max(map(int, costs["base"]["step_ms"])) >= 8
    # coupled requests' draft lengths: the warm-up measured a step at every length 0..5 (the default gamma)
    lengths = costs["speculative gamma=5 coupled"]["draft_lengths"]
    assert set(lengths["step_ms"]) == {str(g) for g in range(6)} and all(n > 0 for n in lengths["steps"])
    assert 0 < lengths["acceptance"] < 1
    for batch in ("base", "speculative gamma=2"):  # this request's prefill passes (and earlier tests')
        assert costs[batch]["prefill_passes"] >= 1
        assert costs[batch]["padded_tokens"] >= costs[batch]["prompt_tokens"] > 0


def test_generate_both_modes_greedy_agree(server):
    r = post(f"{server}/generate", json={"prompt": "def foo(", "max_new_tokens": 24, "temperature": 0,
                                        "mode": "both", "gamma": 3})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert res["base"]["text"] == res["speculative"]["text"] and res["base"]["tokens"] == 24
    spec = res["speculative"]
    assert 0 <= spec["mean_accepted"] <= 3 and len(spec["acceptance_histogram"]) == 4
    assert spec["target_calls"] >= 1 and res["base"]["tokens_per_s"] > 0


def test_coupled_speculative_text_is_the_base_text(server):
    """``coupled``: sampled speculative decoding gives the base text of the same seed and settings, from /generate
    (both modes in one request), a stream and a streamed completion; without it the text is another sample."""
    from openai import OpenAI

    body = {"prompt": "def foo(", "max_new_tokens": 24, "temperature": 1.0, "top_k": 20, "seed": 9, "mode": "both",
            "gamma": 3, "coupled": True}
    res = post(f"{server}/generate", json=body).json()["results"]
    assert res["base"]["text"] == res["speculative"]["text"] and res["speculative"]["tokens"] == 24
    assert len(res["speculative"]["acceptance_histogram"]) == 4
    ratio = post(f"{server}/generate", json={**body, "coupled": False}).json()["results"]
    assert ratio["base"]["text"] == res["base"]["text"] and ratio["speculative"]["text"] != res["base"]["text"]
    with requests.post(f"{server}/generate/stream", json={**body, "mode": "speculative"}, stream=True,
                       timeout=120) as r:
        blocks = [b for b in "\n".join(r.iter_lines(decode_unicode=True)).split("\n\n") if b.strip()]
    assert blocks[-1].startswith("event: done")
    assert json.loads(blocks[-1].split("data: ", 1)[1])["text"] == res["base"]["text"]
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    kwargs = {"prompt": "x = ", "max_tokens": 20, "temperature": 1.0, "seed": 5}
    base = client.completions.create(model="tiny", **kwargs).choices[0].text
    chunks = client.completions.create(model="tiny-speculative", stream=True, extra_body={"coupled": True}, **kwargs)
    assert "".join(c.choices[0].text for c in chunks) == base


def test_sampling_is_seeded(server):
    body = {"prompt": "x = ", "max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "seed": 7, "mode": "speculative"}
    a, b = post(f"{server}/generate", json=body).json(), post(f"{server}/generate", json=body).json()
    assert a["results"]["speculative"]["text"] == b["results"]["speculative"]["text"]


def test_adaptive_gamma_is_the_librarys_adaptive_speculative_decoding(server, debug_exports):
    """``adaptive_gamma``: the request decodes as the library's speculative decoding with an adaptive gamma capped
    at the limits' max_gamma (8 here): the same tokens and acceptance, from /generate and from a stream."""
    from efftx.export import load_export
    from efftx.generation.decode import decode_bytes
    from efftx.generation.speculative import speculative_generate

    target, draft = load_export(debug_exports["target"])[0], load_export(debug_exports["draft"])[0]
    prompt, n = "x = ", 20
    body = {"prompt": prompt, "max_new_tokens": n, "temperature": 1.0, "top_k": 20, "seed": 7,
            "mode": "speculative", "gamma": 2, "adaptive_gamma": True}
    out, stats = speculative_generate(target, draft, [list(prompt.encode())], n, gamma=2, temperature=1.0, top_k=20,
                                      seed=7, adaptive_gamma=True, max_gamma=8)
    res = post(f"{server}/generate", json=body).json()["results"]["speculative"]
    assert res["text"] == decode_bytes(out[0])
    assert (res["acceptance_histogram"], res["draft_calls"]) == (stats.histogram, stats.draft_calls)
    assert len(res["acceptance_histogram"]) == 9  # 0..8 accepted: the cap
    with requests.post(f"{server}/generate/stream", json=body, stream=True, timeout=120) as r:
        blocks = [b for b in "\n".join(r.iter_lines(decode_unicode=True)).split("\n\n") if b.strip()]
    done = json.loads(blocks[-1].split("data: ", 1)[1])
    assert blocks[-1].startswith("event: done") and done["acceptance_histogram"] == stats.histogram
    fixed = post(f"{server}/generate", json={**body, "adaptive_gamma": False}).json()["results"]["speculative"]
    assert len(fixed["acceptance_histogram"]) == 3


def test_completions_take_gamma_and_adaptive_gamma(server, debug_exports):
    """efftx's ``gamma`` / ``adaptive_gamma`` on the speculative completion model (sent as the OpenAI client's
    ``extra_body``): plain and streamed completions are the library's speculative decoding with that schedule; a
    gamma past the limits is a 422 naming it."""
    from openai import OpenAI

    from efftx.export import load_export
    from efftx.generation.decode import decode_bytes
    from efftx.generation.speculative import speculative_generate

    target, draft = load_export(debug_exports["target"])[0], load_export(debug_exports["draft"])[0]
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    prompt, n = "x = ", 20

    def library(**schedule):
        return decode_bytes(speculative_generate(target, draft, [list(prompt.encode())], n, temperature=1.0, seed=5,
                                                 **schedule)[0][0])

    for extra, expected in (({"gamma": 2, "adaptive_gamma": True}, library(gamma=2, adaptive_gamma=True, max_gamma=8)),
                            ({"gamma": 3}, library(gamma=3))):
        done = client.completions.create(model="tiny-speculative", prompt=prompt, max_tokens=n, temperature=1.0,
                                         seed=5, extra_body=extra)
        assert done.choices[0].text == expected, extra
        chunks = client.completions.create(model="tiny-speculative", prompt=prompt, max_tokens=n, temperature=1.0,
                                           seed=5, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in chunks) == expected, extra
    assert library(gamma=2, adaptive_gamma=True, max_gamma=8) != library(gamma=3)  # the schedule shows in the text
    r = post(f"{server}/v1/completions", json={"model": "tiny-speculative", "prompt": "hi", "gamma": 99})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == "gamma", r.text


def test_openai_client_plain_and_streaming(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    greedy = post(f"{server}/generate", json={"prompt": "import ", "max_new_tokens": 12, "temperature": 0}).json()
    for model in ("tiny", "tiny-speculative"):
        done = client.completions.create(model=model, prompt="import ", max_tokens=12, temperature=0)
        assert done.choices[0].text == greedy["results"]["base"]["text"]
        assert done.usage.completion_tokens == 12
        chunks = list(client.completions.create(model=model, prompt="import ", max_tokens=12, temperature=0,
                                                stream=True))
        assert len(chunks) > 1
        assert "".join(c.choices[0].text for c in chunks) == greedy["results"]["base"]["text"]
        assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("kwargs, status, field", [
    ({"data": b"{not json", "headers": {"content-type": "application/json"}}, 422, None),
    ({"json": {"prompt": "hi", "max_new_tokens": "many"}}, 422, "max_new_tokens"),
    ({"json": {"prompt": ""}}, 422, "prompt"),
    ({"json": {"prompt": "x" * 65}}, 422, "prompt"),
    ({"json": {"prompt": "hi", "max_new_tokens": 41}}, 422, "max_new_tokens"),
    ({"json": {"prompt": "hi", "max_new_tokens": 8, "mode": "speculative", "gamma": 99}}, 422, "gamma"),
    ({"json": {"prompt": "hi", "max_new_tokens": 8, "temperature": 9.5}}, 422, "temperature"),
    ({"json": {"prompt": "hi", "mode": "fast"}}, 422, "mode"),
    ({"json": {"prompt": "hi", "bogus": 1}}, 422, "bogus"),
    ({"data": b'{"prompt": "\xff\xfe"}', "headers": {"content-type": "application/json"}}, 400, None),
])
def test_bad_input_is_a_4xx_naming_the_field_and_the_replica_survives(server, kwargs, status, field):
    r = post(f"{server}/generate", **kwargs)
    assert r.status_code == status, r.text
    if field:
        assert any(field in map(str, err["loc"]) for err in r.json()["detail"]), r.text
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200


def test_completions_unknown_model(server):
    r = post(f"{server}/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 422 and "unknown model" in r.text


def test_completions_stream_is_server_sent_events(server):
    r = requests.post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "import ", "max_tokens": 10,
                                                       "temperature": 0, "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == "tiny" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 10
    plain = post(f"{server}/v1/completions", json={"model": "tiny", "prompt": "import ", "max_tokens": 10,
                                                   "temperature": 0}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]


def test_concurrent_requests_are_decoded_as_one_batch(server):
    """Concurrent requests of different prompt lengths, lengths and seeds share batched passes, and each
    gets exactly the text it gets alone (row seeds are per request)."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"prompt": p, "max_new_tokens": n, "temperature": 1.0, "top_k": 20, "seed": s, "mode": "both",
               "gamma": 3} for p, n, s in (("import os", 20, 1), ("x", 12, 2), ("class Foo(object):", 16, 3),
                                           ("def", 20, 4))]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: post(f"{server}/generate", json=b).json(), bodies))
    assert max(r["results"]["base"]["batch_size"] for r in together) > 1
    for body, res in zip(bodies, together):
        alone = post(f"{server}/generate", json=body).json()
        for mode in ("base", "speculative"):
            assert res["results"][mode]["text"] == alone["results"][mode]["text"]
            assert res["results"][mode]["tokens"] == body["max_new_tokens"]



def test_a_burst_past_the_cache_budget_waits_for_room_and_every_request_gets_its_solo_text(server):
    """Twelve concurrent requests, the cache budget (``cache_mib``) holding ten base rows: every one is answered
    with the text it gets alone, no step holds more than ten rows, and GET /models/info reports the budget and at
    most that much held (slots and pooled caches)."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"prompt": f"x = {i}", "max_new_tokens": 8 + i % 3, "temperature": 1.0, "top_k": 20, "seed": 40 + i}
              for i in range(12)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: post(f"{server}/generate", json=b), bodies))
    assert all(r.status_code == 200 for r in together), [r.text for r in together if r.status_code != 200]
    results = [r.json()["results"]["base"] for r in together]
    assert max(r["batch_size"] for r in results) <= 10, [r["batch_size"] for r in results]
    memory = requests.get(f"{server}/models/info", timeout=30).json()["cache_memory"]
    assert memory["limit_mib"] == CACHE_MIB and memory["held_mib"] + memory["pooled_mib"] <= CACHE_MIB
    for body, res in zip(bodies, results):
        assert res["text"] == post(f"{server}/generate", json=body).json()["results"]["base"]["text"]


def test_streams_join_the_running_batch_and_short_requests_leave_early(server):
    """Continuous batching over HTTP: a long request and a stream arrive together (within the 0.25 s admission
    window) and share decoding steps; a short request sent once the stream has its first tokens joins the running
    batch, is answered as soon as it has its tokens (long before the long one), and each gets exactly what it gets
    alone. Arrival times over HTTP are not under the test's control: the exactness checks hold on every attempt,
    the sharing must be seen on one of three."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    sampling = {"temperature": 1.0, "top_k": 20}
    long = {"prompt": "import os", "max_new_tokens": 40, "seed": 1, "mode": "both", "gamma": 3, **sampling}
    short = {"prompt": "x", "max_new_tokens": 4, "seed": 2, "mode": "base", **sampling}
    streamed = {"prompt": "def f(", "max_new_tokens": 24, "seed": 3, "mode": "speculative", "gamma": 3, **sampling}
    alone = {name: post(f"{server}/generate", json=body).json()["results"]
             for name, body in (("long", long), ("short", short), ("streamed", streamed))}

    def stream_done(body, started):
        lines = []
        with requests.post(f"{server}/generate/stream", json=body, stream=True, timeout=120) as res:
            for line in res.iter_lines(decode_unicode=True):
                lines.append(line)
                if line == "event: step":
                    started.set()  # the stream decodes: its batch is running
        blocks = [b for b in "\n".join(lines).split("\n\n") if b.strip()]
        steps = [json.loads(b.split("data: ", 1)[1]) for b in blocks if b.startswith("event: step")]
        assert blocks[-1].startswith("event: done"), blocks[-1]
        return steps, json.loads(blocks[-1].split("data: ", 1)[1])

    shared = []
    for _ in range(3):
        started = threading.Event()
        with ThreadPoolExecutor(3) as pool:
            jobs = [pool.submit(post, f"{server}/generate", json=long), pool.submit(stream_done, streamed, started)]
            assert started.wait(60)
            short_res = post(f"{server}/generate", json=short).json()["results"]["base"]
            long_res = jobs[0].result().json()["results"]
            steps, done = jobs[1].result()
        assert {m: r["text"] for m, r in long_res.items()} == {m: r["text"] for m, r in alone["long"].items()}
        assert short_res["text"] == alone["short"]["base"]["text"]
        assert (done["text"], done["mean_accepted"]) == (alone["streamed"]["speculative"]["text"],
                                                         alone["streamed"]["speculative"]["mean_accepted"])
        assert len(steps) == done["steps"] and done["tokens"] == 24
        assert short_res["first_token_ms"] <= short_res["latency_ms"]
        if short_res["batch_size"] >= 2 and done["batch_size"] >= 2:
            shared.append((short_res["latency_ms"], long_res["base"]["latency_ms"]))
            break
    assert shared, "the short request never joined a running batch"
    short_ms, long_ms = shared[0]
    assert short_ms < long_ms  # the short request left the batch as soon as it had its 4 tokens


# ---------------------------------------------------------------------------------------------- images
def png_size(data: bytes) -> tuple[int, int]:
    from io import BytesIO

    from PIL import Image

    with Image.open(BytesIO(data)) as im:
        im.load()  # a truncated or corrupt PNG fails here
        return im.size


def test_one_image_is_a_png_and_several_are_json(server):
    from efftx import recipes as r

    side = r.get("dalle_shapes_debug").vae.image_size
    res = post(f"{server}/images/generate", json={"prompt": "a red circle on a blue background", "seed": 1})
    assert res.status_code == 200 and res.headers["content-type"] == "image/png"
    assert png_size(res.content) == (side, side)
    again = post(f"{server}/images/generate", json={"prompt": "a red circle on a blue background", "seed": 1})
    assert again.content == res.content  # the same seed draws the same image
    many = post(f"{server}/images/generate", json={"prompt": "a small green square", "n": 3, "seed": 5,
                                                   "cond_scale": 3.0, "size": 2 * side}).json()
    assert len(many["images"]) == 3 and many["size"] == 2 * side and many["latency_ms"] > 0
    import base64

    sizes = {png_size(base64.b64decode(im["b64_png"])) for im in many["images"]}
    assert sizes == {(2 * side, 2 * side)}


def test_openai_client_generates_images(server):
    import base64

    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    out = client.images.generate(model="dalle_shapes_debug", prompt="a yellow triangle", n=2, size="64x64",
                                 response_format="b64_json")
    assert len(out.data) == 2
    assert all(png_size(base64.b64decode(d.b64_json)) == (64, 64) for d in out.data)


def test_concurrent_image_requests_batch_and_match_their_solo_images(server):
    from concurrent.futures import ThreadPoolExecutor

    bodies = [{"prompt": p, "n": n, "seed": s, "response_format": "b64_json"}
              for p, n, s in (("a red circle", 1, 1), ("a blue square in the upper left", 2, 2), ("a pink triangle", 1, 3))]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda b: post(f"{server}/images/generate", json=b).json(), bodies))
    assert max(r["batch_size"] for r in together) > 1
    for body, res in zip(bodies, together):
        alone = post(f"{server}/images/generate", json=body).json()
        assert [im["b64_png"] for im in res["images"]] == [im["b64_png"] for im in alone["images"]]


@pytest.mark.parametrize("body, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": "x" * 300}, "prompt"),
    ({"prompt": "a red circle", "n": 5}, "n"),
    ({"prompt": "a red circle", "n": 0}, "n"),
    ({"prompt": "a red circle", "cond_scale": 6}, "cond_scale"),
    ({"prompt": "a red circle", "filter_thres": 1.5}, "filter_thres"),
    ({"prompt": "a red circle", "size": 4096}, "size"),
    ({"prompt": "a red circle", "n": "many"}, "n"),
    ({"prompt": "a red circle", "colour": "red"}, "colour"),
    ({"prompt": "a red circle", "response_format": "jpeg"}, "response_format"),
])
def test_bad_image_requests_are_4xx_naming_the_field(server, body, field):
    res = post(f"{server}/images/generate", json=body)
    assert 400 <= res.status_code < 500
    assert field in json.dumps(res.json())
    assert post(f"{server}/images/generate", json={"prompt": "a red circle"}).status_code == 200


def test_bad_openai_image_requests_are_4xx(server):
    for body, field in (({"prompt": "a red circle", "response_format": "url"}, "response_format"),
                        ({"prompt": "a red circle", "size": "64x32"}, "size"),
                        ({"prompt": "a red circle", "model": "nope"}, "model")):
        res = post(f"{server}/v1/images/generations", json=body)
        assert res.status_code == 422 and field in json.dumps(res.json())


# ---------------------------------------------------------------------------------------------- limits
def test_openai_image_size_below_the_minimum_is_a_422_naming_size(server):
    """Was a 500: "4x4" passed the size parser and failed building the internal request."""
    for size in ("4x4", "0x0", "1024X1024", "064x064"):
        res = post(f"{server}/v1/images/generations", json={"prompt": "a red circle", "size": size})
        assert res.status_code == 422 and any(err["loc"][-1] == "size" for err in res.json()["detail"]), res.text
    import base64

    ok = post(f"{server}/v1/images/generations", json={"prompt": "a red circle", "size": "8x8", "seed": 1})
    assert ok.status_code == 200 and png_size(base64.b64decode(ok.json()["data"][0]["b64_json"])) == (8, 8)


@pytest.mark.parametrize("path, body, field", [
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "seed": False}, "seed"),  # was accepted as seed 0
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "seed": 1.0}, "seed"),
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "seed": 2**64}, "seed"),  # was a 500 (overflow)
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "seed": 2**63}, "seed"),
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "seed": -1}, "seed"),
    ("/generate", {"prompt": "hi", "max_new_tokens": True}, "max_new_tokens"),
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "temperature": "0.5"}, "temperature"),
    ("/generate", {"prompt": "\ud800", "max_new_tokens": 4}, "prompt"),  # a lone surrogate: was a 500
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "gamma": 42}, "gamma"),  # base mode too, as the schema says
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "mode": "speculative", "temperature": 9.8e-126,
                   "top_k": 801822355082104390287360}, "top_k"),  # was a 500 (the fuzz test's find)
    ("/generate", {"prompt": "hi", "max_new_tokens": 4, "top_k": 2**63}, "top_k"),
    ("/generate/stream", {"prompt": "hi", "max_new_tokens": 4, "top_k": 2**64}, "top_k"),
    ("/generate/stream", {"prompt": "hi", "max_new_tokens": 4, "seed": 2**64}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4, "seed": 2**64, "stream": True}, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "x", "stream": "yes"}, "stream"),
    ("/images/generate", {"prompt": "a red circle", "seed": 2**64}, "seed"),
    ("/images/generate", {"prompt": "a red circle", "seed": 2**63 - 2, "n": 3}, "seed"),  # seed + 2 overflows
    ("/images/generate", {"prompt": "a red circle", "n": 1.0}, "n"),
    ("/v1/images/generations", {"prompt": "a red circle", "seed": True}, "seed"),
])
def test_strict_types_and_seed_range_are_422s_naming_the_field(server, path, body, field):
    res = post(f"{server}{path}", json=body)
    assert res.status_code == 422 and any(err["loc"][-1] == field for err in res.json()["detail"]), res.text


def test_largest_seeds_are_served(server):
    res = post(f"{server}/generate", json={"prompt": "hi", "max_new_tokens": 4, "seed": 2**63 - 1, "temperature": 1.0})
    assert res.status_code == 200, res.text
    res = post(f"{server}/images/generate", json={"prompt": "a red circle", "seed": 2**63 - 2, "n": 2,
                                                 "response_format": "b64_json"})
    assert res.status_code == 200 and [im["seed"] for im in res.json()["images"]] == [2**63 - 2, 2**63 - 1]


def text_of(res) -> str:
    assert res.status_code == 200, res.text
    return res.json()["results"]


def test_tiny_temperatures_and_top_p_decode_greedily(server):
    """Were 500s (NaN probabilities): a temperature below the floor is greedy; top_p keeps the top token."""
    greedy = text_of(post(f"{server}/generate", json={"prompt": "def ", "max_new_tokens": 12, "temperature": 0,
                                                       "mode": "both", "gamma": 3}))
    for t in (1e-40, 1e-300, 5e-324):
        tiny = text_of(post(f"{server}/generate", json={"prompt": "def ", "max_new_tokens": 12, "temperature": t,
                                                         "mode": "both", "gamma": 3, "seed": 4}))
        assert {m: r["text"] for m, r in tiny.items()} == {m: r["text"] for m, r in greedy.items()}
    sampled = {"prompt": "def ", "max_new_tokens": 12, "temperature": 0.9, "mode": "both", "gamma": 3, "seed": 4}
    free = text_of(post(f"{server}/generate", json=sampled))
    wide = text_of(post(f"{server}/generate", json={**sampled, "top_k": 2**63 - 1}))  # past the vocabulary: no filter
    assert {m: r["text"] for m, r in wide.items()} == {m: r["text"] for m, r in free.items()}
    nucleus = text_of(post(f"{server}/generate", json={"prompt": "def ", "max_new_tokens": 12, "temperature": 1.0,
                                                        "top_p": 1e-300, "mode": "both", "gamma": 3, "seed": 4}))
    assert nucleus["base"]["text"] == greedy["base"]["text"]  # one token left: the argmax
    body = {"prompt": "a red circle", "seed": 3, "response_format": "b64_json"}
    zero = post(f"{server}/images/generate", json={**body, "temperature": 0})
    tiny = post(f"{server}/images/generate", json={**body, "temperature": 1e-40})
    assert zero.status_code == tiny.status_code == 200, tiny.text
    assert tiny.json()["images"][0]["b64_png"] == zero.json()["images"][0]["b64_png"]


def openapi(server) -> dict:
    res = requests.get(f"{server}/openapi.json", timeout=30)
    assert res.status_code == 200
    return res.json()


def test_the_schema_states_the_configured_limits(server):
    schema = openapi(server)
    props = {name: c.get("properties", {}) for name, c in schema["components"]["schemas"].items()}
    gen = props["GenerateRequest"]
    assert (gen["gamma"]["minimum"], gen["gamma"]["maximum"]) == (1, 8)  # gamma 42 was refused, the schema said nothing
    assert gen["max_new_tokens"]["maximum"] == LIMITS["max_new_tokens"] and gen["prompt"]["maxLength"] == 64
    assert gen["temperature"]["maximum"] == 2.0
    assert gen["seed"]["anyOf"][0]["maximum"] == gen["top_k"]["maximum"] == 2**63 - 1  # exact (FastAPI: 2**63)
    assert props["CompletionRequest"]["model"]["enum"] == ["tiny", "tiny-speculative"]
    img = props["ImageRequest"]
    assert (img["n"]["maximum"], img["cond_scale"]["maximum"], img["size"]["anyOf"][0]["maximum"]) == (4, 5, 1024)
    assert props["OpenAIImageRequest"]["model"]["anyOf"][0]["enum"] == ["dalle_shapes_debug"]
    for path, ops in schema["paths"].items():
        for op in ops.values():
            if "requestBody" in op:
                assert "4096 bytes" in op["responses"]["413"]["description"], path
    assert requests.get(f"{server}/docs", timeout=30).status_code == 200


# A request that is valid for each operation; every stated bound is probed at the bound and one step past it.
VALID = {"/generate": {"prompt": "hi", "max_new_tokens": 4, "mode": "both", "gamma": 3},
         "/generate/stream": {"prompt": "hi", "max_new_tokens": 4, "gamma": 3},
         "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 4},
         "/images/generate": {"prompt": "a red circle", "response_format": "b64_json"},
         "/v1/images/generations": {"prompt": "a red circle"}}


def stated_bounds(schema: dict):
    """(path, field, value at the bound, value past it) for every maximum/maxLength/enum of a request field."""
    for path, ops in schema["paths"].items():
        body = ops.get("post", {}).get("requestBody")
        if not body:
            continue
        ref = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        for field, prop in schema["components"]["schemas"][ref]["properties"].items():
            for branch in prop.get("anyOf", [prop]):
                if "maximum" in branch and field != "seed":
                    m = branch["maximum"]
                    yield path, field, m, (m + 1 if branch["type"] == "integer" else m * (1 + 1e-9))
                if "maxLength" in branch:
                    yield path, field, "x" * branch["maxLength"], "x" * (branch["maxLength"] + 1)
                if "enum" in branch and field not in ("mode",):
                    yield path, field, branch["enum"][-1], "nope"


def test_every_stated_bound_is_the_enforced_one(server):
    """The app accepts each field at the bound the schema states and refuses it (422 naming the field) past it."""
    probed = set()
    for path, field, at, past in stated_bounds(openapi(server)):
        if field == "size" and path == "/images/generate":
            at = 64  # a 1024-pixel PNG is slow to make; 64 is within the bound, 1025 past it
        ok = post(f"{server}{path}", json={**VALID[path], field: at})
        assert ok.status_code == 200, (path, field, at, ok.text)
        bad = post(f"{server}{path}", json={**VALID[path], field: past})
        assert bad.status_code == 422, (path, field, bad.text)
        assert any(e["loc"][-1] == field for e in bad.json()["detail"]), (path, field, bad.text)
        probed.add((path, field))
    assert {("/generate", "gamma"), ("/generate", "max_new_tokens"), ("/v1/completions", "model"),
            ("/images/generate", "n"), ("/v1/images/generations", "model")} <= probed


def test_bodies_over_the_limit_are_413_before_parsing(server):
    big = {"prompt": "hi", "max_new_tokens": 4, "padding": "x" * 5000}  # would be a 422 (unknown field) if parsed
    res = post(f"{server}/generate", json=big)
    assert res.status_code == 413 and "4096 bytes" in res.text
    chunks = (json.dumps(big).encode()[i:i + 1000] for i in range(0, 6000, 1000))  # chunked: no Content-Length
    res = post(f"{server}/generate", data=chunks, headers={"content-type": "application/json"})
    assert res.status_code == 413, res.text
    small = post(f"{server}/generate", json={**big, "padding": "x" * 3000})
    assert small.status_code == 422 and "padding" in small.text  # under the limit: parsed as usual
    assert requests.get(f"{server}/healthz", timeout=30).status_code == 200

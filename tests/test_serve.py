"""The text app on Ray Serve, started on 127.0.0.1 and queried over real HTTP (and with the openai client)."""

from __future__ import annotations

import json

import pytest
import requests

from netutil import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(ray_cluster, debug_exports):
    from ray import serve

    from efftx.serving.text import build

    paths = debug_exports
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"target": paths["target"], "draft": paths["draft"], "name": "tiny",
                     "limits": '{"max_new_tokens": 40, "max_prompt_bytes": 64}',
                     "batch_wait_timeout_s": "0.25",  # long enough for concurrent test requests to meet
                     "dalle": paths["dalle"], "image_batch_wait_timeout_s": "0.25",
                     "image_limits": '{"max_images": 4, "max_cond_scale": 5}'}),
              name="text", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def post(url, **kwargs):
    return requests.post(url, timeout=120, **kwargs)


def test_health_models_and_docs(server):
    assert requests.get(f"{server}/healthz", timeout=30).json() == {"status": "ok", "model": "tiny", "speculative": True,
                                                                  "images": True}
    ids = [m["id"] for m in requests.get(f"{server}/v1/models", timeout=30).json()["data"]]
    assert ids == ["tiny", "tiny-speculative", "dalle_shapes_debug"]
    assert requests.get(f"{server}/docs", timeout=30).status_code == 200
    assert "/generate" in requests.get(f"{server}/openapi.json", timeout=30).json()["paths"]


def test_generate_both_modes_greedy_agree(server):
    r = post(f"{server}/generate", json={"prompt": "def foo(", "max_new_tokens": 24, "temperature": 0,
                                        "mode": "both", "gamma": 3})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert res["base"]["text"] == res["speculative"]["text"] and res["base"]["tokens"] == 24
    spec = res["speculative"]
    assert 0 <= spec["mean_accepted"] <= 3 and len(spec["acceptance_histogram"]) == 4
    assert spec["target_calls"] >= 1 and res["base"]["tokens_per_s"] > 0


def test_sampling_is_seeded(server):
    body = {"prompt": "x = ", "max_new_tokens": 16, "temperature": 1.0, "top_k": 20, "seed": 7, "mode": "speculative"}
    a, b = post(f"{server}/generate", json=body).json(), post(f"{server}/generate", json=body).json()
    assert a["results"]["speculative"]["text"] == b["results"]["speculative"]["text"]


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

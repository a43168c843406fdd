"""The playground page and the endpoints behind it.

* Library level (fast): the step events of :mod:`efftx.serving.streaming` against the decoders.
* HTTP (slow): ``POST /generate/stream`` and ``GET /models/info`` of the text app started on 127.0.0.1.
* Browser (slow): the page in a real headless Chromium (Debian's ``chromium``; see
  ``tests/headless_chromium.py``), driven over the DevTools protocol. Every state is saved as a PNG
  screenshot under ``$EFFTX_ARTIFACTS/playground/`` (default ``test-artifacts/playground/`` in the
  checkout, ignored by git); the directory is printed at the end of the module.

Two apps serve the browser tests: ``/`` with the debug speculative pair and a debug DALL-E, and
``/textonly`` with a target alone (no draft, no image model), which also checks that the page works
under a route prefix.
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

import pytest
import requests
import torch

from efftx import recipes
from efftx.generation.decode import decode_bytes, encode_text, generate
from efftx.generation.speculative import speculative_generate
from efftx.models import build as build_model
from efftx.serving.playground import mlflow_version
from efftx.serving.schemas import StreamDone, StreamRequest, StreamStep
from efftx.serving.streaming import split_step, sse, stream_events

from headless_chromium import Chromium, missing_requirements
from netutil import free_port

LIMITS = {"max_new_tokens": 40, "max_prompt_bytes": 64, "max_gamma": 6}
IMAGE_LIMITS = {"max_images": 4, "max_cond_scale": 5}


# ================================================================================ library level (fast)
@pytest.fixture(scope="module")
def pair():
    models = {}
    for role, seed in (("target", 0), ("draft", 1)):
        torch.manual_seed(seed)
        models[role] = build_model(recipes.get(f"spec_{role}_debug")).eval()
    return models["target"], models["draft"]


def test_split_step_tells_draft_tokens_from_the_targets():
    assert split_step([5, 6, 7], accepted=2) == (2, 1)  # two accepted, then the target's resample
    assert split_step([5, 6, 7, 8], accepted=3) == (3, 1)  # all accepted, then the bonus token
    assert split_step([5, 6], accepted=3) == (2, 0)  # cut at max_new_tokens before the target's token
    assert split_step([9], accepted=None) == (0, 1)  # base decoding: the target's token


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stream_events_are_the_decoders_tokens_with_their_marks(pair, temperature):
    target, draft = pair
    prompt = encode_text("def foo(")
    texts = {}
    for mode in ("base", "speculative"):
        req = StreamRequest(prompt="def foo(", max_new_tokens=23, temperature=temperature, seed=7, mode=mode, gamma=3)
        *steps, done = list(stream_events(target, draft, prompt, req))
        assert all(isinstance(s, StreamStep) for s in steps) and isinstance(done, StreamDone)
        assert [s.step for s in steps] == list(range(1, len(steps) + 1)) and done.steps == len(steps)
        counts = [s.drafted_accepted + s.from_target for s in steps]
        assert [s.tokens for s in steps] == [sum(counts[: i + 1]) for i in range(len(counts))]
        assert done.tokens == steps[-1].tokens == 23
        assert all(s.text == s.draft_text + s.target_text for s in steps)
        assert "".join(s.text for s in steps) + done.tail == done.text
        if mode == "base":
            assert counts == [1] * 23 and not any(s.drafted_accepted for s in steps)
        else:
            assert all(s.drafted_accepted <= 3 and s.from_target in (0, 1) for s in steps)
            assert all(s.from_target == 1 for s in steps[:-1])  # only the last step can be cut
            accepted = sum(s.drafted_accepted for s in steps)
            assert accepted == pytest.approx(done.mean_accepted * done.steps) or steps[-1].from_target == 0
            assert done.target_calls >= done.steps and len(done.acceptance_histogram) == 4
        texts[mode] = done.text
    # the same decoding as the library's own entry points, seed for seed
    assert texts["base"] == decode_bytes(generate(target, [prompt], 23, temperature=temperature, seed=7)[0])
    tokens, _ = speculative_generate(target, draft, [prompt], 23, gamma=3, temperature=temperature, seed=7)
    assert texts["speculative"] == decode_bytes(tokens[0])
    if temperature == 0:
        assert texts["base"] == texts["speculative"]


def test_sse_names_the_events_and_reports_a_failure_in_the_stream(pair):
    target, draft = pair
    req = StreamRequest(prompt="a", max_new_tokens=2, temperature=0, mode="speculative", gamma=2)

    def failing():
        yield from stream_events(target, draft, encode_text("a"), req)
        raise RuntimeError("the device went away")

    blocks = list(sse(failing()))
    assert all(b.endswith("\n\n") for b in blocks)
    names = [b.split("\n")[0] for b in blocks]
    assert names == ["event: step"] * (len(blocks) - 2) + ["event: done", "event: error"]
    assert json.loads(blocks[-1].split("\n")[1][len("data: "):]) == {"detail": "RuntimeError: the device went away"}
    assert json.loads(blocks[-2].split("\n")[1][len("data: "):])["tokens"] == 2


def test_mlflow_sources_name_their_version(efftx_home, tmp_path):
    from mlflow import MlflowClient

    from efftx.paths import default_tracking_uri

    uri = default_tracking_uri()
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("playground_card")
    for _ in range(2):
        client.create_model_version("playground_card", source=str(tmp_path))
    assert mlflow_version("models:/playground_card/latest") == ("playground_card", "2")
    assert mlflow_version("models:/playground_card/1") == ("playground_card", "1")
    assert mlflow_version(str(tmp_path)) == (None, None)


# ================================================================================ the app (slow)
@pytest.fixture(scope="module")
def server(ray_cluster, debug_exports):
    """The full app at ``/`` (target, draft, DALL-E) and a text-only one at ``/textonly``."""
    from ray import serve

    from efftx.serving.text import build

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"target": debug_exports["target"], "draft": debug_exports["draft"], "name": "tiny",
                     "limits": json.dumps(LIMITS), "dalle": debug_exports["dalle"],
                     "image_limits": json.dumps(IMAGE_LIMITS)}), name="playground", route_prefix="/")
    serve.run(build({"target": debug_exports["target"], "name": "solo", "limits": json.dumps(LIMITS)}),
              name="textonly", route_prefix="/textonly")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def stream(url: str, body: dict) -> tuple[requests.Response, list[tuple[str, dict]]]:
    """POST a stream request; the response and its server-sent events as (event name, data)."""
    res = requests.post(f"{url}/generate/stream", json=body, stream=True, timeout=120)
    events = []
    if res.ok:
        for block in res.text.split("\n\n"):
            if block.strip():
                fields = dict(line.split(": ", 1) for line in block.split("\n"))
                events.append((fields["event"], json.loads(fields["data"])))
    return res, events


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["base", "speculative"])
def test_stream_endpoint_sends_step_events_then_totals(server, mode):
    body = {"prompt": "import ", "max_new_tokens": 30, "temperature": 1.0, "top_k": 50, "seed": 3, "gamma": 4}
    res, events = stream(server, {**body, "mode": mode})
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/event-stream")
    names = [name for name, _ in events]
    assert names == ["step"] * (len(events) - 1) + ["done"]
    steps, done = [data for _, data in events[:-1]], events[-1][1]
    assert len(steps) == done["steps"] > 1
    total = 0
    for s in steps:  # every step's tokens are counted once, as drafted-and-accepted or as the target's
        total += s["drafted_accepted"] + s["from_target"]
        assert s["tokens"] == total and s["mode"] == mode
    assert total == done["tokens"] == 30
    assert "".join(s["text"] for s in steps) + done["tail"] == done["text"]
    if mode == "speculative":
        assert any(s["drafted_accepted"] for s in steps) and 0 <= done["mean_accepted"] <= 4
    # the streamed decoding is the /generate decoding, seed for seed
    plain = requests.post(f"{server}/generate", json={**body, "mode": mode}, timeout=120).json()["results"][mode]
    assert done["text"] == plain["text"] and done.get("mean_accepted") == plain["mean_accepted"]


@pytest.mark.slow
@pytest.mark.parametrize("body, field", [
    ({"max_new_tokens": 41}, "max_new_tokens"),
    ({"mode": "speculative", "gamma": 7}, "gamma"),
    ({"temperature": 9}, "temperature"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x" * 65}, "prompt"),
    ({"mode": "both"}, "mode"),  # one mode per stream
    ({"top_p": 0}, "top_p"),
    ({"seed": "abc"}, "seed"),
])
def test_stream_endpoint_refuses_bad_input_naming_the_field(server, body, field):
    res, _ = stream(server, {"prompt": "hi", "max_new_tokens": 8, **body})
    assert res.status_code == 422 and any(err["loc"][-1] == field for err in res.json()["detail"]), res.text


@pytest.mark.slow
def test_models_info_lists_the_loaded_models(server, debug_exports):
    from efftx.export import load_export

    info = requests.get(f"{server}/models/info", timeout=30).json()
    assert (info["name"], info["speculative"], info["images"]) == ("tiny", True, True)
    cards = {card["role"]: card for card in info["models"]}
    assert [cards[r]["id"] for r in ("target", "draft")] == ["tiny", "tiny-speculative"]
    for role in ("target", "draft", "dalle"):
        model, cfg, _ = load_export(debug_exports[role])
        card = cards["image" if role == "dalle" else role]
        assert card["source"] == debug_exports[role] and card["mlflow_model"] is None
        params = model.num_params() if role == "dalle" else sum(p.numel() for p in model.parameters())
        assert card["recipe"] == cfg.recipe and card["parameters"] == params
        if role != "dalle":
            assert (card["details"]["attention"], card["details"]["context"]) == (cfg.attention.kind,
                                                                                  cfg.model.max_seq_len)
    assert info["limits"]["max_new_tokens"] == 40 and info["image_limits"]["max_images"] == 4
    solo = requests.get(f"{server}/textonly/models/info", timeout=30).json()
    assert (solo["speculative"], solo["images"], solo["image_limits"]) == (False, False, None)
    assert [card["role"] for card in solo["models"]] == ["target"]


# ================================================================================ in the browser (slow)
@pytest.fixture(scope="module")
def artifacts(pytestconfig):
    root = Path(os.environ.get("EFFTX_ARTIFACTS") or Path(__file__).resolve().parents[1] / "test-artifacts")
    root = root / "playground"
    root.mkdir(parents=True, exist_ok=True)
    for old in root.glob("*.png"):
        old.unlink()
    show = pytestconfig.pluginmanager.get_plugin("capturemanager").global_and_fixture_disabled  # as capsys.disabled
    with show():
        print(f"\n[playground] screenshots go to {root}")
    yield root
    with show():
        print(f"\n[playground] screenshots in {root}: {', '.join(sorted(p.name for p in root.glob('*.png')))}")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    if os.environ.get("EFFTX_SKIP_BROWSER") == "1":
        pytest.skip("EFFTX_SKIP_BROWSER=1: the browser tests are skipped on purpose")
    why = missing_requirements()
    if why:  # never a silent skip: CI and `make test` must run these
        pytest.fail(f"the browser tests cannot run: {why} (or set EFFTX_SKIP_BROWSER=1 to skip them on purpose)")
    with Chromium.launch(tmp_path_factory.mktemp("chromium") / "profile") as browser:
        yield browser.page


READY = "document.body.dataset.ready"


def open_page(page, url: str) -> None:
    page.events.clear()  # each test checks the events of its own page load
    page.navigate(url, ready=READY)
    assert page.evaluate(READY) == "yes", page.evaluate("document.querySelector('#models-summary').textContent")


def fill(page, form: str, values: dict) -> None:
    """Type values into a form's named inputs (firing 'input' as typing does)."""
    page.evaluate(f"""(() => {{
        const form = document.querySelector({json.dumps(form)});
        for (const [name, value] of Object.entries({json.dumps(values)})) {{
            const input = form.querySelector(`[name="${{name}}"]`);
            input.value = String(value);
            input.dispatchEvent(new Event("input", {{bubbles: true}}));
        }}
    }})()""")


def click_and_wait(page, button: str) -> None:
    """Click a submit button; it is disabled while its requests run, so wait until it is enabled again."""
    page.evaluate(f"document.querySelector({json.dumps(button)}).click()")
    page.wait_for(f"!document.querySelector({json.dumps(button)}).disabled")


def column(page, mode: str) -> dict:
    return page.evaluate(f"""(() => {{
        const article = document.querySelector("#col-{mode}");
        const out = article.querySelector("[data-output]");
        const texts = (cls) => [...out.querySelectorAll(cls)].map((s) => s.textContent);
        return {{state: article.dataset.state, text: out.textContent, pieces: out.childNodes.length,
                 stats: article.querySelector("[data-stats]").textContent,
                 draft: texts(".tok-draft"), target: texts(".tok-target"),
                 marked: texts(".tok-draft, .tok-target").join("")}};
    }})()""")


def field_error(page, form: str, field: str) -> dict:
    return page.evaluate(f"""(() => {{
        const form = document.querySelector({json.dumps(form)});
        return {{error: form.querySelector('[data-error-for="{field}"]').textContent,
                 invalid: form.querySelector('[name="{field}"]').classList.contains("invalid"),
                 formError: form.querySelector('[data-error-for="_form"]').textContent}};
    }})()""")


def no_script_errors(page) -> None:
    thrown = page.events_named("Runtime.exceptionThrown")
    logged = [e for e in page.events_named("Runtime.consoleAPICalled") if e["type"] == "error"]
    assert not thrown and not logged, (thrown, logged)


@pytest.mark.slow
def test_page_loads_from_the_app_alone_and_lists_its_models(page, server, artifacts):
    open_page(page, f"{server}/")  # redirects to /playground
    assert page.evaluate("location.pathname") == "/playground"
    info = requests.get(f"{server}/models/info", timeout=30).json()
    rows = page.evaluate("[...document.querySelectorAll('#models-table tbody tr')].map("
                         "(tr) => [...tr.cells].map((td) => td.textContent))")
    assert [(r[0], r[1], r[2]) for r in rows] == [(m["role"], m["id"], m["recipe"]) for m in info["models"]]
    assert all(m["source"] in r[4] for r, m in zip(rows, info["models"]))
    summary = page.evaluate("document.querySelector('#models-summary').textContent")
    assert all(m["id"] in summary for m in info["models"])
    assert page.evaluate("document.querySelector('[data-limit=\"max_new_tokens\"]').textContent") == "≤ 40"
    assert page.evaluate("document.querySelector('#images-tab-button').hidden") is False
    page.screenshot(artifacts / "01-loaded.png")
    page.evaluate("document.querySelector('[data-tab=\"models\"]').click()")
    page.screenshot(artifacts / "02-models-tab.png")
    # nothing but the app itself was asked for anything
    urls = [e["request"]["url"] for e in page.events_named("Network.requestWillBeSent")]
    assert urls and all(u.startswith(server) or u.startswith(("data:", "blob:")) for u in urls), urls
    no_script_errors(page)


@pytest.mark.slow
def test_greedy_columns_stream_and_match(page, server, artifacts):
    open_page(page, f"{server}/playground")
    settings = {"prompt": "def foo(", "max_new_tokens": 24, "temperature": 0, "top_k": 0, "top_p": 1, "seed": 0,
                "gamma": 3}
    fill(page, "#text-form", settings)
    click_and_wait(page, "#generate-text")
    base, spec = column(page, "base"), column(page, "speculative")
    assert base["state"] == spec["state"] == "done", (base, spec)
    expected = requests.post(f"{server}/generate", json={**settings, "mode": "both"}, timeout=120).json()["results"]
    assert base["text"] == spec["text"] == expected["base"]["text"] == expected["speculative"]["text"]
    assert base["pieces"] > 1  # drawn step by step, not at once
    # every character is marked as the draft's or the target's (but a held-back incomplete last character)
    assert spec["target"] and spec["text"].startswith(spec["marked"]) and len(spec["text"]) - len(spec["marked"]) <= 1
    assert f"{expected['speculative']['mean_accepted']:.2f}" in spec["stats"] and "tok/s" in base["stats"]
    badge = page.evaluate("(() => { const b = document.querySelector('#match');"
                          " return {hidden: b.hidden, cls: b.className, text: b.textContent}; })()")
    assert not badge["hidden"] and "identical" in badge["cls"] and "identical" in badge["text"], badge
    page.screenshot(artifacts / "03-greedy-identical.png")
    no_script_errors(page)


@pytest.mark.slow
def test_sampled_columns_mark_draft_and_target_tokens(page, server, artifacts):
    open_page(page, f"{server}/playground")
    settings = {"prompt": "import ", "max_new_tokens": 40, "temperature": 1, "top_k": 0, "top_p": 1, "seed": 11,
                "gamma": 4}
    fill(page, "#text-form", settings)
    page.evaluate("document.querySelector('#sequential').checked = true")  # the other way of running them
    click_and_wait(page, "#generate-text")
    base, spec = column(page, "base"), column(page, "speculative")
    assert base["state"] == spec["state"] == "done", (base, spec)
    expected = requests.post(f"{server}/generate", json={**settings, "mode": "both"}, timeout=120).json()["results"]
    assert base["text"] == expected["base"]["text"] and spec["text"] == expected["speculative"]["text"]
    assert spec["draft"] and spec["target"]  # both kinds of tokens are marked
    assert f"{expected['speculative']['mean_accepted']:.2f}" in spec["stats"]
    badge_cls = page.evaluate("document.querySelector('#match').className")
    assert ("identical" in badge_cls) == (base["text"] == spec["text"])
    page.screenshot(artifacts / "04-sampled-marks.png")
    # the adaptive gamma box: the speculative stream asks for it (its histogram runs to the limits' max_gamma, 6),
    # the base stream is unchanged
    page.evaluate("document.querySelector('#adaptive_gamma').checked = true")
    click_and_wait(page, "#generate-text")
    adaptive = requests.post(f"{server}/generate", json={**settings, "mode": "speculative", "adaptive_gamma": True},
                             timeout=120).json()["results"]["speculative"]
    base2, spec2 = column(page, "base"), column(page, "speculative")
    assert base2["text"] == base["text"] and spec2["text"] == adaptive["text"], (spec2, adaptive)
    assert len(adaptive["acceptance_histogram"]) == 7
    assert f"histogram [{', '.join(map(str, adaptive['acceptance_histogram']))}]" in spec2["stats"]
    no_script_errors(page)


@pytest.mark.slow
def test_over_limit_values_are_shown_at_their_field_and_the_page_recovers(page, server, artifacts):
    open_page(page, f"{server}/playground")
    fill(page, "#text-form", {"prompt": "x = ", "max_new_tokens": 41, "temperature": 0, "gamma": 3})
    click_and_wait(page, "#generate-text")
    err = field_error(page, "#text-form", "max_new_tokens")
    assert "at most 40" in err["error"] and err["invalid"] and not err["formError"], err
    assert column(page, "base")["state"] == column(page, "speculative")["state"] == "error"
    page.screenshot(artifacts / "05-error-max-new-tokens.png")

    # an over-limit gamma refuses only the speculative stream: base decoding goes ahead
    fill(page, "#text-form", {"max_new_tokens": 12, "gamma": 7})
    assert not field_error(page, "#text-form", "max_new_tokens")["error"]  # editing a field clears its error
    click_and_wait(page, "#generate-text")
    err = field_error(page, "#text-form", "gamma")
    assert "must be in [1, 6]" in err["error"] and err["invalid"], err
    assert column(page, "base")["state"] == "done" and column(page, "speculative")["state"] == "error"
    page.screenshot(artifacts / "06-error-gamma.png")

    fill(page, "#text-form", {"gamma": 3})
    click_and_wait(page, "#generate-text")
    assert not field_error(page, "#text-form", "gamma")["error"]
    base, spec = column(page, "base"), column(page, "speculative")
    assert base["state"] == spec["state"] == "done" and base["text"] == spec["text"] and len(base["text"]) > 0
    page.screenshot(artifacts / "07-recovered.png")
    no_script_errors(page)


@pytest.mark.slow
def test_stop_aborts_the_streams_and_the_page_stays_usable(page, server, artifacts):
    open_page(page, f"{server}/playground")
    fill(page, "#text-form", {"prompt": "x = ", "max_new_tokens": 16, "temperature": 0, "gamma": 3})
    # hold the stream requests in the browser (DevTools' Fetch domain) so that Stop surely comes first
    page.send("Fetch.enable", patterns=[{"urlPattern": "*/generate/stream*"}])
    try:
        page.evaluate("document.querySelector('#generate-text').click()")
        page.wait_for_event("Fetch.requestPaused", count=2)  # both streams asked for, neither answered
        assert column(page, "base")["state"] == column(page, "speculative")["state"] == "running"
        page.evaluate("document.querySelector('#stop-text').click()")
        page.wait_for("!document.querySelector('#generate-text').disabled")
    finally:
        page.send("Fetch.disable")
    assert column(page, "base")["state"] == column(page, "speculative")["state"] == "stopped"
    page.screenshot(artifacts / "08-stopped.png")
    click_and_wait(page, "#generate-text")
    base, spec = column(page, "base"), column(page, "speculative")
    assert base["state"] == spec["state"] == "done" and base["text"] == spec["text"]
    no_script_errors(page)


@pytest.mark.slow
def test_text_only_app_hides_the_image_tab(page, server, artifacts):
    open_page(page, f"{server}/textonly/")  # the page under a route prefix
    assert page.evaluate("location.pathname") == "/textonly/playground"
    assert page.evaluate("document.querySelector('#images-tab-button').hidden") is True
    note = page.evaluate("(() => { const n = document.querySelector('#no-images-note');"
                         " return n.hidden ? '' : n.textContent; })()")
    assert "No image model" in note
    fill(page, "#text-form", {"prompt": "x", "max_new_tokens": 10, "temperature": 0})
    click_and_wait(page, "#generate-text")
    base, spec = column(page, "base"), column(page, "speculative")
    assert base["state"] == "done" and spec["state"] == "idle" and "no draft model" in spec["stats"]
    expected = requests.post(f"{server}/textonly/generate", json={"prompt": "x", "max_new_tokens": 10,
                                                                  "temperature": 0}, timeout=120).json()
    assert base["text"] == expected["results"]["base"]["text"]
    page.screenshot(artifacts / "09-text-only-app.png")
    no_script_errors(page)


def png_size(data: bytes) -> tuple[int, int]:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im.load()  # a truncated or corrupt PNG fails here
        return im.size


@pytest.mark.slow
def test_images_tab_draws_a_grid_of_pngs(page, server, artifacts):
    open_page(page, f"{server}/playground")
    page.evaluate("document.querySelector('#images-tab-button').click()")
    body = {"prompt": "a red circle on a blue background", "n": 3, "cond_scale": 2, "filter_thres": 0.9, "seed": 4}
    fill(page, "#image-form", body)
    click_and_wait(page, "#generate-images")
    images = page.wait_for("(() => { const imgs = [...document.querySelectorAll('#image-grid img')];"
                           " return imgs.length && imgs.every((i) => i.complete && i.naturalWidth > 0)"
                           " && imgs.map((i) => i.src); })()", timeout=60)
    assert len(images) == 3 and all(src.startswith("data:image/png;base64,") for src in images)
    pngs = [base64.b64decode(src.split(",", 1)[1]) for src in images]
    side = recipes.get("dalle_shapes_debug").vae.image_size
    assert {png_size(p) for p in pngs} == {(side, side)}
    expected = requests.post(f"{server}/images/generate", json={**body, "response_format": "b64_json"},
                             timeout=120).json()
    assert [base64.b64decode(im["b64_png"]) for im in expected["images"]] == pngs  # seed for seed
    assert "3 images in" in page.evaluate("document.querySelector('#image-stats').textContent")
    page.screenshot(artifacts / "10-images.png")

    fill(page, "#image-form", {"n": 5})
    click_and_wait(page, "#generate-images")
    err = field_error(page, "#image-form", "n")
    assert "at most 4" in err["error"] and err["invalid"], err
    page.screenshot(artifacts / "11-images-error.png")
    fill(page, "#image-form", {"n": 1})
    click_and_wait(page, "#generate-images")
    assert page.evaluate("document.querySelectorAll('#image-grid img').length") == 1
    no_script_errors(page)

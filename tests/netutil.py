"""Small helpers shared by the tests that start servers."""

from __future__ import annotations

from efftx.cluster import free_port  # noqa: F401  (a TCP port nothing listens on right now)


def concurrent_requests_decode_as_the_library(url: str, exports: dict[str, str], max_new: int) -> tuple[list, list]:
    """Three concurrent ``POST /generate`` (mode both, sampled, gamma 5) to the text app at ``url``, each checked
    against the library's eager decoding of ``exports``' target and draft: base and speculative text and the
    acceptance histogram. -> (the bodies, the responses)."""
    from concurrent.futures import ThreadPoolExecutor

    import requests

    from efftx.export import load_export
    from efftx.generation.decode import decode_bytes, generate
    from efftx.generation.speculative import speculative_generate

    target, draft = load_export(exports["target"])[0], load_export(exports["draft"])[0]
    bodies = [{"prompt": p, "max_new_tokens": max_new, "temperature": 1.0, "top_k": 20, "seed": i, "mode": "both"}
              for i, p in enumerate(["x = ", "def f(", "import os"])]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda b: requests.post(f"{url}/generate", json=b, timeout=120), bodies))
    for body, res in zip(bodies, answers):
        assert res.status_code == 200, res.text
        got = res.json()["results"]
        prompt = [list(body["prompt"].encode())]
        base = generate(target, prompt, max_new, temperature=1.0, top_k=20, seed=body["seed"])[0].tolist()
        spec, stats = speculative_generate(target, draft, prompt, max_new, gamma=5, temperature=1.0, top_k=20,
                                           seed=body["seed"])
        assert got["base"]["text"] == decode_bytes(base)
        assert got["speculative"]["text"] == decode_bytes(spec[0])
        assert got["speculative"]["acceptance_histogram"] == stats.histogram
    return bodies, answers

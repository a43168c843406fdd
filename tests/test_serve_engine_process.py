"""The text app with ``engine=process`` on Ray Serve, over real HTTP: when its decoding process dies, the replica's
requests get a 503 (never a 500 or a hang), its health check fails, and Serve replaces it with a replica that
decodes as before. (Every other HTTP test of the app runs against both engines: tests/test_serve.py.)"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import requests

from netutil import free_port

pytestmark = pytest.mark.slow

BODY = {"prompt": "def f(x):", "max_new_tokens": 12, "temperature": 0, "mode": "both", "gamma": 3}


def decoding_processes(app: str) -> list[psutil.Process]:
    """The decoding processes of ``app``'s text replicas (children of a ``ServeReplica:<app>`` process)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "spawn_main" in " ".join(proc.info["cmdline"] or ()) and \
                    f"ServeReplica:{app}:" in " ".join(proc.parent().cmdline()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            continue
    return found


def test_a_dead_decoding_process_fails_requests_with_503_and_serve_replaces_the_replica(ray_cluster, debug_exports):
    from ray import serve

    from efftx.serving.text import TextGenerator, build_with

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_with({"target": debug_exports["target"], "draft": debug_exports["draft"], "engine": "process",
                              "warm_up_rows": "1"},
                             text_deployment=TextGenerator.options(health_check_period_s=1, health_check_timeout_s=10)),
                  name="respawn", route_prefix="/")
        first = requests.post(f"{url}/generate", json=BODY, timeout=60)
        assert first.status_code == 200, first.text
        text = first.json()["results"]["base"]["text"]
        assert first.json()["results"]["speculative"]["text"] == text
        replica = requests.get(f"{url}/models/info", timeout=30).json()["replica"]["id"]
        (child,) = decoding_processes("respawn")
        os.kill(child.pid, signal.SIGKILL)
        statuses = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            r = requests.post(f"{url}/generate", json=BODY, timeout=60)
            statuses.append(r.status_code)
            if r.status_code == 503:
                assert "decoding process exited" in r.text and r.headers.get("Retry-After")
            elif r.status_code == 200 and 503 in statuses:
                break
            else:
                assert r.status_code in (200, 503), (r.status_code, r.text)  # never a 500
            time.sleep(0.2)
        assert 503 in statuses and statuses[-1] == 200, statuses
        assert r.json()["results"]["base"]["text"] == text  # the new replica decodes as the first did
        assert requests.get(f"{url}/models/info", timeout=30).json()["replica"]["id"] != replica
        assert requests.get(f"{url}/healthz", timeout=30).status_code == 200
        assert len(decoding_processes("respawn")) == 1  # the new replica's; the dead one's is gone
    finally:
        serve.shutdown()

"""Moving a served app onto a new @champion: ``python -m efftx.serving.deploy`` pins the aliases of a Serve config to
versions and deploys it with ``serve deploy`` (the Serve REST API of the session cluster's dashboard).

The slow test serves version 1 of a registered LM, keeps clients sending plain and streamed requests, promotes
version 2 and deploys the same config file again: every request gets a full 200 answer (``X-Efftx-Model`` names
the version that produced it), the old version answers requests running when the deploy started, then only the
new one answers. Deploying again with nothing moved changes nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import requests
import yaml

from netutil import free_port
from test_mlflow_models import train_and_register

NAME = "redeploy_lm"
NEW_TOKENS = 100  # lm_debug's context is 128 bytes


@pytest.fixture
def registry(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


def serve_config(path, port: int, **args) -> str:
    path.write_text(yaml.safe_dump({
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "redeploy", "route_prefix": "/", "import_path": "efftx.serving.text:build",
                          "args": {"target": f"models:/{NAME}@champion", "name": "redeploy", **args}}]}))
    return str(path)


def deploy(config: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "efftx.serving.deploy", config, *extra], capture_output=True,
                          text=True, timeout=300)


def test_pin_resolves_aliases_to_versions_and_leaves_the_rest(registry, tmp_path):
    from efftx.promote import promote
    from efftx.serving.deploy import pin

    train_and_register(registry, tmp_path, NAME, 2.0, seed=0)
    train_and_register(registry, tmp_path, NAME, 1.0, seed=1)
    promote(NAME, "1", tracking_uri=registry)
    folder = str(tmp_path / "some-export")
    config = {"applications": [
        {"name": "a", "import_path": "efftx.serving.text:build",
         "args": {"target": f"models:/{NAME}@champion", "draft": f"models:/{NAME}/latest", "dalle": folder}},
        {"name": "b", "import_path": "somewhere.else:app", "args": {"target": f"models:/{NAME}@champion"}}]}
    pinned, pins = pin(config, registry)
    assert pinned["applications"][0]["runtime_env"] == {"env_vars": {"MLFLOW_TRACKING_URI": registry}}
    assert pinned["applications"][0]["args"] == {"target": f"models:/{NAME}/1", "draft": f"models:/{NAME}/2",
                                                 "dalle": folder}
    assert pinned["applications"][1] == config["applications"][1]  # not an efftx app: as written
    assert config["applications"][0]["args"]["target"] == f"models:/{NAME}@champion"  # the input is not changed
    assert [(p.arg, p.pinned) for p in pins] == [("target", f"models:/{NAME}/1"), ("draft", f"models:/{NAME}/2"),
                                                 ("dalle", folder)]
    promote(NAME, "2", tracking_uri=registry)
    assert pin(config, registry)[0]["applications"][0]["args"]["target"] == f"models:/{NAME}/2"


def test_a_model_that_does_not_resolve_is_exit_2_naming_it_and_nothing_is_written(registry, tmp_path):
    from efftx.serving.deploy import pinned_path

    train_and_register(registry, tmp_path, NAME, 2.0, seed=0)  # version 1, @candidate only: no @champion
    config = serve_config(tmp_path / "unready.yaml", 8000)
    proc = deploy(config, "--pin-only")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"models:/{NAME}@champion" in proc.stderr and "no @champion" in proc.stderr
    assert "efftx.serving.ready --check" in proc.stderr
    assert not pinned_path(config).exists()


def dashboard() -> str:
    import ray

    url = ray._private.worker.global_worker.node.webui_url
    return url if url.startswith("http") else f"http://{url}"


class Clients:
    """Threads sending requests back to back (plain /generate and /generate/stream in turn) until stopped; every
    answer is recorded as (start, end, status, X-Efftx-Model, complete, detail)."""

    def __init__(self, url: str, n: int = 3):
        self.url, self.done, self.stop = url, [], threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]

    def one(self, i: int, k: int):
        body = {"prompt": "def ", "max_new_tokens": NEW_TOKENS, "temperature": 0.8, "seed": 100 * i + k}
        t0 = time.monotonic()
        try:
            if k % 2:
                res = requests.post(f"{self.url}/generate/stream", json=body, stream=True, timeout=300)
                events, name = [], None
                for line in res.iter_lines():
                    if line.startswith(b"event: "):
                        name = line[len(b"event: "):].decode()
                    elif line.startswith(b"data: "):
                        events.append((name, json.loads(line[len(b"data: "):])))
                done = [data for name, data in events if name == "done"]
                complete = res.status_code == 200 and len(done) == 1 and done[0].get("tokens") == NEW_TOKENS
                detail = f"stream: {[name for name, _ in events][-3:]} ({len(events)} events) {done}"
            else:
                res = requests.post(f"{self.url}/generate", json=body, timeout=300)
                complete = res.status_code == 200 and res.json()["results"]["base"]["tokens"] == NEW_TOKENS
                detail = res.text[:200]
            row = (t0, time.monotonic(), res.status_code, res.headers.get("x-efftx-model"), complete, detail)
        except requests.RequestException as exc:  # a dropped connection is a failed request
            row = (t0, time.monotonic(), None, None, False, repr(exc))
        with self.lock:
            self.done.append(row)

    def run(self, i: int):
        k = 0
        while not self.stop.is_set():
            self.one(i, k)
            k += 1

    def seen(self, version: str) -> int:
        with self.lock:
            return sum(1 for row in self.done if row[3] == version)

    def wait_for(self, version: str, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.seen(version) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.seen(version) >= n, f"{version} answered {self.seen(version)} requests: {self.done[-5:]}"


@pytest.mark.slow
def test_redeploy_onto_a_new_champion_drops_no_request(ray_cluster, registry, tmp_path):
    from ray import serve

    from efftx.promote import promote

    train_and_register(registry, tmp_path, NAME, 2.0, seed=0)
    promote(NAME, "1", tracking_uri=registry)  # the first champion
    train_and_register(registry, tmp_path, NAME, 1.0, seed=1)  # a better version 2, @candidate
    port = free_port()
    config = serve_config(tmp_path / "text.yaml", port)
    url, address = f"http://127.0.0.1:{port}", dashboard()
    try:
        proc = deploy(config, "--address", address)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"redeploy.target: models:/{NAME}@champion = models:/{NAME}/1" in proc.stdout
        clients = Clients(url)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # the app is up once it answers
            try:
                if requests.get(f"{url}/healthz", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"the app did not come up: {serve.status()}")
        for t in clients.threads:
            t.start()
        clients.wait_for(f"{NAME}/1", 6, 120)

        assert promote(NAME, "candidate", tracking_uri=registry)["action"] == "promoted"
        t_deploy = time.monotonic()
        proc = deploy(config, "--address", address)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"= models:/{NAME}/2 (was models:/{NAME}/1)" in proc.stdout
        clients.wait_for(f"{NAME}/2", 6, 180)
        t_new = time.monotonic()

        proc = deploy(config, "--address", address)  # nothing moved: same config, same replicas
        assert proc.returncode == 0 and "(unchanged)" in proc.stdout and "nothing moved" in proc.stdout, proc.stdout
        clients.wait_for(f"{NAME}/2", 8, 120)
    finally:
        if "clients" in locals():
            clients.stop.set()
            for t in clients.threads:
                t.join(timeout=300)
        serve.shutdown()

    rows = clients.done
    failed = [row for row in rows if not row[4] or row[2] != 200]
    assert not failed, failed[:5]
    versions = {row[3] for row in rows}
    assert versions == {f"{NAME}/1", f"{NAME}/2"}, versions
    old_after = [row for row in rows if row[3] == f"{NAME}/1" and row[1] > t_deploy]
    assert old_after, "no request was answered by the old version after the redeploy started"
    assert not [row for row in rows if row[3] == f"{NAME}/1" and row[0] > t_new], \
        "the old version still took new requests after the new one answered"

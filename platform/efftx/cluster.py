"""A Ray cluster with token authentication on, from nothing: ``make cluster-up`` / ``make submit-example``.

    python -m efftx.cluster up [--num-cpus N] [--num-gpus N] [--port P] [--dashboard-port D] [--temp-dir DIR]
                               [--serve-ingress proxy|haproxy]
    python -m efftx.cluster join --address HEAD:PORT [--temp-dir DIR] [--serve-ingress proxy|haproxy] [ray start options]
    python -m efftx.cluster submit [--address URL] [ray job submit options] -- ENTRYPOINT ...
    python -m efftx.cluster token
    python -m efftx.cluster down

An unauthenticated Ray dashboard runs anyone's code, so the cluster always starts with
``RAY_AUTH_MODE=token``. The token is the one Ray itself reads: ``$RAY_AUTH_TOKEN`` if set, else the file
``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``; when there is none, ``up`` creates it (for the default
file through ``ray get-auth-token --generate``; a ``$RAY_AUTH_TOKEN_PATH`` file is written the same way,
64 hex characters, mode 0600).

``up`` returns only once the cluster accepts jobs: right after ``ray start`` the dashboard may answer
"No available agent" to a submission, so it submits a no-op job until one is accepted and has run. Then a
plain ``RAY_AUTH_MODE=token ray job submit ...`` works. ``submit`` runs ``ray job submit`` with the token
mode set and retries while the cluster answers "No available agent" (no job was created then), so it
may also be used right after a ``ray start`` of any other origin.

``ray start`` gives a new node's raylet a fixed 30 s to register with the GCS; on a busy machine it may take
longer, and ``ray start`` then fails ("The current node timed out during startup") and leaves the half-started
node running. ``up`` and ``join`` stop that node's processes (only its own: the head's by its session, which is
named after the ``ray start`` process, a joining node's by its ``--temp-dir``) and start it again, up to
``--attempts`` times.

The head's dashboard agent takes jobs on an HTTP port: Ray's 52365 when free, else ``up`` picks a free one. Another
process may take it before the agent binds it; Ray then keeps the agent running without HTTP, and no job could ever
be submitted. ``up`` reads that in the agent's log, stops the head and starts it again on a new free port (up to
``--attempts`` times); a port given with ``--dashboard-agent-listen-port`` is not replaced: a clear error names it.

``--serve-ingress haproxy`` starts the node's Ray processes with Serve's HAProxy ingress on
(:mod:`efftx.serving.ingress`): HTTP goes from HAProxy straight to the replicas, without Serve's Python proxy. Give
every node of a cluster the same choice. Each replica then serves HTTP itself on the application's
``http_options.host``: on a cluster of several machines that host must be one the other nodes reach (``0.0.0.0``),
not ``127.0.0.1``, or a node's HAProxy cannot reach the replicas of the others.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import secrets
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from efftx.errors import ConfigError, LaunchError
from efftx.serving.ingress import CHOICES as INGRESSES, Ingress

NO_AGENT = "No available agent"
STARTUP_TIMEOUT = "timed out during startup"  # `ray start`: the raylet did not register within 30 s
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_AGENT_PORT = 52365  # the dashboard agent's HTTP port: jobs go through it


def port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


_HANDED_OUT: set[int] = set()  # the ports free_port returned in this process
_PORT_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port nothing listens on right now and that this process was not given before: the kernel may offer a
    port it just released again, so two calls in a row could name the same port (a `ray start` given it for two of
    its components refuses to start)."""
    import socket

    with _PORT_LOCK:
        for _ in range(1000):
            with socket.socket() as sock:
                sock.bind(("", 0))
                port = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError("free_port: the kernel offered only ports this process was given before")


def start_local(attempts: int = 3, **init_kwargs) -> str:
    """Start a new single-node Ray cluster in this process (``ray.init(address="local", ...)``); returns its GCS
    address.

    Its GCS port is chosen here, so the cluster's own processes can be told their address: every worker gets
    ``RAY_ADDRESS`` (the job's runtime environment). Ray code that looks the cluster up from inside a worker
    needs it when more than one Ray instance runs on the machine (two jobs, a test run beside a ``ray start``):
    without it the lookup fails with "Found multiple active Ray instances". Ray Train's placement-group cleaner
    is such code: it removes the workers' placement group of a run whose controller died (a Tune trial that
    ASHA stopped), and when it fails the group's CPUs stay reserved for as long as the driver lives, until a
    later trial waits forever for them.

    Started again, up to ``attempts`` times in all, when the raylet registers too late (as ``up`` does)."""
    import ray

    port = free_port()
    address = f"{ray.util.get_node_ip_address()}:{port}"  # the address Ray gives the cluster it starts
    runtime_env = dict(init_kwargs.pop("runtime_env", None) or {})
    # "" = no fixed port, for a head node some worker might start (Ray reads RAY_GCS_SERVER_PORT from the
    # environment, which the cluster's processes inherit from this one)
    runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "RAY_ADDRESS": address, "RAY_GCS_SERVER_PORT": ""}
    before = os.environ.get("RAY_GCS_SERVER_PORT")
    os.environ["RAY_GCS_SERVER_PORT"] = str(port)  # read by the head node Ray starts here, and only by it
    try:
        for attempt in range(1, attempts + 1):
            since = datetime.datetime.today().replace(microsecond=0)  # Ray's session clock, as it names sessions
            try:
                ray.init(address="local", runtime_env=runtime_env, **init_kwargs)
                break
            except Exception as exc:  # Ray raises a bare Exception when the raylet registers late
                if STARTUP_TIMEOUT not in str(exc) or attempt == attempts:
                    raise
                # the half-started node: its session is named after this process and this attempt's time (an
                # earlier cluster of this process may still be running, e.g. a test session's)
                restart(session_of(os.getpid(), since), attempt, attempts)
    finally:
        if before is None:
            os.environ.pop("RAY_GCS_SERVER_PORT", None)
        else:
            os.environ["RAY_GCS_SERVER_PORT"] = before
    started = ray.get_runtime_context().gcs_address
    if started != address:
        raise LaunchError(f"Ray started its cluster at {started}, not at {address} as asked")
    return started


def ray_bin(name: str = "ray") -> str:
    """The ``ray`` command beside this interpreter (the project's venv), else the one on PATH."""
    here = Path(sys.executable).parent / name
    if here.is_file():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise LaunchError(f"the `{name}` command is not installed: run `make setup`")
    return found


def token_path() -> Path:
    """The token file Ray reads (``$RAY_AUTH_TOKEN_PATH``, else ``~/.ray/auth_token``)."""
    custom = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(custom).expanduser() if custom else Path.home() / ".ray" / "auth_token"


def ensure_token() -> str:
    """Make sure Ray finds a token; create one when none exists. Returns where it comes from."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "$RAY_AUTH_TOKEN"
    path = token_path()
    if path.is_file() and path.read_text().strip():
        return str(path)
    if path.exists() and not path.is_file():
        raise LaunchError(f"the Ray token path {path} exists but is not a file")
    if "RAY_AUTH_TOKEN_PATH" in os.environ:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    else:
        proc = subprocess.run([ray_bin(), "get-auth-token", "--generate"], env=auth_env(), capture_output=True,
                              text=True)
        if proc.returncode != 0 or not path.is_file():
            raise LaunchError(f"`ray get-auth-token --generate` failed: {(proc.stderr or proc.stdout).strip()[-500:]}")
        path.chmod(0o600)
    print(f"created a Ray authentication token in {path}", file=sys.stderr)
    return str(path)


def auth_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with token authentication on."""
    return {**(os.environ if base is None else base), "RAY_AUTH_MODE": "token"}


def submit(args: list[str], address: str | None = None, wait_s: float = 120.0) -> int:
    """``ray job submit [--address A] ARGS``, output passed through; retried while there is no job agent yet.
    Returns the command's exit code."""
    cmd = [ray_bin(), "job", "submit"] + (["--address", address] if address else []) + list(args)
    deadline = time.monotonic() + wait_s
    delay = 1.0
    while True:
        proc = subprocess.Popen(cmd, env=auth_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        no_agent = False
        for line in proc.stdout:
            no_agent = no_agent or NO_AGENT in line
            sys.stdout.write(line)
            sys.stdout.flush()
        code = proc.wait()
        if code == 0 or not no_agent or time.monotonic() > deadline:
            if code != 0 and no_agent:
                print(f"error: the cluster had no job agent for {wait_s:.0f} s", file=sys.stderr)
            return code
        print(f"[efftx] the cluster's job agent is not up yet; submitting again in {delay:.0f} s", file=sys.stderr)
        time.sleep(delay)
        delay = min(delay * 2, 8.0)


def wait_for_jobs(address: str, wait_s: float = 120.0, check: Callable[[], None] | None = None) -> None:
    """Block until the cluster at ``address`` has accepted and run a no-op job (auth and job agent work).
    ``check``: called after each refused submission; it raises when waiting longer is pointless."""
    os.environ["RAY_AUTH_MODE"] = "token"  # before Ray reads it: the SDK then sends the token
    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = time.monotonic() + wait_s
    last = ""
    while time.monotonic() < deadline:
        try:
            client = JobSubmissionClient(address)
            job = client.submit_job(entrypoint="python -c \"print('efftx: the cluster accepts jobs')\"",
                                    metadata={"efftx": "readiness check"})
            while time.monotonic() < deadline:
                status = client.get_job_status(job)
                if status == JobStatus.SUCCEEDED:
                    return
                if status in (JobStatus.FAILED, JobStatus.STOPPED):
                    raise LaunchError(f"the readiness job on {address} ended {status}: "
                                      f"{client.get_job_logs(job)[-500:]}")
                time.sleep(0.5)
        except (RuntimeError, ConnectionError) as exc:  # the SDK raises RuntimeError for HTTP errors
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
            if "401" in last or "Unauthorized" in last or "authentication" in last.lower():
                raise LaunchError(f"the cluster at {address} refused this token: {last}") from None
            if check is not None:
                check()
            time.sleep(1.0)
    raise LaunchError(f"the cluster at {address} did not accept a job within {wait_s:.0f} s ({last})")


def kill_node(marker: str | Callable[[str], bool]) -> list[int]:
    """SIGKILL one Ray node: the processes with a command-line part that contains ``marker`` (its temp dir plus
    "/") or satisfies it (a predicate: ``session_of``), i.e. GCS, raylet, dashboard, monitors, and all their
    descendants (the dashboard and runtime-env agents rename themselves ``ray::...``; the Ray workers). Returns
    their pids."""
    import signal

    import psutil

    found = marker if callable(marker) else (lambda part: marker in part)
    me = os.getpid()
    roots = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != me and any(found(part) for part in proc.info["cmdline"] or []):
                roots.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    family = set(roots)
    for proc in roots:
        try:
            family |= set(proc.children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    for proc in family:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    return sorted(p.pid for p in family)


SESSION_TIME = "%Y-%m-%d_%H-%M-%S_%f"  # Ray's session dirs: session_<local time in this format>_<pid>


def _session_name(pid: int) -> str:
    """A regex of the session dir name of a head node that process ``pid`` started (group 1: its start time)."""
    return rf"session_(\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+)_{pid}(?![0-9])"


def session_of(pid: int, since: datetime.datetime | None = None) -> Callable[[str], bool]:
    """Whether a command-line part names the session dir of a head node started by the process ``pid`` (Ray
    names it ``session_<date>_<time>_<microseconds>_<pid>``), and, with ``since``, one started at ``since`` or
    later: a process that starts a node again keeps its pid, and an earlier cluster of its own may still run."""
    pattern = re.compile(_session_name(pid))

    def names(part: str) -> bool:
        return any(since is None or datetime.datetime.strptime(m.group(1), SESSION_TIME) >= since
                   for m in pattern.finditer(part))

    return names


def restart(marker: str | Callable[[str], bool], attempt: int, attempts: int) -> None:
    """After attempt ``attempt`` of ``attempts`` timed out (STARTUP_TIMEOUT): kill the half-started node
    (``marker``, see ``kill_node``), say so, and give its ports a moment before the next attempt."""
    killed = kill_node(marker)
    print(f"[efftx] `ray start`: the node's raylet did not register with the GCS within Ray's 30 s (a busy "
          f"machine?); stopped its {len(killed)} processes, starting it again ({attempt + 1} of {attempts})",
          file=sys.stderr)
    time.sleep(2.0)


def start_node(cmd: list[str], attempts: int, node_marker, env: dict[str, str] | None = None) -> None:
    """Run ``ray start`` (``cmd``) with token auth; when its raylet did not register in time, stop the
    half-started node (``node_marker(pid of ray start)``, see ``kill_node``; None: it cannot be told apart from
    others, so no retry) and start again, ``attempts`` times in all. ``env``: the command's environment (default
    this process's), token auth added. Returns the pid of the ``ray start`` that succeeded (a head's session dir
    is named after it). Raises LaunchError on failure."""
    for attempt in range(1, attempts + 1):
        proc = subprocess.Popen(cmd, env=auth_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate()
        if proc.returncode == 0:
            return proc.pid
        text = (err or out).strip()
        marker = node_marker(proc.pid)
        if STARTUP_TIMEOUT not in text or attempt == attempts or marker is None:
            hint = ("" if STARTUP_TIMEOUT not in text or marker is not None else
                    "\n(not started again: without a --temp-dir of its own the node's processes cannot be told "
                    "apart from other nodes' on this machine)")
            tries = f" ({attempt} attempts)" if attempt > 1 else ""
            raise LaunchError(f"`ray start` failed{tries}:\n{text[-2000:]}{hint}")
        restart(marker, attempt, attempts)


def ingress_env(ns: argparse.Namespace) -> dict[str, str]:
    """This process's environment with ``--serve-ingress``'s variables (and none another ingress set)."""
    env = dict(os.environ)
    Ingress(ns.serve_ingress).apply(env)
    return env


def join(ns: argparse.Namespace) -> int:
    """``ray start --address HEAD`` with token auth, retried like ``up``'s head (only with a ``--temp-dir``)."""
    source = ensure_token()
    cmd = [ray_bin(), "start", "--address", ns.address, "--disable-usage-stats"]
    for flag, value in (("--num-cpus", ns.num_cpus), ("--num-gpus", ns.num_gpus), ("--temp-dir", ns.temp_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    temp = str(Path(ns.temp_dir).resolve()) + "/" if ns.temp_dir else None
    start_node(cmd + ns.ray_args, ns.attempts, lambda pid: temp, ingress_env(ns))
    print(f"Ray node joined {ns.address} with token authentication (token: {source})")
    return 0


class AgentPortTaken(LaunchError):
    """The head's dashboard agent could not listen on its HTTP port (another process holds it): the node runs,
    but it can never take a job."""

    def __init__(self, port: int, log: Path):
        self.port = port
        super().__init__(f"Ray's dashboard agent could not listen on port {port} (address already in use, see {log}): "
                         f"the cluster cannot take jobs; give --dashboard-agent-listen-port a free port")


AGENT_BIND_FAILED = re.compile(r"Agent port #(\d+) failed to bind")


def session_dir(pid: int) -> Path | None:
    """The session dir of the head node that ``ray start`` (pid ``pid``) started, from its processes' command
    lines (the raylet's name it); None while none is found."""
    import psutil

    pattern = re.compile(rf"(/\S*?/{_session_name(pid)})")
    for proc in psutil.process_iter(["cmdline"]):
        try:
            for part in proc.info["cmdline"] or []:
                m = pattern.search(part)
                if m:
                    return Path(m.group(1))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return None


def agent_port_check(pid: int) -> Callable[[], None]:
    """A ``wait_for_jobs`` check: raises AgentPortTaken once the head's agent log (node of ``ray start`` pid)
    says its HTTP port could not be bound (Ray's agent then stays up without HTTP, so waiting would not help)."""

    def check() -> None:
        found = session_dir(pid)
        log = found / "logs" / "dashboard_agent.log" if found else None
        if log is not None and log.is_file():
            m = AGENT_BIND_FAILED.search(log.read_text(errors="replace"))
            if m:
                raise AgentPortTaken(int(m.group(1)), log)

    return check


def up(ns: argparse.Namespace) -> int:
    """``ray start --head`` with token auth, then wait until it runs a job. The agent's port, when not given: Ray's
    default if free, else a free one; if another process takes it before the agent binds it (a race with other
    Ray nodes on this machine), the head is stopped and started again on a new free port, ``--attempts`` times."""
    source = ensure_token()
    env = ingress_env(ns)
    cmd = [ray_bin(), "start", "--head", "--disable-usage-stats", "--dashboard-port", str(ns.dashboard_port)]
    for flag, value in (("--num-cpus", ns.num_cpus), ("--num-gpus", ns.num_gpus), ("--port", ns.port),
                        ("--temp-dir", ns.temp_dir)):
        if value is not None:
            cmd += [flag, str(value)]
    agent_given = any(a.startswith("--dashboard-agent-listen-port") for a in ns.ray_args)
    agent_port = None
    if not agent_given and not port_free(DEFAULT_AGENT_PORT):
        # Another Ray node on this machine holds it: the new agent would start without HTTP and no job could
        # ever be submitted ("No available agent").
        agent_port = free_port()
        print(f"[efftx] port {DEFAULT_AGENT_PORT} (Ray's dashboard agent) is taken, by another Ray cluster on this "
              f"machine: the agent listens on {agent_port} instead", file=sys.stderr)
    address = f"http://127.0.0.1:{ns.dashboard_port}"
    for attempt in range(1, ns.attempts + 1):
        agent = [] if agent_port is None else ["--dashboard-agent-listen-port", str(agent_port)]
        pid = start_node(cmd + agent + ns.ray_args, ns.attempts, session_of, env)
        if ns.no_wait:
            break
        try:
            wait_for_jobs(address, ns.wait, check=agent_port_check(pid))
            break
        except AgentPortTaken as exc:
            killed = kill_node(session_of(pid))  # a head that can take no job: none is left running
            if agent_given or attempt == ns.attempts:
                raise
            agent_port = free_port()
            print(f"[efftx] {exc}; stopped the head's {len(killed)} processes, starting it again with the agent on "
                  f"port {agent_port} ({attempt + 1} of {ns.attempts})", file=sys.stderr)
            time.sleep(2.0)
    print(f"Ray head running with token authentication (token: {source}); jobs: {address}\n"
          f"  RAY_AUTH_MODE=token {ray_bin()} job submit --address {address} --working-dir . -- python jobs/train_sinkhorn.py\n"
          f"  (or: python -m efftx.cluster submit --address {address} --working-dir . -- python jobs/...)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.cluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    u = sub.add_parser("up", help="start a Ray head with token authentication and wait until it accepts jobs")
    u.add_argument("--num-cpus", type=int)
    u.add_argument("--num-gpus", type=int)
    u.add_argument("--port", type=int, help="GCS port (Ray's default 6379)")
    u.add_argument("--dashboard-port", type=int, default=DEFAULT_DASHBOARD_PORT)
    u.add_argument("--temp-dir")
    u.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the job agent")
    u.add_argument("--no-wait", action="store_true", help="return right after `ray start`")
    j = sub.add_parser("join", help="start a worker node of the cluster at --address (GCS HEAD:PORT), token auth")
    j.add_argument("--address", required=True, help="the head's GCS address, e.g. 10.0.0.1:6379")
    j.add_argument("--num-cpus", type=int)
    j.add_argument("--num-gpus", type=int)
    j.add_argument("--temp-dir", help="this node's own temp dir (needed to start it again after a timeout)")
    for parser in (u, j):
        parser.add_argument("--serve-ingress", default="proxy", choices=INGRESSES,
                            help="how HTTP reaches Serve's replicas on this node: Serve's Python proxy (default) or "
                                 "HAProxy straight to the replicas (efftx.serving.ingress)")
        parser.add_argument("--attempts", type=int, default=3,
                            help="`ray start` tries when the raylet does not register in time, and (up) head starts when "
                                 "another process took the agent's port (default 3)")
    s = sub.add_parser("submit", help="`ray job submit` with the token, retried while there is no job agent yet")
    s.add_argument("--address", help="the dashboard URL (default: $RAY_ADDRESS or Ray's default)")
    s.add_argument("--wait", type=float, default=120.0)
    sub.add_parser("token", help="print the token file (creating a token when none exists)")
    sub.add_parser("down", help="`ray stop`")
    ns, extra = p.parse_known_args(argv)  # up: more `ray start` options; submit: `ray job submit`'s, -- ENTRYPOINT
    if extra and ns.command not in ("up", "join", "submit"):
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(ns, "attempts", 1) < 1:
        p.error(f"--attempts must be at least 1, not {ns.attempts}")
    try:
        if ns.command in ("up", "join"):
            ns.ray_args = extra
            return up(ns) if ns.command == "up" else join(ns)
        if ns.command == "submit":
            job_args = extra
            if "--" not in job_args or job_args.index("--") == len(job_args) - 1:
                p.error("submit needs an entrypoint after --, e.g. submit --working-dir . -- python jobs/train_lm.py")
            ensure_token()
            return submit(job_args, ns.address, ns.wait)
        if ns.command == "token":
            print(ensure_token())
            return 0
        return subprocess.run([ray_bin(), "stop"]).returncode
    except (LaunchError, ConfigError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

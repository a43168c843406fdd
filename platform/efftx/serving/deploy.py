"""Deploy a Serve config with its registry aliases pinned: ``python -m efftx.serving.deploy [serve/text.yaml]``.

``serve/text.yaml`` names models by alias (``models:/spec_target_small@champion``). Ray Serve rebuilds an
application only when its config changes, so re-deploying the same file after ``efftx.promote`` moved
``@champion`` would change nothing. This command resolves every ``models:/NAME@ALIAS`` (and ``/latest``) of the
efftx applications to the version it names now (``models:/NAME/VERSION``), writes that pinned config to
``<efftx home>/serve/<name>.pinned.yaml`` (with ``MLFLOW_TRACKING_URI`` in the application's ``runtime_env``, so
the replicas load from the registry it resolved against) and deploys it with ``serve deploy`` to the running
cluster:

* a moved alias changes the application's arguments, so Serve starts replicas on the new version and stops the
  old ones gracefully: requests already running finish on the old model (up to the deployment's
  ``graceful_shutdown_timeout_s``: 120 s for text, 60 s for images), new requests wait for the new replicas,
  none is dropped;
* nothing moved: the pinned file is the same and Serve keeps the running replicas (the command says so).

It prints what each alias resolves to and what it was at the previous deploy. ``--pin-only`` writes the pinned
file and prints its path without deploying (``make serve`` serves that file with ``serve run``). A model that
does not resolve is exit code 2 naming it (``python -m efftx.serving.ready --check`` says how to make it).
"""

from __future__ import annotations

import argparse
import copy
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from efftx.errors import EfftxError, ExportError
from efftx.serving.ready import APP_IMPORT, MODEL_ARGS, REPO, read_config
from efftx.tracking import registry_exists

DEFAULT_ADDRESS = "http://127.0.0.1:8265"  # the Ray dashboard of a local cluster (`serve run`, `make cluster-up`)


@dataclass
class Pin:
    app: str
    arg: str
    source: str  # as the config names it
    pinned: str  # models:/NAME/VERSION, or the source itself when it names a version or a folder


def pin(config: dict, tracking_uri: str = "") -> tuple[dict, list[Pin]]:
    """A copy of a Serve config (a mapping) with the efftx applications' registered-model arguments pinned to the
    versions they resolve to now, and what was pinned. ExportError naming the model when one does not resolve."""
    from efftx.export import registered_version
    from efftx.paths import default_tracking_uri

    uri = tracking_uri or default_tracking_uri()
    out = copy.deepcopy(config)
    pins = []
    for app in out.get("applications") or []:
        if not isinstance(app, dict) or app.get("import_path") != APP_IMPORT:
            continue
        args = app.get("args") or {}
        if any(str(args.get(arg) or "").startswith("models:/") for arg in MODEL_ARGS):
            # the replicas load the versions from the registry they were pinned against (unless the config says)
            env = app.setdefault("runtime_env", {}).setdefault("env_vars", {})
            env.setdefault("MLFLOW_TRACKING_URI", uri)
        for arg in MODEL_ARGS:
            source = str(args.get(arg) or "")
            if not source:
                continue
            pinned = source
            if source.startswith("models:/"):
                if not registry_exists(uri):  # asking MLflow would create an empty registry file
                    raise ExportError(f"{app.get('name', 'app')}.{arg}: {source}: there is no MLflow registry at "
                                      f"{uri} yet (nothing has been trained and registered there)")
                try:
                    name, version = registered_version(source, uri)
                except ExportError as exc:
                    raise ExportError(f"{app.get('name', 'app')}.{arg}: {exc}") from None
                pinned = f"models:/{name}/{version}"
            args[arg] = pinned
            pins.append(Pin(str(app.get("name", "")), arg, source, pinned))
    return out, pins


def pinned_path(config_file: str | Path) -> Path:
    from efftx.paths import home

    return home() / "serve" / f"{Path(config_file).stem}.pinned.yaml"


def _previous(path: Path) -> dict[tuple[str, str], str]:
    """(app, arg) -> pinned source of the last pinned file written for this config."""
    import yaml

    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return {(str(app.get("name", "")), arg): str(app["args"][arg])
            for app in config.get("applications") or [] if isinstance(app, dict) and isinstance(app.get("args"), dict)
            for arg in MODEL_ARGS if app["args"].get(arg)}


def write_pinned(config_file: str | Path, tracking_uri: str = "") -> tuple[Path, list[Pin], dict, bool]:
    """Pin ``config_file`` and write it; returns (pinned file, pins, previous pins, whether the file changed)."""
    import yaml

    from efftx.export import atomic_write

    pinned, pins = pin(read_config(config_file), tracking_uri)
    out = pinned_path(config_file)
    previous = _previous(out)
    header = (f"# {Path(config_file).resolve()} with its registry aliases pinned by `python -m efftx.serving.deploy`;"
              " regenerated at every deploy, do not edit\n")
    text = header + yaml.safe_dump(pinned, sort_keys=False)
    changed = not out.is_file() or out.read_text() != text
    if changed:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, text)
    return out, pins, previous, changed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.serving.deploy", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=str(REPO / "serve" / "text.yaml"), help="a Serve config file")
    p.add_argument("--address", default="", help=f"the Ray dashboard to deploy to (default: $RAY_DASHBOARD_ADDRESS, "
                                                 f"else {DEFAULT_ADDRESS})")
    p.add_argument("--tracking-uri", default="", help="the MLflow registry (default: $MLFLOW_TRACKING_URI, else "
                                                      "the efftx home's mlflow.db)")
    p.add_argument("--pin-only", action="store_true", help="write the pinned config and print its path; no deploy")
    args = p.parse_args(argv)
    try:
        out, pins, previous, changed = write_pinned(args.config, args.tracking_uri)
    except EfftxError as exc:
        print(f"error: {exc} (python -m efftx.serving.ready --check {args.config} says how to make it)",
              file=sys.stderr)
        return 2
    if args.pin_only:
        print(out)
        return 0
    for x in pins:
        was = previous.get((x.app, x.arg))
        note = "" if was is None else (" (unchanged)" if was == x.pinned else f" (was {was})")
        print(f"{x.app}.{x.arg}: {x.source} = {x.pinned}{note}")
    if not changed:
        print("nothing moved since the last deploy: Serve keeps the running replicas (deploying the same config)")
    from efftx.cluster import auth_env, ray_bin
    import os

    address = args.address or os.environ.get("RAY_DASHBOARD_ADDRESS") or DEFAULT_ADDRESS
    proc = subprocess.run([ray_bin("serve"), "deploy", str(out), "--address", address], env=auth_env(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        print(f"error: `serve deploy {out} --address {address}` failed: {lines[-1] if lines else proc.returncode}",
              file=sys.stderr)
        return 1
    print(f"deployed {out} to {address}: Serve moves the replicas over while requests keep being served "
          f"(`serve status --address {address}` shows the progress)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

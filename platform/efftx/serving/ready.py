"""Make a Serve config's models servable: ``python -m efftx.serving.ready [serve/text.yaml]`` (``make serve``).

For every registered-model URI an efftx application of the Serve config names (``target``, ``draft``, ``dalle``:
``models:/NAME@champion`` in ``serve/text.yaml``), in the registry the app will read:
- it resolves: nothing to do;
- the model is registered but has no ``@champion``: its ``@candidate`` (what training sets) is promoted
  (:func:`efftx.promote.promote`: with no champion yet, the candidate becomes it);
- the model is not registered: the job that trains its recipe (:func:`efftx.recipes.train_command`; one job for
  models trained together, such as a speculative pair) runs first, saying so, then its candidate is promoted.
A model it cannot make (a name that is no recipe, an export folder that is not there) is exit code 2 naming it,
before anything is trained. ``--check`` only says what is missing and the commands that would make it (exit 1
when something is).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from efftx.errors import EfftxError, ExportError

APP_IMPORT = "efftx.serving.text:build"
MODEL_ARGS = ("target", "draft", "dalle")
REPO = Path(__file__).resolve().parents[3]


@dataclass
class Need:
    arg: str  # the app argument (target, draft, dalle)
    source: str  # models:/NAME@ALIAS (or /VERSION, /latest)
    name: str
    problem: str = ""  # "" = resolves
    command: str | None = None  # the job that trains it, when it is not registered
    promote: bool = False  # registered, no @champion: promote its @candidate


def read_config(config_file: str | Path) -> dict:
    """A Serve config file as a mapping with an ``applications`` list; ExportError naming the file otherwise."""
    import yaml

    path = Path(config_file)
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ExportError(f"cannot read the Serve config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ExportError(f"{path} is not valid YAML: {exc}") from None
    apps = (config or {}).get("applications") if isinstance(config, dict) else None
    if not isinstance(apps, list):
        raise ExportError(f"{path} has no 'applications' list (a Serve config file, like serve/text.yaml)")
    return config


def model_sources(config_file: str | Path) -> list[tuple[str, str]]:
    """(argument, value) of every model argument of the efftx applications of a Serve config file."""
    out = []
    for app in read_config(config_file)["applications"]:
        if isinstance(app, dict) and app.get("import_path") == APP_IMPORT:
            args = app.get("args") or {}
            out += [(arg, str(args[arg])) for arg in MODEL_ARGS if args.get(arg)]
    if not out:
        raise ExportError(f"{config_file} has no {APP_IMPORT} application with a model")
    return out


def plan(config_file: str | Path, tracking_uri: str = "") -> list[Need]:
    """What each model of the config needs (nothing, a promotion, or training first)."""
    from efftx import recipes
    from efftx.export import resolve_export
    from efftx.paths import default_tracking_uri
    from efftx.tracking import client_for, registry_exists

    uri = tracking_uri or default_tracking_uri()
    needs = []
    for arg, source in model_sources(config_file):
        if not source.startswith("models:/"):
            resolve_export(source)  # an export folder: it is there or it is an error naming it
            continue
        name = source[len("models:/"):].split("@")[0].split("/")[0]
        need = Need(arg, source, name)
        try:
            if not registry_exists(uri):  # asking MLflow would create an empty registry file
                raise ExportError(f"{source}: there is no MLflow registry at {uri} yet")
            resolve_export(source, uri)
        except ExportError as exc:
            need.problem = str(exc)
            if registry_exists(uri) and _registered(client_for(uri), name):
                need.promote = True
            else:
                need.command = recipes.train_command(name)
                if need.command is None:
                    raise ExportError(f"{source} ({arg}): {exc}; and {name!r} is no efftx recipe, so nothing here "
                                      f"can train it: train it under that name (tracking.model_name) or change "
                                      f"{arg} in {config_file}") from None
        needs.append(need)
    return needs


def _registered(client, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        return bool(client.search_model_versions(f"name='{name}'"))
    except MlflowException:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.serving.ready", description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", default=str(REPO / "serve" / "text.yaml"), help="a Serve config file")
    p.add_argument("--check", action="store_true", help="only say what is missing (exit 1 when something is)")
    p.add_argument("--tracking-uri", default="", help="the MLflow registry (default: $MLFLOW_TRACKING_URI, else "
                                                      "the efftx home's mlflow.db)")
    args = p.parse_args(argv)
    from efftx.promote import promote

    try:
        needs = plan(args.config, args.tracking_uri)
    except EfftxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    missing = [n for n in needs if n.problem]
    for n in needs:
        print(f"{n.arg}: {n.source} " + ("is ready" if not n.problem else
                                          f"is missing ({'no @champion yet' if n.promote else 'not registered'})"))
    if not missing:
        return 0
    commands = list(dict.fromkeys(n.command for n in missing if n.command))
    if args.check:
        for command in commands:
            print(f"to train: {command}")
        for name in dict.fromkeys(n.name for n in missing):
            print(f"then: python -m efftx.promote {name} candidate")
        return 1
    for command in commands:
        names = ", ".join(n.name for n in missing if n.command == command)
        print(f"training {names} (not in the registry yet): {command}\n"
              f"  this trains real models on this machine (measured on a 2-core CPU: about 7 minutes for the small "
              f"speculative pair, 6 for the small dVAE + DALL-E)", flush=True)
        start = time.monotonic()
        argv_ = shlex.split(command)
        env = {**os.environ, **({"MLFLOW_TRACKING_URI": args.tracking_uri} if args.tracking_uri else {})}
        proc = subprocess.run([sys.executable, *argv_[1:]] if argv_[0] == "python" else argv_, cwd=REPO, env=env)
        if proc.returncode != 0:
            print(f"error: `{command}` failed (exit {proc.returncode}); nothing was promoted", file=sys.stderr)
            return 2
        print(f"trained {names} in {time.monotonic() - start:.0f} s", flush=True)
    for name in dict.fromkeys(n.name for n in missing):
        try:
            result = promote(name, "candidate", tracking_uri=args.tracking_uri)
        except EfftxError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(result["message"])
        if result["action"] == "refused":
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Move the ``champion`` alias of a registered model to a version whose validation metric is no worse.

    python -m efftx.promote NAME VERSION [--force] [--tracking-uri URI] [--json]

VERSION is a version number or an alias (``candidate``: the version the latest training run registered). The
metric is the task's headline validation metric and direction (``Task.metric`` / ``Task.mode``: ``val_bpb``,
lower is better, for language models; ``val_loss`` for the image models), read from the MLflow run that
registered each version (its final evaluation), or from the export's metadata when the run has no such metric.

* no champion yet: the version becomes the champion;
* no worse than the champion (equal counts as no worse): ``@champion`` moves to it;
* worse, or a value missing on either side: refused, exit code 1, both values printed; ``--force`` moves it anyway;
* an unknown model, version or alias, or a registry that cannot be read: exit code 2, saying which.

Prints one line saying what it did (``--json``: one JSON object instead). Serve picks up a new champion when the
app is (re)deployed: ``serve/text.yaml`` serves ``models:/NAME@champion``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from efftx.errors import EfftxError
from efftx.tracking import CHAMPION


class PromoteError(EfftxError):
    """A model, version or alias the registry does not have (exit code 2)."""


def _version(client, name: str, ref: str):
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        known = sorted(m.name for m in client.search_registered_models(max_results=50))
        raise PromoteError(f"the registry has no model {name!r}"
                           + (f" (registered: {', '.join(known)})" if known else " (it has no models yet)")) from None
    try:
        if ref.isdigit():
            return client.get_model_version(name, ref)
        return client.get_model_version_by_alias(name, ref.lstrip("@"))
    except MlflowException:
        versions = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
        what = f"version {ref}" if ref.isdigit() else f"alias @{ref.lstrip('@')}"
        raise PromoteError(f"{name} has no {what} (versions: {', '.join(map(str, versions)) or 'none'}; "
                           f"aliases: {', '.join(sorted(client.get_registered_model(name).aliases)) or 'none'})"
                           ) from None


def version_metric(client, mv, tracking_uri: str) -> dict[str, Any]:
    """{metric, mode, value} of a model version: the task's metric from the run that registered it, else from the
    export's metadata (the evaluation the export was written with); value None when neither has it."""
    from mlflow.exceptions import MlflowException

    from efftx.train import tasks

    params: dict[str, str] = {}
    metrics: dict[str, float] = {}
    if mv.run_id:
        try:
            run = client.get_run(mv.run_id)
            params, metrics = run.data.params, run.data.metrics
        except MlflowException:
            pass
    family = params.get("model.family")
    if not family or tasks.get(family).metric not in metrics:
        from efftx.export import read_export_config, resolve_export

        cfg, meta = read_export_config(resolve_export(f"models:/{mv.name}/{mv.version}", tracking_uri))
        family = cfg.model.family
        metrics = {**{k: v for k, v in meta.items() if isinstance(v, (int, float))}, **metrics}
    task = tasks.get(family)
    value = metrics.get(task.metric)
    return {"metric": task.metric, "mode": task.mode, "value": None if value is None else float(value)}


def _worse(candidate: float, champion: float, mode: str) -> bool:
    return candidate > champion if mode == "min" else candidate < champion


def promote(name: str, version: str, *, tracking_uri: str = "", force: bool = False,
            alias: str = CHAMPION) -> dict[str, Any]:
    """Check and move ``@alias`` of ``name`` to ``version`` (see the module docstring). Returns what happened:
    ``action`` is "promoted", "refused" or "unchanged", with both versions' metric values and a ``message``."""
    from mlflow.exceptions import MlflowException

    from efftx.paths import default_tracking_uri
    from efftx.tracking import client_for, registry_exists

    uri = tracking_uri or default_tracking_uri()
    if not registry_exists(uri):
        raise PromoteError(f"no MLflow database at {uri[len('sqlite:///'):]}: nothing is registered there yet "
                           "(train first, or pass --tracking-uri)")
    try:
        client = client_for(uri)
        mv = _version(client, name, version)
        try:
            current = client.get_model_version_by_alias(name, alias)
        except MlflowException:
            current = None
        out: dict[str, Any] = {"model": name, "version": str(mv.version), "alias": alias,
                               "previous": None if current is None else str(current.version), "forced": False}
        if current is not None and str(current.version) == str(mv.version):
            return {**out, "action": "unchanged", "message": f"{name} version {mv.version} is already @{alias}"}
        cand = version_metric(client, mv, uri)
        out.update(metric=cand["metric"], mode=cand["mode"], candidate_value=cand["value"], champion_value=None)
        better = "lower" if cand["mode"] == "min" else "higher"
        mine = f"{cand['metric']} {_fmt(cand['value'])}"
        refusal = None
        if current is None:
            why = f"there was no @{alias} ({mine}; {better} is better)"
        else:
            champ = version_metric(client, current, uri)
            out["champion_value"] = champ["value"]
            theirs = f"{champ['metric']} {_fmt(champ['value'])} of version {current.version}, the current @{alias}"
            if champ["metric"] != cand["metric"]:
                refusal = f"its metric {cand['metric']} cannot be compared with {champ['metric']} of version " \
                          f"{current.version}, the current @{alias}"
            elif cand["value"] is None or champ["value"] is None:
                refusal = f"{mine} vs {theirs}: a value is missing, nothing to compare"
            elif _worse(cand["value"], champ["value"], cand["mode"]):
                refusal = f"{mine} is worse than {theirs} ({better} is better)"
            why = refusal or f"{mine} vs {theirs} ({better} is better)"
        if refusal and not force:
            return {**out, "action": "refused",
                    "message": f"refused: {name} version {mv.version} stays off @{alias}: {refusal}; "
                               f"--force promotes it anyway"}
        client.set_registered_model_alias(name, alias, mv.version)
        note = f"promoted {name} version {mv.version} to @{alias}" + (" (forced)" if refusal else "") + f": {why}"
        client.set_model_version_tag(name, mv.version, f"efftx.{alias}",
                                     time.strftime("%Y-%m-%dT%H:%M:%S%z") + f" {note}")
        return {**out, "action": "promoted", "forced": bool(refusal), "message": note}
    except MlflowException as exc:
        raise PromoteError(f"the MLflow registry at {uri}: {exc.message}") from None


def _fmt(value: float | None) -> str:
    return "(none)" if value is None else f"{value:.6g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m efftx.promote", description=__doc__.strip().splitlines()[0])
    p.add_argument("name", help="registered model name (e.g. spec_target_small)")
    p.add_argument("version", help="version number, or an alias such as candidate")
    p.add_argument("--force", action="store_true", help="promote even when the metric is worse or missing")
    p.add_argument("--tracking-uri", default="", help="MLflow tracking/registry URI (default: $MLFLOW_TRACKING_URI, "
                                                      "else the checkout's .efftx/mlflow.db)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a line")
    args = p.parse_args(argv)
    try:
        result = promote(args.name, args.version, tracking_uri=args.tracking_uri, force=args.force)
    except EfftxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else result["message"])
    return 1 if result["action"] == "refused" else 0


if __name__ == "__main__":
    raise SystemExit(main())

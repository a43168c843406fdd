"""Exports: what generation, Serve and the model registry load; no training code is imported here.

An export is a folder of ``model.safetensors`` (fp32 weights, no pickle) + ``config.json`` (the run config
and metadata), plus any files its task adds (DALL-E: ``tokenizer.json`` when it was trained with one), each
written to a temp file and renamed into place. :func:`load_export` rebuilds the model from the first two
files alone (through the model registry, :func:`efftx.models.build`). :func:`resolve_export` turns an export
folder, an export at a storage URI (``s3://bucket/runs/NAME/export``, ``gs://...``: what a run with
``scaling.storage_path`` at a URI writes; downloaded into ``<efftx home>/cache/exports/``, keyed by the URI and
refreshed when the remote files change; S3 endpoint and credentials from ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``) or an MLflow registered-model URI (``models:/NAME/VERSION``, ``/latest``, ``@ALIAS``)
into a local folder.

A registered version is either layout: an MLflow model (what training logs since efftx.mlflow_model: an
``MLmodel`` file and the export under ``artifacts/``, loadable with ``mlflow.pyfunc.load_model``) or, for
versions registered before, the plain export folder. :func:`export_folder` finds the export in either, and every
loader here goes through it.

Exports written before the model registry existed load unchanged: their ``config.json`` holds the same keys.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
from pathlib import Path
from typing import Any

import torch

from efftx.config import Config
from efftx.errors import ExportError

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"  # DALL-E exports trained with a tokenizers JSON carry it
MLMODEL_FILE = "MLmodel"  # an MLflow model folder (efftx.mlflow_model): the export is one of its artifacts


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder + ``os.replace``: a reader sees the
    old file or the whole new one, never a torn one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export(model: torch.nn.Module, cfg: Config, out_dir: str | Path, meta: dict[str, Any],
           files: dict[str, str | bytes] | None = None) -> Path:
    """Write ``model``'s weights + config.json (+ ``files``: name -> text or bytes) into ``out_dir`` (replacing an
    older export): :func:`export_state_dict` of ``model.state_dict()``."""
    return export_state_dict(model.state_dict(), cfg, out_dir, meta, files)


def export_state_dict(state: dict[str, torch.Tensor], cfg: Config, out_dir: str | Path, meta: dict[str, Any],
                      files: dict[str, str | bytes] | None = None) -> Path:
    """Write ``state`` (the weights of the model ``cfg`` builds, cast to fp32) as model.safetensors + config.json
    (+ ``files``: name -> text or bytes) into ``out_dir`` (replacing an older export). Training passes the
    optimizer's fp32 masters where it keeps them (bf16/fp16: :func:`efftx.train.checkpoint.export_state`)."""
    from efftx import weights

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in state.items()}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    weights.save(tensors, tmp, metadata={"format": "pt", "efftx.recipe": cfg.recipe})
    tmp.replace(out / WEIGHTS_FILE)
    for name, content in (files or {}).items():
        atomic_write(out / name, content)
    atomic_write(out / CONFIG_FILE, json.dumps({"config": cfg.to_dict(), "meta": meta}, indent=2))
    return out


def resolve_export(source: str, tracking_uri: str = "") -> Path:
    """A local export folder for ``source``: an export folder, an export at a storage URI (``s3://...``, cached
    locally), or an MLflow registered model ``models:/NAME/VERSION`` (or ``/latest``, or ``models:/NAME@ALIAS``) of
    ``tracking_uri`` ("" = the default), downloaded once per process. Raises ExportError naming the problem (the
    folder is checked by :func:`read_export_config`)."""
    source = str(source)
    path = _download_registered(source, tracking_uri) if source.startswith("models:/") else _local(source)
    path = export_folder(path)
    read_export_config(path)
    return path


def _local(source: str | Path) -> Path:
    """A local folder for a path or a storage URI (s3://, gs://, file://...: downloaded into the export cache)."""
    from efftx import storage

    if storage.is_uri(str(source)):
        from efftx.paths import home

        return storage.fetch_dir(str(source), home() / "cache" / "exports")
    if storage.scheme(str(source)) == "file":
        return Path(storage.normalize(str(source)))
    return Path(source).expanduser()


def export_folder(path: str | Path) -> Path:
    """The export inside ``path``: ``path`` itself, or for an MLflow model folder (an ``MLmodel`` file) the folder
    of its ``config`` artifact (``artifacts/``). Reads the MLmodel YAML only: no MLflow import, no model load. A
    storage URI (``s3://...``) is downloaded into the local export cache first."""
    path = _local(path)
    mlmodel = path / MLMODEL_FILE
    if not mlmodel.is_file() or (path / CONFIG_FILE).is_file():
        return path
    import yaml

    try:
        spec = yaml.safe_load(mlmodel.read_text())
        return path / Path(spec["flavors"]["python_function"]["artifacts"]["config"]["path"]).parent
    except (yaml.YAMLError, KeyError, TypeError) as exc:
        raise ExportError(f"{path} is an MLflow model but not one of an efftx export (no 'config' artifact in its "
                          f"{MLMODEL_FILE}: {exc!r})") from None


def registered_version(source: str, tracking_uri: str = "") -> tuple[str, str]:
    """(name, version) of ``models:/NAME/VERSION``, ``models:/NAME/latest`` (the newest version) or
    ``models:/NAME@ALIAS``, asked of the registry at ``tracking_uri`` ("" = the default). ExportError otherwise."""
    from mlflow.exceptions import MlflowException

    from efftx.paths import default_tracking_uri
    from efftx.tracking import client_for

    uri = tracking_uri or default_tracking_uri()
    ref = source[len("models:/"):] if source.startswith("models:/") else ""
    name, sep, version = ref.partition("@") if "@" in ref else ref.partition("/")
    if not name or not sep or not version or "/" in version:
        raise ExportError(f"{source!r} is not a registered-model URI: use models:/NAME/VERSION, models:/NAME/latest "
                          "or models:/NAME@ALIAS")
    try:
        client = client_for(uri)
        if "@" in ref:  # one query when the alias is there; the error path below asks what there is instead
            try:
                return name, str(client.get_model_version_by_alias(name, version).version)
            except MlflowException:
                pass
        versions = client.search_model_versions(f"name='{name}'")
        if not versions:
            raise ExportError(f"{source}: the MLflow registry at {uri} has no model {name!r}" + _train_hint(name))
        if "@" in ref:
            aliases = client.get_registered_model(name).aliases
            if version not in aliases:
                have = ", ".join(f"@{a}" for a in sorted(aliases)) or "none"
                numbers = ", ".join(str(n) for n in sorted(int(v.version) for v in versions))
                raise ExportError(f"{source}: {name} has versions {numbers} but no @{version} (aliases: {have})" + (
                                      f"; promote one with: python -m efftx.promote {name} candidate"
                                      if version == "champion" else ""))
            version = aliases[version]
        elif version == "latest":
            version = max(versions, key=lambda v: int(v.version)).version
        return name, str(version)
    except MlflowException as exc:
        raise ExportError(f"cannot fetch {source} from the MLflow registry at {uri}: {exc.message}") from None


def _train_hint(name: str) -> str:
    """'; train it with: <command>' for a recipe name, '' otherwise."""
    from efftx import recipes

    command = recipes.train_command(name)
    return (f"; train it with: {command} (it registers {name} with @candidate; then python -m efftx.promote {name} "
            f"candidate)") if command else ""


def _download_registered(source: str, tracking_uri: str) -> Path:
    """The local folder of a registered version. The alias or ``latest`` is asked of the registry on every call
    (an alias moves: ``@champion`` after ``python -m efftx.promote``); a version is downloaded once per process."""
    from efftx.paths import default_tracking_uri

    uri = tracking_uri or default_tracking_uri()
    name, version = registered_version(source, uri)
    return _download_version(name, version, uri)


@functools.lru_cache(maxsize=16)
def _download_version(name: str, version: str, uri: str) -> Path:
    from mlflow.exceptions import MlflowException

    from efftx.tracking import client_for

    try:
        download_uri = client_for(uri).get_model_version_download_uri(name, version)
        import mlflow

        return Path(mlflow.artifacts.download_artifacts(artifact_uri=download_uri, tracking_uri=uri))
    except MlflowException as exc:
        raise ExportError(f"cannot fetch models:/{name}/{version} from the MLflow registry at {uri}: {exc.message}"
                          ) from None


def read_export_config(path: str | Path) -> tuple[Config, dict[str, Any]]:
    path = export_folder(path)
    cfg_file = path / CONFIG_FILE
    if not path.is_dir() or not cfg_file.is_file() or not (path / WEIGHTS_FILE).is_file():
        raise ExportError(f"{path} is not an efftx export (expected a folder with {WEIGHTS_FILE} and {CONFIG_FILE})")
    try:
        blob = json.loads(cfg_file.read_text())
        return Config.from_dict(blob["config"]), blob.get("meta", {})
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportError(f"{cfg_file} is not a valid efftx export config: {exc}") from None


def export_skeleton(path: str | Path) -> tuple[torch.nn.Module, Config, dict]:
    """The model of an export built on the meta device, its weights not read: its settings, shapes and parameter
    counts, for a process that checks requests against a model another process loads (the text app's
    ``engine=process``). ``path`` as :func:`load_export`'s."""
    from efftx import models

    path = resolve_export(path) if str(path).startswith("models:/") else export_folder(path)
    cfg, meta = read_export_config(path)
    with torch.device("meta"):
        model = models.build(cfg)
    return model.eval(), cfg, meta


def load_export(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Config, dict]:
    """Rebuild the model of an export from its config and load its weights (strictly). ``path``: an export folder,
    an MLflow model folder, or a registered-model URI of the default registry (``models:/NAME@champion``)."""
    from efftx import models, weights

    path = resolve_export(path) if str(path).startswith("models:/") else export_folder(path)  # URIs: export_folder
    cfg, meta = read_export_config(path)
    model = models.build(cfg)
    try:
        state = weights.load(Path(path) / WEIGHTS_FILE, device)
    except (weights.WeightsError, OSError) as exc:
        raise ExportError(f"cannot read {Path(path) / WEIGHTS_FILE}: {exc}") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ExportError(f"weights in {path} do not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.to(device).eval(), cfg, meta

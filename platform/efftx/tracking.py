"""MLflow records of a run, written by rank 0 only.

* params: the flattened run config, with the same dotted keys as ``--set`` (plus ``data.sha256``);
* metrics: per step (train loss, lr, tokens/s, MFU) and per evaluation (val loss, bits-per-byte);
* artifacts: samples under ``samples/`` (text, or PNG images from the image tasks), the exported model
  under ``export/``;
* the model registry: each run's export logged as an MLflow model (efftx.mlflow_model: a pyfunc whose
  artifacts are the export's files) and registered under the recipe name (``tracking.model_name``), once per
  run (a resumed run that exports again reuses its version); the new version gets the alias ``candidate``
  (:data:`CANDIDATE`), and ``python -m efftx.promote NAME VERSION`` moves ``champion`` (:data:`CHAMPION`) to it.

The default tracking URI is a sqlite file in the efftx home (``.efftx/mlflow.db`` in a checkout);
``MLFLOW_TRACKING_URI`` or ``tracking.uri`` override it. With a sqlite store, artifacts go next to
the database in ``mlartifacts/``. With a tracking server (``http(s)://``, e.g. the one
``python -m efftx.tracking_server`` starts) the server decides: new experiments get its default artifact root,
``mlflow-artifacts:/`` when it proxies artifacts, so clients never need the object store's credentials.

Artifacts go through the server both ways (:func:`proxy_artifacts`: no presigned URLs to the object store), so
clients need neither the store's credentials nor a route to it.

A server is probed once per process before its first use (:func:`check_server`, called by :func:`client_for`):
one request with a short timeout and no retries, so a server that is down, unreachable, refuses the credentials or
is not MLflow is a LaunchError naming the URI at once, instead of MLflow's retries of several minutes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from efftx.errors import ConfigError, LaunchError

CANDIDATE = "candidate"  # the alias a training run sets on the version it registers
CHAMPION = "champion"  # the alias serve/text.yaml serves; moved by efftx.promote


CHECK_TIMEOUT_S = 10.0  # one probe of a tracking server: connect + answer
PROBE_ENDPOINT = "/api/2.0/mlflow/experiments/search"
_answered: set[str] = set()  # servers that answered in this process


def artifact_root_for(uri: str) -> str | None:
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None  # a tracking server decides (mlflow-artifacts:/ when it proxies artifacts)


def is_server(uri: str) -> bool:
    return uri.lower().startswith(("http://", "https://"))


def check_server(uri: str, timeout: float = CHECK_TIMEOUT_S) -> None:
    """For an ``http(s)://`` tracking URI: one request to the MLflow REST API (``timeout`` seconds, no retries,
    with the credentials MLflow would send: ``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``, ``MLFLOW_TRACKING_TOKEN``).
    LaunchError naming the URI when nothing answers, the credentials are refused, or what answers is not an MLflow
    tracking server. Other URIs (sqlite:, file:, databricks) are not probed."""
    if not is_server(uri):
        return
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    where = f"the MLflow tracking server {uri}"
    hint = ("start it (python -m efftx.tracking_server, or make mlflow-server) or point tracking.uri / "
            "--tracking-uri / $MLFLOW_TRACKING_URI at one that runs")
    try:
        response = http_request(get_default_host_creds(uri), PROBE_ENDPOINT, "GET", params={"max_results": 1},
                                max_retries=0, timeout=timeout, raise_on_status=False)
    except MlflowException as exc:
        text = str(exc.message)
        if "Connection refused" in text or "Errno 111" in text:
            why = "nothing listens there (connection refused)"
        elif "timed out" in text.lower() or "timeout" in text.lower():
            why = f"no answer within {timeout:g} s"
        elif "Name or service not known" in text or "resolve" in text.lower() or "nodename" in text:
            why = "its host name does not resolve"
        else:
            why = " ".join(text.split())[-300:]
        raise LaunchError(f"{where} cannot be reached: {why}; {hint}") from None
    status = response.status_code
    body = " ".join((response.text or "").split())[:200]
    if status in (401, 403):
        hint = ("MLflow's host check refused the name in the URI: start the server with --allowed-hosts naming it"
                if "host" in body.lower() and status == 403 else
                "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to an account "
                "it accepts")
        raise LaunchError(f"{where} refused the request (HTTP {status}: {body or 'no message'}); {hint}")
    try:
        payload = response.json() if status == 200 else None
    except ValueError:
        payload = None
    if not isinstance(payload, dict) or not set(payload) <= {"experiments", "next_page_token"}:
        got = f"HTTP {status}" + (f": {body}" if body else "")
        raise LaunchError(f"{uri} answers but is not an MLflow tracking server ({got} for {PROBE_ENDPOINT}); "
                          f"check tracking.uri / --tracking-uri / $MLFLOW_TRACKING_URI (host, port and path)")
    _answered.add(uri)


def registry_exists(uri: str) -> bool:
    """False only for a ``sqlite:///`` URI whose database file is not there yet: asking MLflow about it would
    create an empty registry file (a server or another scheme is asked)."""
    return not uri.startswith("sqlite:///") or Path(uri[len("sqlite:///"):]).is_file()


def client_for(uri: str):
    """An MlflowClient for tracking and the registry at ``uri``; a tracking server is probed first, once per
    process (:func:`check_server`)."""
    from mlflow import MlflowClient

    if is_server(uri):
        if uri not in _answered:
            check_server(uri)
        proxy_artifacts()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def proxy_artifacts() -> None:
    """Send every artifact transfer of this process through the tracking server. A server that proxies an object
    store (``--artifacts-destination s3://...``) advertises presigned URLs, and MLflow 3 clients then download (and
    upload large files) straight from the store: every client would need to reach it. Set once, process-wide,
    unless the variables are set already (``MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD=true`` turns that back on)."""
    for key in ("MLFLOW_ENABLE_PROXY_MULTIPART_DOWNLOAD", "MLFLOW_ENABLE_PROXY_MULTIPART_UPLOAD"):
        os.environ.setdefault(key, "false")


def experiment_id(client, name: str, uri: str) -> str:
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_root_for(uri))
    except Exception:  # another process created it first
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


@contextlib.contextmanager
def _quiet_registry_wait():
    """No "Waiting up to 300 seconds for model version to finish creation" line per registration (a REST registry
    polls until the version is READY; the wait itself stays)."""
    logger = logging.getLogger("mlflow.store.model_registry.abstract_store")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class Tracker:
    """An MLflow run. ``run_id`` given = continue that run (after a resume).

    A child run (``parent_run_id``: a sweep's trial) whose parent already holds a child of the same run name
    continues that one: an earlier attempt of the same trial created it and died before its run folder recorded
    the run id (a sweep's driver killed as a trial starts), and rerunning the trial must not leave a second run,
    the first one stuck RUNNING. Its parameters are logged where they are missing."""

    def __init__(self, cfg, run_id: str | None = None, extra_params: dict[str, Any] | None = None,
                 parent_run_id: str | None = None):
        from mlflow.entities import Param

        self.uri = cfg.tracking.uri
        if not self.uri:
            raise ConfigError("tracking.uri is empty: launch resolves it before training starts")
        self.client = client_for(self.uri)
        self.cfg = cfg
        if run_id is None:
            tags = {"efftx.recipe": cfg.recipe, "efftx.run_name": cfg.name}
            exp_id = experiment_id(self.client, cfg.tracking.experiment, self.uri)
            earlier = None
            if parent_run_id:
                tags["mlflow.parentRunId"] = parent_run_id
                children = self.client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent_run_id}'",
                                                   order_by=["attributes.start_time ASC"])
                earlier = next((r for r in children if r.data.tags.get("efftx.run_name") == cfg.name), None)
            if earlier is None:
                run = self.client.create_run(exp_id, run_name=cfg.name, tags=tags)
                self.run_id, logged = run.info.run_id, {}
            else:
                self.run_id, logged = earlier.info.run_id, earlier.data.params
                self.client.update_run(self.run_id, status="RUNNING")
            params = {k: str(v) for k, v in {**cfg.flat(), **(extra_params or {})}.items() if k not in logged}
            if params:
                self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items() if isinstance(v, (int, float))]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)

    def log_text(self, text: str, path: str) -> None:
        self.client.log_text(self.run_id, text, path)

    def log_sample(self, artifact, path: str) -> None:
        """One sample artifact at ``path``: text (str), file bytes (e.g. a PNG) or a Pillow image (saved as PNG)."""
        if isinstance(artifact, str):
            self.log_text(artifact, path)
            return
        if not isinstance(artifact, bytes):  # a Pillow image
            from efftx.generation.png import png_bytes

            artifact = png_bytes(artifact)
        import tempfile

        parent, name = Path(path).parent, Path(path).name
        with tempfile.TemporaryDirectory(prefix="efftx-artifact-") as tmp:
            local = Path(tmp, name)
            local.write_bytes(artifact)
            self.client.log_artifact(self.run_id, str(local), None if str(parent) == "." else str(parent))

    def log_artifacts(self, local_dir: str, path: str) -> None:
        self.client.log_artifacts(self.run_id, local_dir, path)

    def register(self, artifact_path: str, export_dir: str | None = None) -> str | None:
        """Register this run's export as a version of ``tracking.model_name`` (default: the recipe), once, and
        point the alias ``candidate`` at the new version; returns ``models:/NAME/VERSION``.

        ``export_dir`` given (the local export folder; what training does): the export is logged as an MLflow
        model (efftx.mlflow_model) and that model is registered. Without it: the run's artifact folder
        ``artifact_path`` is registered as it is (a plain export folder: the layout of versions registered before
        MLflow models; efftx.export still loads those). When this run already registered a version (a resumed
        run that had exported before), that version is returned and nothing new is made."""
        if not self.cfg.tracking.register_model:
            return None
        name = self.cfg.tracking.model_name or self.cfg.recipe
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException:
            pass  # already registered
        ours = self.client.search_model_versions(f"name='{name}' and run_id='{self.run_id}'")
        tags = {"efftx.run_name": self.cfg.name}
        if export_dir is not None:
            if ours:
                return f"models:/{name}/{min(int(v.version) for v in ours)}"
            from efftx import mlflow_model

            logged = mlflow_model.log_export(self.client, self.run_id, export_dir, name=name,
                                             step=self.cfg.train.steps)
            # source = the LoggedModel's storage location, not models:/<model_id>: MLflow's sqlite registry
            # resolves the latter against the global tracking URI, not this client's
            with _quiet_registry_wait():
                version = self.client.create_model_version(name, source=logged.artifact_location,
                                                           run_id=self.run_id, tags=tags, model_id=logged.model_id)
        else:
            source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{artifact_path}"
            existing = [v for v in ours if v.source == source]
            if existing:
                return f"models:/{name}/{min(int(v.version) for v in existing)}"
            with _quiet_registry_wait():
                version = self.client.create_model_version(name, source=source, run_id=self.run_id, tags=tags)
        self.client.set_registered_model_alias(name, CANDIDATE, version.version)
        return f"models:/{name}/{version.version}"

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def ui_command(uri: str) -> str:
    if is_server(uri):
        return f"open {uri.rstrip('/')}/#/experiments   (the tracking server's own UI)"
    return f".venv/bin/mlflow ui --backend-store-uri {uri} --port 5000   # then open http://127.0.0.1:5000"

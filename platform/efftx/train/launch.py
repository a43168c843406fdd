"""Driver side of a run: resolve the config, prepare data, check the cluster, run the TorchTrainer.

    launch(cfg) -> summary dict

The same function runs a job script (``python jobs/train_lm.py``, local Ray started in-process),
a job on a cluster (``ray job submit``: ``ray.init()`` joins the cluster) and each Tune trial.

The run folder ``<scaling.storage_path>/<run name>`` may be local or a URI (efftx/storage.py): the storage is
probed on the driver before anything starts, Ray Train gets its filesystem (``RunConfig(storage_path,
storage_filesystem)``), and the run record and the export go through the same filesystem.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

from efftx import paths
from efftx.config import Config
from efftx.storage import Storage, normalize
from efftx.errors import ConfigError, EfftxError, LaunchError
from efftx.tracking import check_server as check_tracking_server
from efftx.train import ds_config
from efftx.train.tasks import get as get_task, validate_run

RUN_FILE = "efftx_run.json"  # in the Ray run folder: MLflow run id and the config of the first attempt



def default_run_name(recipe: str) -> str:
    return f"{recipe}-{time.strftime('%Y%m%d-%H%M%S')}"


def resolve(cfg: Config) -> Config:
    """Fill machine-dependent defaults (paths, URIs, run name), merge a DeepSpeed config file
    (``engine.deepspeed_config``: the file wins, see efftx/train/ds_config.py), let the task derive the keys that
    come from elsewhere (DALL-E: vae.* from its dVAE export), and validate. Returns a copy."""
    cfg = cfg.copy()
    ds_config.apply(cfg)
    cfg.name = cfg.name or default_run_name(cfg.recipe)
    cfg.tracking.uri = cfg.tracking.uri or paths.default_tracking_uri()
    cfg.scaling.validate()  # a malformed URI is an error naming the key, before it is normalised
    cfg.scaling.storage_path = normalize(cfg.scaling.storage_path or paths.default_storage_path())
    cfg.data.cache_dir = cfg.data.cache_dir or paths.default_data_dir()
    return validate_run(get_task(cfg.model.family).configure(cfg))


def storage(cfg: Config) -> Storage:
    """The filesystem of ``scaling.storage_path`` (a resolved config), rooted there."""
    return Storage.open(cfg.scaling.storage_path, cfg.scaling.storage_endpoint)


def run_dir(cfg: Config) -> str:
    """The run folder as a user names it: a local path or a URI (s3://bucket/prefix/<run name>)."""
    st = storage(cfg)
    return st.uri(st.join(cfg.name))


def export_dir(cfg: Config) -> str:
    st = storage(cfg)
    return st.uri(st.join(cfg.name, "export"))


def _check_resume_compatible(cfg: Config, previous: dict[str, Any]) -> None:
    old = Config.from_dict(previous).flat()
    new = cfg.flat()
    changed = [f"{k}: {old[k]!r} -> {new[k]!r}" for k in new if old.get(k) != new[k] and not cfg.resumable(k)]
    if changed:
        raise ConfigError(f"run '{cfg.name}' already exists with a different config, so it cannot be resumed "
                          f"({'; '.join(changed[:6])}). Use a new --run-name, or the original settings.")


def _mlflow_run(cfg: Config, prepared: dict[str, Any], parent_run_id: str | None) -> str:
    """The MLflow run of this Ray run: created on the first attempt, continued on resume. The record
    (efftx_run.json) lives in the run folder, wherever the storage is."""
    from efftx.tracking import Tracker

    st = storage(cfg)
    record_file = st.join(cfg.name, RUN_FILE)
    if st.is_file(record_file):
        record = json.loads(st.read_text(record_file))
        _check_resume_compatible(cfg, record["config"])
        if record.get("tracking_uri") == cfg.tracking.uri:
            return Tracker(cfg, run_id=record["mlflow_run_id"]).run_id
    extra = {"data.sha256": prepared.get("corpus", {}).get("sha256", ""), **prepared.get("params", {})}
    tracker = Tracker(cfg, extra_params=extra, parent_run_id=parent_run_id)
    st.write(record_file, json.dumps({"mlflow_run_id": tracker.run_id, "tracking_uri": cfg.tracking.uri,
                                      "config": cfg.to_dict()}, indent=2))
    return tracker.run_id


def ensure_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (set inside ``ray job submit``), else start one in-process."""
    import ray

    if not ray.is_initialized():
        from ray._private import services

        address = os.environ.get("RAY_ADDRESS")
        # what ray.init() itself asks (Ray 2.60): RAY_ADDRESS, else the newest `ray start` cluster on this machine
        if address is None and services.canonicalize_bootstrap_address(None) is None:
            from efftx.cluster import start_local

            start_local(log_to_driver=True)  # a new cluster whose workers know its address (see start_local)
        else:
            ray.init(address=address, log_to_driver=True)
    from efftx.console import filter_worker_logs

    filter_worker_logs()  # the workers' lines a user cannot act on (DeepSpeed's op builds, a Ray-internal warning)


def check_resources(cfg: Config, use_gpu: bool) -> None:
    import ray

    total = ray.cluster_resources()
    s = cfg.scaling
    # an elastic run starts with what fits, at least scaling.min_workers
    workers, key = (s.min_workers, "scaling.min_workers") if s.elastic else (s.num_workers, "scaling.num_workers")
    need_cpu = workers * s.cpus_per_worker
    if need_cpu > total.get("CPU", 0) + 1e-9:
        raise LaunchError(f"the run needs {need_cpu:g} CPUs ({key}={workers} x "
                          f"scaling.cpus_per_worker={s.cpus_per_worker:g}) but the Ray cluster has "
                          f"{total.get('CPU', 0):g}; lower one of them (e.g. --set scaling.cpus_per_worker=0.5)")
    if use_gpu and workers > total.get("GPU", 0):
        raise LaunchError(f"scaling.device=cuda with {workers} workers ({key}) needs {workers} GPUs; "
                          f"the Ray cluster has {total.get('GPU', 0):g}")
    if s.placement_strategy == "STRICT_SPREAD":
        nodes = sum(1 for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0)
                    >= s.cpus_per_worker - 1e-9)
        if nodes < workers:
            raise LaunchError(f"scaling.placement_strategy=STRICT_SPREAD puts each worker on its own node: "
                              f"{workers} workers ({key}) need {workers} nodes with "
                              f"{s.cpus_per_worker:g} CPUs, the Ray cluster has {nodes}; add nodes or use SPREAD")


def _worker_error(exc: BaseException) -> str:
    """The user-facing message of a failed run: an EfftxError's text, else the worker's error line."""
    failures = getattr(exc, "worker_failures", None) or {}
    candidates = list(failures.values()) or [getattr(exc, "controller_failure", exc)]
    for failure in candidates:
        seen = failure
        while seen is not None:
            if isinstance(seen, EfftxError):
                return seen.args[0] if seen.args else str(seen)
            seen = getattr(seen, "cause", None) or seen.__cause__
    first = candidates[0]
    lines = [ln for ln in str(first).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else repr(first)


START_TIMEOUT_VAR = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"


@contextlib.contextmanager
def _start_timeout(seconds: float):
    """``scaling.start_timeout_s`` for this run: Ray Train hands the variable (set in the driver's environment
    when its controller starts) to its controller; the previous value is back afterwards."""
    if not seconds:
        yield
        return
    before = os.environ.get(START_TIMEOUT_VAR)
    os.environ[START_TIMEOUT_VAR] = f"{seconds:g}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(START_TIMEOUT_VAR, None)
        else:
            os.environ[START_TIMEOUT_VAR] = before


def launch(cfg: Config, *, parent_run_id: str | None = None, callbacks: list | None = None) -> dict[str, Any]:
    """Train ``cfg`` with Ray Train + DeepSpeed; return the run summary.

    ``parent_run_id``: make the MLflow run a child (Tune trials of a sweep). ``callbacks``: Ray Train
    callbacks, e.g. Tune's ``TuneReportCallback`` when this runs inside a Tune trial.
    """
    import ray.train
    from ray.train.torch import TorchTrainer

    cfg = resolve(cfg)
    st = storage(cfg)
    st.check()  # an unreachable endpoint, a missing bucket, refused credentials: an error naming the URI, now
    check_tracking_server(cfg.tracking.uri)  # http(s)://: down, unreachable or not MLflow: same, in seconds
    task = get_task(cfg.model.family)
    prepared = task.prepare(cfg)  # clear data errors here, before any worker starts
    ensure_ray()
    prepared = task.share(cfg, prepared)  # handed to the workers (text corpora: Ray's object store, data.handoff)
    import ray

    gpus = ray.cluster_resources().get("GPU", 0)
    use_gpu = cfg.scaling.device == "cuda" or (cfg.scaling.device == "auto" and gpus > 0)
    if cfg.engine.precision == "auto":  # the seeds train in fp16 on GPUs; CPUs have no fast fp16
        cfg.engine.precision = "fp16" if use_gpu else "fp32"
    if cfg.engine.precision == "fp16" and not use_gpu:
        raise ConfigError("engine.precision=fp16 needs CUDA GPUs; use bf16 or fp32 on CPU")
    from efftx.train.engine import check_optimizer

    check_optimizer(cfg.engine.optimizer, "cuda" if use_gpu else "cpu", cfg.engine.zero_stage)
    check_resources(cfg, use_gpu)
    if cfg.scaling.device == "auto":
        cfg.scaling.device = "cuda" if use_gpu else "cpu"
    mlflow_run_id = _mlflow_run(cfg, prepared, parent_run_id)

    # run_dir / export_dir: paths on the storage's filesystem; the storage itself (a pickled pyarrow filesystem
    # with the driver's endpoint and credentials) travels with the payload
    payload = {"config": cfg.to_dict(), "prepared": prepared, "mlflow_run_id": mlflow_run_id,
               "export_dir": st.join(cfg.name, "export"), "run_dir": st.join(cfg.name), "storage": st}
    resources = {"CPU": cfg.scaling.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}
    from efftx.train.loop import train_loop_per_worker

    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=payload,
        scaling_config=ray.train.ScalingConfig(
            num_workers=cfg.scaling.ray_num_workers,  # an int, or (min, max) for elastic training
            use_gpu=use_gpu, resources_per_worker=resources, placement_strategy=cfg.scaling.placement_strategy,
            elastic_resize_monitor_interval_s=cfg.scaling.resize_interval_s),
        run_config=ray.train.RunConfig(
            name=cfg.name,
            # a local path as it is (Ray resolves it); a URI as its filesystem and the path on it
            storage_path=cfg.scaling.storage_path if st.is_local else st.root,
            storage_filesystem=None if st.is_local else st.fs,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.train.keep_checkpoints),
            failure_config=ray.train.FailureConfig(max_failures=cfg.train.max_failures),
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),  # our own progress lines instead
            callbacks=callbacks,
        ),
    )
    from efftx.tracking import client_for

    try:
        with _start_timeout(cfg.scaling.start_timeout_s):
            result = trainer.fit()
    except ray.train.TrainingFailedError as exc:
        client_for(cfg.tracking.uri).set_terminated(mlflow_run_id, status="FAILED")
        raise LaunchError(f"run '{cfg.name}' failed: {_worker_error(exc)} "
                          f"(re-run the same command to resume from its last checkpoint)") from None
    client_for(cfg.tracking.uri).set_terminated(mlflow_run_id, status="FINISHED")
    m = result.metrics or {}
    return {
        "run_name": cfg.name,
        "recipe": cfg.recipe,
        "family": cfg.model.family,
        "final_step": m.get("step"),
        **task.summary(m),
        "tokens_per_s": m.get("tokens_per_s"),
        "peak_memory_mb": m.get("peak_memory_mb"),
        "mlflow_run_id": mlflow_run_id,
        "tracking_uri": cfg.tracking.uri,
        "registered_model": m.get("registered_model") or None,
        "export_path": m.get("export_path"),
        "checkpoint": st.uri(result.checkpoint.path) if result.checkpoint else None,
    }

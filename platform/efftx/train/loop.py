"""The one per-worker train loop, run by Ray Train's TorchTrainer on every worker.

Per optimizer step: ``grad_accum`` micro batches through the DeepSpeed engine; every
``log_every`` steps loss / lr / tokens/s / MFU and the task's own training metrics (mean over micro
batches and ranks); every ``eval_every`` the fixed validation set (whose ``val_loss`` also feeds the
plateau schedule); every ``sample_every`` a sample; every ``checkpoint_every`` (and at the end) a
Ray checkpoint with a manifest (checkpoint.save; the log line names its step and folder). At the end the
model is exported (safetensors + config.json + the task's files), logged to MLflow and registered once.

A batch is whatever the task makes: a tensor, or a tuple / list / dict of them (:func:`to_device`).

Resume is exact: the data of (step, micro batch, rank) and the dropout RNG are functions of the
seed and those coordinates, and the DeepSpeed checkpoint restores weights, optimizer and LR
schedule; so the first step after a resume computes what an uninterrupted run computes there. It starts
from the newest checkpoint of the run folder whose files match its manifest, which may be newer than the
one Ray Train offers (checkpoint.restore).

The run folder may be on any storage (``payload["storage"]``, efftx.storage.Storage: a local folder or a URI's
filesystem with the driver's endpoint and credentials): checkpoints, manifests and the export go there. On a remote
storage rank 0 writes the export into a local temp folder, uploads it (config.json last), and logs and registers
that local copy with MLflow.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from efftx.config import Config
from efftx.errors import NonFiniteLossError
from efftx.flops import peak_flops
from efftx import models
from efftx.export import CONFIG_FILE, export_state_dict
from efftx.storage import Storage
from efftx.train import checkpoint
from efftx.train import engine as engine_lib
from efftx.train.tasks import batch_rng, get as get_task


def duration(seconds: float) -> str:
    """'42s', '3m05s', '2h07m'."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def log(rank: int, message: str) -> None:
    """Progress lines from rank 0 (written to stdout directly: Ray Train re-routes print to logging)."""
    if rank == 0:
        sys.stdout.write(f"[efftx] {message}\n")
        sys.stdout.flush()


def peak_memory_mb(device: str) -> float:
    """Peak memory of this worker: CUDA allocator peak on GPU, the process's peak RSS on CPU."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def quiet_ray_train_logs() -> None:
    """Drop Ray Train's per-report INFO lines on workers (one logger is named by its file path, so
    LoggingConfig's level misses it); warnings and errors still show."""
    for name in list(logging.root.manager.loggerDict):
        if "ray/train" in name or name.startswith("ray.train"):
            logging.getLogger(name).setLevel(logging.WARNING)


def all_mean(values: list[float], weight: float = 1.0) -> list[float]:
    """Weighted mean over ranks of each value (weights summed across ranks), reduced on the process group's device
    (nccl, Ray Train's backend on GPUs, reduces CUDA tensors only)."""
    t = torch.tensor([v * weight for v in values] + [weight], dtype=torch.float64)
    if dist.is_available() and dist.is_initialized():
        t = t.to(checkpoint._dist_device())
        dist.all_reduce(t)
    *sums, total = t.tolist()
    return [x / total if total else 0.0 for x in sums]


def in_step(batches: list, zero_stage: int, rank: int = 0) -> list:
    """This rank's validation batches, as many as every rank's under ZeRO-3: its forward passes gather the
    partitioned parameters from every rank, so a rank with a batch more than another would wait for it for good
    (a validation set that does not split evenly: 3 windows over 2 ranks). The extra batches are left out (at
    most one a rank; the means are weighted by what was evaluated); other stages run every batch."""
    if zero_stage < 3 or not (dist.is_available() and dist.is_initialized()):
        return batches
    count = torch.tensor([len(batches)], dtype=torch.long, device=checkpoint._dist_device())
    dist.all_reduce(count, op=dist.ReduceOp.MIN)
    fewest = int(count.item())
    if fewest < len(batches) and rank == 0:
        log(rank, f"validation: {len(batches) - fewest} batch(es) of rank 0 left out, so that every rank runs "
                  f"{fewest} (ZeRO-3 gathers parameters from every rank at each forward pass)")
    return batches[:fewest]


def to_device(batch: Any, device) -> Any:
    """A task's batch on ``device``: a tensor, or tuples / lists / dicts of them (nested); anything else
    (e.g. the dVAE's Gumbel temperature, a float) is passed as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _accumulate(sums: dict[str, torch.Tensor], metrics: dict[str, Any]) -> None:
    """Add a micro batch's task metrics (0-d tensors or numbers) to ``sums``, without a host sync."""
    for k, v in metrics.items():
        v = v.detach().float() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
        sums[k] = sums[k] + v.to(sums[k].device) if k in sums else v


def _seed_step(cfg: Config, rank: int, step: int, micro: int) -> None:
    """Dropout & co draw from a generator seeded by (seed, rank, step, micro): resume-exact."""
    torch.manual_seed(int(batch_rng(cfg.train.seed, rank, step, micro).integers(2**62)))


def _inject_failure(cfg: Config, step: int, rank: int, world: int, resumed: bool) -> None:
    t = cfg.train
    if t.fail_at_step != step or resumed:
        return
    # Every rank reaches this step first: rank 0 has logged the step before to MLflow (synchronously) by then, so
    # the failure never races that write (without the barrier the last rank could fail while rank 0 was still
    # writing, and the step's first loss could be lost: seen once in CI).
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
    if rank != world - 1:
        return
    # No waiting for Ray Train to commit the last checkpoint: it learns of reports by polling, so a worker
    # that dies right after a save may take that report with it, and the restart must (and does) still
    # resume from that checkpoint, found in the run folder by its manifest (checkpoint.restore).
    message = f"injected failure at step {step} (train.fail_at_step={t.fail_at_step}) on rank {rank}"
    if t.fail_mode == "exit":
        sys.stdout.write(f"[efftx] {message}: the worker process exits now\n")
        sys.stdout.flush()
        os._exit(17)
    raise RuntimeError(message)


def train_loop_per_worker(payload: dict[str, Any]) -> None:
    import ray
    import ray.train

    cfg = Config.from_dict(payload["config"])
    quiet_ray_train_logs()
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = engine_lib.select_device(cfg)
    engine_lib.set_accelerator_env(device)
    if device == "cpu":
        torch.set_num_threads(max(1, int(cfg.scaling.cpus_per_worker)))

    task = get_task(cfg.model.family)(cfg, payload["prepared"])
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every rank
    model = models.build(cfg)
    task.load_pretrained(model)  # weights this run does not train (DALL-E's frozen dVAE)
    engine_lib.compile_model(model, cfg, device, log=lambda message: log(rank, message))
    engine, _, scheduler = engine_lib.initialize(model, cfg)
    dev = engine.device

    run_dir, keep = payload["run_dir"], cfg.train.keep_checkpoints
    storage: Storage = payload.get("storage") or Storage.local()
    state = checkpoint.restore(engine, rank, run_dir, keep, log=lambda message: log(rank, message), storage=storage)
    resumed = state is not None
    start = state["step"] if resumed else 0
    tokens_seen = state["tokens_seen"] if resumed else 0
    last_eval: dict[str, float] = state.get("last_eval", {}) if resumed else {}
    tracker = None
    if rank == 0:
        from efftx.tracking import Tracker

        tracker = Tracker(cfg, run_id=payload["mlflow_run_id"])
    # Which node each rank runs on, and the world size of this attempt (an elastic run's changes after a node is
    # lost): a log line, and the metric world_size at the attempt's first step.
    nodes = checkpoint.all_gather_json(ray.get_runtime_context().get_node_id())
    log(rank, f"workers: {world} on {len(set(nodes))} node(s): "
              + ", ".join(f"rank {r} on node {n}" for r, n in enumerate(nodes)))
    if tracker:
        tracker.log_metrics({"world_size": world, "nodes": len(set(nodes))}, start)
    log(rank, f"{'resumed at' if resumed else 'starting'} step {start}/{cfg.train.steps} "
              f"({model.num_params():,} parameters, {world} workers, {device}, {cfg.engine.precision}, "
              f"ZeRO-{cfg.engine.zero_stage}{engine_lib.offload_label(cfg)}, {cfg.engine.optimizer}, "
              f"{cfg.train.schedule} schedule)")

    t = cfg.train
    tokens_per_step = world * t.grad_accum * task.tokens_per_micro_batch
    flops_per_token = engine.module.flops_per_token(cfg.data.seq_len)
    peak = peak_flops(device, cfg.engine.precision)
    eval_set = in_step(task.eval_batches(rank, world), cfg.engine.zero_stage, rank)

    def evaluate(step: int) -> dict[str, float]:
        engine.eval()
        metrics, weight = task.evaluate(engine.module, [to_device(b, dev) for b in eval_set])
        engine.train()
        names = sorted(metrics)
        metrics = dict(zip(names, all_mean([metrics[k] for k in names], weight)))
        if tracker:
            tracker.log_metrics(metrics, step)
        log(rank, f"eval step {step}: " + " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
        if "val_loss" in metrics and scheduler.observe(metrics["val_loss"]):
            log(rank, f"learning rate cut to {scheduler.get_last_lr()[0]:.2e} (train.schedule=plateau: val_loss "
                      f"has not improved for more than {t.plateau_patience} evaluations)")
        return metrics

    def sample(step: int) -> None:
        engine.eval()
        artifacts, metrics = task.sample(engine.module, step)  # every rank: ZeRO-3 gathers weights collectively
        engine.train()
        if tracker and metrics:
            tracker.log_metrics(metrics, step)
        for name, artifact in artifacts.items():  # text, or image bytes / Pillow images (PNG)
            if tracker:
                tracker.log_sample(artifact, name)
            log(rank, f"sample at step {step}:\n{artifact}" if isinstance(artifact, str)
                else f"sample at step {step}: {name}")

    def save(step: int, metrics: dict[str, Any]) -> None:
        state = {"step": step, "tokens_seen": tokens_seen, "config": cfg.to_dict(),
                 "mlflow_run_id": payload["mlflow_run_id"], "last_eval": last_eval}
        checkpoint.save(engine, state, metrics, rank, run_dir, log=lambda message: log(rank, message), storage=storage)

    if not resumed:
        last_eval = evaluate(0)

    engine.train()
    interval_time, interval_steps, run_time, run_tokens = 0.0, 0, 0.0, 0
    step = start
    wall_start = time.perf_counter()  # the ETA counts evaluations, samples and checkpoints too
    while step < t.steps:
        _inject_failure(cfg, step + 1, rank, world, resumed)
        t0 = time.perf_counter()
        loss_sum = torch.zeros((), device=dev)
        task_sums: dict[str, torch.Tensor] = {}
        for micro in range(t.grad_accum):
            batch = to_device(task.train_batch(step, micro, rank), dev)
            _seed_step(cfg, rank, step, micro)
            loss, task_metrics = task.loss(engine, batch)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()
            _accumulate(task_sums, task_metrics)
        (loss_value,) = all_mean([loss_sum.item() / t.grad_accum])  # .item() synchronises the device
        dt = time.perf_counter() - t0
        step += 1
        tokens_seen += tokens_per_step
        interval_time, interval_steps = interval_time + dt, interval_steps + 1
        run_time, run_tokens = run_time + dt, run_tokens + tokens_per_step
        if not torch.isfinite(torch.tensor(loss_value)):
            raise NonFiniteLossError(f"non-finite training loss ({loss_value}) at step {step}: lower train.lr, "
                                     f"raise train.warmup_steps, or use engine.precision=fp32/bf16")

        if step % t.log_every == 0 or step == t.steps:
            tok_s = interval_steps * tokens_per_step / interval_time
            metrics = {"loss": loss_value, "lr": scheduler.get_last_lr()[0], "tokens_per_s": tok_s,
                       "mfu": flops_per_token * tok_s / (peak * world), "tokens_seen": tokens_seen,
                       # optimizer steps DeepSpeed skipped for fp16 overflow (the loss-scale search), 0 otherwise
                       "skipped_steps": float(getattr(engine, "skipped_steps", 0))}
            names = sorted(task_sums)  # the same on every rank: all_mean is collective
            task_means = dict(zip(names, all_mean([task_sums[k].item() / t.grad_accum for k in names]))) if names else {}
            metrics.update(task_means)
            if tracker:
                tracker.log_metrics(metrics, step)
            eta = (t.steps - step) * (time.perf_counter() - wall_start) / (step - start)
            log(rank, f"step {step}/{t.steps} loss {loss_value:.4f} lr {metrics['lr']:.2e} "
                      f"tok/s {tok_s:,.0f} mfu {metrics['mfu']:.2%}"
                      + "".join(f" {k} {v:.4g}" for k, v in task_means.items()) + f" eta {duration(eta)}")
            interval_time, interval_steps = 0.0, 0
        else:
            # still logged to MLflow every step: the resume test reads the loss of any step
            if tracker:
                tracker.log_metrics({"loss": loss_value}, step)

        evaluated = step % t.eval_every == 0 or step == t.steps
        if evaluated:
            last_eval = evaluate(step)
        if (t.sample_every and step % t.sample_every == 0) or step == t.steps:
            sample(step)
        if step % t.checkpoint_every == 0 and step < t.steps:  # the last one is saved after the export
            save(step, {"step": step, "loss": loss_value, "tokens_per_s": run_tokens / run_time, **last_eval})
        elif evaluated and step < t.steps:  # Tune schedulers (ASHA) see every evaluation
            ray.train.report({"step": step, "loss": loss_value, "tokens_per_s": run_tokens / run_time, **last_eval})

    # ------------------------------------------------------------------ export and final report
    export_dir = payload["export_dir"]  # on the storage's filesystem
    local_export = export_dir if storage.is_local else tempfile.mkdtemp(prefix="efftx-export-")
    model_uri = None
    try:
        with checkpoint.full_parameters(engine):
            # every rank: the fp32 masters are gathered
            state = checkpoint.export_state(engine, keep=rank == 0, log=lambda message: log(rank, message))
            if rank == 0:
                meta = {"step": step, "tokens_seen": tokens_seen, "num_params": engine.module.num_params(),
                        "mlflow_run_id": payload["mlflow_run_id"], **last_eval}
                export_state_dict(state, cfg, local_export, meta, files=task.export_files())
                if not storage.is_local:
                    storage.upload_dir(local_export, export_dir, last=(CONFIG_FILE,))
            del state
        if tracker:
            # an MLflow model (efftx.mlflow_model) of the local copy, alias @candidate; its artifacts hold the
            # export, so the weights are not logged a second time as run artifacts (only when nothing is registered)
            model_uri = tracker.register("export", local_export)
            if model_uri is None:
                tracker.log_artifacts(local_export, "export")
            log(rank, f"exported to {storage.uri(export_dir)}" + (f", registered as {model_uri}" if model_uri else ""))
    finally:
        if not storage.is_local:
            shutil.rmtree(local_export, ignore_errors=True)
    # The last checkpoint carries the run's final metrics (Ray's Result.metrics are the latest checkpoint's).
    save(step, {"step": step, "tokens_per_s": run_tokens / run_time if run_time else 0.0,
                "peak_memory_mb": peak_memory_mb(device),
                "export_path": storage.uri(export_dir), "registered_model": model_uri or "", **last_eval})
    if rank == 0:
        checkpoint.prune_after_run(run_dir, keep, log=lambda message: log(rank, message), storage=storage)

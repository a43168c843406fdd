"""Ray Tune sweeps over dotted config keys.

A search space is data (:class:`Space`): a grid over config keys. Grid points the run config rejects
(the same validation a job runs: ``Config.validate``, the attention backend's and the task's checks) are
left out before any trial starts, each reason printed. Each trial is the same launch as a training job: a
TorchTrainer (DeepSpeed, N workers) run inside a Tune function trainable, its reports forwarded to Tune by
``TuneReportCallback`` (the Ray 2.60 pattern: ``Tuner(TorchTrainer)`` no longer works). Any family can be
swept: the objective is its task's headline metric (``Task.metric`` / ``Task.mode``: the LM's validation
bits per byte, the dVAE's and DALL-E's validation loss), on which ASHA stops bad trials early. Every trial
is an MLflow run, child of the sweep's parent run, which gets the results table, the best config and a plot.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from efftx import paths, recipes
from efftx.config import Config
from efftx.errors import ConfigError, LaunchError
from efftx.train.tasks import get as get_task, validate_run


@dataclass(frozen=True)
class Space:
    description: str
    recipe: str  # default base recipe (its model.family's task gives the metric)
    grid: dict[str, list] = field(default_factory=dict)  # dotted key -> values


SPACES: dict[str, Space] = {
    "sinkhorn_blocks": Space(
        description="Sinkhorn bucket size x number of local-attention heads",
        recipe="sinkhorn_debug",
        grid={"attention.sinkhorn.bucket_size": [8, 16, 32], "attention.sinkhorn.n_local_attn_heads": [0, 2]},
    ),
    "performer_features": Space(
        description="Performer random features x feature redraw interval",
        recipe="performer_debug",
        grid={"attention.performer.nb_features": [16, 64, 256],
              "attention.performer.feature_redraw_interval": [0, 10]},
    ),
    # The recipe's compress_stride=0 ties the stride to the compressed block (as in the seed): the NSA options'
    # validation then drops points whose selection block is not a multiple of the compressed block, and
    # GQA's drops kv_heads that do not divide the heads.
    "nsa_blocks": Space(
        description="NSA compressed block x selection block x selected blocks x window x kv heads (of 4 heads)",
        recipe="nsa_debug",
        grid={"attention.nsa.compress_block_size": [4, 8, 16], "attention.nsa.selection_block_size": [8, 16],
              "attention.nsa.num_selected_blocks": [1, 2, 4], "attention.nsa.sliding_window_size": [8, 32],
              "model.kv_heads": [1, 2, 4]},
    ),
    "dvae_codebook": Space(
        description="dVAE codebook size x hidden width (objective: validation loss)",
        recipe="dvae_shapes_debug",
        grid={"vae.num_tokens": [32, 64, 128], "vae.hidden_dim": [16, 32]},
    ),
    # DALL-E trains on a trained dVAE: --set dalle.vae_path=EXPORT (e.g. the export of a dvae_shapes_debug run).
    "dalle_layers": Space(
        description="DALL-E attention layout x depth (objective: validation loss)",
        recipe="dalle_shapes_debug",
        grid={"dalle.attn_types": ["full", "full,axial_row", "axial_row,axial_col,conv_like"], "model.depth": [2, 4]},
    ),
}


def get_space(name: str) -> Space:
    if name not in SPACES:
        raise ConfigError(f"unknown search space {name!r}; available: {', '.join(sorted(SPACES))}")
    return SPACES[name]


def points(space: Space, base: Config, log=print) -> list[dict[str, Any]]:
    """Every grid point the run config accepts (``validate_run``: the config's, the attention backend's and the
    task's checks), in grid order. Rejected points are left out, each logged with its reason; a grid with no
    valid point is a ConfigError giving the first reason."""
    keys = list(space.grid)
    for key in keys:
        base.get(key)  # unknown key -> ConfigError naming it
    out, rejected = [], []
    for values in itertools.product(*(space.grid[k] for k in keys)):
        point = dict(zip(keys, values))
        cfg = base.copy().override(point)
        cfg.name = cfg.name or "check"
        try:
            validate_run(cfg)
        except ConfigError as exc:
            rejected.append((point, str(exc)))
            continue
        out.append(point)
    for point, why in rejected:
        log(f"[efftx] search space: left out {point}: {why}")
    if not out:
        raise ConfigError(f"the search space has no valid point: {rejected[0][1]}" if rejected else
                          "the search space is empty")
    return out


def choose(all_points: list[dict], samples: int, seed: int) -> list[dict]:
    """All points (samples <= 0 or >= their number), else ``samples`` of them drawn without replacement."""
    if samples <= 0 or samples >= len(all_points):
        return all_points
    return random.Random(seed).sample(all_points, samples)


def _trial(config: dict[str, Any]) -> None:
    """A Tune function trainable: one training run through the normal launch."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from efftx.train.launch import launch

    cfg = Config.from_dict(config["base"]).override(config["overrides"])
    cfg.name = f"{config['sweep']}-{tune.get_context().get_trial_id()}"
    launch(cfg, parent_run_id=config["parent_run_id"], callbacks=[TuneReportCallback()])


def sweep(space_name: str, *, recipe: str | None = None, samples: int = 0, max_concurrent: int = 2,
          overrides: list[str] | None = None, name: str | None = None) -> dict[str, Any]:
    """Run a sweep; returns a summary with the best config, the table and the plot path."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from efftx.tracking import Tracker
    from efftx.train.launch import check_resources, ensure_ray, resolve

    space = get_space(space_name)
    if max_concurrent < 1:
        raise ConfigError(f"--max-concurrent must be >= 1, got {max_concurrent}")
    base = recipes.get(recipe or space.recipe).override(overrides or [])
    sweep_name = name or f"{space_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    base.name = sweep_name
    base = resolve(base)
    from efftx.train import ds_config

    clash = sorted(set(space.grid) & set(ds_config.keys_set(base)))
    if clash:  # every trial re-reads the file, and the file wins: the sweep would not vary these keys
        raise ConfigError(f"the sweep varies {', '.join(clash)}, which engine.deepspeed_config "
                          f"{base.engine.deepspeed_config!r} sets (the file wins); remove them from the file")
    task = get_task(base.model.family)
    metric, mode = task.metric, task.mode
    chosen = choose(points(space, base), samples, base.train.seed)

    ensure_ray()
    use_gpu = base.scaling.device == "cuda" or (base.scaling.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    check_resources(base, use_gpu)
    per_trial = base.scaling.num_workers * base.scaling.cpus_per_worker
    total = ray.cluster_resources().get("CPU", 0)
    concurrent = min(max_concurrent, len(chosen))
    if concurrent * per_trial > total + 1e-9:
        raise LaunchError(f"--max-concurrent {concurrent} trials x {per_trial:g} CPUs each "
                          f"(scaling.num_workers x scaling.cpus_per_worker) = {concurrent * per_trial:g} CPUs, "
                          f"but the Ray cluster has {total:g}; lower --max-concurrent or the per-trial CPUs")

    parent = Tracker(base, extra_params={"sweep.space": space_name, "sweep.points": len(chosen),
                                         "sweep.grid": json.dumps(space.grid)})
    parent.client.set_tag(parent.run_id, "efftx.sweep", space_name)
    print(f"[efftx] sweep {sweep_name}: {len(chosen)} trials of {base.recipe} over "
          f"{', '.join(space.grid)}; MLflow parent run {parent.run_id}", flush=True)

    t = base.train
    scheduler = ASHAScheduler(time_attr="step", max_t=t.steps, grace_period=min(t.eval_every, t.steps),
                              reduction_factor=2)
    tuner = tune.Tuner(
        tune.with_resources(_trial, {"cpu": 0.01}),  # the trial only waits on its TorchTrainer's workers
        param_space={"base": base.to_dict(), "sweep": sweep_name, "parent_run_id": parent.run_id,
                     "overrides": tune.grid_search(chosen)},
        tune_config=tune.TuneConfig(metric=metric, mode=mode, scheduler=scheduler, max_concurrent_trials=concurrent),
        run_config=tune.RunConfig(name=sweep_name, storage_path=str(paths.home() / "tune"), verbose=0),
    )
    grid = tuner.fit()

    rows, trial_status = [], {}
    for result in grid:
        m = result.metrics or {}
        status = "error" if result.error else "complete" if m.get("step") == t.steps else "stopped early"
        if m.get("trial_id"):
            trial_status[f"{sweep_name}-{m['trial_id']}"] = status  # the trial's MLflow run name (see _trial)
        rows.append({**result.config["overrides"], metric: m.get(metric), "tokens_per_s": m.get("tokens_per_s"),
                     "step": m.get("step"), "status": status,
                     "error": str(result.error).strip().splitlines()[-1][:200] if result.error else ""})
    _close_trial_runs(parent, trial_status)
    finished = [r for r in rows if r[metric] is not None and not r["error"]]
    if not finished:
        parent.finish("FAILED")
        raise LaunchError(f"sweep {sweep_name}: no trial finished; first error: {rows[0]['error'] if rows else 'none'}")
    # ASHA-stopped trials report from an earlier step: compare like with like, completed trials first
    complete = [r for r in finished if r["status"] == "complete"]
    best = (min if mode == "min" else max)(complete or finished, key=lambda r: r[metric])
    keys = list(space.grid)
    table = format_table(rows, keys, metric, mode)
    print(table, flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        plot = Path(tmp) / f"{space_name}.png"
        plot_results(rows, keys, plot, title=f"{space_name} ({base.recipe})", metric=metric)
        (Path(tmp) / "results.json").write_text(json.dumps(rows, indent=2))
        parent.log_artifacts(tmp, "sweep")
    parent.log_text(table, "sweep/results.txt")
    parent.log_metrics({f"best_{metric}": best[metric]}, step=0)
    parent.client.log_param(parent.run_id, "sweep.best", json.dumps({k: best[k] for k in keys}))
    parent.finish("FINISHED")
    return {"sweep": sweep_name, "space": space_name, "trials": len(rows), "finished": len(finished),
            "metric": metric, "mode": mode,
            "best": {k: best[k] for k in keys}, f"best_{metric}": best[metric],
            "mlflow_parent_run_id": parent.run_id, "tracking_uri": base.tracking.uri,
            "plot_artifact": f"sweep/{space_name}.png"}


def _close_trial_runs(parent, trial_status: dict[str, str]) -> None:
    """ASHA stops trials by killing them, so their driver never closes their MLflow run, and that includes every
    trial that completes: ASHA also stops a trial at its report from step ``max_t`` (train.steps), after the final
    evaluation and the export but before its launch returns. Once the sweep is over, a child run still RUNNING
    is marked FINISHED if Tune saw its trial complete (``trial_status``: run name -> results-table status), else
    KILLED."""
    exp = parent.client.get_run(parent.run_id).info.experiment_id
    children = parent.client.search_runs([exp], filter_string=f"tags.mlflow.parentRunId = '{parent.run_id}'")
    for child in children:
        if child.info.status == "RUNNING":
            complete = trial_status.get(child.info.run_name) == "complete"
            parent.client.set_terminated(child.info.run_id, status="FINISHED" if complete else "KILLED")


def format_table(rows: list[dict], keys: list[str], metric: str, mode: str = "min") -> str:
    """The results, best first."""
    cols = keys + [metric, "tokens_per_s", "step", "status", "error"]
    short = {k: k.split(".")[-1] for k in cols}

    def cell(v):
        if isinstance(v, float):
            return f"{v:,.4f}" if abs(v) < 100 else f"{v:,.0f}"
        return "" if v is None else str(v)[:40]

    sign = 1 if mode == "min" else -1
    ranked = sorted(rows, key=lambda r: (r[metric] is None, sign * (r[metric] or 0)))
    body = [[cell(r.get(c)) for c in cols] for r in ranked]
    widths = [max(len(short[c]), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    lines = ["  ".join(short[c].ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def plot_results(rows: list[dict], keys: list[str], out: Path, title: str, metric: str) -> None:
    """Metric against the first swept key, one line per combination of the other keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key, other = keys[0], keys[1:]
    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict[tuple, list[tuple]] = {}
    for r in rows:
        if r[metric] is not None and not math.isnan(r[metric]):
            groups.setdefault(tuple(r[k] for k in other), []).append((r[x_key], r[metric], r.get("status")))
    for group, pts in sorted(groups.items(), key=lambda kv: str(kv[0])):
        pts.sort(key=lambda p: (p[0], p[1]))
        label = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(other, group)) or metric
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        stopped = [p for p in pts if p[2] == "stopped early"]
        if stopped:  # hollow markers: ASHA stopped these trials, their value is from an earlier step
            ax.plot([p[0] for p in stopped], [p[1] for p in stopped], "o", markersize=11, fillstyle="none",
                    color=line.get_color())
    if any(r.get("status") == "stopped early" for r in rows):
        ax.plot([], [], "o", fillstyle="none", color="gray", markersize=11, label="stopped early by ASHA")
    ax.set_xlabel(x_key)
    ax.set_ylabel(f"validation {metric} (last report)")
    ax.set_title(title)
    if all(isinstance(r[x_key], (int, float)) and r[x_key] > 0 for r in rows):
        ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def sweep_main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Sweep dotted config keys with Ray Tune (ASHA) over the efftx train loop.")
    p.add_argument("--space", required=True, help=f"named search space: {', '.join(sorted(SPACES))}")
    p.add_argument("--recipe", help="base recipe (default: the space's own)")
    p.add_argument("--samples", type=int, default=0, help="trials to draw from the grid (0 = the whole grid)")
    p.add_argument("--max-concurrent", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--name", help="sweep name (Tune experiment and MLflow parent run)")
    args = p.parse_args(argv)
    from efftx.cli import run_reporting

    return run_reporting(lambda: sweep(args.space, recipe=args.recipe, samples=args.samples,
                                       max_concurrent=args.max_concurrent, overrides=args.overrides, name=args.name))

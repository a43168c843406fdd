"""Command line of the train jobs: ``--recipe NAME [--set key=value ...] [--run-name N] [--workers N]``.

The last line printed is one JSON object summarising the run, so scripts can read it.
"""

from __future__ import annotations

import argparse
import json
import sys

from efftx import recipes
from efftx.config import Config
from efftx.errors import ConfigError, EfftxError


def parser(description: str, default_recipe: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--recipe", default=default_recipe, required=default_recipe is None,
                   help=f"named config, one of: {', '.join(recipes.names())}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")
    p.add_argument("--run-name", help="run name; re-using one resumes that run from its last checkpoint")
    p.add_argument("--workers", type=int, help="number of Ray Train workers (scaling.num_workers)")
    p.add_argument("--deepspeed-config", metavar="PATH",
                   help="a DeepSpeed config JSON (engine.deepspeed_config): its batch, clipping, precision, ZeRO "
                        "stage, optimizer and scheduler replace the run config's (the file wins)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = recipes.get(args.recipe).override(args.overrides)
    if args.run_name:
        cfg.name = args.run_name
    if args.workers is not None:
        cfg.scaling.num_workers = args.workers
    if args.deepspeed_config:
        cfg.engine.deepspeed_config = args.deepspeed_config
    return cfg


def run_reporting(work) -> int:
    """Run ``work()`` -> summary dict: a user error prints one line and exits 2; success prints the
    summary as the last line (after Ray's forwarded logs), as one JSON object."""
    try:
        summary = work()
    except EfftxError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if summary is None:
        return 0
    flush_ray_logs()
    print(json.dumps(summary), flush=True)
    return 0


def train_main(argv: list[str] | None = None, *, default_recipe: str | None = None,
               description: str = "Train a model through the efftx train loop (Ray Train + DeepSpeed).") -> int:
    args = parser(description, default_recipe).parse_args(argv)

    def work():
        from efftx.train.launch import launch, resolve

        cfg = config_from_args(args)
        if args.print_config:
            print(resolve(cfg).to_json())
            return None
        summary = launch(cfg)
        _print_epilogue(summary)
        return summary

    return run_reporting(work)


def flush_ray_logs() -> None:
    """Disconnect from Ray so its forwarded worker logs are printed before the final JSON line."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _print_epilogue(summary: dict) -> None:
    """The run's task says what to print: the headline metric, where the export is, what to do next."""
    from efftx.train.tasks import get as get_task

    print("\n".join(get_task(summary["family"]).epilogue(summary)), flush=True)


def train_dalle_main(argv: list[str] | None = None) -> int:
    """Train DALL-E on a given dVAE (--vae), or the recipe's paired dVAE first and then DALL-E on its export."""
    p = parser("Train DALL-E through the efftx train loop; without --vae (or dalle.vae_path), train its dVAE "
               "first (the paired recipe: dalle* -> dvae*).", "dalle_shapes_small")
    p.add_argument("--vae", help="the trained dVAE: an export folder or models:/NAME/VERSION (sets dalle.vae_path)")
    p.add_argument("--vae-recipe", help="recipe of the dVAE trained first (default: the pair of --recipe)")
    p.add_argument("--vae-set", dest="vae_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key of the dVAE run only; --set keys of data.*, scaling.*, engine.*, "
                        "tracking.uri and tracking.experiment apply to both runs, the others to DALL-E only; "
                        "--deepspeed-config is DALL-E's (the dVAE's: --vae-set engine.deepspeed_config=PATH)")
    args = p.parse_args(argv)

    def work():
        from efftx.train.launch import default_run_name, launch, resolve

        from efftx.train.tasks import get as get_task

        cfg = config_from_args(args)
        key = get_task(cfg.model.family).pretrained_key  # dalle.vae_path
        if not key:
            raise ConfigError(f"recipe {args.recipe!r} trains model.family={cfg.model.family!r}, not a DALL-E (no "
                              f"pretrained dVAE to train on); choose one of {', '.join(recipes.pairs())}")
        if args.vae:
            cfg.set(key, args.vae)
        name = args.run_name or default_run_name(args.recipe)
        cfg.name = f"{name}-dalle"
        vae_cfg = None
        if not cfg.get(key):
            shared = [o for o in args.overrides if o.split("=", 1)[0].strip().startswith(SHARED_PREFIXES)]
            vae_cfg = recipes.get(args.vae_recipe or recipes.paired_dvae(args.recipe)).override(shared)
            vae_cfg.override(args.vae_overrides)
            vae_cfg.name = f"{name}-dvae"
            if args.workers is not None:
                vae_cfg.scaling.num_workers = args.workers
        elif args.vae_recipe or args.vae_overrides:
            raise ConfigError("--vae-recipe and --vae-set configure the dVAE this job trains; with --vae (or "
                              "dalle.vae_path) it trains none")
        if args.print_config:
            print(json.dumps({"dvae": resolve(vae_cfg).to_dict() if vae_cfg else None,
                              "dalle": resolve(cfg).to_dict() if cfg.get(key) else cfg.to_dict()}, indent=2))
            return None
        summaries = {"dvae": None}
        if vae_cfg is not None:
            summaries["dvae"] = launch(vae_cfg)
            _print_epilogue(summaries["dvae"])
            cfg.set(key, summaries["dvae"]["export_path"])
        summaries["dalle"] = launch(cfg)
        _print_epilogue(summaries["dalle"])
        return summaries

    return run_reporting(work)


# --set keys that describe the machine or the data rather than a model: jobs/train_dalle.py gives them to the
# dVAE it trains first too.
SHARED_PREFIXES = ("data.", "scaling.", "engine.", "tracking.uri", "tracking.experiment")


def train_speculative_main(argv: list[str] | None = None) -> int:
    """Train a speculative pair: the draft, then a target that measures speculative decoding against it at every
    sample; or, with ``--distill``, the target first and then a draft distilled from the target's export
    (``distill.teacher``), measured against the target at the end."""
    p = argparse.ArgumentParser(description="Train a speculative-decoding pair: the draft, then the target "
                                            "(base vs speculative decoding timed and logged at every sample); "
                                            "with --distill the target, then a draft distilled from it.")
    p.add_argument("--size", default="small", choices=["debug", "small", "enwik8"],
                   help="recipes spec_draft_<size> and spec_target_<size>")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of both runs (repeatable)")
    p.add_argument("--draft-set", dest="draft_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of the draft run only, after --set (e.g. distill.alpha=0.5)")
    p.add_argument("--run-name", help="runs <name>-draft and <name>-target; re-using it resumes them")
    p.add_argument("--workers", type=int)
    p.add_argument("--deepspeed-config", metavar="PATH",
                   help="a DeepSpeed config JSON for both runs (engine.deepspeed_config; the file wins)")
    p.add_argument("--distill", action="store_true",
                   help="train the target first, then the draft distilled from its export (distill.teacher: KL "
                        "to the target's distribution on the same batches, DistillSpec); the target's speculative "
                        "measurement then runs once at the end, against the distilled draft, logged to its run")
    p.add_argument("--target", metavar="EXPORT",
                   help="with --distill: distill from this trained target (an export folder or models:/NAME/VERSION) "
                        "instead of training one")
    args = p.parse_args(argv)

    def work():
        from efftx.train.launch import default_run_name, launch

        if args.target and not args.distill:
            raise ConfigError("--target names the teacher of a distilled draft: it goes with --distill")
        name = args.run_name or default_run_name(f"spec_{args.size}")

        def config(role: str) -> Config:
            cfg = recipes.get(f"spec_{role}_{args.size}").override(args.overrides)
            if role == "draft":
                cfg.override(args.draft_overrides)
            cfg.name = f"{name}-{role}"
            if args.workers is not None:
                cfg.scaling.num_workers = args.workers
            if args.deepspeed_config:
                cfg.engine.deepspeed_config = args.deepspeed_config
            return cfg

        summaries = {}
        if not args.distill:
            for role in ("draft", "target"):
                cfg = config(role)
                if role == "target":
                    cfg.speculative.draft = summaries["draft"]["export_path"]
                summaries[role] = launch(cfg)
                _print_epilogue(summaries[role])
            return summaries
        target_cfg = config("target")
        if args.target:
            summaries["target"] = None
            target_export = args.target
        else:
            summaries["target"] = launch(target_cfg)
            _print_epilogue(summaries["target"])
            target_export = summaries["target"]["export_path"]
        draft_cfg = config("draft")
        draft_cfg.distill.teacher = target_export
        summaries["draft"] = launch(draft_cfg)
        _print_epilogue(summaries["draft"])
        summaries["speculative"] = final_speculative_measurement(target_export, summaries["draft"]["export_path"],
                                                                 summaries["target"])
        return summaries

    return run_reporting(work)


def final_speculative_measurement(target_export: str, draft_export: str, target_summary: dict | None) -> dict:
    """The target's speculative measurement against a draft trained after it (``--distill``): the target run's
    own sample (LMTask.sample with ``speculative.draft`` set: base vs speculative, timed, mean accepted), once, on
    the driver, plus a greedy check that speculative decoding gives exactly the target's tokens. Logged to the
    target's MLflow run at its final step (when this job trained it). Returns the metrics."""
    import torch

    from efftx.export import load_export, read_export_config, resolve_export
    from efftx.generation.decode import generate
    from efftx.generation.speculative import speculative_generate
    from efftx.tracking import client_for
    from efftx.train.tasks import get as get_task

    folder = resolve_export(target_export, target_summary["tracking_uri"] if target_summary else "")
    cfg, _ = read_export_config(folder)
    cfg.speculative.draft = str(resolve_export(draft_export, cfg.tracking.uri))
    cfg.distill.teacher = ""  # the target is measured, not distilled
    task_cls = get_task(cfg.model.family)
    task = task_cls(cfg, task_cls.prepare(cfg))
    target, _, _ = load_export(folder)
    step = (target_summary or {}).get("final_step") or 0
    artifacts, metrics = task.sample(target, step)
    draft = task._draft(torch.device("cpu"))
    prompt_len = min(cfg.train.sample_prompt_len, cfg.data.seq_len)
    prompt = task.data.val_windows(1, prompt_len)[:, :prompt_len]
    n = max(1, min(cfg.train.sample_length, target.max_seq_len - prompt.shape[1] - cfg.speculative.gamma - 1))
    spec, _ = speculative_generate(target, draft, prompt, n, gamma=cfg.speculative.gamma, temperature=0)
    metrics["spec_greedy_equal"] = float(spec[0] == generate(target, prompt, n, temperature=0)[0].tolist())
    if target_summary:
        from mlflow.entities import Metric

        client = client_for(target_summary["tracking_uri"])
        run_id = target_summary["mlflow_run_id"]
        client.log_batch(run_id, metrics=[Metric(k, float(v), 0, step) for k, v in metrics.items()])
        for path, text in artifacts.items():
            client.log_text(run_id, text, path.replace("samples/", "samples/final_speculative_"))
    print(f"[efftx] final speculative measurement (target vs draft, gamma {cfg.speculative.gamma}): "
          + " ".join(f"{k} {v:.3f}" for k, v in metrics.items()), flush=True)
    return metrics

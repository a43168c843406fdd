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
    """Train a draft, then a target that measures speculative decoding against it at every sample."""
    p = argparse.ArgumentParser(description="Train a speculative-decoding pair: the draft, then the target "
                                            "(base vs speculative decoding timed and logged at every sample).")
    p.add_argument("--size", default="small", choices=["debug", "small", "enwik8"],
                   help="recipes spec_draft_<size> and spec_target_<size>")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key of both runs (repeatable)")
    p.add_argument("--run-name", help="runs <name>-draft and <name>-target; re-using it resumes them")
    p.add_argument("--workers", type=int)
    p.add_argument("--deepspeed-config", metavar="PATH",
                   help="a DeepSpeed config JSON for both runs (engine.deepspeed_config; the file wins)")
    args = p.parse_args(argv)

    def work():
        from efftx.train.launch import default_run_name, launch

        name = args.run_name or default_run_name(f"spec_{args.size}")
        summaries = {}
        for role in ("draft", "target"):
            cfg = recipes.get(f"spec_{role}_{args.size}").override(args.overrides)
            cfg.name = f"{name}-{role}"
            if args.workers is not None:
                cfg.scaling.num_workers = args.workers
            if args.deepspeed_config:
                cfg.engine.deepspeed_config = args.deepspeed_config
            if role == "target":
                cfg.speculative.draft = summaries["draft"]["export_path"]
            summaries[role] = launch(cfg)
            _print_epilogue(summaries[role])
        return summaries

    return run_reporting(work)

"""Command line of the train jobs: ``--recipe NAME [--set key=value ...] [--run-name N] [--workers N]``.

The last line printed is one JSON object summarising the run, so scripts can read it.
"""

from __future__ import annotations

import argparse
import json
import sys

from efftx import recipes
from efftx.config import Config
from efftx.errors import EfftxError


def parser(description: str, default_recipe: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--recipe", default=default_recipe, required=default_recipe is None,
                   help=f"named config, one of: {', '.join(recipes.names())}")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.lr=3e-4 (repeatable)")
    p.add_argument("--run-name", help="run name; re-using one resumes that run from its last checkpoint")
    p.add_argument("--workers", type=int, help="number of Ray Train workers (scaling.num_workers)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return p


def config_from_args(args: argparse.Namespace) -> Config:
    cfg = recipes.get(args.recipe).override(args.overrides)
    if args.run_name:
        cfg.name = args.run_name
    if args.workers is not None:
        cfg.scaling.num_workers = args.workers
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
    from efftx.generate import sample_text
    from efftx.tracking import ui_command
    from efftx.train.checkpoint import read_export_config

    export = summary.get("export_path")
    if export:
        prompt = "def "
        room = read_export_config(export)[0].model.max_seq_len - len(prompt)
        text = sample_text(export, prompt=prompt, max_new_tokens=min(200, room), temperature=0.8, top_k=32, seed=0)
        print(f"\n--- sample from the exported model (prompt {prompt!r}) ---\n{prompt}{text}\n---")
    bpb, tok_s = summary.get("val_bpb"), summary.get("tokens_per_s")
    print(f"run:            {summary['run_name']} (step {summary['final_step']}"
          + (f", validation bits/byte {bpb:.3f}" if bpb is not None else "")
          + (f", {tok_s:,.0f} tokens/s" if tok_s else "") + ")")
    print(f"MLflow run:     {summary['mlflow_run_id']} in {summary['tracking_uri']}")
    print(f"MLflow UI:      {ui_command(summary['tracking_uri'])}")
    if summary.get("registered_model"):
        print(f"registered as:  {summary['registered_model']}")
    print(f"exported model: {export}")
    print(f"generate:       .venv/bin/python -m efftx.generate --model {export} --prompt 'def ' --max-new-tokens 200")


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
            if role == "target":
                cfg.speculative.draft = summaries["draft"]["export_path"]
            summaries[role] = launch(cfg)
            _print_epilogue(summaries[role])
        return summaries

    return run_reporting(work)

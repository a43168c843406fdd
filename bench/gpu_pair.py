"""A trained speculative pair for the GPU check's ``speculative`` section, made where the project is installed.

    make gpu-pair                 # = python bench/gpu_pair.py [--out .efftx/gpu-pair] [--size small] [--set K=V ...]

Trains ``jobs/train_speculative.py --size small`` (the draft, then the target, through Ray Train + DeepSpeed as any
job), then a draft distilled from that target (``--distill --target <its export>``), and copies the three exports
into OUT/target, OUT/draft and OUT/distilled (fp32 safetensors + config: about 15 MB for the small pair). A GPU
image with torch alone then judges issue 15's speculative goals on it:

    PYTHONPATH=platform:bench python3 bench/gpu_check.py --only speculative --pair .efftx/gpu-pair --out DIR

(OUT is under the git-ignored ``.efftx``: the device tool carries it when asked to). A pair already in OUT is
replaced only when both trainings succeed; a failing job stops here, naming it, and OUT is left as it was.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / ".efftx" / "gpu-pair"
ROLES = ("target", "draft", "distilled")


def train(args: list[str], what: str) -> dict:
    """``jobs/train_speculative.py ARGS`` -> its summaries (the JSON on its last line of output); SystemExit naming
    ``what`` when it fails."""
    cmd = [sys.executable, "jobs/train_speculative.py", *args]
    print(f"[gpu-pair] {what}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)  # its log goes to stderr, as it runs
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"error: {what} failed (exit code {proc.returncode}); see its log above")
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        raise SystemExit(f"error: {what} printed no summary (its last line: {lines[-1][:200]!r})") from None


def local_export(summary: dict | None, role: str) -> Path:
    """The export folder of a job's ``role`` run (a local path: the default storage)."""
    path = Path(str((summary or {}).get("export_path") or "").removeprefix("file://"))
    if not (path / "config.json").is_file():
        raise SystemExit(f"error: the {role} run left no export at {path or '(none)'}: gpu-pair needs runs on local "
                         "storage (the default, under .efftx)")
    return path


def collect(exports: dict[str, Path], out: Path) -> None:
    """Copy ``exports`` (role -> export folder) into ``out``/<role>, replacing what was there only once all are
    copied (into a new folder beside it first)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp's folder is its owner's alone
    try:
        for role, path in exports.items():
            shutil.copytree(path, staging / role)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="where the exports go (OUT/target, OUT/draft, OUT/distilled)")
    p.add_argument("--size", default="small", choices=["debug", "small"], help="jobs/train_speculative.py --size")
    p.add_argument("--run-name", default="gpu-pair", help="runs <name>-draft, <name>-target, <name>-distilled-draft")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="an override for every run (e.g. train.steps=20)")
    args = p.parse_args(argv)
    sets = [a for kv in args.overrides for a in ("--set", kv)]
    pair = train(["--size", args.size, "--run-name", args.run_name, *sets], "the pair (draft, then target)")
    target = local_export(pair.get("target"), "target")
    distilled = train(["--size", args.size, "--distill", "--target", str(target), "--run-name",
                       f"{args.run_name}-distilled", *sets], "the distilled draft")
    exports = {"target": target, "draft": local_export(pair.get("draft"), "draft"),
               "distilled": local_export(distilled.get("draft"), "distilled draft")}
    out = Path(args.out)
    collect(exports, out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"[gpu-pair] {', '.join(ROLES)} exports in {out} ({size / 2**20:.1f} MiB); on a GPU: PYTHONPATH=platform:bench "
          f"python3 bench/gpu_check.py --only speculative --pair {out} --out DIR")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Runs a bench under ``bench/`` as a command, as a user runs it (the library on ``PYTHONPATH``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python bench/<script> args...`` from the repository's root; its exit code and output, as text."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, f"bench/{script}", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_refuses(script: str, cases: list[tuple[list[str], str]]) -> None:
    """Each ``(args, message)``: the bench exits with argparse's 2, ``message`` on its stderr."""
    for args, message in cases:
        run = run_bench(script, *args)
        assert run.returncode == 2 and message in run.stderr, (args, run.returncode, run.stderr[-2000:])

"""bench/row_noise.py: a draw's noise with counter-based streams against a torch.Generator per row, side by side,
and the scheduler's steps both ways (run as a command, as a user runs it)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "bench/row_noise.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_bench_times_both_draws_and_steps_and_marks_its_goals():
    run = bench("--rows", "1", "16", "--repeats", "3", "--steps")
    assert run.returncode == 0, run.stderr
    draws = re.findall(r"^\s+(base \(V=256\)|speculative \(6 x 257\))\s+(\d+) rows: generators\s+([\d.]+) us, "
                       r"streams\s+([\d.]+) us \(\s*([\d.]+)x\), torch reference\s+([\d.]+) us", run.stdout, re.M)
    assert {(name, int(n)) for name, n, *_ in draws} == {(s, n) for s in ("base (V=256)", "speculative (6 x 257)")
                                                         for n in (1, 16)}, run.stdout
    for _, _, gens, streams, ratio, ref in draws:
        assert float(gens) > 0 and float(streams) > 0 and float(ref) > 0
        assert abs(float(ratio) - float(gens) / float(streams)) <= 0.05 + 0.01 * float(ratio)
    for mode in ("base", "speculative"):
        line = re.search(rf"^\s+{mode}\s+per row stepped, generators / streams: (.*)$", run.stdout, re.M)
        assert line, run.stdout
        assert re.findall(r"(\d+) rows \d+ / \d+ us \([\d.]+x\)", line[1]) == ["1", "16"], line[1]
    for name in ("base \\(V=256\\)", "speculative \\(6 x 257\\)"):
        assert re.search(rf"^\s+\[(met|NOT met)\] {name}: a 16-row draw with streams >= 4x faster than per-row "
                         rf"generators: [\d.]+x", run.stdout, re.M), run.stdout


def test_the_bench_refuses_bad_arguments():
    run = bench("--rows", "0")
    assert run.returncode == 2 and "--rows and --repeats must be >= 1" in run.stderr
    run = bench("--device", "tpu")
    assert run.returncode == 2 and "invalid choice" in run.stderr

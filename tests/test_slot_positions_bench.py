"""bench/slot_positions.py: continuous batching's slots fitted to their rows' positions against whole-context slots,
side by side, under a cache budget (run as a command, as a user runs it)."""

from __future__ import annotations

import re

from bench_command import run_bench


def bench(*args: str):
    return run_bench("slot_positions.py", *args)


def test_the_bench_holds_more_short_rows_in_fitted_slots_and_marks_its_goal():
    """A budget of two rows of the context: eight short requests decode together in fitted slots (64 positions of
    256), two at a time in whole-context ones, base and speculative, no errors; the goal line says met."""
    run = bench("--requests", "8", "--budget-rows", "2", "--loads", "short")
    assert run.returncode == 0, run.stderr
    rows = {(m[1], m[2]): (int(m[3]), int(m[4])) for m in
            re.finditer(r"^short\s+(base|speculative)\s+(fit|context)\s+(\d+)\s+[\d.]+\s+\d+\s+[\d.]+\s+[\d.]+\s+(\d+)$",
                        run.stdout, re.M)}
    assert rows == {("base", "fit"): (8, 0), ("base", "context"): (2, 0),
                    ("speculative", "fit"): (8, 0), ("speculative", "context"): (2, 0)}, run.stdout
    assert "[met] (info) short base: rows per step, fitted over context" in run.stdout
    assert "[met] (info) short speculative: rows per step, fitted over context" in run.stdout


def test_the_bench_refuses_bad_arguments():
    run = bench("--loads", "long")
    assert run.returncode == 2 and "--loads: short, mixed" in run.stderr
    run = bench("--budget-rows", "0")
    assert run.returncode == 2 and "--budget-rows and --requests must be at least 1" in run.stderr

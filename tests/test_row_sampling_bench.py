"""bench/row_sampling.py: a draw's noise with counter-based streams against a torch.Generator per row, a step's
distributions for rows of mixed settings in one pass against a pass per setting, the C++ sampling kernel against
torch's operators, side by side, and the scheduler's steps each way (run as a command, as a user runs it)."""

from __future__ import annotations

import re

from bench_command import assert_refuses, run_bench


def bench(*args: str):
    return run_bench("row_sampling.py", *args)


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
    dists = re.findall(r"^\s+(\d+) rows,\s+(\d+) settings: a pass per setting\s+[\d.]+ us \((\d+) operations\), "
                       r"one pass\s+[\d.]+ us \((\d+) operations\): +[\d.]+x the time, +([\d.]+)x the operations; "
                       r"the same distributions$", run.stdout, re.M)
    assert [(int(n), int(k)) for n, k, *_ in dists] == [(1, 1), (16, 16)], run.stdout
    for _, _, grouped, one, ratio in dists:
        assert abs(float(ratio) - int(grouped) / int(one)) < 0.06
    assert int(dists[1][2]) > int(dists[0][2])  # a pass per setting runs more operations with more settings...
    assert int(dists[1][3]) == int(dists[0][3]) + 12  # ...one pass as many (12 more for a top-k and a nucleus)
    assert re.search(r"^\s+\[(met|NOT met)\] distributions of 16 rows of 16 settings in one pass: at most a third of "
                     r"the operations", run.stdout, re.M), run.stdout
    for mode in ("base", "speculative"):
        line = re.search(rf"^\s+{mode}\s+per row stepped, generators / streams: (.*)$", run.stdout, re.M)
        assert line, run.stdout
        assert re.findall(r"(\d+) rows \d+ / \d+ us \([\d.]+x\)", line[1]) == ["1", "16"], line[1]
    # the C++ sampling kernel against torch's operators, per call, with its goal at 1 and 16 rows
    calls = re.findall(r"^\s+(\d+) rows, (draft draw|verify distributions|acceptance|a step's sampling)\s*: torch\s+"
                       r"([\d.]+) us, kernel\s+([\d.]+) us \(\s*([\d.]+)x\)$", run.stdout, re.M)
    assert {(int(n), name) for n, name, *_ in calls} == {
        (n, name) for n in (1, 16) for name in ("draft draw", "verify distributions", "acceptance",
                                                "a step's sampling")}, run.stdout
    for *_, off, on, ratio in calls:
        assert abs(float(ratio) - float(off) / float(on)) <= 0.05 + 0.01 * float(ratio)
    for n in (1, 16):
        assert re.search(rf"^\s+\[(met|NOT met)\] a speculative step's sampling at {n} row\(s\) at least 2x faster "
                         r"through the C\+\+ kernel than torch's operators: [\d.]+x$", run.stdout, re.M), run.stdout
        line = re.search(rf"^\s+{'speculative' if n == 16 else 'base'}\s+per row stepped, sampling kernel off / on: (.*)$",
                         run.stdout, re.M)
        assert line and re.findall(r"(\d+) rows \d+ / \d+ us \([\d.]+x\)", line[1]) == ["1", "16"], run.stdout
    for name in ("base \\(V=256\\)", "speculative \\(6 x 257\\)"):
        assert re.search(rf"^\s+\[(met|NOT met)\] {name}: a 16-row draw with streams >= 4x faster than per-row "
                         rf"generators: [\d.]+x", run.stdout, re.M), run.stdout


def test_the_bench_refuses_bad_arguments():
    assert_refuses("row_sampling.py", [(["--rows", "0"], "--rows and --repeats must be >= 1"),
                                       (["--device", "tpu"], "invalid choice")])

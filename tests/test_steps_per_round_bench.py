"""bench/steps_per_round.py: continuous batching's decoding (base, speculative) with several steps a round against
one, side by side, the same tokens (and acceptance) both ways (run as a command, as a user runs it)."""

from __future__ import annotations

import re

from bench_command import assert_refuses, run_bench


def bench(*args: str):
    return run_bench("steps_per_round.py", *args)


def test_the_bench_compares_both_settings_and_marks_its_goal():
    run = bench("--size", "debug", "--rows", "1", "3", "--tokens", "10", "--rounds", "1")
    assert run.returncode == 0, run.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+default\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+$", run.stdout,
                      re.M)
    # 10 new tokens: the prefill's and 9 steps, in 9 rounds one at a time, in 3 (4 + 4 + 1) four at a time
    assert [(int(n), int(k), int(r)) for n, k, _, r, _, _ in rows] == [(1, 1, 9), (1, 4, 3), (3, 1, 9), (3, 4, 3)]
    assert all(float(t) > 0 and float(p) > 0 and float(h) > 0 for _, _, t, _, p, h in rows)
    ratios = re.findall(r"^\s+(\d+)\s+4 steps a round / 1: ([\d.]+)x the tokens/s, ([\d.]+)x the host time per "
                        r"token; the same tokens$", run.stdout, re.M)
    assert [int(n) for n, _, _ in ratios] == [1, 3], run.stdout
    by = {(int(n), int(k)): (float(t), float(h)) for n, k, t, _, _, h in rows}
    for n, speed, host in ratios:
        (t1, h1), (t4, h4) = by[(int(n), 1)], by[(int(n), 4)]
        assert abs(float(speed) - t4 / t1) <= 0.01 + 0.02 * t4 / t1
        assert abs(float(host) - h4 / h1) <= 0.01 + 0.05 * h4 / h1
        assert re.search(rf"^\s+\[(met|NOT met)\] {n} rows: the scheduler's own time per token with 4 steps a round "
                         rf"at most 0.5x one step's: {host}x$", run.stdout, re.M), run.stdout


def test_speculative_batches_take_several_steps_a_round_with_the_same_tokens_and_acceptance():
    run = bench("--size", "debug", "--rows", "2", "--tokens", "24", "--rounds", "1", "--mode", "speculative",
                "--gamma", "3")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("speculative decoding (gamma 3), 24 new tokens per request")
    rows = re.findall(r"^\s+2\s+(\d+)\s+default\s+\d+\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+$", run.stdout, re.M)
    (one, k1), (four, k4) = [(int(s), int(r)) for s, r in rows]
    assert (one, four) == (1, 4) and 0 < k4 < k1  # fewer scheduling rounds for the same steps
    assert re.search(r"^\s+2\s+4 steps a round / 1: [\d.]+x the tokens/s, [\d.]+x the host time per token; the "
                     r"same tokens and acceptance$", run.stdout, re.M), run.stdout


def test_pipeline_compares_unpipelined_with_pipelined_steps_and_judges_only_on_cuda():
    """``--pipeline --steps 1``: base decoding unpipelined against pipelined, the same tokens both ways in as many
    rounds (a pipelined row leaves as its last step is queued, which is read at that round's end), the ratio printed
    and not judged on a CPU."""
    run = bench("--size", "debug", "--rows", "1", "2", "--tokens", "10", "--rounds", "1", "--pipeline", "--steps", "1")
    assert run.returncode == 0, run.stderr
    assert "1 steps a round, unpipelined against pipelined" in run.stdout.splitlines()[0]
    rows = re.findall(r"^\s+(\d+)\s+1\s+(no|yes)\s+(\d+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+$", run.stdout, re.M)
    assert [(int(n), p, int(r)) for n, p, _, r in rows] == [(1, "no", 9), (1, "yes", 9), (2, "no", 9), (2, "yes", 9)]
    by = {(int(n), p): int(t) for n, p, t, _ in rows}
    for n in (1, 2):
        (speed,) = re.findall(rf"^\s+{n}\s+pipelined / unpipelined: ([\d.]+)x the tokens/s, [\d.]+x the host time "
                              r"per token; the same tokens$", run.stdout, re.M)
        assert abs(float(speed) - by[n, "yes"] / by[n, "no"]) <= 0.01 + 0.02 * float(speed)
        assert re.search(rf"^\s+\[not judged \(a CPU runs nothing ahead of the host\)\] {n} rows: pipelined tokens/s "
                         r"at least 1.1x unpipelined on CUDA: [\d.]+x$", run.stdout, re.M), run.stdout


def test_the_bench_refuses_bad_arguments():
    assert_refuses("steps_per_round.py", [(["--steps", "1"], "--steps >= 2"),
                                          (["--pipeline", "--steps", "0"], "(>= 1 with --pipeline)"),
                                          (["--pipeline", "--mode", "speculative"],
                                           "--pipeline: base decoding's steps are pipelined"),
                                          (["--rows", "0"], "--rows, --tokens and --rounds must be >= 1"),
                                          (["--device", "tpu"], "invalid choice"),
                                          (["--mode", "speculative", "--gamma", "0"], "--gamma must be >= 1")])

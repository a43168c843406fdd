"""bench/speculative.py (base vs speculative tokens/s, issue 15's goals marked), run as a command as a user runs it,
and the GPU check's reading of its verdict (bench/gpu_check.py's speculative section)."""

from __future__ import annotations

import json
import re

from bench_command import assert_refuses, run_bench
from test_gpu_check import gpu_check


def test_the_bench_checks_greedy_equality_times_both_ways_and_marks_the_goals(tmp_path):
    verdict_path = tmp_path / "verdict.json"
    run = run_bench("speculative.py", "--untrained", "--batches", "1,2", "--new-tokens", "6", "--timed-prompts", "2",
                    "--acceptance-prompts", "2", "--repeats", "1", "--no-adaptive", "--prompt-len", "16",
                    "--json", str(verdict_path))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "device cpu" in run.stdout.splitlines()[0]
    assert re.findall(r"greedy output == base: (\w+)", run.stdout) == ["yes", "yes"]  # fixed and adaptive gamma
    for batch in (1, 2):
        assert re.search(rf"^speculative, untrained\s+{batch}\s+5\s+[\d,]+\s+[\d.]+x", run.stdout, re.M), run.stdout
    goals = re.findall(r"^  batch (\d+): at least ([\d.]+)x: best ([\d.]+)x \(speculative, untrained\): "
                       r"(MET|NOT MET)$", run.stdout, re.M)
    assert [(b, g) for b, g, _, _ in goals] == [("1", "2.5"), ("2", "1.5")], run.stdout
    assert all((float(r) >= float(g)) == (v == "MET") for _, g, r, v in goals)
    # --json: the same verdict, as the GPU check reads it
    verdict = json.loads(verdict_path.read_text())
    assert verdict["equality"] == [{"draft": "untrained", "gamma": "fixed", "equal": True},
                                   {"draft": "untrained", "gamma": "adaptive", "equal": True}]
    assert [(g["batch"], g["goal"], f"{g['best']:.2f}", g["label"], "MET" if g["met"] else "NOT MET")
            for g in verdict["goals"]] == [(int(b), float(g), r, "speculative, untrained", v) for b, g, r, v in goals]
    # the GPU check's rows of this verdict: equality a correctness row, one row per goal
    rows = gpu_check.verdict_rows(verdict)
    assert [(r.name, r.status, r.correctness) for r in rows] == [
        ("greedy speculative == base, every draft", "pass", True),
        ("batch 1: at least 2.5x", "info", False), ("batch 2: at least 1.5x", "info", False)]
    assert rows[1].detail == f"best {goals[0][2]}x (speculative, untrained): {goals[0][3]}"
    # a draft whose greedy output differs, or no verdict at all (the bench stopped early), fails the check
    verdict["equality"][0]["equal"] = False
    wrong = gpu_check.verdict_rows(verdict)
    assert wrong[0].status == "FAIL" and wrong[0].detail == "1/2 equal"
    assert [(r.name, r.status) for r in gpu_check.verdict_rows(None)] == [
        ("greedy speculative == base, every draft", "FAIL"), ("goals", "FAIL")]
    assert [(r.name, r.status) for r in gpu_check.verdict_rows({"equality": verdict["equality"][1:]})] == [
        ("greedy speculative == base, every draft", "pass"), ("goals", "FAIL")]


def test_bf16_weight_rows_sit_beside_the_float32_ones_and_keep_greedy_equality():
    run = run_bench("speculative.py", "--untrained", "--batches", "1,2", "--new-tokens", "6", "--timed-prompts", "2",
                    "--acceptance-prompts", "2", "--repeats", "1", "--no-adaptive", "--prompt-len", "16",
                    "--bf16-weights", "--costs")
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.findall(r"greedy output == bf16 base: (\w+)", run.stdout) == ["yes"]
    # --costs: per batch the eager pass costs, and beside them the same with the linear kernel's prefetch off and
    # with the attention kernel key by key
    number = r"\s*([\d.]+)"
    passes = rf"base step{number}  verify{number}  draft step{number}  verify/base{number}"
    for batch in (1, 2):
        on = re.search(rf"^  batch {batch} eager\s+{passes}  allows a=2: [\d.]+x", run.stdout, re.M)
        assert on, run.stdout
        for what, gain in (("the linear kernel's prefetch off", "the prefetch"),
                           ("the attention kernel key by key", "the blocked attention")):
            off = re.search(rf"^  batch {batch} eager, {what}: {passes}; {gain} makes a base step ([\d.]+)x, "
                            rf"a verify ([\d.]+)x, a draft step ([\d.]+)x as fast$", run.stdout, re.M)
            assert off, run.stdout
            on_ms, off_ms = [float(v) for v in on.groups()[:3]], [float(v) for v in off.groups()[:3]]
            for a, b, ratio in zip(on_ms, off_ms, off.groups()[4:]):  # the printed ratio is off / on (ms to 0.01)
                assert (b - 0.005) / (a + 0.005) - 0.005 <= float(ratio) <= (b + 0.005) / (a - 0.005) + 0.005, (
                    a, b, ratio)
    for batch in (1, 2):
        assert re.search(rf"^base, KV cache, bf16 weights\s+{batch}\s+-\s+[\d,]+\s+[\d.]+x", run.stdout, re.M)
        assert re.search(rf"^speculative, untrained, bf16 weights\s+{batch}\s+5\s+[\d,]+\s+[\d.]+x.*\s-$",
                         run.stdout, re.M), run.stdout  # no goal marked on its row
        assert re.search(rf"^  bf16 weights at batch {batch}, tokens/s over the float32 row: base, KV cache "
                         r"[\d.]+x, speculative, untrained [\d.]+x$", run.stdout, re.M), run.stdout
    # the goals still judge the float32 rows only
    assert re.findall(r"^  batch \d+: at least [\d.]+x: best [\d.]+x \((.*)\)", run.stdout, re.M) == [
        "speculative, untrained"] * 2


def test_the_bench_refuses_a_device_it_cannot_use():
    assert_refuses("speculative.py", [(["--untrained", "--device", "cuda"], "--device cuda: this torch sees no CUDA "
                                       "device"),
                                      (["--untrained", "--device", "tpu"], "--device takes cpu or cuda (cuda:N), not "
                                       "'tpu'"),
                                      (["--untrained", "--device", "meta"], "not 'meta'"),
                                      (["--untrained", "--bf16-weights", "--compile", "on"],
                                       "--bf16-weights adds eager rows beside the eager float32 ones")])


def test_coupled_rows_check_sampled_output_against_base_and_sit_beside_the_ratio_tests():
    """``--coupled``: an acceptance line per draft with coupled acceptance beside the ratio test's, its sampled output
    checked against sampled base decoding (same seeds; in the verdict too), and a timed coupled row per batch."""
    run = run_bench("speculative.py", "--untrained", "--batches", "1", "--new-tokens", "6", "--timed-prompts", "2",
                    "--acceptance-prompts", "2", "--repeats", "1", "--no-adaptive", "--prompt-len", "16", "--coupled")
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"coupled, fixed: T=0.8 [\d.]+ / [\d.]+ \(the ratio test's [\d.]+ / [\d.]+\), sampled output == "
                     r"sampled base \(same seeds\): yes", run.stdout), run.stdout
    assert re.search(r"^speculative, untrained, coupled\s+1\s+5\s+[\d,]+\s+[\d.]+x", run.stdout, re.M), run.stdout
    # and a row whose steps take their draft length by cost, with the steps it took at each length
    assert re.search(r"^speculative, untrained, coupled, by cost\s+1\s+5\s+[\d,]+\s+[\d.]+x", run.stdout, re.M)
    steps = re.search(r"untrained draft, coupled, by cost at batch 1: steps per draft length 0..5 \[([\d, ]+)\]",
                      run.stdout)
    assert steps and sum(int(x) for x in steps.group(1).split(",")) > 0, run.stdout

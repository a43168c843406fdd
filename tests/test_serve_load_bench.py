"""bench/serve_load.py's in-process load (``--inprocess``): the scheduler under a closed-loop load, unbatched vs
fifo vs continuous, with the issue's goals marked. It is the GPU check's ``serveload`` section, which runs on a
GPU image that has torch and no web stack, so it is run here with Ray, FastAPI, pydantic, Starlette and MLflow
made unimportable."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("serve_load", REPO / "bench" / "serve_load.py")
serve_load = importlib.util.module_from_spec(_spec)
sys.modules["serve_load"] = serve_load
_spec.loader.exec_module(serve_load)

# runs the bench as ``python bench/serve_load.py ARGS`` with the web stack (and Ray, MLflow, requests, safetensors)
# unimportable: a GPU image with torch alone (the exports it writes and reads: efftx.weights' own format code)
BARE = """
import importlib.abc, runpy, sys
BLOCKED = {"ray", "fastapi", "pydantic", "starlette", "uvicorn", "mlflow", "deepspeed", "requests", "safetensors"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on this image")
sys.meta_path.insert(0, Block())
sys.argv = ["bench/serve_load.py", *sys.argv[1:]]
runpy.run_path("bench/serve_load.py", run_name="__main__")
"""


def bench(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", BARE, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_inprocess_load_runs_with_torch_alone_and_marks_the_goals(tmp_path):
    out = tmp_path / "figures.json"
    proc = bench("--inprocess", "--size", "debug", "--requests", "12", "--clients", "4", "--max-new", "32",
                 "--unloaded", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert set(runs) == {f"{p}/{m}" for p, _ in serve_load.POLICIES for m in ("base", "speculative")}
    for key, (r,) in runs.items():
        assert (r["ok"], r["errors"]) == (12, 0), key
        assert r["rps"] > 0 and r["seconds"] > 0 and set(r["unloaded"]) == {"8", "16"}
        # the scheduler's rounds: their passes' time and its own besides
        timing = r["timing"]
        assert timing["rounds"] > 0 and timing["pass_us"] > 0 and timing["host_us"] > 0 and timing["host_share"] < 1
    for mode in ("base", "speculative"):
        # the baseline really decodes one row at a time; the batching policies share steps
        assert runs[f"unbatched/{mode}"][0]["rows"] == 1
        assert runs[f"fifo/{mode}"][0]["rows"] > 1 and runs[f"continuous/{mode}"][0]["rows"] > 1
        for goal in ("requests/s >= 3x unbatched", "short requests' p99 under load <= 2x", "no errors: 0"):
            assert any(line.startswith(("  [met] " + mode, "  [NOT met] " + mode)) and goal in line
                       for line in proc.stdout.splitlines()), (mode, goal, proc.stdout[-2000:])
        assert f"[info] {mode}: the scheduling besides the passes, per round (wall clock): continuous " in proc.stdout
    assert "in-process on cpu (cpu clock, 1 torch thread)" in proc.stdout and "in-process decoding step, speculative" in proc.stdout
    # each step cost with the scheduler's own time in it, at every row count (1, 4 and 8)
    for mode in ("base", "speculative"):
        line = next(x for x in proc.stdout.splitlines() if x.startswith(f"in-process decoding step, {mode}"))
        shares = [float(v) for v in re.findall(r"scheduling (\d+) us of it", line)]
        assert len(shares) == 3 and all(v > 0 for v in shares), line
    # one prompt's prefill by its length, as decoding runs it beside torch's attention past 16 tokens (in the plan, and
    # on the module path): 16 and 17 tokens, and either side of the kernel's limit (MAX_QUERIES, 128)
    line = next(x for x in proc.stdout.splitlines() if x.startswith("in-process prefill of one prompt (base)"))
    got = re.findall(r"(\d+) tokens ([\d.]+) ms \(SDPA past 16 tokens in the plan ([\d.]+) ms, [\d.]+x; on the module "
                     r"path ([\d.]+) ms, [\d.]+x\)", line)
    assert [int(g[0]) for g in got] == [16, 17, 29, 64, 128, 129, 200] and all(float(v) > 0 for g in got for v in g[1:]), line


def test_the_inprocess_load_runs_compiled_passes_with_torch_alone(tmp_path):
    """``--compile on``: every policy's scheduler compiles its passes (here up to 1 row), and the step costs compiled
    at every row count are printed beside the eager ones; ``--short-slowdown`` reaches the continuous policy alone."""
    out = tmp_path / "figures.json"
    proc = bench("--inprocess", "--size", "debug", "--modes", "base", "--requests", "6", "--clients", "2",
                 "--max-new", "16", "--unloaded", "1", "--compile", "on", "--compile-rows", "1", "--short-slowdown",
                 "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert all((r["ok"], r["errors"]) == (6, 0) for (r,) in runs.values())
    assert runs["continuous/base"][0]["knobs"]["short_slowdown"] == 0 and runs["continuous/base"][0]["long_rounds"] == 0
    assert all("short_slowdown" not in runs[f"{p}/base"][0]["knobs"] for p in ("unbatched", "fifo"))
    assert "compile=on up to 1 rows" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("in-process decoding step compiled (on)"))
    assert line.count("eager / this: ") == 4 and line.count("; scheduling ") == 4  # rows 1, 2, 4, 8


def test_long_prompts_in_chunks_and_in_one_pass_run_beside_whole_prompts_grouped(tmp_path):
    """``--long-prompts N --prefill-chunk C --one-pass --steps-per-round 4 --unpipelined``: every other long request
    gets an N-byte prompt, and four more policies, ``chunked`` (``prefill_chunk=C``), ``one-pass``
    (``group_prefills=False``), ``multi-step`` (``steps_per_round=4``) and ``unpipelined`` (``pipeline=False``), run
    beside ``continuous`` (whole prompts, grouped by cost, a step a round, the default pipelining), each with an
    [info] line comparing them."""
    assert len(serve_load.prompt_of(1, 40, 60)) == 60 and len(serve_load.prompt_of(3, 40, 60)) == 60
    assert len(serve_load.prompt_of(2, 40, 60)) < 30 and len(serve_load.prompt_of(1, 8, 60)) < 30  # short: as ever
    out = tmp_path / "figures.json"
    proc = bench("--inprocess", "--size", "debug", "--modes", "base", "--requests", "8", "--clients", "2",
                 "--max-new", "32", "--unloaded", "1", "--long-prompts", "60", "--prefill-chunk", "16",
                 "--one-pass", "--steps-per-round", "4", "--unpipelined", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert runs["chunked/base"][0]["knobs"]["prefill_chunk"] == 16 and runs["chunked/base"][0]["errors"] == 0
    assert runs["continuous/base"][0]["knobs"]["prefill_chunk"] == 0
    assert "[info] base: prompts in chunks of 16 tokens: short p99" in proc.stdout
    single, grouped = runs["one-pass/base"][0], runs["continuous/base"][0]
    assert single["knobs"]["group_prefills"] is False and "group_prefills" not in grouped["knobs"]
    assert single["errors"] == 0 and all(r["prefills"] > 0 and r["prefill_tokens"] > 0 for r in (single, grouped))
    assert "[info] base: arrivals in one pass per lane (group_prefills off) against grouped by cost" in proc.stdout
    multi = runs["multi-step/base"][0]
    assert multi["knobs"]["steps_per_round"] == 4 and "steps_per_round" not in grouped["knobs"]
    assert multi["errors"] == 0 and multi["timing"]["rounds"] > 0
    assert re.search(r"^\s+\[info\] base: 4 steps a round while nothing waits: requests/s [\d.]+x one step's; short "
                     r"p99 [\d.]+x unloaded against [\d.]+x; first token p99 \d+ ms against \d+ ms; scheduling \d+ "
                     r"us of a \d+ us round against \d+ of \d+; errors 0$", proc.stdout, re.M), proc.stdout
    unpiped = runs["unpipelined/base"][0]
    assert unpiped["knobs"]["pipeline"] is False and "pipeline" not in grouped["knobs"] and unpiped["errors"] == 0
    assert re.search(r"^\s+\[info\] base: unpipelined: requests/s [\d.]+x continuous's \(the default\); short p99 ",
                     proc.stdout, re.M), proc.stdout
    for flag in (["--prefill-chunk", "16"], ["--one-pass"], ["--steps-per-round", "4"], ["--unpipelined"]):
        proc = bench(*flag)
        assert proc.returncode == 2 and "--long-prompts, --prefill-chunk, --one-pass, --steps-per-round and " \
            "--unpipelined are --inprocess options" in proc.stderr
    proc = bench("--inprocess", "--steps-per-round", "1")
    assert proc.returncode == 2 and "--steps-per-round takes a count >= 2" in proc.stderr


def run(rps: float, p99: float, errors: int = 0) -> dict:
    return {"rps": rps, "short_ratio_p99": p99, "later_ratio_p99": p99, "errors": errors, "unloaded": {8: 10, 16: 20},
            "ttft_p50": 1.0, "ttft_p99": 2.0}


def test_speculative_batches_take_several_steps_a_round_under_the_load(tmp_path):
    """``--steps-per-round 4`` in speculative mode: the ``multi-step`` policy beside ``continuous``, compared."""
    out = tmp_path / "figures.json"
    proc = bench("--inprocess", "--size", "debug", "--modes", "speculative", "--requests", "6", "--clients", "2",
                 "--max-new", "24", "--unloaded", "1", "--steps-per-round", "4", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    multi, one = json.loads(out.read_text())["multi-step/speculative"][0], \
        json.loads(out.read_text())["continuous/speculative"][0]
    assert multi["knobs"]["steps_per_round"] == 4 and multi["errors"] == 0 and multi["ok"] == 6
    assert multi["timing"]["rounds"] < one["timing"]["rounds"]  # the same work in fewer scheduling rounds
    assert re.search(r"^\s+\[info\] speculative: 4 steps a round while nothing waits: requests/s [\d.]+x one step's; ",
                     proc.stdout, re.M), proc.stdout


def test_the_load_decodes_with_bf16_weights_when_asked(tmp_path):
    """``--decode-weights bfloat16``: the scheduler's models hold bfloat16 Linear weights (as a replica's with the
    text app's ``decode_weights``), and the load runs without an error."""
    out = tmp_path / "figures.json"
    proc = bench("--inprocess", "--size", "debug", "--modes", "speculative", "--configs", "continuous", "--requests",
                 "4", "--clients", "2", "--max-new", "16", "--unloaded", "1", "--decode-weights", "bfloat16",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "; Linear weights in bfloat16 (decode_weights)" in proc.stdout
    assert all((r["ok"], r["errors"]) == (4, 0) for (r,) in json.loads(out.read_text()).values())
    paths, _ = serve_load.export_models("debug")
    for model in serve_load.load_models(paths, "cpu", 1, "bfloat16"):
        assert model.blocks[0].attn.fn.q.weight.dtype == torch.bfloat16 and model.embed.weight.dtype == torch.float32


def test_the_step_costs_sit_beside_the_attention_kernels_key_by_key_reference():
    """``--attention-reference``: the step costs per row count are timed again with the CPU attention kernel key by
    key, and printed beside the blocked path's (the same costs as the plain line's) with their ratio."""
    proc = bench("--inprocess", "--size", "debug", "--modes", "base", "--configs", "continuous", "--requests", "2",
                 "--clients", "2", "--max-new", "8", "--unloaded", "1", "--attention-reference")
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = re.search(r"^in-process decoding step \(the attention kernel blocked\), base, best of 3: (.*)$",
                     proc.stdout, re.M)
    assert line, proc.stdout
    cells = re.findall(r"(\d+) rows ([\d.]+) ms \([\d.]+x; key by key / this: ([\d.]+)x\)", line.group(1))
    assert [int(n) for n, _, _ in cells] == [1, 2, 4, 8]
    plain = re.search(r"^in-process decoding step, base, best of 3: (.*)$", proc.stdout, re.M)
    assert plain and re.findall(r"(\d+) rows ([\d.]+) ms", plain.group(1)) == [(n, ms) for n, ms, _ in cells]
    assert all(float(r) > 0 for _, _, r in cells)


@pytest.mark.parametrize("rps, p99, errors, marks", [
    (3.0, 2.0, 0, ["met", "met", "met"]),
    (2.99, 2.01, 0, ["NOT met", "NOT met", "met"]),
    (9.0, 1.0, 1, ["met", "met", "NOT met"]),
])
def test_goals_are_marked_at_their_thresholds(rps, p99, errors, marks):
    """requests/s >= 3x unbatched (the median of the rounds' paired ratios), short p99 <= 2x, no errors."""
    runs = {("unbatched", "base"): [run(1.0, 9.0), run(2.0, 9.0)],
            ("continuous", "base"): [run(rps, p99, errors), run(2 * rps, p99)]}
    lines = [line for line in serve_load.goals(runs, ["base"], {"base": "a note"}) if not line.startswith("[info]")]
    assert [line[1:line.index("]")] for line in lines] == marks
    assert f"{rps:.2f}x [{rps:.2f}, {rps:.2f}]" in lines[0] and "a note" in lines[1]


@pytest.mark.parametrize("rps, p99, errors, marks", [
    (3.0, 2.0, 0, ["met", "met", "met"]),
    (2.99, 2.01, 2, ["NOT met", "NOT met", "NOT met"]),
])
def test_the_process_engine_gets_its_own_goals_beside_the_thread(rps, p99, errors, marks):
    """The ``process`` configuration (engine=process): its goals marked at the same thresholds, and its requests/s
    paired with ``continuous``'s (engine=thread) round by round."""
    runs = {("unbatched", "base"): [run(1.0, 9.0), run(2.0, 9.0)],
            ("continuous", "base"): [run(2.0, 3.0), run(4.0, 3.0)],
            ("process", "base"): [run(rps, p99, errors), run(2 * rps, p99)]}
    lines = [line for line in serve_load.goals(runs, ["base"]) if "engine=process" in line]
    assert [line[1:line.index("]")] for line in lines[:3]] == marks
    assert f"requests/s >= 3x unbatched: {rps:.2f}x [{rps:.2f}, {rps:.2f}]" in lines[0]
    assert f"<= 2x unloaded: {p99:.2f}x" in lines[1] and f"no errors: {errors}" in lines[2]
    assert lines[3].startswith("[info]") and f"requests/s {rps / 2:.2f}x engine=thread's" in lines[3]


def test_the_process_engine_is_judged_without_the_thread_engine_beside_it():
    """``--configs unbatched,process``: the process engine's goals are marked though ``continuous`` did not run (its
    [info] line then has no engine=thread ratio)."""
    runs = {("unbatched", "base"): [run(1.0, 9.0)], ("process", "base"): [run(3.5, 1.8)]}
    lines = [line for line in serve_load.goals(runs, ["base"]) if "engine=process" in line]
    assert [line[1:line.index("]")] for line in lines[:3]] == ["met", "met", "met"]
    assert "requests/s >= 3x unbatched: 3.50x" in lines[0] and "engine=thread" not in lines[3]


def test_haproxy_is_paired_with_the_proxy_per_configuration_and_mode():
    """``--ingress proxy,haproxy``: HAProxy's requests/s and unloaded short latency over the proxy's, round by round
    (their median), for the configurations and modes both measured; nothing when only one ingress ran."""
    def at(rps, unloaded):
        return {**run(rps, 1.0), "unloaded_short": unloaded}

    by = {"proxy": {("process", "base"): [at(40.0, 20.0), at(36.0, 22.0)], ("unbatched", "base"): [at(15.0, 20.0)] * 2},
          "haproxy": {("process", "base"): [at(60.0, 15.0), at(45.0, 11.0)], ("fifo", "base"): [at(50.0, 15.0)] * 2}}
    head, *lines = serve_load.ingress_lines(by)
    assert head.startswith("haproxy vs proxy") and len(lines) == 1  # process alone ran through both
    assert "process" in lines[0] and "requests/s 1.38x [1.50, 1.25]" in lines[0]
    assert "unloaded latency 0.62x [0.75, 0.50]" in lines[0]
    assert serve_load.ingress_lines({"haproxy": by["haproxy"]}) == []


def test_pipelined_runs_say_how_many_steps_followed_the_step_in_flight():
    """In-process runs of a pipelining scheduler (its ``pipelining()``) get an [info] line with the median share of
    base steps that followed the step in flight; runs without it (a CPU's default, or over HTTP) get none."""
    piped = [{**run(4.0, 1.5), "pipelining": {"steps": n, "followed": f, "share": round(f / n, 4)}}
             for n, f in ((100, 60), (120, 84), (90, 45))]
    runs = {("unbatched", "base"): [run(1.0, 9.0)] * 3, ("continuous", "base"): piped}
    (line,) = [x for x in serve_load.goals(runs, ["base"]) if "followed the step in flight" in x]
    assert line.startswith("[info] base: ") and ": 60% of 100 (" in line  # medians of the runs' shares and steps
    runs[("continuous", "base")] = [run(4.0, 1.5)] * 3
    assert not [x for x in serve_load.goals(runs, ["base"]) if "followed the step in flight" in x]


@pytest.mark.parametrize("args, says", [
    (["--device", "cuda"], "torch sees no CUDA device"),
    (["--modes", "base,fast"], "--modes takes base, speculative and/or coupled"),
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--threads", "2", "--clock", "cpu"], "use --clock wall with --threads above 1"),
    (["--compile-rows", "2"], "--compile-rows takes a count >= 1 with --compile on|auto"),
    (["--compile", "on", "--compile-rows", "0"], "--compile-rows takes a count >= 1"),
    (["--short-slowdown", "0.5"], "--short-slowdown takes 0 (off) or a number >= 1"),
    (["--prefill-chunk", "0"], "--prefill-chunk tokens >= 1"),
    (["--long-prompts", "-5"], "--long-prompts takes bytes >= 0"),
    (["--ingress", "proxy,nginx"], "--ingress: unknown Serve ingress 'nginx'"),
    (["--ingress", "haproxy"], "--ingress is about HTTP: --inprocess has none"),
])
def test_bad_arguments_are_refused_by_name(args, says):
    proc = bench("--inprocess", *args)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr[-2000:]


def test_coupled_requests_load_beside_and_report_their_draft_lengths(tmp_path):
    """``--modes base,coupled``: coupled speculative requests under the load, their goals marked, and the steps the
    load chose at each draft length; none for base requests (whose schedulers hold the warm-up's coupled costs,
    never stepped)."""
    out = tmp_path / "figures.json"
    proc = bench("--inprocess", "--size", "debug", "--modes", "base,coupled", "--requests", "6", "--clients", "2",
                 "--max-new", "24", "--unloaded", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())["continuous/coupled"][0]
    assert got["errors"] == 0 and got["ok"] == 6
    assert len(got["draft_lengths"][0]["steps"]) == 6  # lengths 0..5, the warm-up having stepped each
    assert re.search(r"^\s+\[(met|NOT met)\] coupled: requests/s >= 3x unbatched", proc.stdout, re.M), proc.stdout
    assert re.search(r"^\s+\[info\] coupled: continuous: steps per draft length 0\.\.: \[[\d, ]+\]; measured "
                     r"acceptance [\d.]+", proc.stdout, re.M), proc.stdout
    assert "base: unbatched: steps per draft length" not in proc.stdout
    assert "base: continuous: steps per draft length" not in proc.stdout

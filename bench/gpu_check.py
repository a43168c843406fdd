"""The GPU check: every CUDA path of efftx in one command, one table.

    make gpu-check                                    # = python bench/gpu_check.py (one CUDA GPU, < 10 min on an H100)
    python bench/gpu_check.py [--only kernels,train,decode,nsa,scaling,cost,serveload,decodeattn,speculative,serve]
                              [--quick] [--out DIR] [--pair DIR]
                              [--device cuda|cpu] [--kernel-jobs N] [--nsa-lengths T ...] [--scaling-lengths T ...]

On a GPU machine with only torch and triton (no project venv: no Ray, DeepSpeed or MLflow), from the checkout:

    PYTHONPATH=platform:bench python3 bench/gpu_check.py --only kernels,decode,nsa,scaling,cost --out DIR

(about 7 minutes on an H100; the train and serve sections need the project installed and are refused, naming
what is missing, when it is not), and in a second call the serving load, with torch alone too:

    PYTHONPATH=platform:bench python3 bench/gpu_check.py --only serveload,decodeattn --out DIR

and issue 15's speculative goals on a trained pair, made beforehand where the project is installed (``make gpu-pair``:
``.efftx/gpu-pair``, git-ignored, carried to the GPU machine):

    PYTHONPATH=platform:bench python3 bench/gpu_check.py --only speculative --pair .efftx/gpu-pair --out DIR

Sections (each row: pass / FAIL / skip with the reason, and its figures):

* ``kernels``: ``tests/test_kernels.py`` (selected-block attention) and ``tests/test_decode_attention.py`` (decode
  attention over compiled decoding's caches) compiled for the GPU (``EFFTX_TRITON_GPU=1``): fp32, fp16 and bf16
  against the float64 reference with the same-dtype error rule, every accepted block size, GQA 1-8, head dims
  64/128, T to 65536, forward and backward; decode passes of 1-16 tokens per row over ragged rows, every split
  count, the model's passes and compiled decoding through the kernel (CUDA graphs); and
  ``tests/test_row_noise_gpu.py`` (sampling's counter-based noise, its integer bits exactly); and ``tests/test_host.py``
  (host values, a ragged cache's step, and continuous batching's base steps eager and compiled, with kernels still
  queued: no wait for the device before the tokens are read). One row per test group.
* ``train``: one short run per model family (LM, Sinkhorn, Performer, NSA with the Triton kernel, the speculative
  pair, dVAE + DALL-E) through the real job scripts (TorchTrainer + DeepSpeed; nccl on CUDA), in bf16 and in fp16
  with loss scaling: the validation loss must fall and no optimizer step may be skipped for overflow after the
  warm-up (``skipped_steps`` in MLflow). Runs go in parallel, each in its own efftx home.
* ``decode``: tokens/s at batch 1 and 8, base and speculative (gamma 5), timed with device synchronisation, on the
  speculative pair the train section trained (untrained debug models otherwise); greedy speculative output must
  equal greedy base output; compiled decoding (``compile="on"``: CUDA graphs) beside the eager base, its greedy
  tokens equal to the base's (a correctness row in fp32) and its tokens/s, compile time apart; compiled speculative
  decoding too (greedy equal to the base, sampled runs, tokens/s over compiled base); continuous
  batching under a cache budget (``cache_mib``) on the device: held to it, outputs as alone, and how much the
  device's memory grew.
* ``nsa``: ``bench/nsa.py`` on CUDA (Triton NSA vs SDPA flash, forward and forward+backward, to T=65536; the
  kernel vs its torch reference; a train step; torch.profiler's table of the layer), its tables passed through.
* ``scaling``: ``bench/attention_scaling.py --device cuda``: every backend's layer against SDPA flash, bf16.
* ``cost``: ``bench/decode_cost.py --device cuda``: one cached decoding step per backend at contexts 2048 / 8192.
* ``serveload``: ``bench/serve_load.py --inprocess --device cuda --rounds 2 --unpipelined``: the
  continuous-batching scheduler under the load of 16 clients (8..128 new tokens), one row at a time vs without
  priority vs continuous batching (and continuous batching with base steps unpipelined beside it), on the wall
  clock, its goals (requests/s >= 3x unbatched, short requests' p99 <= 2x unloaded, no errors) marked met or not:
  torch alone (no Ray, no HTTP), so it runs on a bare GPU image. Then ``bench/steps_per_round.py --device cuda
  --pipeline --steps 1`` (pipelined base steps against unpipelined, eager: ``OUT/pipeline.log``). Then the same
  load with compiled passes
  (``--compile on --quick``: CUDA graphs per power-of-two row count, 8 clients), the compiled step costs beside
  the eager ones (``OUT/serveload-compiled.log``), and base decoding with the fixed priority lanes alone
  (``--short-slowdown 0 --quick``: what the scheduler's measured costs change on the GPU,
  ``OUT/serveload-fixed-lanes.log``); and ``bench/row_sampling.py --device cuda --steps`` (sampling's per-row noise
  and distributions, one call for every row against one per row or setting, ``OUT/rowsampling.log``); and last
  ``bench/steps_per_round.py --device cuda`` (base decoding with 4 steps a round against 1, eager and compiled:
  ``OUT/stepsperround.log``, ``OUT/stepsperround-compiled.log``; speculative decoding eager,
  ``OUT/stepsperround-speculative.log``), then its ``--pipeline --steps 1 --compile on``
  (``OUT/pipeline-compiled.log``).
* ``decodeattn``: ``bench/decode_attention.py --device cuda``: compiled decode steps (CUDA graphs) with the Triton
  decode attention kernel against attention over the whole capacity, rows of 128 and 1024 keys in a 2048-slot
  cache, batch 1 and 16, 1 and 6 tokens per row; eager passes over a KVCache with the kernel against SDPA; the
  attention alone; its goals marked met or not (``OUT/decodeattn.log``).
* ``speculative``: ``bench/speculative.py --device cuda`` on the trained pair in ``--pair`` (``target``, ``draft`` and
  ``distilled`` exports, made by ``make gpu-pair``: ``jobs/train_speculative.py --size small``, plain and
  ``--distill``): base vs speculative tokens/s at batch 1, 4 and 8, eager and compiled (CUDA graphs), gamma 5, with
  coupled acceptance too (``--coupled``: fixed gamma, and eager draft lengths by measured cost, 0 = the target
  alone), the step time outside the passes and the pass costs, greedy output equal to base and coupled sampled
  output equal to sampled base; a row per goal of its verdict (its ``--json``, kept as ``OUT/speculative.json``:
  batch 1 at least 2.5x base, batches 4 and 8 at least 1.5x), then ``bench/serve_load.py --inprocess --modes
  base,speculative,coupled`` on the same pair (``OUT/serveload-trained.log``: the serving goals with real
  acceptance, coupled requests' draft lengths by the load). Skipped, saying how to make one, when ``--pair`` holds no pair.
* ``serve``: the Serve app on the device: ``/generate`` in both modes and ``/images/generate`` answered, and
  ``/models/info`` naming the device; the text app again with ``engine=process`` (its scheduler in a decoding
  process of the replica's own), its greedy texts those of ``engine=thread``.

``--device cpu`` runs the same plumbing on the CPU (what the test suite does, with a few families): the CUDA-only
rows are skipped, saying so. The exit code is 1 when a correctness row fails, else 0. The table is also written to
``OUT/gpu_check.md`` and ``OUT/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# Triton kernels vs their references
KERNEL_TESTS = ("tests/test_kernels.py", "tests/test_decode_attention.py", "tests/test_row_noise_gpu.py",
                "tests/test_host.py")
SECTIONS = ("kernels", "train", "decode", "nsa", "scaling", "cost", "serveload", "decodeattn", "speculative", "serve")

# family -> (job script, recipe, extra overrides); the speculative and DALL-E jobs train two models each.
FAMILIES = {
    "lm": ("train_lm.py", ["--recipe", "lm_debug"], []),
    "sinkhorn": ("train_sinkhorn.py", ["--recipe", "sinkhorn_debug"], []),
    "performer": ("train_performer.py", ["--recipe", "performer_debug"], []),
    # the Triton kernel takes selection blocks of a multiple of 16 (nsa_debug's are 8)
    "nsa": ("train_nsa.py", ["--recipe", "nsa_debug"], ["attention.nsa.impl=triton",
                                                         "attention.nsa.selection_block_size=16"]),
    "speculative": ("train_speculative.py", ["--size", "debug"], []),
    "dalle": ("train_dalle.py", ["--recipe", "dalle_shapes_debug"], []),
}
CPU_ONLY_SKIPS = {"nsa": ["attention.nsa.impl=reference"]}  # the Triton kernel needs CUDA
# What a section imports beyond torch and triton: checked up front, so a Python without them (a GPU image with
# only torch, say) gets one clear error instead of a table of failed jobs.
SECTION_NEEDS = {"train": ("ray", "deepspeed", "mlflow"), "serve": ("ray", "requests"), "kernels": ("pytest",),
                 "serveload": (), "speculative": ()}  # torch alone: exports read without safetensors (efftx.weights)
DEFAULT_PAIR = REPO / ".efftx" / "gpu-pair"  # bench/gpu_pair.py's (make gpu-pair)


@dataclasses.dataclass
class Row:
    section: str
    name: str
    status: str  # pass | FAIL | skip | info
    detail: str = ""
    correctness: bool = True  # a FAIL of a correctness row fails the check

    def line(self) -> str:
        return f"| {self.section} | {self.name} | {self.status} | {self.detail} |"


# ------------------------------------------------------------------------------------------------ kernels
def kernel_choices(autotune_log: Path | None = None) -> list[Row]:
    """The launch options of the selected-block kernel: the tuning table's choice (tile, warps, stages) per head dim
    and dtype, and, with EFFTX_TRITON_AUTOTUNE=1, what autotune chose in the kernel tests (read from
    `autotune_log`, the EFFTX_TRITON_AUTOTUNE_LOG file those tests wrote): one row per kernel, dtype and head dim,
    counting the tuned shapes and the configs picked."""
    import collections

    import torch

    from efftx.kernels.selected_attention import AUTOTUNE_ENV, TUNING_ENV, _kernel_meta, autotune_enabled

    def launch(meta: dict) -> str:
        return f"TILE {meta['TILE']} x {meta['num_warps']} warps x {meta['num_stages']} stages"

    overrides = os.environ.get(TUNING_ENV)
    rows = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for d in (64, 128):
            q = torch.empty(1, 1, 8, d, dtype=dtype, device="meta")
            k = torch.empty(1, 1, 2, d, dtype=dtype, device="meta")
            idx = torch.empty(1, 1, 2, 16, dtype=torch.long, device="meta")
            fwd, bwd = _kernel_meta(q, k, idx, 64)
            rows.append(Row("kernels", f"launch options {str(dtype)[6:]} D={d}", "info",
                            f"fwd {launch(fwd)}, bwd {launch(bwd)}, {fwd['PRECISION']} dots (block 64, GQA 4"
                            + (f"; {TUNING_ENV}={overrides}" if overrides else "") + ")", correctness=False))
    if not autotune_enabled():
        rows.append(Row("kernels", "autotune", "info", f"off: the table's choice ran ({AUTOTUNE_ENV}=1 to autotune)",
                        correctness=False))
        return rows
    choices = []
    if autotune_log is not None and autotune_log.is_file():
        choices = [json.loads(line) for line in autotune_log.read_text().splitlines() if line.strip()]
    if not choices:
        rows.append(Row("kernels", "autotune", "info", f"{AUTOTUNE_ENV}=1 but no kernel ran on CUDA: nothing tuned",
                        correctness=False))
        return rows
    groups: dict[tuple, list[dict]] = {}
    for c in choices:
        groups.setdefault((c["kernel"], c["dtype"], c["D_PAD"]), []).append(c)
    for (kernel, dtype, d_pad), group in sorted(groups.items()):
        kept = sum(c["TILE"] == c["table"]["tile"] and c["num_warps"] == c["table"]["num_warps"]
                   and c["num_stages"] == c["table"]["num_stages"] for c in group)
        picked = collections.Counter(launch(c) for c in group)
        rows.append(Row("kernels", f"autotune {kernel} {dtype} D<={d_pad}", "info",
                        f"{len(group)} shapes tuned, table's choice kept in {kept}; picked "
                        + ", ".join(f"{cfg} ({n})" for cfg, n in picked.most_common()), correctness=False))
    return rows


def check_kernels(args, out: Path) -> list[Row]:
    if args.device != "cuda":
        return [Row("kernels", "Triton kernel compiled", "skip", "no CUDA device: the interpreter runs them in the "
                    "test suite instead")] + kernel_choices()
    xml = out / "kernels.xml"
    env = {**os.environ, "EFFTX_TRITON_GPU": "1"}
    env.pop("TRITON_INTERPRET", None)
    autotune_log = out / "autotune.jsonl"  # what autotune chose, when EFFTX_TRITON_AUTOTUNE=1 (kernel_choices)
    autotune_log.unlink(missing_ok=True)
    env["EFFTX_TRITON_AUTOTUNE_LOG"] = str(autotune_log)
    t0 = time.perf_counter()
    jobs = ["-n", str(args.kernel_jobs)] if args.kernel_jobs > 1 else []  # compiling is CPU work: xdist spreads it
    proc = subprocess.run([PY, "-m", "pytest", *KERNEL_TESTS, "-q", "-p", "no:cacheprovider", *jobs,
                           f"--junitxml={xml}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    (out / "kernels.log").write_text(proc.stdout + proc.stderr)
    if not xml.is_file():
        return [Row("kernels", " ".join(KERNEL_TESTS), "FAIL", f"pytest did not run: {proc.stderr[-300:]!r}")]
    groups: dict[str, list[int]] = {}
    failures: dict[str, list[str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        group = case.get("name", "?").split("[")[0]
        counts = groups.setdefault(group, [0, 0, 0])
        if case.find("failure") is not None or case.find("error") is not None:
            counts[1] += 1
            failures.setdefault(group, []).append(case.get("name", "?"))
        elif case.find("skipped") is not None:
            counts[2] += 1
        else:
            counts[0] += 1
    rows = []
    for group, (ok, bad, skipped) in sorted(groups.items()):
        detail = f"{ok} passed, {bad} failed, {skipped} skipped"
        if bad:
            detail += ": " + ", ".join(failures[group][:3])
        rows.append(Row("kernels", group, "FAIL" if bad else ("pass" if ok else "skip"), detail))
    rows.append(Row("kernels", "wall time", "info", f"{time.perf_counter() - t0:.0f} s", correctness=False))
    return rows + kernel_choices(autotune_log)


# ------------------------------------------------------------------------------------------------ train
def mlflow_history(summary: dict, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=summary["tracking_uri"])
    return sorted((m.step, m.value) for m in client.get_metric_history(summary["mlflow_run_id"], key))


def judge_run(name: str, summary: dict, warmup: int) -> Row:
    """Validation loss fell from step 0 to the end, and no step after warm-up was skipped for overflow."""
    val = mlflow_history(summary, "val_loss")
    if len(val) < 2:
        return Row("train", name, "FAIL", "fewer than two validation losses in MLflow")
    first, last = val[0][1], val[-1][1]
    skipped = [(s, v) for s, v in mlflow_history(summary, "skipped_steps") if s > warmup]
    grew = [b[1] - a[1] for a, b in zip(skipped, skipped[1:]) if b[1] > a[1]]
    detail = (f"val_loss {first:.3f} -> {last:.3f}, {summary.get('tokens_per_s') or 0:,.0f} tok/s, "
              f"peak {summary.get('peak_memory_mb') or 0:,.0f} MiB")
    if not skipped:
        return Row("train", name, "FAIL", detail + "; no skipped_steps metric after warm-up")
    detail += f", skipped steps after warm-up {int(sum(grew))} (total {int(skipped[-1][1])})"
    return Row("train", name, "pass" if last < first and not grew else "FAIL", detail)


def train_one(family: str, precision: str, args, out: Path) -> tuple[list[Row], dict]:
    script, recipe_args, extra = FAMILIES[family]
    overrides = list(extra) + (CPU_ONLY_SKIPS.get(family, []) if args.device != "cuda" else [])
    overrides += [f"scaling.device={args.device}", "scaling.num_workers=1", f"engine.precision={precision}",
                  f"train.steps={args.steps}", f"train.eval_every={args.steps // 2}", f"train.log_every={args.steps // 2}",
                  f"train.warmup_steps={args.warmup}", f"train.checkpoint_every={args.steps}"]
    overrides += args.set
    set_args = [a for o in overrides for a in ("--set", o)]
    if family == "dalle":
        set_args += [a for o in overrides for a in ("--vae-set", o)]
    name = f"{family}-{precision}"
    home = out / "homes" / name
    env = {**os.environ, "EFFTX_HOME": str(home)}
    env.pop("MLFLOW_TRACKING_URI", None)
    cmd = [PY, str(REPO / "jobs" / script), *recipe_args, "--run-name", name, *set_args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return [Row("train", name, "FAIL", f"no result within {args.timeout} s")], {}
    (out / f"train-{name}.log").write_text(proc.stdout + proc.stderr)
    secs = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return [Row("train", name, "FAIL", f"exit {proc.returncode}: {tail[:200]}")], {}
    final = json.loads(next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")))
    parts = ({"dvae": final["dvae"], "dalle": final["dalle"]} if family == "dalle" else
             {"draft": final["draft"], "target": final["target"]} if family == "speculative" else {family: final})
    rows = []
    for part, summary in parts.items():
        if summary is None:
            continue
        row = judge_run(f"{part} {precision}" if part != family else name, summary, args.warmup)
        row.detail += f" ({secs:.0f} s for the job)"
        rows.append(row)
    return rows, {f"{part}-{precision}": s for part, s in parts.items() if s}


def check_train(args, out: Path) -> tuple[list[Row], dict]:
    precisions = args.precisions or (["bf16", "fp16"] if args.device == "cuda" else ["bf16"])
    jobs = [(f, p) for f in args.families for p in precisions]
    rows: list[Row] = []
    summaries: dict = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
        for got, sums in pool.map(lambda fp: train_one(fp[0], fp[1], args, out), jobs):
            rows += got
            summaries.update(sums)
    return rows, summaries


# ------------------------------------------------------------------------------------------------ decode
def timed(fn, device: str, repeats: int = 3) -> float:
    """Median seconds of ``fn()``, with the device synchronised around each call (CUDA work is asynchronous)."""
    import torch

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def check_decode(args, summaries: dict) -> list[Row]:
    import torch

    from efftx import recipes
    from efftx.generation.decode import generate
    from efftx.generation.speculative import speculative_generate
    from efftx.models import build as build_model
    from efftx.export import load_export

    device = args.device
    source = "trained pair"
    if "target-bf16" in summaries and "draft-bf16" in summaries:
        target = load_export(summaries["target-bf16"]["export_path"], device)[0]
        draft = load_export(summaries["draft-bf16"]["export_path"], device)[0]
    else:
        source = "untrained debug pair"
        torch.manual_seed(0)
        target = build_model(recipes.get("spec_target_debug")).to(device).eval()
        draft = build_model(recipes.get("spec_draft_debug")).to(device).eval()
    rows = []
    new = args.new_tokens
    g = torch.Generator().manual_seed(0)
    for batch in (1, 8):
        prompts = torch.randint(0, target.vocab_size, (batch, 16), generator=g).to(device)
        with torch.no_grad():
            base_s = timed(lambda: generate(target, prompts, new, temperature=0.0), device)
            spec_s = timed(lambda: speculative_generate(target, draft, prompts, new, gamma=5, temperature=0.0), device)
            base_out = generate(target, prompts, new, temperature=0.0).tolist()
            spec_out, stats = speculative_generate(target, draft, prompts, new, gamma=5, temperature=0.0)
        same = base_out == spec_out
        rows.append(Row("decode", f"batch {batch}, greedy speculative == base", "pass" if same else "FAIL",
                        f"{source}, {new} new tokens"))
        rows.append(Row("decode", f"batch {batch} tokens/s", "info",
                        f"base {batch * new / base_s:,.0f}, speculative {batch * new / spec_s:,.0f} "
                        f"({base_s / spec_s:.2f}x), {stats.mean_accepted:.2f} accepted/step", correctness=False))
        rows += compiled_decode_rows(target, draft, prompts, new, batch, base_s, base_out, device)
    return rows + cache_budget_rows(target, draft, device)


def cache_budget_rows(target, draft, device: str, rows: int = 5) -> list[Row]:
    """Continuous batching under a cache budget (``cache_mib`` / ``cache_fraction`` of the text app) of ``rows``
    speculative rows on the device: a burst of 12 greedy requests, half speculative, decodes with the slots and
    pooled caches at most the budget at every step and every output equal to greedy base decoding alone; on CUDA,
    how much the device's allocated memory grew during the burst (the caches, their prefills and activations)."""
    import torch

    from efftx.generation.decode import cache_bytes, free_memory, generate
    from efftx.serving.continuous import Job, Sampling, Scheduler

    limit = rows * sum(cache_bytes(m.new_cache(1, m.max_seq_len)) for m in (target, draft))
    free_memory()
    held: list[int] = []
    scheduler = Scheduler(target, draft, short_tokens=0, prefill_rows=0, cache_budget=limit,
                          hook=lambda kind, jobs: held.append(scheduler.budget.held() + scheduler.budget.pooled()))
    jobs = [scheduler.submit(Job([1 + i, 2, 3], 12, Sampling(0.0), i, 5 if i % 2 else None)) for i in range(12)]
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    scheduler.drain()
    grown = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else None
    with torch.no_grad():
        alone = [generate(target, [job.prompt], 12, temperature=0.0)[0].tolist() for job in jobs]
    errors = [repr(j.error) for j in jobs if j.error is not None]
    same = not errors and all(j.out == a for j, a in zip(jobs, alone))
    within = bool(held) and max(held) <= limit
    return [Row("decode", f"cache budget of {rows} speculative rows of the context: held to it, outputs as alone",
                "pass" if same and within else "FAIL",
                f"budget {limit / 2**20:.2f} MiB, held + pooled at most {max(held, default=0) / 2**20:.2f} MiB, "
                f"at most {max(j.batch_size for j in jobs)} rows a step"
                + (f", device memory grew {grown:.2f} MiB during the burst" if grown is not None else "")
                + (f"; errors: {errors[:2]}" if errors else "") + ("" if same or errors else "; outputs differ"))]


def compiled_decode_rows(target, draft, prompts, new: int, batch: int, base_s: float, base_out: list,
                         device: str) -> list[Row]:
    """Compiled decoding (efftx.generation.compiled: CUDA graphs on CUDA) beside the eager base: greedy tokens
    equal, and tokens/s; compiled speculative decoding too (greedy: equal to base; sampled: it runs). CUDA only (on
    CPU, tests/test_compiled_decode.py compiles it); the first call compiles."""
    import torch

    from efftx.generation import compiled
    from efftx.generation.decode import generate
    from efftx.generation.speculative import speculative_generate

    name = f"batch {batch}, greedy compiled == base"
    if device != "cuda":
        return [Row("decode", name, "skip", "CUDA only here (tests/test_compiled_decode.py covers CPU)")]
    reason = compiled.unsupported_reason(target)
    if reason is not None:
        return [Row("decode", name, "skip", f"eager only: {reason}")]
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            out = generate(target, prompts, new, temperature=0.0, compile="on").tolist()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            comp_s = timed(lambda: generate(target, prompts, new, temperature=0.0, compile="on"), device)
    except compiled.CompileUnavailable as e:
        return [Row("decode", name, "FAIL", str(e).splitlines()[0][:300])]
    exact = target.embed.weight.dtype == torch.float32  # lower precisions may round an argmax the other way

    def equal_row(label: str, got: list) -> Row:
        same = got == base_out
        matching = sum(a == b for r, q in zip(got, base_out) for a, b in zip(r, q))
        detail = "equal" if same else f"{matching}/{batch * new} tokens equal"
        return Row("decode", label, "pass" if same else ("FAIL" if exact else "info"),
                   f"{detail}, {str(target.embed.weight.dtype)[6:]}", correctness=exact)

    rows = [equal_row(name, out),
            Row("decode", f"batch {batch} compiled tokens/s", "info",
                f"eager {batch * new / base_s:,.0f}, compiled {batch * new / comp_s:,.0f} ({base_s / comp_s:.2f}x), "
                f"first call {first_s:.1f} s (compiles)", correctness=False)]
    spec = f"batch {batch}, greedy compiled speculative == base"
    try:
        with torch.no_grad():
            greedy, _ = speculative_generate(target, draft, prompts, new, gamma=5, temperature=0.0, compile="on")
            spec_s = timed(lambda: speculative_generate(target, draft, prompts, new, gamma=5, temperature=0.0,
                                                        compile="on"), device)
            sampled, _ = speculative_generate(target, draft, prompts, new, gamma=5, temperature=1.0, top_k=32,
                                              seed=0, compile="on")
    except Exception as e:  # noqa: BLE001 - a row, not a crash
        why = str(e).splitlines()[0][:300] if str(e) else ""
        return rows + [Row("decode", spec, "FAIL", f"{type(e).__name__}: {why}")]
    ran = len(sampled) == batch and all(len(r) == new for r in sampled)
    return rows + [equal_row(spec, greedy),
                   Row("decode", f"batch {batch}, sampled compiled speculative", "pass" if ran else "FAIL",
                       f"{sum(map(len, sampled))} tokens"),
                   Row("decode", f"batch {batch} compiled speculative tokens/s", "info",
                       f"{batch * new / spec_s:,.0f} ({comp_s / spec_s:.2f}x compiled base, greedy)",
                       correctness=False)]


# ------------------------------------------------------------------------------------------------ benches
def bench_section(section: str, name: str, cmd: list[str], args, out: Path, log: str | None = None) -> list[Row]:
    """A bench of bench/ on CUDA, its tables passed through (printed and kept in OUT/<log or section>.log): pass when
    it ran to the end, FAIL when it crashed or ran past --timeout."""
    log = log or section
    if args.device != "cuda":
        return [Row(section, name, "skip", "no CUDA device")]
    try:
        proc = subprocess.run([PY, *cmd], cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as exc:  # what it printed so far is kept
        partial = exc.stdout or b""
        (out / f"{log}.log").write_text(partial.decode() if isinstance(partial, bytes) else partial)
        return [Row(section, name, "FAIL", f"no result within {args.timeout} s")]
    (out / f"{log}.log").write_text(proc.stdout + proc.stderr)
    print(proc.stdout)
    if proc.returncode != 0:
        return [Row(section, name, "FAIL", (proc.stderr.strip().splitlines() or ["?"])[-1][:200])]
    return [Row(section, name, "pass", f"tables in {out / (log + '.log')}")]


def check_nsa(args, out: Path) -> list[Row]:
    """bench/nsa.py on CUDA: the NSA layer (Triton kernel) vs SDPA flash, the kernel vs its reference, a train
    step, and a torch.profiler table of the layer at the longest length."""
    lengths = sorted(args.nsa_lengths)
    profile = 4096 if args.quick else lengths[-2 if len(lengths) > 1 else -1]  # the longest but one: quicker
    cmd = ["bench/nsa.py", "--no-cpu", "--gpu-lengths", *map(str, lengths), "--profile", str(profile)]
    return bench_section("nsa", "bench/nsa.py --no-cpu", cmd + (["--quick"] if args.quick else []), args, out)


def check_scaling(args, out: Path) -> list[Row]:
    """bench/attention_scaling.py on CUDA: every backend's layer fwd+bwd against SDPA flash, bf16."""
    cmd = ["bench/attention_scaling.py", "--device", "cuda", "--lengths", *map(str, args.scaling_lengths),
           "--rounds", "1", "--repeats", "5"]
    return bench_section("scaling", "bench/attention_scaling.py --device cuda", cmd, args, out)


def check_cost(args, out: Path) -> list[Row]:
    """bench/decode_cost.py on CUDA: one cached decoding step per backend at long context."""
    cmd = ["bench/decode_cost.py", "--device", "cuda", "--contexts", "2048", "8192", "--rounds", "1"]
    return bench_section("cost", "bench/decode_cost.py --device cuda", cmd, args, out)


def check_decodeattn(args, out: Path) -> list[Row]:
    """bench/decode_attention.py on CUDA: compiled decode steps with the Triton decode attention kernel vs attention
    over the whole capacity."""
    cmd = ["bench/decode_attention.py", "--device", "cuda"] + (["--tokens", "1", "--repeats", "3"] if args.quick else [])
    return bench_section("decodeattn", "bench/decode_attention.py --device cuda", cmd, args, out)


def check_serveload(args, out: Path) -> list[Row]:
    """bench/serve_load.py --inprocess on CUDA: the continuous-batching scheduler's load and its goals (torch
    alone: no Ray, no HTTP)."""
    cmd = ["bench/serve_load.py", "--inprocess", "--device", "cuda", "--rounds", "1" if args.quick else "2",
           "--unpipelined"]
    if args.device != "cuda":
        return [Row("serveload", "bench/serve_load.py --inprocess", "skip", "no CUDA device")]
    rows = bench_section("serveload", "bench/serve_load.py --inprocess --device cuda --unpipelined",
                         cmd + (["--quick"] if args.quick else []), args, out)
    # pipelined base steps (the next step queued before the last one's tokens are read) against unpipelined, a step
    # a round, eager (early: the newest work)
    rows += bench_section("serveload", "bench/steps_per_round.py --device cuda --pipeline --steps 1",
                          ["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "64", "--pipeline",
                           "--steps", "1"], args, out, log="pipeline")
    # then with compiled passes (CUDA graphs per power-of-two row count; 8 clients keep the graphs to 1..8 rows)
    rows += bench_section("serveload", "bench/serve_load.py --inprocess --device cuda --compile on --quick",
                          ["bench/serve_load.py", "--inprocess", "--device", "cuda", "--compile", "on", "--quick",
                           "--rounds", "1"], args, out, log="serveload-compiled")
    # sampling's per-row work on the device: counter-based noise against a generator per row, one pass of mixed
    # settings against a pass per setting, and the scheduler's steps both ways
    rows += bench_section("serveload", "bench/row_sampling.py --device cuda --steps",
                          ["bench/row_sampling.py", "--device", "cuda", "--steps"], args, out, log="rowsampling")
    # base decoding with the fixed lanes alone (short_slowdown=0): what the measured costs change on this device
    rows += bench_section("serveload", "bench/serve_load.py --inprocess --device cuda --short-slowdown 0",
                          ["bench/serve_load.py", "--inprocess", "--device", "cuda", "--short-slowdown", "0",
                           "--modes", "base", "--quick", "--rounds", "1"], args, out, log="serveload-fixed-lanes")
    # last (the newest): base decoding with several steps a round against one (the host's share of a round), eager
    # and compiled
    rows += bench_section("serveload", "bench/steps_per_round.py --device cuda",
                          ["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "64"], args, out,
                          log="stepsperround")
    rows += bench_section("serveload", "bench/steps_per_round.py --device cuda --compile on",
                          ["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "--compile", "on"],
                          args, out, log="stepsperround-compiled")
    # speculative batches' several steps a round (each step still reads its acceptance), eager
    rows += bench_section("serveload", "bench/steps_per_round.py --device cuda --mode speculative",
                          ["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "--mode",
                           "speculative"], args, out, log="stepsperround-speculative")
    # pipelined base steps against unpipelined, compiled
    return rows + bench_section("serveload", "bench/steps_per_round.py --device cuda --pipeline --steps 1 --compile on",
                                ["bench/steps_per_round.py", "--device", "cuda", "--rows", "1", "16", "--pipeline",
                                 "--steps", "1", "--compile", "on"], args, out, log="pipeline-compiled")


def check_speculative(args, out: Path) -> list[Row]:
    """bench/speculative.py on CUDA with the trained pair in ``args.pair`` (issue 15's speculative goals, one row
    each from its verdict), then the in-process serving load on that pair; torch alone."""
    name = "bench/speculative.py --device cuda (trained pair)"
    if args.device != "cuda":
        return [Row("speculative", name, "skip", "no CUDA device")]
    pair = Path(args.pair)
    missing = [role for role in ("target", "draft") if not (pair / role / "config.json").is_file()]
    if missing:
        return [Row("speculative", name, "skip", f"no trained pair in {pair} (no {' or '.join(missing)} export): "
                    "make gpu-pair where the project is installed, then carry it", correctness=False)]
    models = ["--target", str(pair / "target"), "--draft", str(pair / "draft")]
    cmd = ["bench/speculative.py", "--device", "cuda", *models, "--compile", "off,on", "--no-adaptive", "--coupled",
           "--overhead", "--costs"]
    if (pair / "distilled" / "config.json").is_file():
        cmd[cmd.index("--compile"):cmd.index("--compile")] = ["--distilled-draft", str(pair / "distilled")]
    if args.quick:
        cmd += ["--repeats", "1", "--timed-prompts", "8", "--acceptance-prompts", "8"]
    verdict = (out / "speculative.json").resolve()  # the bench runs in the repository
    verdict.unlink(missing_ok=True)  # an earlier run's is not this one's
    rows = bench_section("speculative", name, cmd + ["--json", str(verdict)], args, out)
    if rows[0].status == "pass":
        rows += verdict_rows(json.loads(verdict.read_text()) if verdict.is_file() else None)
    return rows + bench_section("speculative", "bench/serve_load.py --inprocess --device cuda (trained pair)",
                                ["bench/serve_load.py", "--inprocess", "--device", "cuda", *models, "--modes",
                                 "base,speculative,coupled", "--rounds", "1" if args.quick else "2"]
                                + (["--quick"] if args.quick else []), args, out,
                                log="serveload-trained")


def verdict_rows(verdict: dict | None) -> list[Row]:
    """bench/speculative.py's verdict (its ``--json``; None where it wrote none): greedy speculative output equal to
    base for every draft and gamma (a correctness row), and a row per goal (met or not: information)."""
    checks = (verdict or {}).get("equality", [])
    equal = sum(bool(c.get("equal")) for c in checks)
    rows = [Row("speculative", "greedy speculative == base, every draft",
                "FAIL" if equal < len(checks) or not checks else "pass", f"{equal}/{len(checks)} equal")]
    goals = (verdict or {}).get("goals", [])
    if not goals:
        return rows + [Row("speculative", "goals", "FAIL", "no verdict in the bench's output")]
    for g in goals:
        rows.append(Row("speculative", f"batch {g['batch']}: at least {g['goal']:.1f}x", "info",
                        f"best {g['best']:.2f}x ({g['label']}): {'MET' if g['met'] else 'NOT MET'}",
                        correctness=False))
    return rows


# ------------------------------------------------------------------------------------------------ serve
def check_serve(args, summaries: dict) -> list[Row]:
    import requests

    needed = ("target-bf16", "draft-bf16", "dalle-bf16")
    if not all(k in summaries for k in needed):
        return [Row("serve", "Serve app on the device", "skip", "needs the train section's speculative pair and "
                    "DALL-E (run with --only including train, and families speculative,dalle)")]
    from ray import serve

    from efftx.cluster import free_port
    from efftx.serving.text import build

    import ray

    ray.init(num_cpus=4, num_gpus=1 if args.device == "cuda" else 0, include_dashboard=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = []
    texts = {}
    try:
        # the scheduler on a thread of the replica, then in a decoding process of its own (engine=process): the
        # same greedy texts
        for engine in ("thread", "process"):
            app = build({"target": summaries["target-bf16"]["export_path"],
                         "draft": summaries["draft-bf16"]["export_path"],
                         "dalle": summaries["dalle-bf16"]["export_path"], "device": args.device, "engine": engine})
            serve.run(app, name="gpu-check", route_prefix="/")
            url = f"http://127.0.0.1:{port}"
            info = requests.get(f"{url}/models/info", timeout=60).json()
            devices = sorted({m.get("device", "?").split(":")[0] for m in info.get("models", [])})  # cuda:0 -> cuda
            rows.append(Row("serve", f"models on the device (engine={engine})",
                            "pass" if devices == [args.device] else "FAIL", f"/models/info devices: {devices}"))
            t0 = time.perf_counter()
            r = requests.post(f"{url}/generate", json={"prompt": "def ", "max_new_tokens": 32, "temperature": 0,
                                                       "mode": "both", "gamma": 5}, timeout=120)
            res = r.json()["results"] if r.status_code == 200 else {}
            texts[engine] = res.get("base", {}).get("text")
            ok = bool(res) and res["base"]["text"] == res["speculative"]["text"] and texts[engine] == texts["thread"]
            rows.append(Row("serve", f"/generate both modes (engine={engine})", "pass" if ok else "FAIL",
                            f"HTTP {r.status_code}, {1e3 * (time.perf_counter() - t0):.0f} ms, greedy texts equal"
                            f"{' (and to engine=thread)' if engine != 'thread' else ''}: {ok}"))
        r = requests.post(f"{url}/images/generate", json={"prompt": "a red circle", "n": 1, "seed": 0}, timeout=300)
        png = r.status_code == 200 and r.content[:8] == b"\x89PNG\r\n\x1a\n"
        rows.append(Row("serve", "/images/generate", "pass" if png else "FAIL", f"HTTP {r.status_code}, "
                        f"{len(r.content):,} bytes"))
    except Exception as exc:  # a row, not a crash: the rest of the table still prints
        rows.append(Row("serve", "Serve app", "FAIL", f"{type(exc).__name__}: {str(exc)[:200]}"))
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


# ------------------------------------------------------------------------------------------------ main
def importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or half-installed package
        return False


def environment(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU ({os.cpu_count()} cores), torch {torch.__version__}"


def run(argv: list[str] | None = None) -> tuple[int, list[Row]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    p.add_argument("--families", default=",".join(FAMILIES), help=f"train section: some of {', '.join(FAMILIES)}")
    p.add_argument("--precisions", default="", help="train section: default bf16,fp16 on CUDA, bf16 on CPU")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="steps whose overflow skips are allowed (loss scale search)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="one more override for every run")
    p.add_argument("--parallel", type=int, default=4, help="train runs at once")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--nsa-lengths", type=int, nargs="+", default=[2048, 8192, 32768, 65536], metavar="T")
    p.add_argument("--scaling-lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768], metavar="T")
    p.add_argument("--kernel-jobs", type=int, default=1, help="kernels section: pytest-xdist processes (1: none)")
    p.add_argument("--timeout", type=int, default=480, help="seconds per subprocess")
    p.add_argument("--out", default=None, help="where logs and the table go (default: a new temp folder)")
    p.add_argument("--pair", default=str(DEFAULT_PAIR),
                   help="speculative section: the trained pair's exports (target/, draft/, distilled/; make gpu-pair)")
    args = p.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.families = [f for f in args.families.split(",") if f]
    args.precisions = [x for x in args.precisions.split(",") if x]
    unknown = [f for f in args.families if f not in FAMILIES] + [s for s in args.only.split(",") if s not in SECTIONS]
    if unknown:
        p.error(f"unknown families/sections: {unknown}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch sees no CUDA device")
    missing = {section: [m for m in SECTION_NEEDS[section] if not importable(m)]
               for section in args.only.split(",") if section in SECTION_NEEDS}
    missing = {section: mods for section, mods in missing.items() if mods}
    if missing:
        p.error("; ".join(f"section {section} needs {', '.join(mods)}, which this Python cannot import"
                          for section, mods in missing.items())
                + f" ({sys.executable}): install the project (make setup, then .venv/bin/python), or leave the "
                  "section out, e.g. --only kernels,decode,nsa,scaling,cost with PYTHONPATH=platform:bench on a GPU "
                  "image that has only torch and triton")
    out = Path(args.out or tempfile.mkdtemp(prefix="efftx-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",")
    t0 = time.perf_counter()
    rows: list[Row] = [Row("env", "device", "info", environment(args.device), correctness=False)]
    summaries: dict = {}
    if "kernels" in only:
        rows += check_kernels(args, out)
    if "train" in only:
        got, summaries = check_train(args, out)
        rows += got
    if "decode" in only:
        rows += check_decode(args, summaries)
    if "nsa" in only:
        rows += check_nsa(args, out)
    if "scaling" in only:
        rows += check_scaling(args, out)
    if "cost" in only:
        rows += check_cost(args, out)
    if "serveload" in only:
        rows += check_serveload(args, out)
    if "decodeattn" in only:
        rows += check_decodeattn(args, out)
    if "speculative" in only:
        rows += check_speculative(args, out)
    if "serve" in only:
        rows += check_serve(args, summaries)
    failed = [r for r in rows if r.status == "FAIL" and r.correctness]
    rows.append(Row("all", "verdict", "FAIL" if failed else "pass",
                    f"{len(failed)} correctness rows failed; {time.perf_counter() - t0:.0f} s in all", correctness=False))
    table = "\n".join(["| section | check | status | figures |", "|---|---|---|---|"] + [r.line() for r in rows])
    (out / "gpu_check.md").write_text(table + "\n")
    (out / "gpu_check.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    print(table)
    print(f"\nlogs and the table: {out}")
    return (1 if failed else 0), rows


if __name__ == "__main__":
    sys.exit(run()[0])

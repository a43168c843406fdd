"""Base vs speculative decoding tokens/s for a trained pair (and a distilled draft), goals of issue 15 marked.

    python bench/speculative.py [--target models:/spec_target_small/latest] [--draft models:/spec_draft_small/latest]
                                [--distilled-draft EXPORT] [--batches 1,4,8] [--gamma 5] [--max-gamma 8]
                                [--new-tokens 64] [--repeats 3] [--temperature 0.8] [--compile off|on|off,on]
                                [--overhead] [--costs] [--untrained] [--device cuda] [--json VERDICT.json]
                                [--bf16-weights]

Train a pair first (python jobs/train_speculative.py --size small), and a distilled draft of its target
(python jobs/train_speculative.py --size small --distill --target <the target's export>); any export folders
work too (``--untrained``: the spec_target_small / spec_draft_small architectures with seeded random weights, for
the step costs and overheads only: such a pair's acceptance means nothing). Prompts are windows of the bundled
corpus; every timed row decodes the same ``--timed-prompts`` prompts (32, those of the acceptance check) in batches
of its size (32 decodings at batch 1, 8 at batch 4, ...), so a ratio does not hang on a few prompts' acceptance
(the first 8 accept more than the 32 on average: batch 8 read 1.52x over them, 1.22x over 32); sampling at
--temperature (0 = greedy) with top-k 32, fixed seeds (group i seeds i). Rows: each draft (plain, distilled)
with a fixed gamma and with an adaptive gamma per row (starting at gamma, at most --max-gamma), eagerly and/or
compiled (``--compile``: the draft's one-token steps and the target's verify passes through
efftx.generation.compiled; base decoding gets a compiled row too). Columns: tokens/s, the ratio to base cached
decoding at the same batch size (eager, the library's default: the issue's "base"; and compiled, where timed),
accepted draft tokens per step and per drafted token, and the issue's goal for that batch size (batch 1: 2.5x,
batches 4 and 8: 1.5x), met or not. Every decoding runs once untimed first (compilation, warm caches), then
``--repeats`` times round robin (median). Every draft's greedy speculative output is checked to equal greedy
base decoding, token for token.

``--overhead``: per speculative row, the time per step outside the models' forward passes (the step time minus
the sum of its draft and target passes, from one more instrumented run): sampling, acceptance, rewinds, Python
(compiled rows draw their tokens and decide acceptance inside the compiled passes: their gap is the rest).
``--device cuda``: the models and every decoding on a CUDA device (fp32, as trained), each timed call (a decoding,
a pass of ``--costs``, a pass of ``--overhead``) waiting for the device before and after; the recompute-window row
(the seed wrappers' way, on the CPU's generator) is left out there. ``bench/gpu_check.py --only speculative``
runs this on a GPU with a pair trained here (``make gpu-pair``).
``--json PATH``: the verdict as JSON too (``equality``: per draft and gamma, greedy output equal to base;
``goals``: per batch size, the goal, the best ratio at --gamma, its row, met or not), written at the end of a run.
``--bf16-weights``: eager rows of base and fixed-gamma speculative decoding with the models' Linear weights in
bfloat16 (weight-only, efftx.kernels.linear_cpu.bf16_weights), beside the float32 rows, and per batch size their
ratio to the float32 row of the same decoding; greedy speculative output under them is checked against greedy base
decoding under them. Their rows do not count for the goals (a different model's tokens/s).
``--costs``: per batch size, the eager and compiled cost (fastest of 15 calls) of one target pass of 1 token (a base step), of
gamma + 1 tokens (a verify pass) and of one draft step, and the speedup they allow at a given acceptance:
(1 + accepted) * base step / (gamma * draft step + verify pass); on a CPU, the eager costs again with the linear
kernel's prefetch off (``efftx.kernels.linear_cpu.without_prefetch``) and what the prefetch gains per pass, and with
the attention kernel key by key (``efftx.kernels.decode_attention_cpu.key_by_key``, its reference) and what its
blocked path gains per pass. All figures come from this one run.
``--coupled``: coupled acceptance too (sampled output checked against base decoding's with the same seeds), a
coupled row beside each ratio-test row, and, eagerly, a row per draft whose steps take their draft length 0..gamma
by measured cost (``speculative_generate(..., lengths=DraftLength(gamma))``, one chooser per draft and batch size,
its costs measured in the untimed run; 0: a step of the target alone), with the steps it took at each length.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

from efftx.data.bytes import ByteData, prepare
from efftx.export import load_export, resolve_export
from efftx.generation.compiled import StaticDecoder, capacity_for
from efftx.generation.decode import Rows, generate
from efftx.generation.draft_length import DraftLength
from efftx.generation.sampling import sample
from efftx.generation.speculative import SpecStats, speculative_generate
from efftx.kernels.decode_attention_cpu import key_by_key
from efftx.kernels.linear_cpu import bf16_weights, without_prefetch
from efftx.paths import default_data_dir

BF16 = ", bf16 weights"  # the label suffix of --bf16-weights rows
GOALS = {1: 2.5}  # issue 15: batch 1 at least 2.5x base tokens/s; other batch sizes at least 1.5x
OTHER_GOAL = 1.5


def goal(batch: int) -> float:
    return GOALS.get(batch, OTHER_GOAL)


@torch.no_grad()
def recompute_window(model, prompt, new_tokens, temperature, seed):
    """How the seed wrappers decode: the whole sequence through the model at every step, no cache."""
    gen = torch.Generator().manual_seed(seed)
    seq = prompt
    for _ in range(new_tokens):
        nxt = sample(model(seq)[:, -1], temperature, 32, 1.0, gen)
        seq = torch.cat([seq, nxt[:, None]], 1)
    return seq[:, prompt.shape[1]:]


def load_models(args, device: torch.device):
    """(target, {draft name: draft}) on ``device``, from exports, or untrained models of the small recipes
    (--untrained)."""
    if args.untrained:
        from efftx import recipes
        from efftx.models import build

        torch.manual_seed(0)
        target = build(recipes.get("spec_target_small")).eval()
        torch.manual_seed(1)
        return target.to(device), {"untrained": build(recipes.get("spec_draft_small")).eval().to(device)}
    target, _, _ = load_export(resolve_export(args.target), device)
    drafts = {"plain": load_export(resolve_export(args.draft), device)[0]}
    if args.distilled_draft:
        drafts["distilled"] = load_export(resolve_export(args.distilled_draft), device)[0]
    return target, drafts


def waiter(device: torch.device):
    """A wait for ``device``'s queued work (CUDA: a timed call ends when the device has run it), else nothing."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def timed_s(fn, sync) -> tuple[float, object]:
    """(seconds, result) of ``fn()``, the device's queued work waited for before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


class PassTimer:
    """Adds up the seconds spent in the models' forward passes (eager Rows and compiled StaticDecoder) while on
    (``sync``: each pass waited for before and after, on a GPU)."""

    def __init__(self, sync=lambda: None):
        self.seconds = 0.0
        self.sync = sync
        self._saved = []

    def __enter__(self):
        for cls, name in ((Rows, "forward"), (StaticDecoder, "forward"), (StaticDecoder, "run")):
            original = getattr(cls, name)

            def timed(obj, *args, original=original, **kwargs):
                secs, out = timed_s(lambda: original(obj, *args, **kwargs), self.sync)
                self.seconds += secs
                return out

            self._saved.append((cls, name, original))
            setattr(cls, name, timed)
        return self

    def __exit__(self, *exc):
        for cls, name, original in self._saved:
            setattr(cls, name, original)


def merged(results):
    """One (outputs, SpecStats) of several speculative_generate calls: outputs concatenated, statistics summed."""
    outputs, stats = [], SpecStats(gamma=max(st.gamma for _, st in results))
    for out, st in results:
        outputs += out
        stats.steps += st.steps
        stats.accepted += st.accepted
        stats.drafted += st.drafted
        stats.draft_calls += st.draft_calls
        stats.target_calls += st.target_calls
    return outputs, stats


def min_ms(fn, repeats: int = 15, sync=lambda: None) -> float:
    """The fastest of ``repeats`` calls (after one untimed): a pass's cost with the least interference from
    other work on the machine."""
    fn()
    return min(timed_s(fn, sync)[0] for _ in range(repeats)) * 1e3


def step_costs(target, draft, batch: int, gamma: int, prompt_len: int, mode: str, sync=lambda: None
               ) -> dict[str, float]:
    """Median ms of a target pass of 1 and of gamma + 1 tokens and of a draft step, eager (Rows) or compiled
    (StaticDecoder), every row at position prompt_len (each pass rewound after)."""
    out = {}
    for name, model, t in (("base step", target, 1), ("verify", target, gamma + 1), ("draft step", draft, 1)):
        tokens = torch.ones(batch, t, dtype=torch.long, device=next(model.parameters()).device)
        rows = Rows(model, batch, prompt_len + gamma + 2)
        rows.prefill([[1] * prompt_len] * batch)
        state = rows
        decoder = None
        if mode != "off":
            decoder = StaticDecoder(model, batch, capacity_for(model, prompt_len + gamma + 2), True, "on")
            decoder.load(rows.caches[0], rows.lengths)
            state = decoder

        def one(state=state, tokens=tokens, t=t, base=name == "base step" and decoder is not None):
            if base:  # compiled base decoding's own one-token step (generate(compile="on"): the same graph)
                state(tokens[:, 0])
            else:
                state.forward(tokens)
            state.rewind([t] * batch)

        with torch.no_grad():
            out[name] = min_ms(one, sync=sync)
        if decoder is not None:
            decoder.release()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="models:/spec_target_small/latest")
    p.add_argument("--draft", default="models:/spec_draft_small/latest", help="the plain draft")
    p.add_argument("--distilled-draft", default="", help="a draft distilled from the target (optional)")
    p.add_argument("--untrained", action="store_true",
                   help="untrained spec_target_small / spec_draft_small models (costs and overheads only)")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--more-gammas", default="", help="more fixed gammas to time, e.g. 2,3 (comma-separated)")
    p.add_argument("--max-gamma", type=int, default=8, help="the cap of the adaptive gamma rows")
    p.add_argument("--no-adaptive", action="store_true", help="leave out the adaptive gamma rows")
    p.add_argument("--coupled", action="store_true",
                   help="rows with coupled acceptance too (sampled tokens those of base decoding with the same seed), and "
                        "rows whose draft lengths follow measured costs")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--timed-prompts", type=int, default=32,
                   help="prompts each timed row decodes, in batches of its batch size (the same prompts at every size)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", default="off", help="off, on, or off,on: eager and/or compiled decoding rows")
    p.add_argument("--overhead", action="store_true", help="time per step outside the forward passes, per row")
    p.add_argument("--costs", action="store_true", help="per-pass costs and the speedup they allow")
    p.add_argument("--acceptance-prompts", type=int, default=32, help="prompts of the exactness/acceptance check")
    p.add_argument("--device", default="cpu", help="cpu or cuda (timed calls wait for the device)")
    p.add_argument("--bf16-weights", action="store_true",
                   help="eager rows with bfloat16 Linear weights too (weight-only), with their ratio to float32")
    p.add_argument("--json", default="", metavar="PATH",
                   help="also write the verdict (greedy equality per draft, each goal's best ratio) as JSON to PATH")
    args = p.parse_args()
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        p.error(f"--device takes cpu or cuda (cuda:N), not {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device")
    sync = waiter(device)
    torch.set_num_threads(args.threads)
    modes = [m.strip() for m in args.compile.split(",") if m.strip()]
    for m in modes:
        if m not in ("off", "on"):
            raise SystemExit(f"--compile takes off, on or off,on, not {m!r}")
    target, drafts = load_models(args, device)
    halves = None  # --bf16-weights: (target, {draft name: draft}) with bfloat16 Linear weights
    if args.bf16_weights:
        if device.type != "cpu":
            p.error("--bf16-weights is a CPU decoding option")
        if "off" not in modes:
            p.error("--bf16-weights adds eager rows beside the eager float32 ones: give --compile off or off,on")
        halves = tuple(copy.deepcopy(m) for m in (target, drafts))
        for m in (halves[0], *halves[1].values()):
            bf16_weights(m)
    batches = [int(b) for b in args.batches.split(",")]
    if args.timed_prompts < max(batches):
        raise SystemExit(f"--timed-prompts ({args.timed_prompts}) must be at least the largest batch ({max(batches)})")
    data = ByteData(prepare("bundled", default_data_dir(), args.prompt_len))
    prompts = data.val_windows(args.timed_prompts, args.prompt_len)[:, :args.prompt_len]
    n, gamma, sampling = args.new_tokens, args.gamma, {"temperature": args.temperature, "top_k": 32}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")

    print(f"target {sum(x.numel() for x in target.parameters()):,} params, drafts "
          + ", ".join(f"{k} {sum(x.numel() for x in d.parameters()):,}" for k, d in drafts.items())
          + f"; {n} new tokens after {args.prompt_len}; temperature {args.temperature}, top-k 32; "
          f"{args.threads} thread(s); each timed row decodes the same {args.timed_prompts} prompts in batches of its "
          f"size; median of {args.repeats}, timed round robin; load average {load:.1f}; device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
    # Exactness and acceptance over many prompts (no timing, so the machine's load does not matter): greedy
    # speculative output is the target's own, token for token; accepted drafts per step and per drafted token.
    many = data.val_windows(args.acceptance_prompts, args.prompt_len)[:, :args.prompt_len]
    base = generate(target, many, n, temperature=0).tolist()
    print(f"acceptance over {len(many)} prompts, gamma {gamma} (adaptive: {gamma}-{args.max_gamma}); "
          f"accepted per step / per drafted token:")
    verdict = {"equality": [], "goals": []}  # --json
    for name, draft in drafts.items():
        cells = []
        for adaptive in (False, True):
            extra = {"adaptive_gamma": adaptive, "max_gamma": args.max_gamma if adaptive else None}
            out, greedy = speculative_generate(target, draft, many, n, gamma=gamma, temperature=0, **extra)
            verdict["equality"].append({"draft": name, "gamma": "adaptive" if adaptive else "fixed",
                                        "equal": out == base})
            _, sampled = speculative_generate(target, draft, many, n, gamma=gamma, seed=0, **sampling, **extra)
            cells.append(f"{'adaptive' if adaptive else 'fixed'}: greedy {greedy.mean_accepted:.2f} / "
                         f"{greedy.acceptance_rate:.2f}, T={args.temperature} {sampled.mean_accepted:.2f} / "
                         f"{sampled.acceptance_rate:.2f}, greedy output == base: {'yes' if out == base else 'NO'}")
        print(f"  {name + ' draft':<16}" + ("\n" + " " * 18).join(cells))
    if args.coupled:  # coupled acceptance: sampled speculative output is base decoding's with the same seeds
        sampled_base = generate(target, many, n, seed=0, **sampling).tolist()
        for name, draft in drafts.items():
            out, coupled = speculative_generate(target, draft, many, n, gamma=gamma, seed=0, coupled=True, **sampling)
            _, ratio_test = speculative_generate(target, draft, many, n, gamma=gamma, seed=0, **sampling)
            verdict["equality"].append({"draft": name, "gamma": "fixed, coupled, sampled", "equal": out == sampled_base})
            print(f"  {name + ' draft':<16}coupled, fixed: T={args.temperature} {coupled.mean_accepted:.2f} / "
                  f"{coupled.acceptance_rate:.2f} (the ratio test's {ratio_test.mean_accepted:.2f} / "
                  f"{ratio_test.acceptance_rate:.2f}), sampled output == sampled base (same seeds): "
                  f"{'yes' if out == sampled_base else 'NO'}")
    if halves:
        half_base = generate(halves[0], many, n, temperature=0).tolist()
        for name, draft in halves[1].items():
            out, greedy = speculative_generate(halves[0], draft, many, n, gamma=gamma, temperature=0)
            verdict["equality"].append({"draft": name, "gamma": "fixed, bf16 weights", "equal": out == half_base})
            print(f"  {name + ' draft':<16}bf16 weights, fixed: greedy {greedy.mean_accepted:.2f} / "
                  f"{greedy.acceptance_rate:.2f}, greedy output == bf16 base: {'yes' if out == half_base else 'NO'}")

    if args.costs:
        first = next(iter(drafts.values()))
        print(f"pass costs (ms, fastest of 15) at position {args.prompt_len}, gamma {gamma}; 'allows' = "
              f"(1 + a) * base step / (gamma * draft step + verify) at a accepted drafts per step:")
        for batch in batches:
            for mode in modes:
                c = step_costs(target, first, batch, gamma, args.prompt_len, mode, sync)
                allows = "  ".join(f"a={a}: {(1 + a) * c['base step'] / (gamma * c['draft step'] + c['verify']):.2f}x"
                                   for a in (2, 3, 4, gamma))
                print(f"  batch {batch} {'compiled' if mode == 'on' else 'eager':<8}"
                      + "".join(f"{k} {v:6.2f}" + "  " for k, v in c.items())
                      + f"verify/base {c['verify'] / c['base step']:.2f}  allows {allows}")
                if mode == "off" and args.device == "cpu":  # the CPU kernels' reference paths, side by side
                    for switch, what, gain in ((without_prefetch, "the linear kernel's prefetch off", "the prefetch"),
                                               (key_by_key, "the attention kernel key by key",
                                                "the blocked attention")):
                        with switch():
                            off = step_costs(target, first, batch, gamma, args.prompt_len, mode, sync)
                        print(f"  batch {batch} eager, {what}: "
                              + "".join(f"{k} {v:6.2f}" + "  " for k, v in off.items())
                              + f"verify/base {off['verify'] / off['base step']:.2f}; {gain} makes "
                              + ", ".join(f"a {k} {off[k] / c[k]:.2f}x" for k in c) + " as fast")

    header = (f"{'decoding':<44}{'batch':>6}{'gamma':>7}{'tokens/s':>10}{'vs base':>9}{'vs comp':>9}{'acc/step':>10}"
              f"{'acc/draft':>10}{'goal':>7}  met" + ("   gap ms/step (% of step)" if args.overhead else ""))
    print(header)
    best: dict[int, tuple[float, str]] = {}
    more = [int(g) for g in args.more_gammas.split(",") if g.strip()]
    adaptives = (False,) if args.no_adaptive else (False, True)
    for batch in batches:
        groups = [prompts[i:i + batch] for i in range(0, args.timed_prompts - args.timed_prompts % batch, batch)]
        runs = {}
        for mode in modes:
            suffix = ", compiled" if mode == "on" else ""
            runs["base, KV cache" + suffix] = ((lambda mode=mode: [
                generate(target, x, n, seed=i, compile=mode, **sampling) for i, x in enumerate(groups)]), None)
        if batch == 1 and device.type == "cpu":
            runs["base, recompute window"] = (lambda: [recompute_window(target, x, n, args.temperature, i)
                                                       for i, x in enumerate(groups)], None)
        for mode in modes:
            configs = [(name, draft, False, g) for name, draft in drafts.items() for g in more if g != gamma]
            configs += [(name, draft, adaptive, gamma) for name, draft in drafts.items() for adaptive in adaptives]
            for (name, draft, adaptive, g), coupled in ((c, j) for j in (False, True)[:1 + args.coupled]
                                                        for c in configs):
                label = (f"speculative, {name}" + (", adaptive" if adaptive else "") + (", coupled" if coupled else "")
                         + (", compiled" if mode == "on" else "") + (f" ({g})" if g != gamma else ""))
                runs[label] = ((lambda draft=draft, adaptive=adaptive, g=g, mode=mode, coupled=coupled: merged([
                    speculative_generate(target, draft, x, n, gamma=g, seed=i, adaptive_gamma=adaptive, compile=mode,
                                         max_gamma=args.max_gamma if adaptive else None, coupled=coupled, **sampling)
                    for i, x in enumerate(groups)])), (adaptive, g))
        choosers = {}  # --coupled: per draft, each step's length 0..gamma by measured cost (the library's lengths)
        if args.coupled and "off" in modes:
            for name, draft in drafts.items():
                choosers[name] = chooser = DraftLength(gamma)  # costs measured in the untimed run, then carried
                runs[f"speculative, {name}, coupled, by cost"] = ((lambda draft=draft, chooser=chooser: merged([
                    speculative_generate(target, draft, x, n, gamma=gamma, seed=i, coupled=True, lengths=chooser,
                                         **sampling) for i, x in enumerate(groups)])), (False, gamma))
        if halves:  # eager, fixed gamma: the float32 rows' twins with bfloat16 Linear weights
            runs["base, KV cache" + BF16] = ((lambda: [generate(halves[0], x, n, seed=i, **sampling)
                                                       for i, x in enumerate(groups)]), None)
            for name, draft in halves[1].items():
                runs[f"speculative, {name}" + BF16] = ((lambda draft=draft: merged([speculative_generate(
                    halves[0], draft, x, n, gamma=gamma, seed=i, **sampling) for i, x in enumerate(groups)])),
                    (False, gamma))
        for fn, _ in runs.values():  # untimed: compilation, first-touch allocations
            fn()
            sync()
        # round robin: every repeat times each decoding once, so a change in the machine's load hits all alike
        times: dict[str, list[float]] = {label: [] for label in runs}
        results = {}
        for _ in range(args.repeats):
            for label, (fn, _) in runs.items():
                secs, results[label] = timed_s(fn, sync)
                times[label].append(secs)
        twins = []  # --bf16-weights: (label, its tokens/s over the float32 row's)
        base_s = statistics.median(times["base, KV cache"]) if "base, KV cache" in times else None
        comp_s = statistics.median(times["base, KV cache, compiled"]) if "base, KV cache, compiled" in times else None
        for label, (fn, spec) in runs.items():
            secs = statistics.median(times[label])
            ratio = base_s / secs if base_s else float("nan")
            vs_comp = f"{comp_s / secs:>8.2f}x" if comp_s else f"{'-':>9}"
            if spec is None:
                print(f"{label:<44}{batch:>6}{'-':>7}{len(groups) * batch * n / secs:>10,.0f}{ratio:>8.2f}x{vs_comp}"
                      f"{'-':>10}{'-':>10}{'-':>7}")
                if label.endswith(BF16):
                    twins.append((label, base_s / secs))
                continue
            adaptive, g = spec
            stats = results[label][1]
            shown = f"{g}-{args.max_gamma}" if adaptive else str(g)
            gap = ""
            if args.overhead:
                with PassTimer(sync) as timer:
                    total, (_, st) = timed_s(fn, sync)
                steps = max(st.target_calls, 1)
                gap = f"   {(total - timer.seconds) / steps * 1e3:6.2f} ({100 * (total - timer.seconds) / total:3.0f}%)"
            marked = (f"{'-':>7}  -" if label.endswith(BF16)  # not a goal's row
                      else f"{goal(batch):>6.1f}x  {'MET' if ratio >= goal(batch) else 'not met'}")
            print(f"{label:<44}{batch:>6}{shown:>7}{len(groups) * batch * n / secs:>10,.0f}{ratio:>8.2f}x{vs_comp}"
                  f"{stats.mean_accepted:>10.2f}{stats.acceptance_rate:>10.2f}{marked}{gap}")
            if label.endswith(BF16):
                twins.append((label, statistics.median(times[label[:-len(BF16)]]) / secs))
                continue
            if g == gamma and ratio > best.get(batch, (0.0, ""))[0]:  # the goals are at --gamma
                best[batch] = (ratio, label)
        for name, chooser in choosers.items():
            print(f"  {name} draft, coupled, by cost at batch {batch}: steps per draft length 0..{gamma} "
                  f"{chooser.chosen} (untimed run included), measured acceptance {chooser.acceptance:.2f}")
        if twins:
            print(f"  bf16 weights at batch {batch}, tokens/s over the float32 row: " + ", ".join(
                f"{label[:-len(BF16)]} {r:.2f}x" for label, r in twins))
    print("goals (issue 15, speculative tokens/s over eager base at the same batch size):")
    for batch, (ratio, label) in best.items():
        print(f"  batch {batch}: at least {goal(batch):.1f}x: best {ratio:.2f}x ({label}): "
              f"{'MET' if ratio >= goal(batch) else 'NOT MET'}")
        verdict["goals"].append({"batch": batch, "goal": goal(batch), "best": ratio, "label": label,
                                 "met": ratio >= goal(batch)})
    if args.json:  # written last: a run that stopped early leaves none (bench/gpu_check.py: no verdict, a FAIL)
        Path(args.json).write_text(json.dumps(verdict, indent=1) + "\n")


if __name__ == "__main__":
    main()

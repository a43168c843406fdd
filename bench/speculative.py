"""Base vs speculative decoding tokens/s for a trained pair, and cached vs window-recomputing decoding.

    python bench/speculative.py [--target models:/spec_target_debug/latest] [--draft models:/spec_draft_debug/latest]
                                [--new-tokens 128] [--repeats 3]

Train a pair first (python jobs/train_speculative.py --size debug); any export folders work too.
Prompts are windows of the bundled corpus. Sampling at temperature 0.8, top-k 32, fixed seeds.
All figures come from this one run; ratios are against base cached decoding at the same batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from efftx.data.bytes import ByteData, prepare
from efftx.generation.decode import generate
from efftx.generation.sampling import sample
from efftx.generation.speculative import speculative_generate
from efftx.paths import default_data_dir
from efftx.export import load_export, resolve_export


@torch.no_grad()
def recompute_window(model, prompt, new_tokens, seed):
    """How the seed wrappers decode: the whole sequence through the model at every step, no cache."""
    gen = torch.Generator().manual_seed(seed)
    seq = prompt
    for _ in range(new_tokens):
        nxt = sample(model(seq)[:, -1], 0.8, 32, 1.0, gen)
        seq = torch.cat([seq, nxt[:, None]], 1)
    return seq[:, prompt.shape[1]:]


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="models:/spec_target_debug/latest")
    p.add_argument("--draft", default="models:/spec_draft_debug/latest")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    target, _, _ = load_export(resolve_export(args.target))
    draft, _, _ = load_export(resolve_export(args.draft))
    data = ByteData(prepare("bundled", default_data_dir(), args.prompt_len))
    prompts = data.val_windows(4, args.prompt_len)[:, :args.prompt_len]
    n = args.new_tokens

    print(f"target {sum(x.numel() for x in target.parameters()):,} params, draft "
          f"{sum(x.numel() for x in draft.parameters()):,}; {n} new tokens after {args.prompt_len}; 1 thread")
    print(f"{'decoding':<28}{'batch':>6}{'gamma':>6}{'tokens/s':>11}{'vs base':>9}{'accepted/step':>15}")
    for batch in (1, 4):
        x = prompts[:batch]
        base_s, _ = timed(lambda: generate(target, x, n, temperature=0.8, top_k=32, seed=0), args.repeats)
        base_tps = batch * n / base_s
        print(f"{'base, KV cache':<28}{batch:>6}{'-':>6}{base_tps:>11,.0f}{1.0:>8.2f}x{'-':>15}")
        win_s, _ = timed(lambda: recompute_window(target, x, n, 0), args.repeats)
        print(f"{'base, recompute window':<28}{batch:>6}{'-':>6}{batch * n / win_s:>11,.0f}"
              f"{base_s / win_s:>8.2f}x{'-':>15}")
        modes = [("speculative (batched)", True)] + ([("speculative (rows in turn)", False)] if batch > 1 else [])
        for gamma in (2, 3, 5):
            for label, batched in modes:
                spec_s, (_, stats) = timed(lambda: speculative_generate(
                    target, draft, x, n, gamma=gamma, temperature=0.8, top_k=32, seed=0, batched=batched), args.repeats)
                print(f"{label:<28}{batch:>6}{gamma:>6}{batch * n / spec_s:>11,.0f}"
                      f"{base_s / spec_s:>8.2f}x{stats.mean_accepted:>15.2f}")


if __name__ == "__main__":
    main()

"""Activation checkpointing: saved-activation memory and train-step time, without and with, side by side.

    python bench/activation_memory.py [--recipe lm_small] [--batch 8] [--repeats 7] [--device cpu] [--set key=value ...]

For one model (default: lm_small, 4 layers, 192 wide, 128 tokens; seconds on a CPU) the same weights are run
with ``model.activation_checkpointing`` off and on:
- saved activations: the bytes autograd keeps for backward after one training forward (distinct storages,
  parameters excluded), i.e. what the activations hold at the forward/backward boundary;
- the fwd+bwd step: median seconds of forward + loss + backward (no optimizer step), after a warm-up,
  the two settings alternating step by step;
- on CUDA also the peak memory allocated during the step, above the weights and gradients.
It prints both and the ratios (with / without).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from efftx import models, recipes


def saved_activation_bytes(model, x) -> int:
    """Bytes of the tensors autograd keeps for backward after one forward: distinct storages, parameters
    excluded (they are held anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            held[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(held.values())


def step(model, x) -> None:
    logits = model(x[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1)).backward()


def measure(model, x, repeats: int, device: str) -> dict[bool, dict[str, float]]:
    """Without and with checkpointing (the same weights): saved bytes, then timed steps interleaved round by
    round (so a busy machine slows both alike), then on CUDA the peak memory of one step."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out: dict[bool, dict[str, float]] = {}
    for ckpt in (False, True):
        model.activation_checkpointing = ckpt  # run_blocks reads the flag at each forward
        out[ckpt] = {"saved_mib": saved_activation_bytes(model, x[:, :-1]) / 2**20}
        model.zero_grad(set_to_none=False)
        step(model, x)  # warm-up; gradients allocated
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for ckpt in (False, True):
            model.activation_checkpointing = ckpt
            sync()
            t0 = time.perf_counter()
            step(model, x)
            sync()
            times[ckpt].append(time.perf_counter() - t0)
    for ckpt in (False, True):
        out[ckpt]["step_s"] = statistics.median(times[ckpt])
        if device == "cuda":
            model.activation_checkpointing = ckpt
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(model, x)
            sync()
            out[ckpt]["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", default="lm_small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    cfg = recipes.get(args.recipe).override([*args.overrides, "model.reversible=false"])
    cfg.name = "bench"
    cfg.validate()
    t = cfg.data.seq_len
    torch.manual_seed(0)
    model = models.build(cfg).to(args.device).train()
    x = torch.randint(0, cfg.model.vocab_size, (args.batch, t + 1), device=args.device)
    print(f"{args.recipe}: depth {cfg.model.depth}, dim {cfg.model.dim}, attention {cfg.attention.kind}, "
          f"batch {args.batch} x {t} tokens, {model.num_params() / 1e6:.2f}M params, {args.device}, "
          f"{torch.get_num_threads()} threads")
    results = measure(model, x, args.repeats, args.device)
    keys = [k for k in ("saved_mib", "peak_mib", "step_s") if k in results[False]]
    print(f"{'':24}{'plain':>12}{'checkpointed':>14}{'ratio':>8}")
    for k in keys:
        a, b = results[False][k], results[True][k]
        label = {"saved_mib": "saved activations MiB", "peak_mib": "step peak MiB", "step_s": "fwd+bwd step s"}[k]
        print(f"{label:24}{a:12.3f}{b:14.3f}{b / a:8.2f}")


if __name__ == "__main__":
    main()

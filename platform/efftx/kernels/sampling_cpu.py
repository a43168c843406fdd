"""Sampling's per-token work on a CPU as a compiled C++ kernel (``sampling_cpu.cpp``): logits to distributions
(temperature, top-k, top-p, softmax), the exponential race and a speculative step's acceptance, one call each.

In torch, :func:`efftx.generation.sampling.probabilities` is a division, a ``topk``, a mask and a softmax (a sort,
a cumsum and a scatter more with top-p), and :func:`~efftx.generation.sampling.probabilities_per_row` a dozen
operators: measured on this project's 2-core machine, 18 us for one row of 256 logits, 51 us for 8 rows and 269 us
for the 48 rows of a batch of 8's speculative verify (6 tokens each), most of it per operator and per row, not per
logit. A speculative step makes one such call per drafted token and one for its verify. The kernel reads each row
a few times in one loop and splits rows over torch's threads.

What it computes per row is documented in ``sampling_cpu.cpp``: the same distribution as the torch path up to float
rounding (its own e^y, sums in double, ties of a nucleus broken by index), every row computed alone, so a row's
values are bit for bit the same alone or among other rows, with one setting for all rows or settings per row, eager
or in a graph ``torch.compile`` traces (there as the operators ``efftx::cpu_probabilities``, ``efftx::cpu_race`` and
``efftx::cpu_accept``, when the kernel was loaded before tracing). The acceptance (:func:`accept`) replaces about
fifteen operators of :func:`efftx.generation.speculative.accept_sampled` (90 us a step at batch 1). The torch path is its reference (tests/test_sampling_cpu.py).

Taken: float32 CPU logits with no autograd graph to record. ``EFFTX_CPU_SAMPLING=off`` (or :func:`disabled`, for
side-by-side benches) keeps every call on torch; where the kernel cannot be built the calls take torch and the log
says why, once. ``make setup`` builds it ahead (``python -m efftx.kernels.sampling_cpu``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from efftx.kernels.cpu_build import CpuKernel


def _probs_shape(x, temperature, top_k, top_p):
    return torch.empty_like(x)


def _race_shape(probs, noise):
    return probs.new_empty(probs.shape[:-1], dtype=torch.long)


def _accept_shape(p, q, drafted, u, noise, own):
    return drafted.new_empty((drafted.shape[0], drafted.shape[1] + 2))


KERNEL = CpuKernel(__name__, "efftx_sampling_cpu", Path(__file__).with_name("sampling_cpu.cpp"),
                   "C++ CPU sampling kernel", "sampling runs on torch's operators", env="EFFTX_CPU_SAMPLING",
                   op="efftx::cpu_probabilities", shape=_probs_shape, more_ops={"efftx::cpu_race": _race_shape, "efftx::cpu_accept": _accept_shape})
_state = KERNEL.state
kernel, disabled, build = KERNEL.kernel, KERNEL.disabled, KERNEL.build  # disabled: benches time it side by side


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernel takes a call on these tensors (when it is built): float32, on the CPU, no autograd."""
    if not _state["enabled"]:
        return False
    grad = torch.is_grad_enabled()  # a plain loop: this check runs before every draw of a decoding step
    for t in tensors:
        if not t.is_cpu or t.dtype != torch.float32 or t.dim() < 1 or t.shape[-1] == 0 or (grad and t.requires_grad):
            return False
    return True


def probabilities(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor | None:
    """The distributions of :func:`efftx.generation.sampling.probabilities` (one setting for every row), or None
    where the kernel does not take the call (the caller runs torch's operators)."""
    if not takes(logits):
        return None
    if torch.compiler.is_compiling():
        if KERNEL.ready:
            return torch.ops.efftx.cpu_probabilities(logits, float(temperature), int(top_k), float(top_p))
        return None
    module = kernel()
    return None if module is None else module.probabilities(logits, float(temperature), int(top_k), float(top_p))


def probabilities_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       use_k: bool, nucleus: bool) -> torch.Tensor | None:
    """:func:`efftx.generation.sampling.probabilities_per_row`'s distributions ((B, ..., V) logits, (B,) settings on
    the CPU; ``use_k`` False: no row has a top-k, ``nucleus`` False: no row has a top-p), or None where the kernel
    does not take the call (in a traced graph too: there the torch operators run)."""
    if (not takes(logits) or logits.dim() < 2 or torch.compiler.is_compiling()
            or any(s.device.type != "cpu" for s in (temperature, top_k, top_p))):
        return None
    module = kernel()
    if module is None:
        return None
    return module.probabilities_rows(logits, temperature.float(), top_k.long(), top_p.float(), bool(use_k),
                                     bool(nucleus))


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor | None:
    """argmax(probs / noise) over the last dimension (:func:`efftx.generation.sampling.race`), or None where the
    kernel does not take the call."""
    if probs.shape != noise.shape or not takes(probs, noise):
        return None
    if torch.compiler.is_compiling():
        return torch.ops.efftx.cpu_race(probs, noise) if KERNEL.ready else None
    module = kernel()
    return None if module is None else module.race(probs, noise)


def accept(p: torch.Tensor, q: torch.Tensor, drafted: torch.Tensor, u: torch.Tensor, noise: torch.Tensor,
           own: torch.Tensor) -> torch.Tensor | None:
    """A speculative step's (B, G + 2) acceptance (:func:`efftx.generation.speculative.accept_sampled`: accepted
    counts, last tokens, drafts), or None where the kernel does not take the call."""
    if not (takes(p, q, u, noise) and drafted.device.type == "cpu" and own.device.type == "cpu"
            and drafted.dtype == torch.long and own.dtype == torch.long):
        return None
    if torch.compiler.is_compiling():
        return torch.ops.efftx.cpu_accept(p, q, drafted, u, noise, own) if KERNEL.ready else None
    module = kernel()
    return None if module is None else module.accept(p, q, drafted, u, noise, own)


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

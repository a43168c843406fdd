"""A Linear layer's product for a few rows on a CPU (decoding steps) as a compiled C++ kernel (``linear_cpu.cpp``).

A decoding step multiplies every Linear weight of the model with one row per sequence (batch 1: one row; a
speculative verify: gamma + 1 rows), so its time is the time to read the weights. torch's ``F.linear`` hands
these products to its BLAS, which on this project's CPU machines streams the weights at about a third of the
memory bandwidth for one row and less for 2 to 16 rows (``bench/decode_reference.py --breakdown`` prints both
side by side); the kernel reads each weight row once, multiplies it with every input row in registers, and
splits the output rows over torch's threads.

:func:`linear` is ``F.linear`` with the kernel taking the calls it is for: float32 CPU tensors, at most
:data:`MAX_ROWS` input rows, a contiguous weight, no autograd graph to record (decoding runs under
``torch.no_grad`` / ``inference_mode``; training always takes ``F.linear``). Graphs that ``torch.compile``
traces (compiled decoding, :mod:`efftx.generation.compiled`, which loads the kernel first) call it as the
operator ``efftx::cpu_linear`` under the same conditions. Each
output is summed in one fixed order whatever the number of rows, so a row's result is bit for bit the same alone
or in a batch of up to :data:`MAX_ROWS` (``F.linear`` promises no such thing). ``F.linear`` is the kernel's
reference (tests/test_linear_cpu.py holds them together over many shapes).

``EFFTX_CPU_LINEAR=off`` (or :func:`disabled`, for side-by-side benches) keeps every call on ``F.linear``; where
the kernel cannot be built (no C++ compiler, no ninja) the calls take ``F.linear`` and the log says why, once.
``make setup`` builds it ahead (``python -m efftx.kernels.linear_cpu``).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from efftx.kernels.cpu_build import build_name as _build_name
from efftx.kernels.cpu_build import build_ahead, load_operator, resolve, switch, switched_off

SOURCE = Path(__file__).with_name("linear_cpu.cpp")
PREFIX = "efftx_linear_cpu"
MAX_ROWS = 16  # beyond, the product is compute-bound and the BLAS is as fast or faster (24 rows: 0.3-1.3x)
ENV = "EFFTX_CPU_LINEAR"

log = logging.getLogger(__name__)
_state = switch(ENV)


def build_name() -> str:
    return _build_name(PREFIX, SOURCE)


@functools.cache
def _load():
    """(module, None) or (None, why it is unavailable); built or loaded once per process. Loading it also
    registers the operator ``efftx::cpu_linear`` (and here its shape function) for compiled graphs."""
    return load_operator(PREFIX, SOURCE, "efftx::cpu_linear", _shape, _op)


def _shape(x, w, b):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


_op = {"ready": False}  # efftx::cpu_linear is registered (read while torch.compile traces: a constant there)


@functools.cache
def _warn_once(why: str) -> None:
    log.warning("efftx's C++ CPU linear kernel is unavailable (%s): decoding's products run on F.linear", why)


def kernel():
    """The compiled module, or None where it cannot be built (said once in the log)."""
    return resolve(_load, _warn_once)


def disabled():
    """Every :func:`linear` call inside takes ``F.linear`` (benches measure the kernel side by side with it)."""
    return switched_off(_state)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` hands this call to the kernel (when it is built)."""
    return (_state["enabled"] and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.is_contiguous() and weight.dim() == 2
            and x.numel() <= MAX_ROWS * weight.shape[1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; few-row float32 CPU products without autograd run the C++ kernel (in a graph
    torch.compile traces: as the operator ``efftx::cpu_linear``, when the kernel was loaded before tracing)."""
    if takes(x, weight):
        if torch.compiler.is_compiling():
            if _op["ready"]:
                return torch.ops.efftx.cpu_linear(x, weight, bias)
        else:
            module = kernel()
            if module is not None:
                return module.linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) whose calls go through :func:`linear`: a decoding step's
    few-row products run the kernel, every other call (training included) is ``F.linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def build(log_line=print) -> float:
    """Build (or load from the cache) the kernel ahead of the first run; -> seconds. Raises if it cannot."""
    return build_ahead(_load, "C++ CPU linear kernel", build_name(), log_line)


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

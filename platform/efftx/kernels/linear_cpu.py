"""A Linear layer's product for a few rows on a CPU (decoding steps) as a compiled C++ kernel (``linear_cpu.cpp``).

A decoding step multiplies every Linear weight of the model with one row per sequence (batch 1: one row; a
speculative verify: gamma + 1 rows), so its time is the time to read the weights. torch's ``F.linear`` hands
these products to its BLAS, which on this project's CPU machines streams the weights at about a third of the
memory bandwidth for one row and less for 2 to 16 rows (``bench/decode_reference.py --breakdown`` prints both
side by side); the kernel reads each weight row once, multiplies it with every input row in registers, and
splits the output rows over torch's threads. With ``gelu`` it also applies the exact GELU to its outputs as it
finishes them (a feed-forward's up projection, :class:`efftx.models.layers.MLP`): torch's CPU GELU took ~19 us a call
there, a tenth of a cached pass of the small speculative target, where the epilogue adds next to nothing.

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

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from efftx.kernels.cpu_build import CpuKernel

MAX_ROWS = 16  # beyond, the product is compute-bound and the BLAS is as fast or faster (24 rows: 0.3-1.3x)


def _shape(x, w, b, gelu=False):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


KERNEL = CpuKernel(__name__, "efftx_linear_cpu", Path(__file__).with_name("linear_cpu.cpp"), "C++ CPU linear kernel",
                   "decoding's products run on F.linear", env="EFFTX_CPU_LINEAR", op="efftx::cpu_linear",
                   shape=_shape)
_state = KERNEL.state
kernel, disabled, build = KERNEL.kernel, KERNEL.disabled, KERNEL.build  # disabled: benches time it side by side


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` hands this call to the kernel (when it is built)."""
    return (_state["enabled"] and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and weight.is_contiguous() and weight.dim() == 2
            and x.numel() <= MAX_ROWS * weight.shape[1]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           gelu: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` (``gelu``: ``F.gelu`` of it, the exact GELU); few-row float32 CPU products
    without autograd run the C++ kernel, which applies the GELU to the outputs as it computes them (in a graph
    torch.compile traces: as the operator ``efftx::cpu_linear``, when the kernel was loaded before tracing)."""
    if takes(x, weight):
        if torch.compiler.is_compiling():
            if KERNEL.ready:
                return torch.ops.efftx.cpu_linear(x, weight, bias, gelu)
        else:
            module = kernel()
            if module is not None:
                return module.linear(x, weight, bias, gelu)
    return torch_linear(x, weight, bias, gelu)


def torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 gelu: bool = False) -> torch.Tensor:
    """What :func:`linear` runs where the kernel does not take the call: ``F.linear`` (and ``F.gelu`` of it)."""
    y = F.linear(x, weight, bias)
    return F.gelu(y) if gelu else y


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) whose calls go through :func:`linear`: a decoding step's
    few-row products run the kernel, every other call (training included) is ``F.linear``."""

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """``gelu``: the exact GELU of the product (a feed-forward's up projection), in the kernel where it runs."""
        return linear(x, self.weight, self.bias, gelu)


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

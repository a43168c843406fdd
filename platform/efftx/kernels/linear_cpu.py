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

:func:`bf16_weights` stores a model's Linear weights in bfloat16 for decoding on a CPU (weight-only: activations,
biases, norms, embeddings and caches stay float32): the kernel widens each weight to float32 in registers (exact)
and multiplies as before, reading half the bytes, so a one-row product bound by reading its weights takes about
two thirds of the time (``bench/speculative.py --bf16-weights`` prints it side by side) and the weights
take half the memory; where many rows make the product compute-bound it costs about what float32 does. The result
is bit for bit the float32 kernel's on the widened weights (rounding each weight to bfloat16 is the only change), so
greedy speculative decoding still matches base decoding under it. Products the kernel does not take (past
:data:`MAX_ROWS` rows: prefills) widen the weight for ``F.linear``.

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

WEIGHT_DTYPES = (torch.float32, torch.bfloat16)  # bfloat16: weight-only (bf16_weights), widened in registers
MAX_ROWS = 16  # beyond, the product is compute-bound and the BLAS is as fast or faster (24 rows: 0.3-1.3x)


def _shape(x, w, b, gelu=False):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


KERNEL = CpuKernel(__name__, "efftx_linear_cpu", Path(__file__).with_name("linear_cpu.cpp"), "C++ CPU linear kernel",
                   "decoding's products run on F.linear", env="EFFTX_CPU_LINEAR", op="efftx::cpu_linear",
                   shape=_shape)
_state = KERNEL.state
kernel, disabled, build = KERNEL.kernel, KERNEL.disabled, KERNEL.build  # disabled: benches time it side by side


def without_prefetch():
    """Inside, the kernel does not ask the memory for the next block of weights ahead (``linear_cpu.cpp``), for
    benches that time the prefetch side by side; results are the same bit for bit either way."""
    return KERNEL.setting("set_prefetch", False)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` hands this call to the kernel (when it is built)."""
    return (_state["enabled"] and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype in WEIGHT_DTYPES and weight.is_contiguous() and weight.dim() == 2
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
    y = F.linear(x, weight.to(x.dtype), bias)  # bfloat16 weights (bf16_weights): widened, float32 products
    return F.gelu(y) if gelu else y


WEIGHTS = ("float32", "bfloat16")  # the choices of bf16_weights' callers (--weights, the text app's decode_weights)


def bf16_weights(model: nn.Module) -> int:
    """Store every efftx :class:`Linear` weight of ``model`` in bfloat16, in place, for decoding on a CPU (weight-only:
    see the module docstring); returns how many it cast. For inference: the weights become frozen parameters (no
    gradient), and a model on another device is refused, since there a whole-model bfloat16 (or float16) runs on
    the accelerator's own units instead."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for layer in layers:
        if layer.weight.device.type != "cpu":
            raise ValueError(f"bfloat16 weights are a CPU decoding option; this model's weights are on "
                             f"{layer.weight.device.type} (there, run the whole model in bfloat16)")
        if layer.weight.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"bfloat16 weights need float32 Linear weights, got {layer.weight.dtype}")
    for layer in layers:
        layer.weight = nn.Parameter(layer.weight.detach().to(torch.bfloat16).contiguous(), requires_grad=False)
    return len(layers)


def use_weights(model: nn.Module, weights: str) -> nn.Module:
    """``model`` with its Linear weights in ``weights`` (:data:`WEIGHTS`: ``float32`` leaves it as it is,
    ``bfloat16`` casts them, :func:`bf16_weights`)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights == "bfloat16":
        bf16_weights(model)
    return model


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) whose calls go through :func:`linear`: a decoding step's
    few-row products run the kernel, every other call (training included) is ``F.linear``."""

    def forward(self, x: torch.Tensor, gelu: bool = False) -> torch.Tensor:
        """``gelu``: the exact GELU of the product (a feed-forward's up projection), in the kernel where it runs."""
        return linear(x, self.weight, self.bias, gelu)


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

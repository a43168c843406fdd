"""RMSNorm on a CPU without autograd (decoding) as a compiled C++ kernel (``rms_norm_cpu.cpp``).

torch's CPU ``rms_norm`` is a composite of six operators, about 8 us for one decoding row of a few hundred floats
on this project's CPU machines, and a decoding step runs two norms per layer and one more at the end: about a
twelfth of a cached step of the small speculative target. The kernel reads each row once and writes it once
(about 1.5 us a call).

:class:`RMSNorm` is ``nn.RMSNorm`` (the same parameter and state dict) whose calls go through :func:`rms_norm`:
float32 CPU tensors with a weight and an ``eps``, normalised over the last dimension, no autograd graph to record
(decoding and evaluation under ``torch.no_grad`` / ``inference_mode``; training takes ``F.rms_norm``). Graphs that
``torch.compile`` traces (compiled decoding, :mod:`efftx.generation.compiled`, which loads the kernel first) call
it as the operator ``efftx::cpu_rms_norm`` under the same conditions, so compiled and eager passes compute the same
values. A row's result is bit for bit the same alone or among other rows. ``F.rms_norm`` is the kernel's reference
(tests/test_rms_norm_cpu.py holds them together over many shapes).

``EFFTX_CPU_RMS_NORM=off`` (or :func:`disabled`, for side-by-side benches) keeps every call on ``F.rms_norm``;
where the kernel cannot be built the calls take ``F.rms_norm`` and the log says why, once. ``make setup`` builds it
ahead (``python -m efftx.kernels.rms_norm_cpu``).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from efftx.kernels.cpu_build import CpuKernel


def _shape(x, w, eps):
    return torch.empty_like(x)


KERNEL = CpuKernel(__name__, "efftx_rms_norm_cpu", Path(__file__).with_name("rms_norm_cpu.cpp"),
                   "C++ CPU RMSNorm kernel", "norms run on F.rms_norm", env="EFFTX_CPU_RMS_NORM",
                   op="efftx::cpu_rms_norm", shape=_shape)
_state = KERNEL.state
kernel, disabled, build = KERNEL.kernel, KERNEL.disabled, KERNEL.build  # disabled: benches time it side by side


def takes(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, eps: float | None) -> bool:
    """Whether :func:`rms_norm` hands this call to the kernel (when it is built)."""
    return (_state["enabled"] and weight is not None and eps is not None and len(shape) == 1
            and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.dim() == 1 and weight.is_contiguous() and x.dim() >= 1 and x.shape[-1] == shape[0]
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm(x, shape, weight, eps)``; float32 CPU calls without autograd run the C++ kernel (in a graph
    torch.compile traces: as the operator ``efftx::cpu_rms_norm``, when the kernel was loaded before tracing)."""
    if takes(x, shape, weight, eps):
        if torch.compiler.is_compiling():
            if KERNEL.ready:
                return torch.ops.efftx.cpu_rms_norm(x, weight, eps)
        else:
            module = kernel()
            if module is not None:
                return module.rms_norm(x, weight, eps)
    return F.rms_norm(x, shape, weight, eps)


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (the same parameter and state dict) whose calls go through :func:`rms_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

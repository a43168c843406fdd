"""Counter-based row noise (:mod:`efftx.kernels.row_noise`) on a CPU as a compiled C++ kernel
(``row_noise_cpu.cpp``): one call fills every row of a draw, where the torch reference takes about 30 tensor
operations and per-row generators one call per row.

:func:`takes`: int64 CPU keys, the switch on. ``EFFTX_CPU_ROW_NOISE=off`` (or :func:`disabled`, for side-by-side
benches) keeps every call on the reference; where the kernel cannot be built (no C++ compiler, no ninja) the calls
take the reference and the log says why, once. The integer bits are the reference's; the float32 log is the C
library's, within a unit in the last place of torch's (tests/test_row_noise.py). ``make setup`` builds it ahead
(``python -m efftx.kernels.row_noise_cpu``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from efftx.kernels.cpu_build import CpuKernel


def _shape(keys, width):
    return keys.new_empty((keys.shape[0], width), dtype=torch.float32)


KERNEL = CpuKernel(__name__, "efftx_row_noise_cpu", Path(__file__).with_name("row_noise_cpu.cpp"),
                   "C++ CPU row noise kernel", "draws take the torch reference", env="EFFTX_CPU_ROW_NOISE",
                   op="efftx::cpu_row_noise", shape=_shape)
_state = KERNEL.state
kernel, disabled, build = KERNEL.kernel, KERNEL.disabled, KERNEL.build  # disabled: benches time it side by side


def takes(keys: torch.Tensor) -> bool:
    """Whether :func:`efftx.kernels.row_noise.row_noise` hands these keys to the kernel (when it is built)."""
    return _state["enabled"] and keys.device.type == "cpu" and keys.dtype == torch.int64


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

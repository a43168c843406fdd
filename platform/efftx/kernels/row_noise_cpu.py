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

import functools
import logging
from pathlib import Path

import torch

from efftx.kernels.cpu_build import build_ahead, load_operator, resolve, switch, switched_off
from efftx.kernels.cpu_build import build_name as _build_name

SOURCE = Path(__file__).with_name("row_noise_cpu.cpp")
PREFIX = "efftx_row_noise_cpu"
ENV = "EFFTX_CPU_ROW_NOISE"

log = logging.getLogger(__name__)
_state = switch(ENV)
_op = {"ready": False}  # efftx::cpu_row_noise is registered


def build_name() -> str:
    return _build_name(PREFIX, SOURCE)


def _shape(keys, width):
    return keys.new_empty((keys.shape[0], width), dtype=torch.float32)


@functools.cache
def _load():
    """(module, None) or (None, why it is unavailable); built or loaded once per process."""
    return load_operator(PREFIX, SOURCE, "efftx::cpu_row_noise", _shape, _op)


@functools.cache
def _warn_once(why: str) -> None:
    log.warning("efftx's C++ CPU row noise kernel is unavailable (%s): draws take the torch reference", why)


def kernel():
    """The compiled module, or None where it cannot be built (said once in the log)."""
    return resolve(_load, _warn_once)


def disabled():
    """Inside, every call takes the torch reference (benches time the kernel side by side with it)."""
    return switched_off(_state)


def takes(keys: torch.Tensor) -> bool:
    """Whether :func:`efftx.kernels.row_noise.row_noise` hands these keys to the kernel (when it is built)."""
    return _state["enabled"] and keys.device.type == "cpu" and keys.dtype == torch.int64


def build(log_line=print) -> float:
    """Build (or load from the cache) the kernel ahead of the first run; -> seconds. Raises if it cannot."""
    return build_ahead(_load, "C++ CPU row noise kernel", build_name(), log_line)


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

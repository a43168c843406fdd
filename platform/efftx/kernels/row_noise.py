"""Counter-based Exp(1) noise for every row of a batch in one call: each row's values depend only on its key.

Sampling draws a token as the exponential race argmax(p / E) (:func:`efftx.generation.sampling.race`). A row's
noise E must be the same whatever else is in its batch, so that a request's tokens are those it gets alone. Drawn
from a ``torch.Generator`` per row, that is one ``exponential_`` call per row and step: on a GPU one kernel launch
per row, which at 16 rows is most of a small model's decoding step. Here the noise of a row's draw is a fixed
function of a 64-bit key (its seed and draw count, :class:`efftx.generation.sampling.Stream`) and the element's
index: one call fills every row, and a row's first ``n`` values are the same whatever the width asked for.

The function, per element ``j`` of a row with key halves ``(k0, k1)`` (each below 2**32)::

    x = mix32(mix32(j ^ k0) ^ k1)            # mix32: a 32-bit avalanche bijection (below)
    u = ((x >> 9) + 0.5) * 2**-23            # uniform on (0, 1), never 0 or 1, exactly in float32
    E = -log(u)                              # Exp(1)

:func:`row_noise_reference` is that in torch integer operations (values below 2**32 in int64; each product of a
32-bit value and a constant below 2**31 stays below 2**63), the oracle and the fallback. :func:`row_noise` hands CPU
tensors to the C++ kernel (:mod:`efftx.kernels.row_noise_cpu`) and CUDA tensors to the Triton kernel
(:mod:`efftx.kernels.row_noise_gpu`) where they are available, else to the reference (also, from then on, where
the Triton kernel fails to build or launch: said once in the log). The integer bits are the same
in all three; the log may differ in the last bit between implementations (tests/test_row_noise.py).
"""

from __future__ import annotations

import logging

import torch

M32 = 0xFFFFFFFF
M64 = 0xFFFFFFFFFFFFFFFF
# mix32's multipliers: odd, below 2**31 (so x * C, x < 2**32, fits in int64), with shifts 16, 15, 15: a 32-bit
# integer finalizer of low bias (a bijection: an xorshift and an odd multiplication mod 2**32 are each invertible)
C1, C2 = 0x21F0AAAD, 0x735A2D97
SCALE = 2.0 ** -23

log = logging.getLogger(__name__)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finalizer on an int64 tensor of values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * C1) & M32
    x = x ^ (x >> 15)
    x = (x * C2) & M32
    return x ^ (x >> 15)


def splitmix64(z: int) -> int:
    """A 64-bit mix (the SplitMix64 output function, its golden-ratio increment included) of a Python int."""
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def check_keys(keys: torch.Tensor, width: int) -> None:
    if keys.dtype != torch.int64 or keys.dim() != 2 or keys.shape[1] != 2:
        raise ValueError(f"keys must be an int64 tensor of shape (rows, 2), got {keys.dtype} {tuple(keys.shape)}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be an integer >= 0, got {width!r}")


def row_bits(keys: torch.Tensor, width: int) -> torch.Tensor:
    """(B, 2) int64 keys (each half in [0, 2**32)) -> (B, width) int64: every element's 32 random bits."""
    check_keys(keys, width)
    j = torch.arange(width, device=keys.device, dtype=torch.int64)
    return mix32(mix32(j[None, :] ^ keys[:, :1]) ^ keys[:, 1:])


def row_noise_reference(keys: torch.Tensor, width: int) -> torch.Tensor:
    """(B, 2) int64 keys -> (B, width) float32 Exp(1) noise (the module docstring's function)."""
    u = ((row_bits(keys, width) >> 9).to(torch.float32) + 0.5) * SCALE
    return -torch.log(u)


def row_noise(keys: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`row_noise_reference`'s values from the kernel for ``keys``' device where there is one."""
    check_keys(keys, width)
    if keys.device.type == "cpu":
        from efftx.kernels import row_noise_cpu

        if row_noise_cpu.takes(keys):
            module = row_noise_cpu.kernel()
            if module is not None:
                return module.row_noise(keys, width)
    elif keys.is_cuda:
        return _on_gpu(keys, width)
    return row_noise_reference(keys, width)


def _on_gpu(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The Triton kernel's noise where it takes ``keys``; the reference where it does not, or fails (for good)."""
    from efftx.kernels import row_noise_gpu

    if row_noise_gpu.takes(keys):
        try:
            return row_noise_gpu.row_noise(keys, width)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot build or launch here: the reference
            row_noise_gpu._state["enabled"] = False
            log.warning("efftx's Triton row noise kernel failed (%s: %s): draws take the torch reference",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
    return row_noise_reference(keys, width)

"""Counter-based row noise (:mod:`efftx.kernels.row_noise`) on a GPU: one Triton kernel launch fills every row.

Sampling draws each row's Exp(1) noise from its own 64-bit key (:func:`efftx.kernels.row_noise.row_noise`); on a
GPU the torch reference is about thirty elementwise launches per draw, this is one. Program (row, block) computes
``BLOCK`` consecutive elements of its row in 32-bit unsigned integers (multiplications wrap mod 2**32, as the
reference's masks do), so the integer bits are the reference's exactly and only the final log may differ from
torch's in the last places. It is the operator ``efftx::gpu_row_noise`` (``torch.library.custom_op`` with a shape
function): ``torch.compile(fullgraph=True)`` traces it as one node and CUDA graphs capture its launch (nothing syncs).
:func:`efftx.kernels.row_noise.row_noise_reference` is the oracle: tests/test_row_noise_gpu.py holds the kernel to it
through Triton's interpreter (``TRITON_INTERPRET=1`` before import; :func:`on_cpu` lets CPU tensors in) and compiles
it for an sm_90 target without a GPU. ``EFFTX_GPU_ROW_NOISE=off`` (or :func:`disabled`) keeps draws on the reference.
"""

from __future__ import annotations

import contextlib

import torch

from efftx.kernels.cpu_build import interpreted_on_cpu, switch, switched_off
from efftx.kernels.row_noise import C1, C2, check_keys

try:  # Triton is an optional extra (`pip install efftx[triton]`); without it draws take the torch reference
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["row_noise", "row_bits", "takes", "disabled", "on_cpu", "BLOCK", "MAX_WIDTH"]

BLOCK = 1024  # elements per program: 8 per thread on 4 warps
NUM_WARPS = 4
MAX_BLOCKS = 65535  # a CUDA grid's second dimension
MAX_WIDTH = BLOCK * MAX_BLOCKS  # about 67M elements per row: far past any vocabulary
ENV = "EFFTX_GPU_ROW_NOISE"

_state = switch(ENV)
_cpu = {"on": False}  # on_cpu(): the interpreted kernel takes CPU tensors too (tests)


def disabled():
    """Inside, no draw takes the kernel (benches time it side by side with the torch reference)."""
    return switched_off(_state)


def on_cpu():
    """Inside, CPU tensors take the kernel too, through Triton's interpreter (``TRITON_INTERPRET=1`` before import;
    raises otherwise)."""
    return interpreted_on_cpu(_cpu, INTERPRETED, __name__)


# ------------------------------------------------------------------------------------------------ kernel

if triton is not None:
    _C1 = tl.constexpr(C1)  # a jitted function reads module globals only as constexprs
    _C2 = tl.constexpr(C2)

    @triton.jit
    def _mix32(x):
        """:func:`efftx.kernels.row_noise.mix32` on uint32 (shifts are logical, products wrap mod 2**32)."""
        x = x ^ (x >> 16)
        x = x * _C1
        x = x ^ (x >> 15)
        x = x * _C2
        return x ^ (x >> 15)

    @triton.jit
    def _row_noise_kernel(KEYS, OUT, skr, skc, width, BLOCK: tl.constexpr, BITS: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: outputs past 2**31 elements
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # int32: width <= MAX_WIDTH
        ok = j < width
        k0 = tl.load(KEYS + row * skr).to(tl.uint32)  # keys below 2**32: truncation keeps them whole
        k1 = tl.load(KEYS + row * skr + skc).to(tl.uint32)
        x = _mix32(_mix32(j.to(tl.uint32) ^ k0) ^ k1)
        if BITS:  # the integer bits themselves (tests compare them exactly)
            tl.store(OUT + row * width + j, x.to(tl.int64), mask=ok)
        else:
            u = ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: (0, 1), exact in float32
            tl.store(OUT + row * width + j, -tl.log(u), mask=ok)

    #: True when the kernel was built by Triton's CPU interpreter (TRITON_INTERPRET=1 before this import).
    INTERPRETED = not isinstance(_row_noise_kernel, triton.JITFunction)
else:  # pragma: no cover
    INTERPRETED = False


def _launch(keys: torch.Tensor, width: int, bits: bool = False) -> torch.Tensor:
    rows = keys.shape[0]
    out = torch.empty(rows, width, device=keys.device, dtype=torch.int64 if bits else torch.float32)
    if rows == 0 or width == 0:
        return out
    grid = (rows, triton.cdiv(width, BLOCK))
    with torch.cuda.device(keys.device) if keys.is_cuda else contextlib.nullcontext():
        _row_noise_kernel[grid](keys, out, keys.stride(0), keys.stride(1), width, BLOCK=BLOCK, BITS=bits,
                                num_warps=NUM_WARPS)
    return out


@torch.library.custom_op("efftx::gpu_row_noise", mutates_args=())
def _op(keys: torch.Tensor, width: int) -> torch.Tensor:
    return _launch(keys, width)


@_op.register_fake
def _(keys, width):
    return keys.new_empty((keys.shape[0], width), dtype=torch.float32)


def _check(keys: torch.Tensor, width: int) -> None:
    check_keys(keys, width)
    if width > MAX_WIDTH:
        raise ValueError(f"width {width} exceeds the row noise kernel's {MAX_WIDTH}")
    if triton is None:
        raise ValueError("the row noise kernel needs the triton package (pip install 'efftx[triton]')")
    if not (keys.is_cuda or INTERPRETED):
        raise ValueError(f"the row noise kernel needs CUDA tensors (keys are on {keys.device}) or TRITON_INTERPRET=1 "
                         "set before efftx is imported; row_noise_reference runs anywhere")


def row_noise(keys: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`efftx.kernels.row_noise.row_noise_reference`'s (B, width) float32 noise from the kernel (the operator
    ``efftx::gpu_row_noise``, one launch): ``keys`` (B, 2) int64, each value in [0, 2**32) (not checked: that would
    sync). Raises ValueError naming a bad argument, or where the kernel cannot run."""
    _check(keys, width)
    return _op(keys, int(width))


def row_bits(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The kernel's (B, width) int64 integer bits, before the log (tests: :func:`efftx.kernels.row_noise.row_bits`
    exactly)."""
    _check(keys, width)
    return _launch(keys, int(width), bits=True)


def takes(keys: torch.Tensor) -> bool:
    """Whether :func:`efftx.kernels.row_noise.row_noise` hands a draw over ``keys`` to this kernel."""
    return (_state["enabled"] and triton is not None and isinstance(keys, torch.Tensor)
            and (keys.is_cuda or (_cpu["on"] and INTERPRETED and keys.device.type == "cpu")))

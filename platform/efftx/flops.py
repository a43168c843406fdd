"""Peak FLOP/s of the device a worker runs on, for model FLOPs utilisation (MFU).

MFU = (model FLOPs per token x tokens/s) / peak FLOP/s. On CUDA the peak is the vendor's dense
figure for known GPUs; elsewhere (and on unknown GPUs) it is measured: the best of a few large
matmuls in the training dtype, so a CPU's MFU is relative to what its BLAS can actually reach.
"""

from __future__ import annotations

import time

import torch

# Dense tensor-core peaks (FLOP/s) from the vendors' data sheets, SXM parts.
_KNOWN_GPU_PEAKS = {
    ("H100", torch.bfloat16): 989e12, ("H100", torch.float16): 989e12, ("H100", torch.float32): 67e12,
    ("H200", torch.bfloat16): 989e12, ("H200", torch.float16): 989e12, ("H200", torch.float32): 67e12,
    ("A100", torch.bfloat16): 312e12, ("A100", torch.float16): 312e12, ("A100", torch.float32): 19.5e12,
}

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                        repeats: int = 5) -> float:
    """Best FLOP/s of ``repeats`` (n x n) @ (n x n) matmuls on ``device`` with the current thread count."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: str, precision: str) -> float:
    dtype = PRECISION_DTYPES[precision]
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for (key, dt), peak in _KNOWN_GPU_PEAKS.items():
            if key in name and dt == dtype:
                return peak
        return measure_matmul_peak("cuda", dtype, n=8192)
    return measure_matmul_peak("cpu", torch.float32 if dtype == torch.float16 else dtype)

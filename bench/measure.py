"""Shared by the benchmarks: the median time and peak memory of a function, measured in this process."""

from __future__ import annotations

import statistics
import time


def timed_peak(fn, device: str, repeats: int) -> tuple[float, float]:
    """(median seconds, peak MiB above the memory held before the warm-up) of ``fn``."""
    import resource

    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        import psutil

        base = psutil.Process().memory_info().rss

    def run():
        fn()
        if device == "cuda":
            torch.cuda.synchronize()

    run()  # warm-up: kernels compiled, allocator filled
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return statistics.median(times), max(peak, 0) / 2**20

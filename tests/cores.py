"""How many cores a thread's torch work keeps busy: torch.set_num_threads is per thread, and a new thread starts
with the process default (every core outside Ray), so tests check the threads that decode, not a setting."""

from __future__ import annotations

import os
import time

import pytest
import torch


def needs_two_cores() -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores to tell one thread from two")  # CI and dev machines have 2


def cores_used(repeats: int = 20) -> float:
    """The process's CPU time over the calling thread's while the calling thread multiplies (96 x 1024) by
    (1024 x 4096) ``repeats`` times: about 1 on one torch thread, about 2 on two (other threads idle)."""
    a, w = torch.randn(96, 1024), torch.randn(4096, 1024)
    torch.nn.functional.linear(a, w)  # warm
    p0, t0 = time.process_time(), time.thread_time()
    for _ in range(repeats):
        torch.nn.functional.linear(a, w)
    return (time.process_time() - p0) / max(time.thread_time() - t0, 1e-9)

"""efftx.host.host_values: host values made into device tensors without waiting for the device (row lengths and
positions of every decoding step's layers, per-row sampling settings, stream keys)."""

from __future__ import annotations

import pytest
import torch

from efftx.attention.cache import KVCache, visible_keys
from efftx.host import host_values


def test_host_values_are_torch_tensors_of_them():
    for values, dtype in (([1, 2, 3], torch.long), ([[0, 2**32 - 1], [5, 6]], torch.int64),
                          ([0.5, 1e-300], torch.float32), ([True, False], torch.bool)):
        got = host_values(values, dtype, "cpu")
        assert got.dtype == dtype and got.device.type == "cpu" and torch.equal(got, torch.tensor(values, dtype=dtype))
    assert host_values([], torch.long).shape == (0,) and host_values([7], torch.long).device.type == "cpu"
    meta = host_values([1, 2], torch.long, "meta")  # another device: a non-blocking copy, nothing pinned
    assert meta.device.type == "meta" and meta.shape == (2,) and meta.dtype == torch.long


def test_on_cuda_the_values_go_through_pinned_memory_without_blocking(monkeypatch):
    """The CUDA branch (no CUDA here: torch's two calls recorded): pinned first, then a non-blocking copy."""
    calls = []

    def pin_memory(self):
        calls.append("pin")
        return self

    def to(self, device, non_blocking=False):
        calls.append(("to", torch.device(device), non_blocking))
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    got = host_values([4, 5], torch.long, "cuda:0")
    monkeypatch.undo()
    assert calls == ["pin", ("to", torch.device("cuda:0"), True)] and got.tolist() == [4, 5]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: bench/gpu_check.py's kernels "
                                                          "section runs it")
def test_on_cuda_neither_host_values_nor_a_ragged_caches_step_waits_for_queued_kernels():
    """Kernels queued for a while (``torch.cuda._sleep``): host values, and a ragged KV cache's write, visibility
    and offsets (what every layer of a continuous-batching step computes from its rows' host lengths), return with
    the stream still busy; a plain ``torch.tensor(..., device="cuda")`` waits for it (the contrast: the check can
    fail)."""
    stream = torch.cuda.current_stream()
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # some 0.3 s of device time
    got = host_values([3, 1, 2], torch.long, "cuda")
    cache = KVCache(2, 8, 1, 4, device="cuda")
    cache.lengths = [1, 3]
    cache.write_rows(torch.ones(2, 1, 1, 4, device="cuda"), torch.ones(2, 1, 1, 4, device="cuda"))
    mask, offset = visible_keys(cache.lengths, 1, True, torch.device("cuda")), cache.offset()
    busy = not stream.query()
    torch.cuda.synchronize()
    assert busy and got.tolist() == [3, 1, 2] and offset[:, 0].tolist() == [2, 4] and mask.shape == (2, 1, 5)
    torch.cuda._sleep(500_000_000)
    torch.tensor([3, 1, 2], device="cuda")
    assert stream.query()  # it waited

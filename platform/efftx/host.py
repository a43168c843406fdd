"""Host values (row lengths, positions, per-row settings) made into device tensors without waiting for the device.

A plain ``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``, after which torch synchronises
the stream: the host waits for every kernel queued before it. Mid-step (a decoding step's layers, its draft passes)
that stops the host from queueing the step's next kernels while the device runs. A non-blocking copy from pageable
memory may still be staged with a stream synchronisation (CUDA's "API synchronization behavior"), so on CUDA the
values go through pinned memory first: torch's caching host allocator keeps that buffer until the copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def host_values(values: Sequence, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """``values`` as a ``dtype`` tensor on ``device`` (None or a CPU: on the host), copied without waiting for the
    device."""
    out = torch.tensor(values, dtype=dtype)
    if device is None:
        return out
    device = torch.device(device)
    if device.type == "cpu":
        return out
    if device.type == "cuda":
        out = out.pin_memory()
    return out.to(device, non_blocking=True)

"""Host values (row lengths, positions, per-row settings) made into device tensors without waiting for the device.

A plain ``torch.tensor(values, device="cuda")`` copies with ``non_blocking=False``, after which torch synchronises
the stream: the host waits for every kernel queued before it. Mid-step (a decoding step's layers, its draft passes)
that stops the host from queueing the step's next kernels while the device runs. A non-blocking copy from pageable
memory may still be staged with a stream synchronisation (CUDA's "API synchronization behavior"), so on CUDA the
values go through pinned memory first: torch's caching host allocator keeps that buffer until the copy is done.

The other way, :class:`Readback`: a device tensor's values sent to the host as soon as the work making them is queued,
so that reading them later waits for that work only. A plain ``tensor.tolist()`` queues its copy behind everything
queued so far: a pipelined decoding step read after the next step was queued would wait for that next step too.
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


class Readback:
    """``values`` (a device tensor) on their way to the host, sent when this is made: on CUDA a non-blocking copy into
    pinned memory queued right behind the work that makes them, and an event recorded after it. :meth:`tolist` waits
    for that event only, not for work queued later (a pipelined step's successor); a device error surfaces there.
    Elsewhere (a CPU: nothing runs ahead of the host) the tensor itself, read when asked."""

    def __init__(self, values: torch.Tensor):
        self._ready = None
        if values.device.type == "cuda":
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(values.device))  # the copy's stream: its device's
        else:
            self._host = values

    def wait(self) -> None:
        """Wait until the values are on the host (on CUDA: the work that makes them has run), reading nothing."""
        self._arrive()

    def tolist(self) -> list:
        self._arrive()
        return self._host.tolist()

    def _arrive(self) -> None:
        if self._ready is not None:
            self._ready.synchronize()

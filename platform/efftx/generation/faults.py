"""What counts as the device's error, in one place.

Two kinds, both the device's and never the code's (nor the compiler's):

- out of memory (``torch.OutOfMemoryError``): one request's or one pass's; a smaller pass, or the same one later,
  may fit;
- a device fault (:func:`device_fault`): a CUDA error (an illegal memory access, a device-side assert, ...). Such an
  error is sticky: every later call on the device fails too, so nothing should run on it again in this process.

Compiled decoding (:mod:`efftx.generation.compiled`) lets both propagate as they are (:func:`device_error`), never
taking them for a compile failure. What a serving replica does with them: :mod:`efftx.serving.faults`.
"""

from __future__ import annotations

import torch


class DeviceFault(RuntimeError):
    """The device failed (a CUDA error: an illegal memory access, a device-side assert, ...). Such an error is
    sticky: every later call on the device fails too, in this process."""


def device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is the device's failure (:class:`DeviceFault`), not one request's or the memory's."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False
    if isinstance(exc, (DeviceFault, torch.AcceleratorError)):
        return True
    return isinstance(exc, RuntimeError) and "CUDA error" in str(exc)


def device_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the device's: out of memory, or a :func:`device_fault`."""
    return isinstance(exc, torch.OutOfMemoryError) or device_fault(exc)

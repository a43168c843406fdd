"""A replica's device fault, held once met: the continuous-batching scheduler's (its batches share one), static
batching's and the image replica's (:func:`~efftx.serving.isolation.contained`). Torch alone: the scheduler runs
without the web stack (a bench on a bare GPU image).

Out of memory is one request's or one pass's: serving contains it per request (a 503 to retry). A device fault
(:class:`~efftx.generation.faults.DeviceFault`) is sticky: every later call on the device fails too, so running a
batch's rows one by one would only fail each of them, and every later request. Instead every request fails with one
:class:`DeviceFault` (a 503), the scheduler refuses new ones, and the Serve app reports the replica unhealthy
(:meth:`FaultLatch.check_health`, called by :meth:`~efftx.serving.text.TextGenerator.check_health`), so Serve
replaces it.

What counts as the device's failure is :mod:`efftx.generation.faults`' (one definition for compiled decoding and
serving alike)."""

from __future__ import annotations

import logging

from efftx.generation.faults import DeviceFault, device_fault

logger = logging.getLogger("ray.serve")


def replica_fault(exc: BaseException) -> DeviceFault:
    """The :class:`DeviceFault` every request fails with after the device failed with ``exc``."""
    if isinstance(exc, DeviceFault):
        return exc
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    fault = DeviceFault(f"the device failed ({type(exc).__name__}: {first}); this replica takes no more requests "
                        "and is replaced")
    fault.__cause__ = exc
    return fault


class FaultLatch:
    """A replica's device fault (:class:`~efftx.generation.faults.DeviceFault`), once met: from then on every request
    fails with it (a 503), and the replica's ``check_health`` raises so that Serve replaces it. One per replica: the
    continuous-batching scheduler's (its batches share it), or static batching's and the image replica's
    (:func:`~efftx.serving.isolation.contained`)."""

    def __init__(self, name: str = ""):
        self.name = name  # the log's prefix
        self.fault: DeviceFault | None = None

    def failed(self, exc: BaseException) -> DeviceFault | None:
        """Where ``exc`` is the device's failure (:func:`~efftx.generation.faults.device_fault`): the fault every
        request fails with (latched, and logged, the first time); else None (``exc`` is a request's own)."""
        if not device_fault(exc):
            return None
        if self.fault is None:
            self.fault = replica_fault(exc)
            logger.error("%s%s", f"{self.name}: " if self.name else "", self.fault, exc_info=self.fault.__cause__)
        return self.fault

    def check_health(self) -> None:
        if self.fault is not None:
            raise RuntimeError(f"unhealthy: {self.fault}")

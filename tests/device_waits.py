"""A test helper: where code would make the host wait for a CUDA device, found on a CPU.

On a GPU the host queues kernels and runs ahead of the device, except where it asks for something the device has not
finished: a value read back (``tolist``, ``item``, ``bool(t)``, ``int(t)``, ...), a tensor made from host values
straight on the device (``torch.tensor(values, device=...)``: a blocking copy, after which torch synchronises the
stream), a result sized by device values (``nonzero``, a boolean mask as an index, ``unique``: the host needs the
size to allocate), or a copy of a tensor built on the host into device memory from pageable memory (``host.to(device)``,
``device.copy_(host)``; CUDA may synchronise the stream to stage it). A decoding step that does any of these
mid-step waits for the kernels queued before it, so the host cannot queue the next layer (or the next step) while
the device runs.

On a CPU nothing waits, but the same calls are made: :class:`DeviceWaits` (a ``TorchFunctionMode``) records each of
them while it is active. Every tensor counts as a device tensor but those on the host: made in the audited run
without a device (``torch.tensor(values)``, ``torch.full(...)``: the default device is the host's), or computed from
such tensors only. Reading those is free, copying them to the device is a wait. :func:`efftx.host.host_values`
(pinned memory and a non-blocking copy on CUDA) is the way to make host values into device tensors without a wait:
what it does inside is not recorded, and what it returns counts as a device tensor. What runs inside a compiled
graph runs on the device (its replay launches kernels and reads nothing): a test runs the traced function eagerly
through :func:`on_device`, which records nothing of it.

A read of values sent ahead (:class:`efftx.host.Readback`: sent to the host as soon as the work making them was
queued) waits for that work only: it is recorded as ``reads a value sent ahead (tolist)`` (a wait for them that
reads nothing, ``Readback.wait``: ``waits for a value sent ahead (wait)``), with how much device work was queued
between its sending and its reading (:attr:`DeviceWaits.ahead`: the work that read does not wait for, every torch
call on device tensors counted, a compiled graph's included), where a plain read would wait for all of it.
"""

from __future__ import annotations

import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode

from efftx import host

READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "__complex__", "numpy", "__repr__",
         "__format__"}
# results whose size depends on the values (the host needs them to allocate), or that are host values themselves
SIZED_BY_VALUES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "equal",
                   "allclose", "multinomial", "cpu"}
FROM_VALUES = {"tensor", "as_tensor"}
# made without a device: on the host (the default device); with one: on the device
FACTORIES = FROM_VALUES | {"full", "zeros", "ones", "empty", "arange", "rand", "randn", "randint", "linspace", "eye"}
HOST_FILE = "efftx/host.py"


def _name(func) -> str:
    return getattr(func, "__name__", str(func))


class DeviceWaits(TorchFunctionMode):
    """Records (in :attr:`waits`: what, and the line and function of efftx or test code that asked) every call that
    would wait for a CUDA device; see the module docstring."""

    active: "DeviceWaits | None" = None  # the mode recording now

    def __init__(self):
        super().__init__()
        self.paused = 0
        self.waits: list[tuple[str, str]] = []
        self.queued = 0  # torch calls on device tensors so far (device work queued)
        self.ahead: list[int] = []  # per read of values sent ahead: the device work queued between its send and read
        self._readback = None
        self._host: set[int] = set()  # ids of the tensors on the host ...
        self._kept: list[torch.Tensor] = []  # ... kept alive while the mode is, so that no id is reused

    def __enter__(self):
        DeviceWaits.active = self
        self._readback = host.Readback.__init__, host.Readback.tolist, host.Readback.wait
        send, read, wait = self._readback
        mode = self

        def sent(rb, values):
            send(rb, values)
            rb.audit_sent_at = mode.queued

        def tolist(rb):
            out = read(rb)  # inside efftx/host.py: not recorded as a plain read
            mode.ahead.append(mode.queued - rb.audit_sent_at)
            mode._wait("reads a value sent ahead (tolist)")
            return out

        def waited(rb):
            wait(rb)  # inside efftx/host.py: not recorded as a plain read
            mode._wait("waits for a value sent ahead (wait)")

        host.Readback.__init__, host.Readback.tolist, host.Readback.wait = sent, tolist, waited
        return super().__enter__()

    def __exit__(self, *exc):
        DeviceWaits.active = None
        host.Readback.__init__, host.Readback.tolist, host.Readback.wait = self._readback
        return super().__exit__(*exc)

    def on_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and id(t) in self._host

    def _mark(self, out) -> None:
        for t in _tensors(out):
            self._host.add(id(t))
            self._kept.append(t)

    def _wait(self, what: str) -> None:
        for frame in reversed(traceback.extract_stack(sys._getframe(2))):
            for root in ("/platform/", "/tests/"):
                if root in frame.filename and ("/efftx/" in frame.filename or root == "/tests/"):
                    name = frame.filename.split(root)[-1]
                    where = f"{'tests/' if root == '/tests/' else ''}{name}:{frame.lineno} ({frame.name})"
                    self.waits.append((what, where))
                    return
        self.waits.append((what, "?"))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            self.queued += 1  # a compiled graph's work: on the device, nothing to record
            return out
        if _inside_host_values():
            return out  # a device tensor (host values): nothing to record
        name, inputs = _name(func), _tensors((args, kwargs))
        device = kwargs.get("device") is not None
        if any(not self.on_host(t) for t in inputs) or (name in FACTORIES and device):
            self.queued += 1
        if name in READS and args and isinstance(args[0], torch.Tensor):
            if not self.on_host(args[0]):
                self._wait(f"reads a device value ({name})")
        elif _sized_by_values(name, args, kwargs) and not all(self.on_host(t) for t in inputs):
            self._wait(f"{name}: a result sized by device values")
        elif name in FROM_VALUES and device:
            self._wait(f"torch.{name}(..., device=...)")
        elif name in ("to", "cuda") and self.on_host(args[0]) and (name == "cuda" or _moves(args[1:], kwargs)):
            self._wait(f"a host tensor's .{name}(device)")
        elif name == "copy_" and self.on_host(args[1]) and not self.on_host(args[0]):
            self._wait("device.copy_(host tensor)")
        elif (name in FACTORIES and not device) or (inputs and all(self.on_host(t) for t in inputs)):
            self._mark(out)  # made on the host, or computed from host tensors only: on the host
        return out


def on_device(fn):
    """``fn`` as a compiled graph runs it: on the device, so nothing it calls is recorded (a stand-in for
    ``torch.compile(fn)`` in an audited run; the graph's guards and launch are the host's, not audited here)."""

    def run(*args, **kwargs):
        mode = DeviceWaits.active
        if mode is None:
            return fn(*args, **kwargs)
        mode.paused += 1
        try:
            return fn(*args, **kwargs)
        finally:
            mode.paused -= 1

    return run


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in ``tree`` (nested tuples, lists, dicts)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _inside_host_values() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(HOST_FILE):
            return True
        frame = frame.f_back
    return False


def _sized_by_values(name: str, args, kwargs) -> bool:
    """Whether torch's ``name`` called with ``args`` makes a result whose size (or value on the host) depends on its
    inputs' values: boolean masks as indices, ``torch.where(cond)``, ``repeat_interleave`` without ``output_size``."""
    if name in SIZED_BY_VALUES:
        return True
    if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
        index = args[1] if len(args) > 1 else ()
        return any(t.dtype == torch.bool for t in _tensors(index))
    if name == "where":
        return len(args) == 1 and not kwargs
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and any(isinstance(a, torch.Tensor) for a in args[1:2])
    return False


def _moves(args, kwargs) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` names a device (not only a dtype)."""
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device)) for a in args)


def waits_of(fn, *args, **kwargs) -> tuple[object, list[tuple[str, str]]]:
    """``fn(*args, **kwargs)`` under :class:`DeviceWaits`: (its result, the waits it would have made on CUDA)."""
    with DeviceWaits() as mode:
        out = fn(*args, **kwargs)
    return out, mode.waits

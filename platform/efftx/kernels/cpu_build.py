"""Building efftx's C++ CPU kernels (``torch.utils.cpp_extension``), shared by every kernel module.

Each kernel compiles once per machine into ``$TORCH_EXTENSIONS_DIR``, which efftx points at the venv
(:func:`efftx.train.ops.use_venv_cache`), for the machine's own CPU (``-march=native``): the build's name carries a
digest of the source, the flags, torch's version and the CPU's feature flags, so a cache shared by machines with
other CPUs never loads a binary built for another one. Work inside the kernels runs on torch's intra-op threads
(``at::parallel_for``; ``-fopenmp`` resolves to the ``libgomp`` torch already loaded: one thread pool, not two).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
from pathlib import Path

import torch

FLAGS = ("-O3", "-march=native", "-fopenmp")


def cpu_tag() -> str:
    """The machine's architecture and CPU feature flags, hashed (what ``-march=native`` compiles for)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


def build_name(prefix: str, source: Path) -> str:
    """The build's name: a digest of the source, the headers beside it (``cpu_vec.h``: any of them may be included),
    the flags and torch's version, and the CPU's tag."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(FLAGS).encode() + torch.__version__.encode())
    return f"{prefix}_{digest.hexdigest()[:10]}_{cpu_tag()}"


def load_extension(prefix: str, source: Path):
    """(module, None) or (None, why it cannot be built or loaded: the compiler's first error where there is one)."""
    try:
        from torch.utils.cpp_extension import load

        from efftx.train.ops import use_venv_cache

        use_venv_cache()
        path = os.environ.get("PATH", "")
        scripts = sysconfig.get_path("scripts") or str(Path(sys.executable).parent)
        if shutil.which("ninja") is None and Path(scripts, "ninja").exists():  # the venv's ninja, off PATH
            os.environ["PATH"] = scripts + os.pathsep + path
        try:
            module = load(name=build_name(prefix, source), sources=[str(source)], extra_cflags=list(FLAGS),
                          verbose=False)
        finally:
            os.environ["PATH"] = path
        return module, None
    except Exception as exc:  # noqa: BLE001 - any build or load failure means: use the torch path
        lines = str(exc).strip().splitlines() or [""]
        errors = [line.strip() for line in lines if "error" in line.lower()]  # the compiler's first error, if any
        return None, f"{type(exc).__name__}: {(errors or lines)[0] if errors else lines[-1]}"


class CpuKernel:
    """One C++ CPU kernel as its module loads and switches it: built or loaded once per process
    (:meth:`load`), the module or None where it cannot be built (:meth:`kernel`, said once in the log), on unless
    its environment variable ``env`` says off (:attr:`state`, :meth:`disabled` for side-by-side benches), built
    ahead by ``make setup`` (:meth:`build`).

    ``module``: the kernel module's name (its logger). ``op`` (``"efftx::name"``) with ``shape``: loading the
    kernel also registers that operator, for graphs ``torch.compile`` traces, and ``shape`` as its fake function
    (``more_ops``: more operators of the same source, ``{op: shape}``); :attr:`ready` then says so (read while a graph
    is traced: a constant there). ``what`` names the kernel in the
    log and in errors, ``fallback`` what runs where it is unavailable."""

    def __init__(self, module: str, prefix: str, source: Path, what: str, fallback: str, env: str | None = None,
                 op: str | None = None, shape=None, more_ops: dict | None = None):
        self.log = logging.getLogger(module)  # the kernel module's
        self.prefix, self.source, self.what, self.fallback = prefix, source, what, fallback
        self.state = switch(env) if env is not None else {"enabled": True}
        self.ops = ({op: shape} if op is not None else {}) | dict(more_ops or {})
        self.ready = False  # the operators in ``ops`` are registered
        self._loaded: tuple | None = None
        self._lock = threading.Lock()  # one build, one registration, whichever threads ask first
        self.warned: set[str] = set()  # the reasons said in the log

    def build_name(self) -> str:
        return build_name(self.prefix, self.source)

    def load(self):
        """(module, None) or (None, why it is unavailable); built or loaded once per process."""
        if self._loaded is None:
            with self._lock:
                if self._loaded is None:
                    module, why = load_extension(self.prefix, self.source)
                    if module is not None and self.ops:
                        for op, shape in self.ops.items():
                            torch.library.register_fake(op)(shape)
                        self.ready = True
                    self._loaded = module, why
        return self._loaded

    def warn_once(self, why: str) -> None:
        if why not in self.warned:
            self.warned.add(why)
            self.log.warning("efftx's %s is unavailable (%s): %s", self.what, why, self.fallback)

    def kernel(self, unavailable=None):
        """The compiled module; where it cannot be built: None, said once in the log, or, with ``unavailable`` (why
        -> an exception), that exception raised."""
        module, why = self.load()
        if module is None:
            if unavailable is not None:
                raise unavailable(why)
            self.warn_once(why)
        return module

    def disabled(self):
        """Inside, the kernel's switch is off: every call takes the torch path it replaces."""
        return switched_off(self.state)

    @contextlib.contextmanager
    def setting(self, setter: str, value: bool):
        """Inside, the built module's ``setter(value)`` holds (a switch of the kernel's own, e.g. the linear
        kernel's prefetch, for benches and tests that time or check its paths side by side; the setter returns
        the setting it replaced, which is put back after); nothing where the kernel cannot be built."""
        module = self.kernel()
        was = getattr(module, setter)(value) if module is not None else None
        try:
            yield
        finally:
            if module is not None:
                getattr(module, setter)(was)

    def build(self, log_line=print) -> float:
        """Build (or load from the cache) the kernel ahead of the first run (``make setup``); -> seconds. Raises
        with the reason when it cannot be built."""
        import time

        start = time.perf_counter()
        module, why = self.load()
        if module is None:
            raise RuntimeError(f"efftx's {self.what} could not be built: {why}")
        seconds = time.perf_counter() - start
        log_line(f"{self.what} {self.build_name()}: ready in {seconds:.1f} s")
        return seconds


def switch(env: str) -> dict:
    """A kernel's switch, ``{"enabled": bool}``: on unless the environment variable ``env`` is off, 0, false or no."""
    return {"enabled": os.environ.get(env, "auto").strip().lower() not in ("off", "0", "false", "no")}


@contextlib.contextmanager
def switched_off(state: dict):
    """Inside, the switch ``state`` is off (benches time a kernel side by side with the torch path it replaces)."""
    before = state["enabled"]
    state["enabled"] = False
    try:
        yield
    finally:
        state["enabled"] = before


@contextlib.contextmanager
def interpreted_on_cpu(state: dict, interpreted: bool, module: str):
    """A Triton kernel module's ``on_cpu()``: inside, ``state["on"]`` is set, so that CPU tensors take its kernels
    through Triton's interpreter (tests on a machine without a GPU); raises where the module was imported without
    ``TRITON_INTERPRET=1`` (``interpreted`` False)."""
    if not interpreted:
        raise RuntimeError(f"on_cpu() needs TRITON_INTERPRET=1 set before {module} is imported")
    before = state["on"]
    state["on"] = True
    try:
        yield
    finally:
        state["on"] = before

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
import os
import platform
import shutil
import sys
import sysconfig
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
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS).encode() + torch.__version__.encode())
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


def load_operator(prefix: str, source: Path, op: str, shape, ready: dict):
    """:func:`load_extension` for a kernel that also registers the operator ``op`` (``"efftx::name"``) as it loads:
    where it loads, ``shape`` (the operator's fake function, for torch.compile's tracing) is registered and
    ``ready["ready"]`` set, which a module reads while a graph is traced (a constant there)."""
    module, why = load_extension(prefix, source)
    if module is not None:
        torch.library.register_fake(op)(shape)
        ready["ready"] = True
    return module, why


def resolve(load, warn_once, unavailable=None):
    """The module ``load()`` gives; where it cannot be built: None, said once through ``warn_once(why)``, or, with
    ``unavailable`` (why -> an exception), that exception raised."""
    module, why = load()
    if module is None:
        if unavailable is not None:
            raise unavailable(why)
        warn_once(why)
    return module


def build_ahead(load, what: str, name: str, log_line=print) -> float:
    """Build (or load from the cache) a kernel ahead of the first run (``make setup``); -> seconds. Raises with
    the reason when it cannot be built."""
    import time

    start = time.perf_counter()
    module, why = load()
    if module is None:
        raise RuntimeError(f"efftx's {what} could not be built: {why}")
    seconds = time.perf_counter() - start
    log_line(f"{what} {name}: ready in {seconds:.1f} s")
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

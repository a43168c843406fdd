"""DeepSpeed's compiled CPU ops: where they are cached, and building them ahead of the first run.

Without a GPU DeepSpeed JIT-compiles two C++ ops the first time a run needs them: the shared-memory collective
(``deepspeed_shm_comm``, every CPU run, about a minute) and CPU Adam (``cpu_adam``, ZeRO-Offload, about 70 s on
2 cores). torch caches compiled ops in ``$TORCH_EXTENSIONS_DIR``, by default under ``~/.cache``: a cache that
outlives the venv that compiled it and is not where a new HOME (CI, a container) looks. efftx points it at the
venv (``<sys.prefix>/torch_extensions``, :func:`use_venv_cache`) unless the variable is already set, so the ops
are compiled once per environment, by whichever process comes first, and ``make setup`` builds them ahead
(``python -m efftx.train.ops``) so no training run or test pays for the compile.

On CUDA machines DeepSpeed's CUDA ops are different builds (FusedAdam, CUDA CPU-Adam): ``build`` compiles only
the CPU ops and says so when CUDA is present.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

CPU_OPS = {"shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder"}


def venv_cache() -> Path:
    return Path(sys.prefix) / "torch_extensions"


# A build holds ``<op>/lock`` (torch's FileBaton) while it compiles; a process killed meanwhile leaves the lock behind
# and every later run waits on it forever, silently. A lock this much older than any build is stale: with the op
# built (its .so present) after STALE_LOCK_BUILT_S, without it after STALE_LOCK_UNBUILT_S (a build takes ~1 minute).
STALE_LOCK_BUILT_S = 600.0
STALE_LOCK_UNBUILT_S = 3600.0


def clear_stale_locks(cache: str | Path, log=print, now: float | None = None) -> list[Path]:
    """Remove the build locks under ``cache`` that no live build can hold (see STALE_LOCK_*); -> removed paths."""
    now = time.time() if now is None else now
    removed = []
    for lock in Path(cache).glob("*/lock"):
        try:
            age = now - lock.stat().st_mtime
        except OSError:
            continue  # released meanwhile
        built = any(lock.parent.glob("*.so"))
        if age > (STALE_LOCK_BUILT_S if built else STALE_LOCK_UNBUILT_S):
            try:
                lock.unlink()
            except OSError:
                continue
            removed.append(lock)
            log(f"removed {lock}: a build lock {age / 60:.0f} minutes old, left by a process stopped while building "
                f"DeepSpeed's {lock.parent.name} op (every run would otherwise wait on it)")
    return removed


def remember_cpu_info() -> bool:
    """Keep py-cpuinfo's answer for this process. ``cpuinfo.get_cpu_info()`` starts a child Python process each call
    (about a second on 2 cores), and DeepSpeed calls it twice per op it loads (its compiler flags: the shared-memory
    op of every CPU run) and once per CPU Adam it builds, in every worker of every run. The CPU under a running
    process does not change, so its first answer stands (callers get a copy). Returns whether the memo is in place
    (False without py-cpuinfo)."""
    try:
        import cpuinfo
    except ImportError:
        return False
    if getattr(cpuinfo.get_cpu_info, "efftx_memo", False):
        return True
    first = functools.cache(cpuinfo.get_cpu_info)

    def get_cpu_info():
        return dict(first())

    get_cpu_info.efftx_memo = True
    cpuinfo.get_cpu_info = get_cpu_info
    return True


def use_venv_cache() -> str:
    """Set TORCH_EXTENSIONS_DIR to the venv's cache unless it is set already (or the venv is read-only);
    returns the directory in use, after clearing its stale build locks. Inherited by Ray's workers started from
    this process."""
    current = os.environ.get("TORCH_EXTENSIONS_DIR")
    if current:
        clear_stale_locks(current, log=lambda message: print(f"[efftx] {message}", file=sys.stderr))
        return current
    cache = venv_cache()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError:
        return ""  # torch's default (~/.cache/torch_extensions)
    if not os.access(cache, os.W_OK):
        return ""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(cache)
    clear_stale_locks(cache, log=lambda message: print(f"[efftx] {message}", file=sys.stderr))
    return str(cache)


def build(names=tuple(CPU_OPS), log=print) -> dict[str, float]:
    """Compile (or load from the cache) DeepSpeed's CPU ops; -> {op: seconds}."""
    unknown = [n for n in names if n not in CPU_OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}; known: {', '.join(CPU_OPS)}")
    os.environ["DS_ACCELERATOR"] = "cpu"  # before DeepSpeed is imported
    where = use_venv_cache() or "torch's default cache"
    from deepspeed.accelerator import get_accelerator

    times = {}
    for name in names:
        log(f"DeepSpeed CPU op {name}: building into {where} (about a minute the first time)...")
        start = time.perf_counter()
        get_accelerator().create_op_builder(CPU_OPS[name]).load(verbose=False)
        times[name] = time.perf_counter() - start
        log(f"DeepSpeed CPU op {name}: ready in {times[name]:.1f} s")
    return times


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Build DeepSpeed's CPU ops into the venv's cache ahead of training.")
    p.add_argument("ops", nargs="*", default=list(CPU_OPS), help=f"ops to build (default: {' '.join(CPU_OPS)})")
    args = p.parse_args(argv)
    unknown = [n for n in args.ops if n not in CPU_OPS]
    if unknown:
        p.error(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(CPU_OPS)}")
    import torch

    if torch.cuda.is_available():
        print("CUDA is present: DeepSpeed's CUDA ops compile at first use on the GPU workers; building the CPU "
              "ops only (used by CPU runs on this machine)")
    build(args.ops)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""NSA's selected branch on a CPU as a compiled C++ kernel (``nsa_selected_cpu.cpp``), built on first use.

The chunked CPU function (:func:`efftx.attention.nsa_cpu.nsa_attention`) computes the selected branch one of two
ways: with torch ops (each query's blocks gathered with ``index_select`` into a copy, batched products, the key
and value gradients added back with ``index_add_``), or with this kernel, which reads every query's own and
selected blocks in place from the kv-head-major key/value tables, keeps one query's scores at a time and adds its
key/value gradients straight into the gradient tables. The torch path stays as its reference (the tests hold the
two to each other and to the float64 naive reference, forward and every gradient).

``attention.nsa.cpu_kernel``: ``auto`` (default) uses the kernel when it builds and falls back to the torch path,
saying why once, when it does not (no C++ compiler, no ninja); ``on`` raises instead; ``off`` never builds it.

The module also holds two per-chunk kernels of the compressed branch (identity score mapping, compressed blocks =
selection blocks, the seed's geometry): ``compressed_select`` turns a chunk's raw compressed scores into their
softmax in place and picks every query's blocks in the same pass (group-mean logits or summed probabilities,
their ranking with the most recent block winning ties, ``min_importance``, forced blocks, top-k), and
``compressed_backward`` recomputes that softmax, forms the scores' gradient and, for ``diff_topk`` with
``logits_softmax`` importances, adds the importance gradient of the selected blocks, all in one pass per row.
``decode`` is cached decoding (:meth:`efftx.attention.nsa.NativeSparseAttention.decode`, its torch reference) in
one call: for each query at its own position, the compressed scores over the blocks it sees, their softmax and the
importances, the ranking and top-k, the own and selected blocks and the window read in place from the cache, and
the gated sum of the three branches (the same geometry and one selection per kv head).
Work runs on torch's own intra-op threads (``at::parallel_for``; the build links OpenMP, which resolves to the
``libgomp`` torch already loaded: one thread pool, not two competing for the cores).

The build uses ``torch.utils.cpp_extension`` (a C++ compiler and ninja; both come with ``make setup``'s
environment, which also builds the kernel ahead), as :mod:`efftx.kernels.cpu_build` describes.
"""

from __future__ import annotations

from pathlib import Path

from efftx.kernels.cpu_build import CpuKernel

KERNEL = CpuKernel(__name__, "efftx_nsa_selected", Path(__file__).with_name("nsa_selected_cpu.cpp"),
                   "C++ CPU NSA kernel", "the selected branch runs on torch ops")
build = KERNEL.build


class KernelUnavailable(RuntimeError):
    """``cpu_kernel=on`` and the kernel could not be built or loaded."""


def kernel(required: bool = False):
    """The compiled kernel module; where it cannot be built: None (said once in the log), or, if ``required``,
    :class:`KernelUnavailable` naming why."""
    return KERNEL.kernel(_unavailable if required else None)


def _unavailable(why: str) -> KernelUnavailable:
    return KernelUnavailable(f"attention.nsa.cpu_kernel=on, but the C++ kernel could not be built: {why}")


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

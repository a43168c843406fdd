"""Full attention's cached passes of a few tokens per row on a CPU as a compiled C++ kernel
(``decode_attention_cpu.cpp``): decoding steps, speculative verify passes, prefills of prompts of up to
:data:`MAX_QUERIES` tokens.

Such a pass asks little arithmetic of attention (one query per row and head against the keys cached so far), and
torch's path spends most of its time around it: per layer, the new keys scattered into the cache with
``index_put`` at each row's position, a (B, T, L) mask built from the row lengths, and SDPA's CPU flash kernel,
which tiles each (row, head)'s few queries as a full block. On a 16-row decoding step of ``spec_target_small``
that was about a third of the step's time; the kernel writes the new keys and values in place and attends, each
query over exactly the keys it may see, in one call per layer.

:func:`attend` takes the calls it is for (:func:`takes`): float32 tensors on a CPU, a
:class:`~efftx.attention.cache.KVCache` whose buffers are contiguous, at most :data:`MAX_QUERIES` new tokens per
row, no autograd graph to record (training never reaches it: it has no cache), outside ``torch.compile``.
Compiled decoding's fixed-shape cache (a DeviceKV: the row lengths a tensor) goes through :func:`attend_device`,
the same kernel as the operator ``efftx::cpu_decode_attention``, which a compiled graph calls. Rows of equal and of
different lengths alike go through it, so a row's
output is bit for bit the same alone or in a batch (each sum is taken in one order that depends only on the row's
own keys). The reference is the torch path it replaces (:class:`~efftx.attention.full.FullAttention` with the
kernel off), and a float64 softmax in the tests, over many shapes (tests/test_decode_attention_cpu.py).

The kernel takes each query's scores 16 keys at a time and a row's queries four at a time through the values (see
``decode_attention_cpu.cpp``); :func:`key_by_key` switches it to its reference inside, every score and every
query on its own, with the same bits (tests/test_decode_attention_cpu.py holds the two together;
``bench/speculative.py --costs`` times passes both ways side by side).

``EFFTX_CPU_ATTENTION=off`` (or :func:`disabled`, for side-by-side benches) keeps every call on the torch path;
where the kernel cannot be built (no C++ compiler, no ninja) the calls take the torch path and the log says why,
once. ``make setup`` builds it ahead (``python -m efftx.kernels.decode_attention_cpu``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from efftx.kernels.cpu_build import CpuKernel

# New tokens per row: decoding (1), verify (gamma + 1), prompts of up to 128 tokens; longer prefills take SDPA. Prefills
# of spec_target_small on a 2-core CPU (one thread, whole cached pass): the kernel 1.46x / 1.23x / 1.14x SDPA's speed
# at 17 / 64 / 128 tokens; a 512-wide model (head dim 64) 1.12x / 1.03x at 17 / 128, 1.00x at 256, 0.95x at 1024;
# attention alone (head dim 64) costs 5x SDPA's at 1024 tokens, whose blocked products pay at that length.
MAX_QUERIES = 128


def _shape(q, k_new, v_new, k, v, lengths, causal, scale):
    return torch.empty_like(q)


KERNEL = CpuKernel(__name__, "efftx_decode_attention", Path(__file__).with_name("decode_attention_cpu.cpp"),
                   "C++ CPU decode attention kernel", "cached attention runs on torch's SDPA",
                   env="EFFTX_CPU_ATTENTION", op="efftx::cpu_decode_attention", shape=_shape)
_state = KERNEL.state
kernel, disabled, build = KERNEL.kernel, KERNEL.disabled, KERNEL.build  # disabled: benches time it side by side


def key_by_key():
    """Inside, the kernel takes every query's scores key by key and each query's weighted sum of the values alone
    (the blocked path's reference: the same bits, more time), for benches and tests that hold the two side by side."""
    return KERNEL.setting("set_blocked", False)


def takes(q: torch.Tensor, k: torch.Tensor, cache) -> bool:
    """Whether :func:`attend` hands this pass to the kernel (when it is built): ``q`` (B, T, H, D) and ``k`` (B, T,
    Hkv, D) the pass's queries and new keys, ``cache`` the layer's cache."""
    from efftx.attention.cache import KVCache

    return (_state["enabled"] and type(cache) is KVCache and q.device.type == "cpu"
            and q.dtype == torch.float32 and k.dtype == torch.float32 and cache.k.dtype == torch.float32
            and q.shape[1] <= MAX_QUERIES and cache.k.is_contiguous() and cache.v.is_contiguous()
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, causal: bool, rotary=None
           ) -> torch.Tensor | None:
    """Write ``k`` / ``v`` (B, T, Hkv, D) into ``cache`` at each row's position and return softmax attention
    (B, T, H, D) of ``q`` over each row's keys (``causal``: query i of a row sees its keys up to its own position;
    else every key of the row, the new ones included), scaled by ``D ** -0.5``. With ``rotary`` (a
    :class:`~efftx.models.layers.Rotary`), ``q`` and ``k`` come unrotated and the kernel rotates them at their
    positions, bit for bit as the module does. None where the kernel does not take the pass (:func:`takes`) or is
    unavailable: the caller then runs the torch path, the cache untouched."""
    if not takes(q, k, cache):
        return None
    tables = () if rotary is None else (rotary.cos, rotary.sin)
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in tables):
        return None
    module = kernel()
    if module is None:
        return None
    return attend_with(module, q, k, v, cache, causal, tables)


def attend_with(module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, causal: bool,
                tables: tuple = ()) -> torch.Tensor:
    """:func:`attend`'s call of the kernel ``module``, for callers that made its checks already (a cached pass's
    plan, :mod:`efftx.models.cpu_plan`, once per pass): the rows' lengths grown (raising, nothing written, where
    they do not fit) and given back where the kernel raises; ``tables``: the rotary's (cos, sin) or ()."""
    before = list(cache.lengths)
    cache._grow(k.shape[1], cache.max_len, "KV cache")  # raises (nothing written) when the rows do not fit
    try:
        return module.attend(q.contiguous(), k.contiguous(), v.contiguous(), cache.k, cache.v, before, causal,
                             q.shape[-1] ** -0.5, *tables)
    except Exception:
        cache.lengths = before
        raise


def attend_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, causal: bool) -> torch.Tensor | None:
    """:func:`attend` for compiled decoding's cache (:class:`~efftx.generation.compiled.DeviceKV`: the buffers of
    its capacity, the row lengths a device tensor the pass does not advance): ``q`` / ``k`` already rotated. In a
    graph torch.compile traces, the operator ``efftx::cpu_decode_attention`` (when the kernel was loaded before
    tracing), so that the compiled step attends over each row's own keys, not the whole capacity, as the eager
    path does. None where the kernel does not take the pass: the caller then writes the keys and attends itself."""
    if not (_state["enabled"] and isinstance(getattr(cache, "lengths", None), torch.Tensor)
            and q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float32
            and cache.k.dtype == torch.float32 and q.shape[1] <= MAX_QUERIES and cache.k.is_contiguous()
            and cache.v.is_contiguous() and cache.lengths.device.type == "cpu"
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
        return None
    if torch.compiler.is_compiling():
        if not KERNEL.ready:
            return None
    elif kernel() is None:
        return None
    return torch.ops.efftx.cpu_decode_attention(q, k, v, cache.k, cache.v, cache.lengths, causal,
                                                q.shape[-1] ** -0.5)


if __name__ == "__main__":  # make setup: build it ahead, so no run or test pays for the compile
    build()

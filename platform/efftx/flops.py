"""Model FLOPs and the peak FLOP/s of the device a worker runs on, for model FLOPs utilisation (MFU).

MFU = (model FLOPs per token x tokens/s) / peak FLOP/s. On CUDA the peak is the vendor's dense
figure for known GPUs; elsewhere (and on unknown GPUs) it is measured: the best of a few large
matmuls in the training dtype, so a CPU's MFU is relative to what its BLAS can actually reach.

Attention FLOPs per backend (:func:`attention_cost`): the matmul FLOPs of one layer's forward pass over one
sequence, counted from the algorithm each backend runs (training = 3 x forward; recomputation in a backward is
not counted, the MFU convention). Causal masking is not halved (PaLM's convention for full attention, kept for
every backend: a bucket, chunk or window counts all its keys). A backend's parameters that are not applied once
per token (Sinkhorn's sort net, NSA's compression networks and memory slots) are left out of the model's
6 x parameters term and counted here at the rate they are applied (per bucket / per compressed block).

* full: QK^T and AV, 4·T·H·D per token.
* local: the same over a window of ``window_size`` keys.
* performer (FAVOR+, m = nb_features, C = chunk_size): query and key features (2·H·D·m and 2·Hkv·D·m per
  token); causal: the chunk states phi(k)^T [v, 1] (2·Hkv·m·(D+1)), their read-out phi(q)·S (2·H·m·(D+1)), and
  each chunk's C x C block, phi(q) phi(k)^T (2·H·C·m) then times [v, 1] (2·H·C·(D+1)); the extra column of ones
  is the denominator. Non-causal: one global state (2·Hkv·m·D + 2·H·m·D + 2·H·m).
* sinkhorn (n = bucket_size, nb = ceil(T / n) buckets, Hs sorting heads, nl local heads): the sorting heads'
  softmax over their own bucket plus the sorted bucket(s) (n, or topk x n keys); the sorted buckets mixed from
  the J candidate buckets slot by slot (keys and values); the sort net's scores s_q W s per bucket pair; the
  local heads' window of 2 (causal) or 3 buckets.
* nsa (l, d = compress block and stride, l' = selection block, k = selected blocks, w = window): the
  compression network per compressed block (keys and values), the compressed branch over every compressed
  block (and memory slot), the selected branch over k + 1 blocks of l' keys, the window branch over w keys.
  (The per-token gate and separate kv projections are parameters: the 6 x parameters term counts them.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

# Dense tensor-core peaks (FLOP/s) from the vendors' data sheets, SXM parts.
_KNOWN_GPU_PEAKS = {
    ("H100", torch.bfloat16): 989e12, ("H100", torch.float16): 989e12, ("H100", torch.float32): 67e12,
    ("H200", torch.bfloat16): 989e12, ("H200", torch.float16): 989e12, ("H200", torch.float32): 67e12,
    ("A100", torch.bfloat16): 312e12, ("A100", torch.float16): 312e12, ("A100", torch.float32): 19.5e12,
}

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                        repeats: int = 5) -> float:
    """Best FLOP/s of ``repeats`` (n x n) @ (n x n) matmuls on ``device`` with the current thread count."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops(device: str, precision: str) -> float:
    dtype = PRECISION_DTYPES[precision]
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for (key, dt), peak in _KNOWN_GPU_PEAKS.items():
            if key in name and dt == dtype:
                return peak
        return measure_matmul_peak("cuda", dtype, n=8192)
    return measure_matmul_peak("cpu", torch.float32 if dtype == torch.float16 else dtype)


# ------------------------------------------------------------------------------------------ attention FLOPs


@dataclass(frozen=True)
class AttentionCost:
    """One attention layer's cost for one sequence: ``forward`` matmul FLOPs of the inner attention and
    ``excluded`` the prefixes of the backend's parameters that are not applied once per token (their cost is
    in ``forward``; the model leaves them out of its 6 x parameters term)."""

    forward: float
    excluded: tuple[str, ...] = ()


_ATTENTION_COSTS: dict[str, Callable] = {}


def register_attention_cost(kind: str):
    """Decorator: ``fn(spec, seq_len) -> AttentionCost`` is the FLOP count of attention backend ``kind``."""
    def wrap(fn):
        _ATTENTION_COSTS[kind] = fn
        return fn
    return wrap


def attention_cost(spec, seq_len: int) -> AttentionCost:
    """The cost of one layer with :class:`efftx.attention.base.AttentionSpec` ``spec`` over ``seq_len`` tokens."""
    from efftx import attention
    from efftx.errors import ConfigError

    if spec.kind not in _ATTENTION_COSTS:
        raise ConfigError(f"attention.kind={spec.kind!r} has no FLOP count for MFU; register one in efftx.flops "
                          f"(counted: {', '.join(sorted(_ATTENTION_COSTS))})")
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    options_class = attention.option_sections().get(spec.kind)
    if spec.options is None and options_class is not None:
        import dataclasses

        spec = dataclasses.replace(spec, options=options_class())
    return _ATTENTION_COSTS[spec.kind](spec, seq_len)


@register_attention_cost("full")
def _full(spec, t: int) -> AttentionCost:
    return AttentionCost(4.0 * t * t * spec.heads * spec.head_dim)


@register_attention_cost("local")
def _local(spec, t: int) -> AttentionCost:
    return AttentionCost(4.0 * t * min(spec.options.window_size, t) * spec.heads * spec.head_dim)


@register_attention_cost("performer")
def _performer(spec, t: int) -> AttentionCost:
    o = spec.options
    h, hkv, d, m = spec.heads, spec.kv_heads, spec.head_dim, o.nb_features
    features = 2 * h * d * m + 2 * hkv * d * m
    if not spec.causal:
        return AttentionCost(t * (features + 2 * hkv * m * d + 2 * h * m * d + 2 * h * m))
    c = min(o.chunk_size, t)
    states = 2 * hkv * m * (d + 1) + 2 * h * m * (d + 1)
    blocks = 2 * h * c * m + 2 * h * c * (d + 1)
    return AttentionCost(float(t * (features + states + blocks)))


@register_attention_cost("sinkhorn")
def _sinkhorn(spec, t: int) -> AttentionCost:
    o = spec.options
    h, d, n = spec.heads, spec.head_dim, o.bucket_size
    nl = min(o.n_local_attn_heads, h)
    hs = h - nl
    nb = math.ceil(t / n)
    if spec.causal:
        j = nb - 1  # candidate buckets: the complete past ones
        picked = o.topk if o.causal_mode == "topk" else 1
        local_keys = 2 * n
    else:
        j, picked, local_keys = nb, 1, 3 * n
    attend = 4 * t * hs * (n + picked * n) * d
    mix = 2 * 2 * hs * nb * picked * j * n * d  # keys and values of every query bucket's picks, slot by slot
    sort_net = hs * (2 * nb * d * d + 2 * nb * j * d)
    local = 4 * t * nl * local_keys * d
    return AttentionCost(float(attend + mix + sort_net + local), excluded=("sort_net",))


@register_attention_cost("nsa")
def _nsa(spec, t: int) -> AttentionCost:
    o = spec.options
    h, hkv, d = spec.heads, spec.kv_heads, spec.head_dim
    l, stride, sel = o.compress_block_size, o.stride, o.selection_block_size
    blocks = (t - l) // stride + 1 if t >= l else 0
    fan_in = l * d  # a block of l keys (values), flattened
    hidden = max(1, round(fan_in * o.compress_mlp_mult))
    # per kv head and block: the MLP's two layers, one linear map, or a softmax pooling (no matmul)
    per_block = {"mlp": 2 * (fan_in * hidden + hidden * d), "conv_linear": 2 * fan_in * d, "attention_pool": 0}
    per_block = per_block[o.compress]
    compress = 2 * hkv * blocks * per_block  # keys and values
    compressed = 4 * t * h * (blocks + o.compress_mem_kv) * d
    selected = 4 * t * h * min(o.num_selected_blocks + 1, math.ceil(t / sel)) * sel * d
    window = 4 * t * h * min(o.sliding_window_size, t) * d
    return AttentionCost(float(compress + compressed + selected + window),
                         excluded=("compress_k", "compress_v", "mem_k", "mem_v"))

"""Full softmax attention through torch SDPA: the reference every other backend is tested against."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from efftx.attention.base import AttentionBackend
from efftx.attention.cache import KVCache
from efftx.attention.registry import register
from efftx.kernels import decode_attention, decode_attention_cpu


def causal_offset_mask(t_q: int, t_k: int, device: torch.device) -> torch.Tensor:
    """(t_q, t_k) bool mask, True = may attend; query i sits at absolute position t_k - t_q + i."""
    q_pos = torch.arange(t_k - t_q, t_k, device=device)[:, None]
    k_pos = torch.arange(t_k, device=device)[None, :]
    return k_pos <= q_pos


def growing_mask_backends(device: torch.device):
    """Where SDPA runs with a mask whose key length grows from call to call (cached decode and verify steps of
    ragged rows: the mask is (B, 1, T, L), T <= SMALL_QUERY, L longer every step): on CUDA, SDPA's
    memory-efficient or math kernel, not cuDNN's. cuDNN attention builds an execution graph per shape, so a new
    key length every step would rebuild one every step (40-50 ms each, as others measured); on an H100 one cached
    step of `full` at context 8192 took 43 ms (bench/decode_cost.py), 16-32x the other backends' steps. This guard
    went in after that GPU was given back: whether cuDNN was the cause is still to be measured. A no-op elsewhere
    and while compiling (compiled decoding's caches have fixed shapes)."""
    if device.type != "cuda" or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


SMALL_QUERY = 16  # compiled cached passes of at most this many tokens per row (decode, verify) use matmuls


def few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention of a few queries per row over a cache, as two batched matmuls around a masked softmax:
    q (B, H, T, D), k/v (B, Hkv, L, D) (H a multiple of Hkv: query head h reads kv head h // (H / Hkv)), mask
    (B, 1, T, L) bool (True = may attend; every query sees at least its own key) -> (B, H, T, D).

    The same function as SDPA with that mask; full attention uses it for compiled decoding, where these ops fuse
    with their neighbours and the step gets cheaper than with SDPA's CPU flash kernel, which tiles each (row, head)
    pair's few queries as a full block (compiled spec_target_small steps, CPU time of 20 by torch's profiler: one
    token 10.8 -> 9.1 ms at batch 1, 39.5 -> 37.7 at batch 8; six tokens 22.4 -> 19.3 and 96.8 -> 91.6). Eager
    decoding keeps SDPA (there these ops were 0-3% slower). The query heads of a kv head are stacked as extra
    queries, so keys and values are read once per kv head."""
    b, h, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = h // hkv
    scores = torch.matmul(q.reshape(b, hkv, g * t, d), k.transpose(-1, -2)) * d ** -0.5  # (B, Hkv, G*T, L)
    scores = scores.view(b, hkv, g, t, length).masked_fill(~mask[:, :, None], float("-inf"))
    weights = scores.softmax(-1).view(b, hkv, g * t, length)
    return torch.matmul(weights, v).view(b, h, t, d)


@register("full")
class FullAttention(AttentionBackend):
    supports_ragged = True

    def attend_rotating(self, q, k, v, cache, rotary):
        """A cached pass of unrotated ``q`` / ``k`` with the rotation done inside the CPU decode attention kernel
        (one call instead of the rotary's table lookups and two rotations per layer); None where the kernel does
        not take it (then the caller rotates and calls :meth:`forward`)."""
        if cache is None or type(self) is not FullAttention or (self.training and self.spec.dropout):
            return None
        return decode_attention_cpu.attend(q, k, v, cache, self.spec.causal, rotary)

    def forward(self, q, k, v, *, cache: KVCache | None = None, x=None):
        # q: (B, T, H, D); k, v: (B, T, Hkv, D)
        t_q = q.shape[1]
        rows = None
        if cache is not None and not (self.training and self.spec.dropout):
            out = decode_attention_cpu.attend(q, k, v, cache, self.spec.causal)  # CPU float32, few tokens per row
            if out is None:
                out = decode_attention.attend(q, k, v, cache, self.spec.causal)  # GPU, few tokens per row
            if out is not None:
                return out
        if cache is not None and type(cache) is not KVCache and not (self.training and self.spec.dropout):
            # compiled decoding's cache (DeviceKV): the CPU's C++ kernel or the GPU's Triton kernel attends over
            # each row's own keys (not the whole capacity)
            out = decode_attention_cpu.attend_device(q, k, v, cache, self.spec.causal)
            if out is None:
                out = decode_attention.attend_device(q, k, v, cache, self.spec.causal)
            if out is not None:
                return out
        if cache is not None:
            k, v, rows = cache.append_rows(k, v, self.spec.causal)  # (B, L, Hkv, D), L = longest row so far
        t_k = k.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        dropout = self.spec.dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        if rows is not None:
            mask, is_causal = rows[:, None], False  # rows of different lengths: (B, 1, T, L)
        elif not self.spec.causal or t_q == 1:
            mask, is_causal = None, False  # one new token may see every cached one
        elif t_q == t_k:
            mask, is_causal = None, True
        else:
            mask, is_causal = causal_offset_mask(t_q, t_k, q.device), False
        if rows is not None and t_q <= SMALL_QUERY and dropout == 0.0 and torch.compiler.is_compiling():
            out = few_query_attention(q, k, v, mask)
        else:
            growing = rows is not None and t_q <= SMALL_QUERY  # a decode or verify step over ragged rows
            with growing_mask_backends(q.device) if growing else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                     is_causal=is_causal, enable_gqa=gqa)
        return out.transpose(1, 2)  # (B, T, H, D)

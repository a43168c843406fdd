"""Full attention's cached passes of a few tokens per row on a GPU: a Triton kernel over each row's own keys.

Compiled decoding (:mod:`efftx.generation.compiled`) and continuous batching's compiled slots keep keys and values in
fixed-capacity buffers (:class:`~efftx.generation.compiled.DeviceKV`: (B, capacity, Hkv, D), the row lengths a device
tensor) so that a step has static shapes and replays as a CUDA graph. Without this kernel such a step attends with
two matmuls over the whole capacity under a mask (:func:`~efftx.attention.full.few_query_attention`): a row of 40
tokens in a 4096-slot cache pays for 4096. Here each program reads only the keys its row may see, so a step costs
what its rows hold, yet the launch (grid, shapes) stays fixed and graph-capturable:

* **split-K ("flash decoding")**: the capacity is cut into ``splits`` equal ranges; program (row x kv head, split)
  runs an online softmax over the part of its range below the row's end (a range past it reads no key: it writes an
  empty partial result), and a second kernel merges the splits' partial maxima, sums and weighted values. ``splits`` is
  chosen from the grid and the device's multiprocessor count (:func:`choose_splits`), so a batch of one row still
  spreads its keys over the GPU; one split writes the output directly (no merge);
* the query heads of a kv head (GQA) and the pass's tokens are stacked as the rows of one tile, so each key is read
  once per kv head;
* visibility: query ``t`` of a row whose cache held ``L`` keys before the pass sees keys ``< L + t + 1`` (causal),
  or every key ``< L + T`` (not causal); the pass's own keys are written into the buffers before the kernel runs
  (:func:`attend_device`: an in-place ``index_put_`` at each row's positions), and the lengths are left to the caller
  (compiled decoding advances them once per pass, after every layer).

The kernel is the operator ``efftx::gpu_decode_attention`` (``torch.library.custom_op`` with a shape function), so
``torch.compile(fullgraph=True)`` traces it as one node and CUDA graphs capture its launches. The torch reference
(:func:`decode_attention_reference`) is the test oracle; tests/test_decode_attention.py holds the kernel to it over
many shapes (on a CPU through Triton's interpreter, ``TRITON_INTERPRET=1`` set before import, fp32 and fp16: the
interpreter's bf16 ``tl.dot`` is wrong; on a GPU, ``EFFTX_TRITON_GPU=1``, bf16 too) and compiles it for an sm_90
target without a GPU.

Eager passes over a :class:`~efftx.attention.cache.KVCache` (the host keeps the row lengths: decoding without
``compile``, continuous batching's eager slots) can take it too (:func:`attend`): the keys written at each row's
position, the lengths copied to the device, no (B, T, L) mask built. They do with ``EFFTX_GPU_ATTENTION=on`` (or
inside :func:`everywhere`) only: that path replaces SDPA for every GPU user who does not compile, and no GPU has
measured it yet.

Which passes take it (:func:`takes`): CUDA tensors of one floating dtype (fp16, bf16, fp32), at most
:data:`MAX_QUERIES` tokens per row, head dim at most :data:`MAX_HEAD_DIM`, tiles of at most :func:`tile_rows`
rows, no autograd graph. ``EFFTX_GPU_ATTENTION=off`` (or :func:`disabled`, for side-by-side benches) keeps every
pass on the matmul path. On a CPU the C++ kernel
(:mod:`efftx.kernels.decode_attention_cpu`) takes these passes; :func:`on_cpu` lets the interpreted Triton kernel
take CPU tensors (the tests run the model's compiled step through it that way).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from efftx.kernels.cpu_build import interpreted_on_cpu, switch, switched_off

try:  # Triton is an optional extra (`pip install efftx[triton]`); without it every pass takes the matmul path
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["decode_attention", "decode_attention_reference", "attend", "attend_device", "takes", "choose_splits",
           "disabled", "everywhere", "on_cpu", "MAX_QUERIES", "MAX_HEAD_DIM"]

MAX_QUERIES = 16  # tokens per row in one pass: decoding (1), speculative verify (gamma + 1), short prefills
MAX_HEAD_DIM = 128
# A program's tile stacks a pass's tokens x the query heads of one kv head. Its launch per dtype and head dim, checked
# with ptxas for sm_90 (tests/test_decode_attention.py): fp16/bf16 tiles of up to 64 rows on 4 warps, 64-key tiles
# (32 past head dim 64); float32 (its dot products in full precision: more registers) on 8 warps with 32-key tiles
# (16 past head dim 64), at most 32 rows past head dim 64. Larger passes take SDPA. (Before: 4 warps for every
# dtype spilled float32 tiles at every size; 128 float32 rows of head dim 128 needed 395 KB of shared memory.)
MAX_TILE_ROWS = 64
MAX_SPLITS = 64
ENV = "EFFTX_GPU_ATTENTION"
DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_state = switch(ENV)
# Eager passes over a KVCache take the kernel only with EFFTX_GPU_ATTENTION=on (or inside everywhere()) until a GPU
# has measured them against SDPA (bench/decode_attention.py, the GPU check's decodeattn section); compiled passes
# take it unless it is off.
_state["eager"] = os.environ.get(ENV, "auto").strip().lower() in ("on", "1", "true", "yes")
_cpu = {"on": False}  # on_cpu(): the interpreted kernel takes CPU tensors too (tests)


def disabled():
    """Inside, no pass takes the kernel (benches time it side by side with the matmul path)."""
    return switched_off(_state)


@contextlib.contextmanager
def everywhere():
    """Inside, eager passes over a KVCache take the kernel too (as with ``EFFTX_GPU_ATTENTION=on``)."""
    before = _state["eager"]
    _state["eager"] = True
    try:
        yield
    finally:
        _state["eager"] = before


def on_cpu():
    """Inside, CPU tensors take the kernel too, through Triton's interpreter (``TRITON_INTERPRET=1`` before import;
    raises otherwise): the tests run model passes through it on a machine without a GPU."""
    return interpreted_on_cpu(_cpu, INTERPRETED, __name__)


# ------------------------------------------------------------------------------------------------ reference


def visible_end(lengths: torch.Tensor, t: int, causal: bool) -> torch.Tensor:
    """(B, T): query ``i`` of row ``b`` sees the keys at positions below ``end[b, i]``."""
    steps = torch.arange(t, device=lengths.device)
    return lengths[:, None] + (steps + 1 if causal else torch.full_like(steps, t))


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                               causal: bool, scale: float | None = None) -> torch.Tensor:
    """Softmax attention in float32 (float64 for float64 inputs) of ``q`` (B, T, H, D) over ``k_cache`` / ``v_cache`` (B, C, Hkv, D), which
    already hold the pass's keys at positions ``lengths[b] .. lengths[b] + T - 1``; query head ``h`` reads kv head
    ``h // (H / Hkv)``; visibility as :func:`visible_end`. -> (B, T, H, D) in ``q``'s dtype. Keys at and past a
    row's end may hold anything (they are masked out before the softmax)."""
    b, t, h, d = q.shape
    c, hkv = k_cache.shape[1], k_cache.shape[2]
    scale = d ** -0.5 if scale is None else scale
    g = h // hkv
    work = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for a float64 oracle
    scores = torch.einsum("btkgd,bckd->bkgtc", q.to(work).view(b, t, hkv, g, d), k_cache.to(work)) * scale
    end = visible_end(lengths, t, causal)
    seen = torch.arange(c, device=q.device)[None, None, :] < end[:, :, None]  # (B, T, C)
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    v = torch.where(seen.any(1)[:, :, None, None], v_cache.to(work), 0.0)  # masked keys' values may be NaN
    out = torch.einsum("bkgtc,bckd->btkgd", scores.softmax(-1), v)
    return out.reshape(b, t, h, d).to(q.dtype)


# ------------------------------------------------------------------------------------------------ kernels

if triton is not None:

    @triton.jit
    def _partial_kernel(Q, K, V, LEN, O, M_OUT, L_OUT, ACC_OUT,
                        sqb, sqt, sqh, sqd, skb, skc, skh, skd, svb, svc, svh, svd, sob, sot, soh, sod, sl,
                        T, C, scale, SPLIT, SPLITS,
                        HKV: tl.constexpr, G: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
                        D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr,
                        PRECISION: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)  # row x kv head (64-bit offsets: caches past 2**31 elements)
        s = tl.program_id(1)  # split of the capacity
        b = pid // HKV
        kvh = pid % HKV
        r = tl.arange(0, M_PAD)  # tile rows: token t, query head kvh * G + g
        t = r // G
        head = kvh * G + r % G
        row_ok = r < T * G
        d = tl.arange(0, D_PAD)
        d_ok = d < D
        length = tl.load(LEN + b * sl).to(tl.int32)
        if CAUSAL:
            q_end = length + t + 1
        else:
            q_end = length + T + t * 0
        end = tl.minimum(length + T, C)
        start = s * SPLIT
        stop = tl.minimum(start + SPLIT, end)
        qd = row_ok[:, None] & d_ok[None, :]
        q = tl.load(Q + b * sqb + t[:, None] * sqt + head[:, None] * sqh + d[None, :] * sqd, mask=qd, other=0.0)
        m = tl.full([M_PAD], float("-inf"), tl.float32)
        l = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, D_PAD], tl.float32)
        for n0 in range(start, stop, BLOCK_N):  # nothing past the row's end is read
            n = n0 + tl.arange(0, BLOCK_N)
            n_ok = n < stop
            kd = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + b * skb + n[:, None] * skc + kvh * skh + d[None, :] * skd, mask=kd, other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M_PAD, BLOCK_N] fp32
            seen = n_ok[None, :] & (n[None, :] < q_end[:, None])
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing here yet
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(V + b * svb + n[:, None] * svc + kvh * svh + d[None, :] * svd, mask=kd, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        if DIRECT:
            out = acc / tl.where(l > 0, l, 1.0)[:, None]
            tl.store(O + b * sob + t[:, None] * sot + head[:, None] * soh + d[None, :] * sod,
                     out.to(O.dtype.element_ty), mask=qd)
        else:
            part = pid * SPLITS + s
            tl.store(M_OUT + part * M_PAD + r, m)
            tl.store(L_OUT + part * M_PAD + r, l)
            tl.store(ACC_OUT + (part * M_PAD + r[:, None]) * D_PAD + d[None, :], acc)

    @triton.jit
    def _merge_kernel(M_IN, L_IN, ACC_IN, O, sob, sot, soh, sod, T, SPLITS,
                      HKV: tl.constexpr, G: tl.constexpr, M_PAD: tl.constexpr, D: tl.constexpr,
                      D_PAD: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        b = pid // HKV
        kvh = pid % HKV
        r = tl.arange(0, M_PAD)
        t = r // G
        head = kvh * G + r % G
        d = tl.arange(0, D_PAD)
        m = tl.full([M_PAD], float("-inf"), tl.float32)
        l = tl.zeros([M_PAD], tl.float32)
        acc = tl.zeros([M_PAD, D_PAD], tl.float32)
        for s in range(SPLITS):
            part = pid * SPLITS + s
            m_s = tl.load(M_IN + part * M_PAD + r)
            l_s = tl.load(L_IN + part * M_PAD + r)
            acc_s = tl.load(ACC_IN + (part * M_PAD + r[:, None]) * D_PAD + d[None, :])
            m_new = tl.maximum(m, m_s)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            w = tl.exp(m_s - m_safe)
            l = l * alpha + l_s * w
            acc = acc * alpha[:, None] + acc_s * w[:, None]
            m = m_new
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(O + b * sob + t[:, None] * sot + head[:, None] * soh + d[None, :] * sod,
                 out.to(O.dtype.element_ty), mask=(r < T * G)[:, None] & (d < D)[None, :])

    #: True when the kernels were built by Triton's CPU interpreter (TRITON_INTERPRET=1 before this import).
    INTERPRETED = not isinstance(_partial_kernel, triton.JITFunction)
else:  # pragma: no cover
    INTERPRETED = False


def _pow2(n: int, floor: int) -> int:
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


def tile_rows(dtype: torch.dtype, d: int) -> int:
    """The most tile rows (tokens x query heads of a kv head) the kernel takes for ``dtype`` and head dim ``d``."""
    return MAX_TILE_ROWS // 2 if dtype == torch.float32 and _pow2(d, 16) > 64 else MAX_TILE_ROWS


def launch_shape(t: int, h: int, hkv: int, d: int, dtype: torch.dtype) -> dict:
    """The kernels' compile-time shape and warps: tile rows (tokens x query heads of a kv head), padded head dim,
    key tile (see :data:`MAX_TILE_ROWS`)."""
    d_pad = _pow2(d, 16)
    wide = dtype == torch.float32
    block_n = (32 if wide else 64) if d_pad <= 64 else (16 if wide else 32)
    return {"G": h // hkv, "M_PAD": _pow2(t * (h // hkv), 16), "D": d, "D_PAD": d_pad, "BLOCK_N": block_n,
            "num_warps": 8 if wide else 4}


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter (tests): one range per row where the grid has two programs or more (the kernel
    # tests pass their split counts explicitly)


def choose_splits(programs: int, capacity: int, block_n: int, device: torch.device) -> int:
    """How many key ranges the capacity is cut into: enough programs for about two per multiprocessor, at least one
    key tile per range, at most :data:`MAX_SPLITS`."""
    tiles = math.ceil(capacity / block_n)
    want = math.ceil(2 * _multiprocessors(device) / max(programs, 1))
    return max(1, min(want, tiles, MAX_SPLITS))


def check_args(q, k_cache, v_cache, lengths) -> None:
    """ValueError naming the argument the kernel cannot take (shapes, dtypes, devices); nothing syncs."""
    for name, x, dims in (("q", q, 4), ("k_cache", k_cache, 4), ("v_cache", v_cache, 4), ("lengths", lengths, 1)):
        if not isinstance(x, torch.Tensor) or x.dim() != dims:
            raise ValueError(f"{name} must be a {dims}-D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    b, t, h, d = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if k_cache.shape[0] != b or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not match q {tuple(q.shape)} (batch, head dim)")
    if k_cache.shape[2] == 0 or h % k_cache.shape[2]:
        raise ValueError(f"q's {h} heads are not a multiple of the cache's {k_cache.shape[2]} kv heads")
    if lengths.shape[0] != b or lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"lengths must be ({b},) int32 or int64, got {tuple(lengths.shape)} {lengths.dtype}")
    if not 1 <= t <= MAX_QUERIES:
        raise ValueError(f"q holds {t} tokens per row; the kernel takes 1 to {MAX_QUERIES}")
    if k_cache.shape[1] < t:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} holds fewer positions than the pass's {t} tokens")
    if t * (h // k_cache.shape[2]) > tile_rows(q.dtype, d):
        raise ValueError(f"{t} tokens x {h // k_cache.shape[2]} query heads per kv head = "
                         f"{t * (h // k_cache.shape[2])} tile rows exceed the kernel's {tile_rows(q.dtype, d)} "
                         f"for {str(q.dtype)[6:]} at head dim {d}")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim {d} exceeds the kernel's {MAX_HEAD_DIM}")
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, k_cache and v_cache must share one of float16, bfloat16, float32; got {q.dtype}, "
                         f"{k_cache.dtype}, {v_cache.dtype}")
    devices = {x.device for x in (q, k_cache, v_cache, lengths)}
    if len(devices) != 1:
        raise ValueError(f"q, k_cache, v_cache and lengths must be on one device, got {sorted(map(str, devices))}")


def _launch(q, k_cache, v_cache, lengths, causal: bool, scale: float, splits: int) -> torch.Tensor:
    b, t, h, d = q.shape
    c, hkv = k_cache.shape[1], k_cache.shape[2]
    meta = launch_shape(t, h, hkv, d, q.dtype)
    warps = meta.pop("num_warps")
    splits = max(1, min(splits, math.ceil(c / meta["BLOCK_N"])))
    split = math.ceil(math.ceil(c / splits) / meta["BLOCK_N"]) * meta["BLOCK_N"]  # keys per range, whole tiles
    splits = math.ceil(c / split)
    out = torch.empty_like(q)
    direct = splits == 1
    parts = b * hkv * splits
    m_pad, d_pad = meta["M_PAD"], meta["D_PAD"]
    m_part = torch.empty(0 if direct else parts * m_pad, device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(0 if direct else parts * m_pad * d_pad, device=q.device, dtype=torch.float32)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # Triton launches on the current device: the tensors' (a model on cuda:N; the interpreter's on a CPU)
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _partial_kernel[(b * hkv, splits)](
            q, k_cache, v_cache, lengths, out, m_part, l_part, acc_part, *q.stride(), *k_cache.stride(),
            *v_cache.stride(), *out.stride(), lengths.stride(0), t, c, scale, split, splits, HKV=hkv, CAUSAL=causal,
            DIRECT=direct, PRECISION=precision, num_warps=warps, **meta)
        if not direct:
            _merge_kernel[(b * hkv,)](m_part, l_part, acc_part, out, *out.stride(), t, splits, HKV=hkv, G=meta["G"],
                                      M_PAD=m_pad, D=d, D_PAD=d_pad, num_warps=warps)
    return out


@torch.library.custom_op("efftx::gpu_decode_attention", mutates_args=())
def _op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, causal: bool,
        scale: float, splits: int) -> torch.Tensor:
    return _launch(q, k_cache, v_cache, lengths, causal, scale, splits)


@_op.register_fake
def _(q, k_cache, v_cache, lengths, causal, scale, splits):
    return torch.empty_like(q)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                     causal: bool = True, scale: float | None = None, splits: int | None = None) -> torch.Tensor:
    """:func:`decode_attention_reference`'s result from the Triton kernels (the operator
    ``efftx::gpu_decode_attention``): ``q`` (B, T, H, D), caches (B, C, Hkv, D) holding the pass's keys, ``lengths``
    (B,) the rows' lengths before the pass. ``splits``: key ranges (default :func:`choose_splits`). Raises
    ValueError naming a bad argument, or where the kernel cannot run (no triton; CPU tensors without the
    interpreter)."""
    check_args(q, k_cache, v_cache, lengths)
    if triton is None:
        raise ValueError("the decode attention kernel needs the triton package (pip install 'efftx[triton]')")
    if not (q.is_cuda or INTERPRETED):
        raise ValueError(f"the decode attention kernel needs CUDA tensors (q is on {q.device}) or TRITON_INTERPRET=1 "
                         "set before efftx is imported; decode_attention_reference runs anywhere")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    b, t, h, d = q.shape
    if splits is None:
        block_n = launch_shape(t, h, k_cache.shape[2], d, q.dtype)["BLOCK_N"]
        splits = choose_splits(b * k_cache.shape[2], k_cache.shape[1], block_n, q.device)
    return _op(q, k_cache, v_cache, lengths, bool(causal), float(d ** -0.5 if scale is None else scale), int(splits))


# ------------------------------------------------------------------------------------------------ model passes


def takes(q: torch.Tensor, cache, k_new: torch.Tensor | None = None) -> bool:
    """Whether this pass (``q`` (B, T, H, D); ``k_new`` its new keys) over ``cache`` goes to the kernel:
    :func:`attend_device` (a DeviceKV: lengths a device tensor) or :func:`attend` (a KVCache: lengths on the host)."""
    k = getattr(cache, "k", None)
    lengths = getattr(cache, "lengths", None)
    device_lengths = isinstance(lengths, torch.Tensor)
    return (_state["enabled"] and triton is not None and (device_lengths or isinstance(lengths, list))
            and isinstance(k, torch.Tensor) and (q.is_cuda or (_cpu["on"] and INTERPRETED))
            and q.device == k.device and (not device_lengths or lengths.device == q.device)
            and q.dtype in DTYPES and k.dtype == q.dtype
            and not (k_new is not None and torch.is_grad_enabled() and k_new.requires_grad)
            and 1 <= q.shape[1] <= MAX_QUERIES and q.shape[-1] <= MAX_HEAD_DIM and k.shape[2] > 0
            and q.shape[2] % k.shape[2] == 0
            and q.shape[1] * (q.shape[2] // k.shape[2]) <= tile_rows(q.dtype, q.shape[-1])
            and not (torch.is_grad_enabled() and q.requires_grad))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, causal: bool) -> torch.Tensor | None:
    """An eager cached pass over a :class:`~efftx.attention.cache.KVCache` (rows of any lengths, kept on the host:
    decoding steps, speculative verify passes, short prefills, continuous batching's slots) on the GPU: writes
    ``k`` / ``v`` (B, T, Hkv, D) at each row's position, advances the rows' lengths and attends with the kernel over
    each row's own keys (no (B, T, L) mask built, no key past a row's end read). None where the kernel does not
    take the pass (:func:`takes`; outside ``torch.compile``): the caller then runs the SDPA path, the cache
    untouched. Rows that do not fit raise, nothing written."""
    from efftx.attention.cache import KVCache

    if not _state["eager"] or type(cache) is not KVCache or torch.compiler.is_compiling() or not takes(q, cache, k):
        return None
    before = list(cache.lengths)
    lengths = cache.write_rows(k, v)  # raises (nothing written) when the rows do not fit
    try:
        end = cache.end  # the host knows where the longest row ends: no range past it is launched
        return decode_attention(q, cache.k[:, :end], cache.v[:, :end], lengths, causal)
    except Exception:
        cache.lengths = before
        raise


def attend_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache, causal: bool) -> torch.Tensor | None:
    """A cached pass over compiled decoding's cache (a :class:`~efftx.generation.compiled.DeviceKV`) on the GPU:
    writes ``k`` / ``v`` (B, T, Hkv, D) at each row's positions, then attends with the kernel over each row's own
    keys; the lengths are left to the caller. None where the kernel does not take the pass (:func:`takes`): the
    caller then writes the keys and attends itself."""
    if not takes(q, cache):
        return None
    cache.write(k, v)
    return decode_attention(q, cache.k, cache.v, cache.lengths, causal)

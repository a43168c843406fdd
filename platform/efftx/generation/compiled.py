"""Compiled one-token decoding (gpt-fast's ``decode_one_token``) for LMs whose every layer is dense attention.

The eager path (:mod:`efftx.generation.decode`) keeps each row's length as a host-side list, so every step
builds position tensors on the host and attends over a key range whose size grows by one per step. Here:

* the cache has a fixed capacity (:class:`DeviceCache`): per layer one (B, capacity, Hkv, D) key and value
  buffer, and one (B,) long tensor of row lengths on the device, shared by every layer;
* a step writes each row's new key/value at its own device position, attends over the whole capacity with a
  mask built from the device lengths (on a CPU in float32: the C++ decode attention kernel as an operator, over
  each row's own keys, :func:`~efftx.kernels.decode_attention_cpu.attend_device`), and adds 1 to the lengths in
  place: static shapes, and no value read back to the host (capacity is checked on the host from the step count,
  which the host knows anyway);
* the step runs the model's own modules (``LM.logits``: embedding, blocks, rotary, norms, head); only the
  layer cache type differs, through the ``append_rows`` / ``offset`` contract that dense attention already
  uses for ragged caches;
* it is compiled with ``torch.compile(fullgraph=True, dynamic=False)`` (a graph break is an error, not a silent
  slowdown): on CUDA with ``mode="reduce-overhead"`` (CUDA graphs; the buffers are marked static addresses and
  kept per model, batch and capacity so one graph serves every call), on CPU with inductor's C++ wrapper
  (:func:`compile_settings`); a decoder checks every guard on its first call of a function with arguments of
  given shapes and values only, then runs just the guards that tell dynamo's cached graphs apart (its model and
  cache do not change; tensor arguments are given row-major strides so that one graph serves every call).

Prefill stays eager (one pass, any prompt lengths: ragged prompts are supported), then its keys and values
are copied into the fixed buffers. Sampling stays outside the compiled step, through the same functions as the
eager path, so greedy and seeded-sampled tokens match it (exactly on CPU fp32 in the tests).

Speculative decoding (:mod:`efftx.generation.speculative`) runs its draft's one-token steps and its target's
(gamma + 1)-token verify passes through the same cache and machinery (:func:`forward_step`,
:meth:`StaticDecoder.forward`, :meth:`StaticDecoder.rewind`: a rewind subtracts each row's count from the device
lengths, one tensor op; the slots past a row's length are masked, then overwritten).

``compile``: ``"off"`` (the default of :func:`~efftx.generation.decode.generate`: today's eager path),
``"on"`` (compiled, or an error naming why it cannot be), ``"auto"`` (compiled where the model supports it and
compilation works, else eager with the reason logged).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Callable

import torch

from efftx.errors import ConfigError, EfftxError
from efftx.generation.faults import device_error
from efftx.host import host_values
from efftx.kernels import decode_attention_cpu, linear_cpu, rms_norm_cpu, sampling_cpu

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", "on", "off")
MIN_CAPACITY = 64  # capacities are powers of two from here (capped at max_seq_len): few shapes, few compilations


class CompileUnavailable(EfftxError, RuntimeError):
    """``compile="on"`` for a model or machine where compiled decoding cannot run."""


@dataclasses.dataclass(frozen=True)
class CompileOptions:
    """How decoding runs: ``compile`` is one of :data:`COMPILE_CHOICES` (see the module docstring)."""

    compile: str = "off"

    def __post_init__(self) -> None:
        if not isinstance(self.compile, str) or self.compile not in COMPILE_CHOICES:
            raise ConfigError(f"compile={self.compile!r} is not one of {', '.join(map(repr, COMPILE_CHOICES))}")


def unsupported_reason(model) -> str | None:
    """Why compiled decoding cannot run ``model`` (None when it can)."""
    from efftx.attention.full import FullAttention
    from efftx.models.layers import Attention
    from efftx.models.lm import LM

    if not isinstance(model, LM):
        return f"compiled decoding runs efftx LM models, not {type(model).__name__}"
    for i, blk in enumerate(model.blocks):
        attn = blk.attention
        if not isinstance(attn, Attention):
            return f"layer {i}'s attention is a {type(attn).__name__}, not the LM's Attention module"
        if type(attn.inner) is not FullAttention:
            return (f"layer {i} uses attention.kind={attn.inner.name!r}; compiled decoding needs dense 'full' "
                    "attention in every layer")
    if model.reversible is not None:
        return "model.reversible=true: compiled decoding runs plain (non-reversible) blocks"
    if model.training:
        return "the model is in training mode (dropout): call model.eval() first"
    return None


def capacity_for(model, needed: int) -> int:
    """The buffer capacity for ``needed`` positions: a power of two >= MIN_CAPACITY, capped at max_seq_len."""
    if needed > model.max_seq_len:
        raise ValueError(f"{needed} positions exceed the model's max_seq_len={model.max_seq_len}")
    cap = MIN_CAPACITY
    while cap < needed:
        cap *= 2
    return min(cap, model.max_seq_len)


class DeviceKV:
    """One layer's keys/values (B, capacity, Hkv, D) with the model's shared (B,) device lengths.

    ``append_rows`` writes new tokens at each row's own position and returns the whole buffers with a
    (B, T, capacity) mask; it does not advance the lengths (:meth:`DeviceCache.advance` does, once per pass,
    after every layer has read them).
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor):
        self.k, self.v, self.lengths = k, v, lengths
        # no pass reaches past the capacity: its runner checks that on the host first (CompiledRunner), so the
        # rotary's position check reads this, not the device lengths (an eager pass after a compile failure)
        self.bound = int(k.shape[1])

    def offset(self) -> torch.Tensor:
        return self.lengths[:, None]  # (B, 1)

    def write(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write new keys/values (B, T, Hkv, D) at each row's own positions; -> those positions (B, T)."""
        b, t = k.shape[:2]
        device = self.k.device
        slots = self.lengths[:, None] + torch.arange(t, device=device)  # (B, T)
        rows = torch.arange(b, device=device)[:, None]
        self.k.index_put_((rows, slots), k.to(self.k.dtype))
        self.v.index_put_((rows, slots), v.to(self.v.dtype))
        return slots

    def append_rows(self, k: torch.Tensor, v: torch.Tensor, causal: bool = True):
        t = k.shape[1]
        slots = self.write(k, v)
        j = torch.arange(self.k.shape[1], device=self.k.device)[None, None, :]  # (1, 1, C)
        mask = j <= slots[:, :, None] if causal else j < (self.lengths + t)[:, None, None]
        return self.k, self.v, mask


class DeviceCache:
    """The model-level cache of compiled decoding: one :class:`DeviceKV` per layer, lengths on the device."""

    def __init__(self, batch: int, capacity: int, shapes: list[tuple[int, int]], device, dtype):
        self.capacity = capacity
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.layers = [DeviceKV(torch.zeros(batch, capacity, hkv, d, device=device, dtype=dtype),
                                torch.zeros(batch, capacity, hkv, d, device=device, dtype=dtype), self.lengths)
                       for hkv, d in shapes]

    @classmethod
    def over(cls, buffers: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor) -> "DeviceCache":
        """A cache over given per-layer (keys, values) buffers (B, capacity, Hkv, D) and (B,) device lengths (views
        of continuous batching's slots, :mod:`efftx.generation.device_slots`): passes write them in place."""
        out = cls.__new__(cls)
        out.capacity, out.lengths = int(buffers[0][0].shape[1]), lengths
        out.layers = [DeviceKV(k, v, lengths) for k, v in buffers]
        return out

    def tensors(self) -> list[torch.Tensor]:
        return [self.lengths] + [t for layer in self.layers for t in (layer.k, layer.v)]

    def offset(self) -> torch.Tensor:
        return self.lengths[:, None]

    def advance(self, t: int) -> None:
        self.lengths.add_(t)

    def load(self, cache, lengths: list[int]) -> None:
        """Copy a prefilled eager cache (``ModelCache`` of ``KVCache`` layers) in; ``lengths`` its rows' lengths."""
        for mine, theirs in zip(self.layers, cache.layers):
            n = min(theirs.k.shape[1], self.capacity)
            mine.k[:, :n].copy_(theirs.k[:, :n])
            mine.v[:, :n].copy_(theirs.v[:, :n])
        self.lengths.copy_(host_values(lengths, torch.long, self.lengths.device))


def new_cache(model, batch: int, capacity: int) -> DeviceCache:
    """A zeroed :class:`DeviceCache` of ``batch`` rows for ``model`` (its parameters' device and dtype)."""
    p = next(model.parameters())
    shapes = [(blk.attention.spec.kv_heads, blk.attention.spec.head_dim) for blk in model.blocks]
    return DeviceCache(batch, capacity, shapes, p.device, p.dtype)


def decode_step(model, token: torch.Tensor, cache: DeviceCache) -> torch.Tensor:
    """One token per row (B,) through ``model`` over ``cache``; returns next-token logits (B, V).
    Everything here stays on the device: this is the function that gets compiled."""
    logits = model.logits(token[:, None], cache)[:, -1]
    cache.advance(1)
    return logits


def forward_step(model, tokens: torch.Tensor, cache: DeviceCache) -> torch.Tensor:
    """(B, T) tokens per row (each row's at its own device position) -> (B, T, V) logits; the lengths advance by
    T. Speculative decoding's draft step (T = 1) and verify pass (T = gamma + 1): compiled once per shape."""
    logits = model.logits(tokens, cache)
    cache.advance(tokens.shape[1])
    return logits


# dynamo keeps its graphs per code object, up to a limit (8 by default): speculative decoding uses one graph per
# model, batch size and token count (draft and target, batches 1/4/8, ...), more than that in one process
RECOMPILE_LIMIT = 64
_COMPILED: dict[tuple[Callable, str], Callable] = {}  # (function, device type) -> compiled (graphs cached per shape)
_THREAD = threading.local()  # .limits: this thread raised dynamo's recompile limit
_BROKEN: dict[str, str] = {}  # device type -> why compiling failed there ("auto" does not retry)
# model -> {(batch, capacity, dtype, device): [free DeviceCaches]}: CUDA graphs replay on the same buffers
_POOLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
        if hasattr(cfg, name) and getattr(cfg, name) < RECOMPILE_LIMIT:
            setattr(cfg, name, RECOMPILE_LIMIT)
    if getattr(cfg, "accumulated_recompile_limit", RECOMPILE_LIMIT) < 4 * RECOMPILE_LIMIT:
        cfg.accumulated_recompile_limit = 4 * RECOMPILE_LIMIT


def compile_settings(device_type: str) -> dict:
    """torch.compile's arguments per device: on CUDA ``mode="reduce-overhead"`` (CUDA graphs); on CPU inductor's
    C++ wrapper (``cpp_wrapper``): the generated code calls its kernels from C++, not Python. A one-token step of
    a small model is hundreds of tiny kernels, so the Python wrapper's per-kernel bookkeeping is a large share of
    it (the spec_target_small verify pass: 1.88 -> 1.60 ms in the decoding loop, measured; compiling takes longer
    once, and inductor caches it on disk)."""
    if device_type == "cuda":
        return {"mode": "reduce-overhead"}
    if device_type == "cpu":
        return {"options": {"cpp_wrapper": True}}
    return {}


def _signature(fn: Callable, tokens: torch.Tensor, args: tuple) -> tuple:
    """What selects a compiled graph of ``fn`` besides the model and cache: every argument's shape, dtype and device
    (tensors, with row-major strides) or value (anything else)."""
    return (fn,) + tuple((a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
                         for a in (tokens, *args))


def _default_stance() -> bool:
    """Whether torch.compile runs in its default stance (a caller may have set another, e.g. "force_eager")."""
    stance = getattr(torch._dynamo.eval_frame, "_stance", None)
    return stance is not None and stance.stance == "default" and stance.backend is None


def _standard(x):
    """``x`` with the row-major strides of its shape (a copy only when they differ): compiled graphs are kept per
    stride, and a slice such as a column of a (B, K) tensor has stride K even where B is 1."""
    if not isinstance(x, torch.Tensor):
        return x
    expected, step = [], 1
    for size in reversed(x.shape):
        expected.append(step)
        step *= size
    if tuple(reversed(expected)) == x.stride():
        return x
    return x.clone(memory_format=torch.contiguous_format)


def compiled_function(fn: Callable, device_type: str) -> Callable:
    """``fn(model, tokens, cache, *args)`` compiled for ``device_type`` (fullgraph, static shapes; one compiled
    function per ``fn``, whose graphs dynamo caches per model, shape and constant argument)."""
    if not getattr(_THREAD, "limits", False):
        # dynamo's settings are per thread (one set in a replica's main thread, e.g. while it warms up, is not seen
        # by its decoding thread): every thread that compiles raises the limit for itself
        _raise_recompile_limit()
        _THREAD.limits = True
    key = (fn, device_type)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, fullgraph=True, dynamic=False, **compile_settings(device_type))
    return _COMPILED[key]


def mark_static(cache: DeviceCache) -> None:
    """CUDA graphs read and write ``cache``'s tensors in place: their addresses are part of the graph."""
    for t in cache.tensors():
        torch._dynamo.mark_static_address(t, guard=False)


class CompiledRunner:
    """Calls ``fn(model, tokens, cache, *args)`` over one :class:`DeviceCache`: compiled (:func:`compiled_function`)
    when ``compiled``, else eagerly (same math). Under ``mode="auto"`` a compile failure switches the runner to eager
    for good (and logs why); under ``"on"`` it raises :class:`CompileUnavailable`."""

    def __init__(self, model, cache: DeviceCache, compiled: bool, mode: str):
        if cache.capacity > model.max_seq_len:  # its layers' bound (DeviceKV.bound) holds for the model's positions
            raise ValueError(f"a decoding cache of {cache.capacity} positions exceeds the model's "
                             f"max_seq_len={model.max_seq_len}")
        self.model, self.cache, self.mode = model, cache, mode
        self.device_type = next(model.parameters()).device.type
        self.compiled = compiled
        if compiled and self.device_type == "cpu":  # its graphs call the few-row linear kernel, the RMSNorm kernel,
            linear_cpu.kernel()  # the decode attention kernel and the sampling kernel where they build (loaded
            rms_norm_cpu.kernel()  # before tracing: their operators exist, and graphs compute what eager calls do)
            decode_attention_cpu.kernel()
            sampling_cpu.kernel()
        self._guarded: set[tuple] = set()  # calls (:func:`_signature`) this runner has run with every guard checked

    def _run(self, fn: Callable, tokens: torch.Tensor, *args):
        """``compiled_function(fn, device_type)(model, tokens, cache, *args)``, or ``fn`` itself when not compiled;
        a compile failure under ``auto`` switches this runner to eager for good (and says why)."""
        if not self.compiled:
            return fn(self.model, tokens, self.cache, *args)
        tokens, args = _standard(tokens), tuple(_standard(a) for a in args)
        if self.device_type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs may be overwritten now
        try:
            step = compiled_function(fn, self.device_type)
            key = _signature(fn, tokens, args)
            if key in self._guarded and _default_stance():
                # this runner ran ``fn`` on arguments of these shapes, dtypes and values once with every guard
                # checked, over the same model and cache: only the guards telling dynamo's cached graphs apart are
                # run (the full check costs ~85 us a call on CPU, measured: a sixth of a speculative step of the
                # small pair). Should dynamo still want to compile, it refuses before running anything: retry guarded.
                try:
                    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                        return step(self.model, tokens, self.cache, *args)
                except RuntimeError as e:
                    if "skip_guard_eval_unsafe" not in str(e):
                        raise
            out = step(self.model, tokens, self.cache, *args)
            self._guarded.add(key)
            return out
        except Exception as e:
            # the device's errors, not the compiler's (out of memory: a CUDA graph's recording or inductor's buffers
            # may run out where the eager pass would too; a device fault): they propagate as they are, and the
            # caller contains them (a smaller pass, ...)
            if device_error(e):
                raise
            # else compilation failed before the graph ran: nothing was written yet
            if self.mode != "auto":
                raise CompileUnavailable(f"compile='on': torch.compile of the decode step failed: "
                                         f"{type(e).__name__}: {e}") from e
            _BROKEN[self.device_type] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("compiled decoding unavailable, decoding eagerly: torch.compile failed (%s)",
                        _BROKEN[self.device_type])
            self.compiled = False
            return fn(self.model, tokens, self.cache, *args)


def owned(out):
    """A compiled call's outputs as tensors of their own (a CUDA graph's next replay overwrites its output buffers):
    a tensor, or a tuple of tensors and Nones (greedy draft steps return no distributions), each tensor cloned."""
    if isinstance(out, tuple):
        return tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
    return out.clone()


class StaticDecoder(CompiledRunner):
    """Decode steps over a :class:`DeviceCache`, compiled or eager (same math). Use through :func:`plan`."""

    def __init__(self, model, batch: int, capacity: int, compiled: bool, mode: str):
        self.batch, self.capacity = batch, capacity
        p = model.embed.weight
        pool = _POOLS.setdefault(model, {}).setdefault((batch, capacity, p.dtype, p.device), [])
        if pool:
            cache = pool.pop()
        else:
            cache = new_cache(model, batch, capacity)
            if compiled and p.device.type == "cuda":
                mark_static(cache)
        super().__init__(model, cache, compiled, mode)
        self._pool = pool
        self.used = 0  # the longest row, counted on the host
        self.row_lengths = [0] * batch

    def load(self, cache, lengths: list[int]) -> None:
        self.cache.load(cache, lengths)
        self.used = max(lengths)
        self.row_lengths = list(lengths)  # host copy, kept by forward/rewind (speculative decoding)

    def release(self) -> None:
        """Give the buffers back for the next call (same model, batch and capacity)."""
        if self._pool is not None:
            self._pool.append(self.cache)
            self._pool = None

    @property
    def lengths(self) -> list[int]:
        """Each row's length as the host counts it (after :meth:`load`, :meth:`forward` and :meth:`rewind`)."""
        return list(self.row_lengths)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) tokens -> (B, T, V) logits, every row at its own device position (:func:`forward_step`)."""
        return self.run(forward_step, tokens)

    def run(self, fn: Callable, tokens: torch.Tensor, *args, positions: int | None = None):
        """``fn(model, tokens, cache, *args)`` over this decoder's cache, compiled as :meth:`forward` is: ``fn``
        advances every row by ``positions`` (default ``tokens.shape[1]``; through :func:`forward_step`) and returns
        tensors computed on the device (speculative decoding's draft steps with their sampling, its verify pass
        with acceptance)."""
        t = tokens.shape[1] if positions is None else positions
        longest = max(self.row_lengths) + t
        if longest > self.capacity:
            raise ValueError(f"compiled decoding cache overflow: {longest} positions > capacity {self.capacity}")
        self.row_lengths = [n + t for n in self.row_lengths]
        self.used = max(self.used, longest)
        out = self._run(fn, tokens, *args)
        if self.compiled and self.device_type == "cuda":  # a CUDA graph's next replay overwrites its outputs
            out = owned(out)
        return out

    def rewind(self, counts) -> None:
        """Forget the last ``counts[b]`` tokens of row b: one subtraction on the device lengths."""
        counts = [int(c) for c in counts]
        if len(counts) != len(self.row_lengths):
            raise ValueError(f"rewind got {len(counts)} counts for {len(self.row_lengths)} rows")
        for c, have in zip(counts, self.row_lengths):
            if not 0 <= c <= have:
                raise ValueError(f"cannot rewind {c} tokens from a cache holding {have}")
        self.row_lengths = [n - c for n, c in zip(self.row_lengths, counts)]
        if any(counts):
            self.cache.lengths.sub_(host_values(counts, torch.long, self.cache.lengths.device))

    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """(B,) tokens -> (B, V) next-token logits."""
        if self.used + 1 > self.capacity:
            raise ValueError(f"compiled decoding cache overflow: {self.used + 1} positions > capacity {self.capacity}")
        self.used += 1
        self.row_lengths = [n + 1 for n in self.row_lengths]
        return self._run(decode_step, token)


def blocked_reason(model) -> str | None:
    """Why compiled decoding cannot run ``model`` here: :func:`unsupported_reason`, or an earlier compile failure on
    its device type (``auto`` does not retry). None when it can."""
    reason = unsupported_reason(model)
    device_type = next(model.parameters()).device.type
    if reason is None and device_type in _BROKEN:
        reason = f"torch.compile failed earlier on {device_type}: {_BROKEN[device_type]}"
    return reason


def plan(model, compile: str, batch: int, needed: int) -> tuple[StaticDecoder | None, str]:
    """Whether to decode through :class:`StaticDecoder`: (decoder, why) or (None, why eager).

    ``needed``: positions the longest row will reach. Raises :class:`CompileUnavailable` for ``compile="on"``
    where it cannot run, :class:`~efftx.errors.ConfigError` for a bad ``compile`` value."""
    mode = CompileOptions(compile).compile
    if mode == "off":
        return None, "compile='off'"
    reason = blocked_reason(model)
    if reason is not None:
        if mode == "on":
            raise CompileUnavailable(f"compile='on' but compiled decoding cannot run: {reason}")
        log.info("compiled decoding not used, decoding eagerly: %s", reason)
        return None, reason
    return StaticDecoder(model, batch, capacity_for(model, needed), True, mode), "compiled"

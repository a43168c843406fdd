"""Continuous batching's slots with compiled passes (CUDA graphs on a GPU) for the batch sizes they pay for.

:class:`~efftx.generation.decode.Slots` keeps a running batch's rows in an eager model cache and steps a range of
them with an eager forward pass: hundreds of small kernels launched from Python. :class:`CompiledSlots` keeps the
same buffers (one (slots, capacity, Hkv, D) key and value tensor per layer, the row lengths on the host) and runs a
pass over rows ``0 .. n - 1`` (the scheduler's steps always start at slot 0: the fast lane, or every row) as a
compiled step (:mod:`efftx.generation.compiled`) for models that compiled decoding runs
(:func:`~efftx.generation.compiled.unsupported_reason`: dense attention in every layer):

* The pass runs over a **bucket** of rows, ``n`` rounded up to a power of two, so a handful of graphs (per
  bucket and tokens per row) serve every batch size. The bucket's view of the buffers is a
  :class:`~efftx.generation.compiled.DeviceCache` whose row lengths are a device tensor filled from the host's
  before each pass. The rows past ``n`` are padding: a row of the slow lane or a free slot (length 0), fed token
  0 at its own position, past its length: it writes only where its next real token will write before anything
  reads it (every position at or past a row's length is masked), and its host length does not move.
* Passes over more rows than ``max_rows`` (and ranges that do not start at slot 0: a containment retry of one
  row, a slow lane stepped alone) run eagerly, as :class:`~efftx.generation.decode.Slots` runs them, over the
  same buffers. On a CPU a compiled pass calls the C++ decode attention kernel as an operator (each row's own
  keys, :func:`~efftx.kernels.decode_attention_cpu.attend_device`) and pays at every size (``bench/serve_load.py
  --compile`` prints both); without the kernel it would attend over the whole capacity and lose past a few rows
  (:func:`compile_knobs` then keeps to :data:`CPU_COMPILE_ROWS`). On a GPU the graphs pay at every size.
* **Prefill.** Up to :data:`PREFILL_ROWS` prompts of at most :data:`PREFILL_TOKENS` tokens are prefilled compiled
  too (:meth:`CompiledSlots.prefill`; on a GPU an eager prefill of a short prompt is mostly kernel launches,
  several decoding steps' time): right-padded to the longest rounded up to a power of two (at least
  :data:`MIN_PREFILL`), in a bucket of rows, over a buffer of that many positions kept per shape; each row keeps
  its own length (its padding, after it, is never read) and joins its slot by the usual copy. The warm-up compiles
  these few shapes. A containment retry (several prefills before their rows join) prefills eagerly.
* The slots grow and shrink as :class:`~efftx.generation.decode.Slots`' do (by powers of two here); the shapes of a
  bucket's views do not depend on how many slots are allocated, so no graph is compiled again (on a GPU a CUDA
  graph is recorded again for new buffers; slots back at a size they had get that size's pooled buffers, device
  lengths included, and replay the graphs recorded over them).

``mode`` is :class:`~efftx.generation.compiled.CompileOptions`'s ``on`` or ``auto``: under ``auto`` a compile
failure switches to eager passes (and logs why), under ``on`` it raises
:class:`~efftx.generation.compiled.CompileUnavailable`.
"""

from __future__ import annotations

import torch

from efftx.generation import compiled as _compiled
from efftx.generation.compiled import CompiledRunner, DeviceCache, forward_step, mark_static
from efftx.attention.cache import KVCache, ModelCache
from efftx.generation.decode import CacheBudget, Rows, Slots, _SlotRows, bucket, splittable
from efftx.host import host_values
from efftx.kernels import decode_attention_cpu


# Prefills of at most PREFILL_ROWS prompts (the scheduler's default prefill_rows) of at most PREFILL_TOKENS tokens run
# compiled, padded to MIN_PREFILL or PREFILL_TOKENS tokens: four shapes per model, which the warm-up compiles
# (continuous.warm_up). Larger prefills run eagerly: their launches are shared by more arithmetic.
PREFILL_ROWS = 2
PREFILL_TOKENS = 32
MIN_PREFILL = 16


class CompiledSlots(Slots):
    """:class:`~efftx.generation.decode.Slots` whose passes over rows ``0 .. n - 1`` run compiled for buckets of at
    most ``max_rows`` rows (None: every bucket)."""

    def __init__(self, model, rows: int = 4, mode: str = "on", max_rows: int | None = None,
                 budget: CacheBudget | None = None):
        reason = eager_reason(model)
        if reason is not None:
            raise _compiled.CompileUnavailable(f"compiled continuous batching cannot run this model: {reason}")
        self.mode = _compiled.CompileOptions(mode).compile
        self.compiled = self.mode != "off"
        self.max_rows = max_rows
        self.device = next(model.parameters()).device
        super().__init__(model, model.max_seq_len, bucket(max(int(rows), 1)), batched=True, budget=budget)
        self._fresh()
        self._prefills: dict[tuple[int, int], CompiledRunner] = {}  # (rows, tokens) -> compiled prefill

    def _fresh(self) -> None:
        """New buffers: new bucket views at the next passes. Their device lengths go with the cache (pooled with it,
        :func:`~efftx.generation.decode.slots_cache`), so slots back at a size they had (a burst's growth and
        shrinking, a later batch, the replica after its warm-up) pass the very buffers a CUDA graph was recorded
        over, which it replays instead of recording again."""
        self._runners: dict[int, CompiledRunner] = {}
        cache = self._cache
        lengths = cache.device_lengths if cache is not None else None
        if lengths is None or lengths.shape[0] != self.slots or lengths.device != self.device:
            lengths = torch.zeros(self.slots, dtype=torch.long, device=self.device)
            if cache is not None:
                cache.device_lengths = lengths
        self._lengths = lengths
        self._cuda_graphs = self.compiled and self.device.type == "cuda"

    def _reallocate(self, slots: int, capacity: int | None = None) -> None:
        # a bucket of slots (none stays none: drained slots under a budget hold nothing); the capacity stays the
        # model's: the graphs' shapes
        super()._reallocate(bucket(slots) if slots else 0, capacity)
        self._fresh()

    def _fit(self, rows: int) -> int:
        """Buckets only: the largest power of two up to ``rows`` (0 for none)."""
        return 1 << (rows.bit_length() - 1) if rows > 0 else 0

    def wants(self, start: int, rows: int) -> bool:
        """Whether a pass over rows ``start .. start + rows - 1`` runs compiled."""
        size = bucket(rows)
        return start == 0 and size <= self.slots and self._compiles(size)

    def _compiles(self, size: int) -> bool:
        """Whether a pass over a bucket of ``size`` rows runs compiled (``max_rows``; "auto" after a compile failure
        runs eagerly)."""
        return (self.compiled and (self.max_rows is None or size <= self.max_rows)
                and self.device.type not in _compiled._BROKEN)

    def runner(self, size: int) -> CompiledRunner:
        """The compiled step over the first ``size`` slots (built once per bucket and set of buffers)."""
        if size not in self._runners:
            cache = DeviceCache.over([(layer.k[:size], layer.v[:size]) for layer in self._cache.layers],
                                     self._lengths[:size])
            if self._cuda_graphs:
                mark_static(cache)
            self._runners[size] = CompiledRunner(self.model, cache, self.compiled, self.mode)
        return self._runners[size]

    @torch.no_grad()
    def prefill(self, prompts: list[list[int]], capacity: int, compiled: bool = True):
        """At most :data:`PREFILL_ROWS` prompts of at most :data:`PREFILL_TOKENS` tokens prefill in one compiled
        pass (see the module docstring: rows and length padded to buckets, a buffer per bucket kept by these
        slots); others, or with ``compiled`` False (a containment retry: several prefills before their rows join),
        as :class:`Slots` does."""
        n, longest = len(prompts), max((len(p) for p in prompts), default=0)
        size, length = bucket(n), max(MIN_PREFILL, bucket(longest))
        if not (compiled and 0 < longest <= PREFILL_TOKENS and size <= PREFILL_ROWS and length <= self.capacity
                and self._compiles(size)):
            return super().prefill(prompts, capacity, compiled)
        runner = self._prefill_runner(size, length)
        padded = [list(p) + [0] * (length - len(p)) for p in prompts] + [[0] * length] * (size - n)
        runner.cache.lengths.zero_()
        logits = runner._run(forward_step, host_values(padded, torch.long, self.device))  # (size, length, V)
        last = host_values([max(len(p) - 1, 0) for p in prompts], torch.long, self.device)
        logits = logits[torch.arange(n, device=self.device), last]  # a copy: the graph's next replay overwrites its own
        lengths = [len(p) for p in prompts]  # the padding past each row's length is never read, then overwritten
        layers = [KVCache.over(layer.k[:n], layer.v[:n], lengths) for layer in runner.cache.layers]
        return Rows._of(self.model, True, [ModelCache(layers)]), logits

    def _prefill_runner(self, size: int, length: int) -> CompiledRunner:
        """The compiled prefill of ``size`` rows of ``length`` tokens, over a buffer of its own (the rows are copied
        into slots before the next prefill of this shape runs)."""
        if (size, length) not in self._prefills:
            cache = _compiled.new_cache(self.model, size, length)
            if self._cuda_graphs:
                mark_static(cache)
            self._prefills[size, length] = CompiledRunner(self.model, cache, self.compiled, self.mode)
        return self._prefills[size, length]

    def rows(self, start: int, stop: int) -> _SlotRows:
        if not 0 <= start <= stop <= self.n:
            raise IndexError(f"rows {start}..{stop} of {self.n}")
        return self._range_rows(_CompiledRows, start, stop)


class _CompiledRows(_SlotRows):
    """A range of :class:`CompiledSlots`: ``forward`` runs compiled where the slots want it (see the module
    docstring), else as :class:`~efftx.generation.decode.Slots`' rows do."""

    def __init__(self, slots: CompiledSlots, start: int, stop: int):
        super().__init__(slots, start, stop)
        self._slots = slots

    def compiles(self, rows: int) -> bool:
        return self._slots.wants(self._start, rows)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        slots, (n, t) = self._slots, tokens.shape
        if not slots.wants(self._start, n):
            return super().forward(tokens)
        mine = self.caches[0].layers[0].lengths
        if max(mine) + t > slots.capacity:
            raise ValueError(f"KV cache overflow: {max(mine) + t} positions > capacity {slots.capacity}")
        size = bucket(n)
        live = self._parents[0].lengths[n:min(size, slots.n)]  # rows of the slow lane padding the bucket
        if any(h + t > slots.capacity for h in live):
            return super().forward(tokens)  # one of them has no room past its length: this pass eagerly
        lengths = list(mine) + list(live) + [0] * (size - n - len(live))
        runner = slots.runner(size)
        runner.cache.lengths.copy_(host_values(lengths, torch.long, slots.device))  # no wait: the step before runs on
        if size > n:
            tokens = torch.cat([tokens, tokens.new_zeros(size - n, t)])
        self.forward_calls += 1
        out = runner._run(forward_step, tokens)
        if runner.compiled and slots._cuda_graphs:  # a CUDA graph's next replay overwrites its outputs
            out = out.clone()
        for layer in self.caches[0].layers:
            layer.lengths = [h + t for h in layer.lengths]
        self._sync()
        return out[:n]


def eager_reason(model, batched: bool | None = None) -> str | None:
    """Why compiled continuous batching cannot run ``model`` (None when it can)."""
    if not (splittable(model) if batched is None else batched):
        return "its cache cannot be split into rows"
    return _compiled.blocked_reason(model)


def slots_for(model, compile: str = "off", batched: bool | None = None, rows: int = 4,
              max_rows: int | None = None, budget: CacheBudget | None = None, fit: bool = True):
    """The slots of a running batch over ``model``: :class:`CompiledSlots` (compiled passes up to ``max_rows``
    rows) where ``compile`` is ``on`` or ``auto`` and compiled decoding runs the model, else
    :class:`~efftx.generation.decode.Slots` (eager; with ``fit``, their positions fitted to their rows' needs). ``on`` where it cannot run raises
    :class:`~efftx.generation.compiled.CompileUnavailable` naming why; ``auto`` logs why."""
    mode = _compiled.CompileOptions(compile).compile
    batched = splittable(model) if batched is None else bool(batched)
    if mode != "off":
        reason = eager_reason(model, batched)
        if reason is None:
            return CompiledSlots(model, rows, mode, max_rows, budget)
        if mode == "on":
            raise _compiled.CompileUnavailable(f"compile='on' but compiled continuous batching cannot run: {reason}")
        _compiled.log.info("compiled continuous batching not used, decoding eagerly: %s", reason)
    return Slots(model, model.max_seq_len, rows, batched=batched, budget=budget, fit=fit)


CPU_COMPILE_ROWS = 2  # on a CPU without the decode attention kernel a compiled pass pays for a row or two only


def compile_knobs(compile: str, compile_rows: int | None, device) -> dict:
    """A scheduler's ``compile`` / ``compile_rows`` on ``device`` (the text app's and the bench's defaults): every
    pass compiled on a GPU, and on a CPU where the C++ decode attention kernel is built
    (:func:`~efftx.kernels.decode_attention_cpu.attend_device`: a compiled pass attends over each row's own keys);
    without it, passes of up to :data:`CPU_COMPILE_ROWS` rows (a compiled pass would attend over the whole
    capacity). ``compile_rows`` only where something is compiled."""
    mode = _compiled.CompileOptions(compile).compile
    if mode == "off":
        return {"compile": mode}
    if compile_rows is None and torch.device(device).type != "cuda" and decode_attention_cpu.kernel() is None:
        compile_rows = CPU_COMPILE_ROWS
    return {"compile": mode, **({"compile_rows": compile_rows} if compile_rows is not None else {})}

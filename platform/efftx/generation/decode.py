"""Prefill + one-token decoding over any model cache, for batches of prompts of any lengths."""

from __future__ import annotations

import copy
import weakref
from typing import Sequence

import torch

from efftx.attention.cache import KVCache, ModelCache, RowLengths
from efftx.generation import compiled
from efftx.generation.sampling import Stream, draw, is_greedy, probabilities, sample
from efftx.host import host_values


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Run the prompt (B, T) through the model, filling ``cache``; return last-position logits (B, V)."""
    return model(tokens, cache=cache)[:, -1]


@torch.no_grad()
def decode_one(model, token: torch.Tensor, cache) -> torch.Tensor:
    """Feed one token per row (B,), return next-token logits (B, V)."""
    return model(token[:, None], cache=cache)[:, -1]


def as_rows(prompts: Sequence[Sequence[int]] | torch.Tensor) -> list[list[int]]:
    """Prompts as lists of token ids: a (B, T) tensor or a list of lists (lengths may differ)."""
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise ValueError("prompts must be a (batch, length) tensor or a list of token lists")
        prompts = prompts.tolist()
    rows = [[int(t) for t in p] for p in prompts]
    if not rows:
        raise ValueError("no prompts given")
    for r, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {r} is empty")
    return rows


def _split_layer(layer, index: list[int]):
    """A copy of one layer's ragged cache holding only rows ``index`` (in that order)."""
    if not isinstance(layer, RowLengths):
        raise TypeError(f"a {type(layer).__name__} does not keep per-row lengths: its rows cannot be split")
    batch = len(layer.lengths)
    out = copy.copy(layer)
    rows: dict[torch.device, torch.Tensor] = {}  # the index on each device the layer's tensors are on (no waits)
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != batch:
                raise TypeError(f"the rows of a {type(layer).__name__} cannot be split: its {name!r} "
                                f"{tuple(value.shape)} is not one entry per row ({batch} rows)")
            if value.device not in rows:
                rows[value.device] = host_values(index, torch.long, value.device)
            setattr(out, name, value.index_select(0, rows[value.device]))
    out.lengths = [layer.lengths[i] for i in index]
    return out


def _join_layers(layers: list):
    """One layer cache holding the rows of ``layers`` one after another (they share every other dimension)."""
    out = copy.copy(layers[0])
    for name, value in vars(layers[0]).items():
        if isinstance(value, torch.Tensor):
            setattr(out, name, torch.cat([getattr(layer, name) for layer in layers]))
    out.lengths = [n for layer in layers for n in layer.lengths]
    return out


def splittable(model) -> bool:
    """Whether ``model``'s caches are ragged and their rows can be taken apart and joined (every tensor of each
    layer's cache is one entry per row): then rows may join and leave a running batch (continuous batching)."""
    if not model.supports_ragged:
        return False
    cache = model.new_cache(2, 2)
    try:
        for layer in cache.layers:
            _split_layer(layer, [1])
    except TypeError:
        return False
    return True


class Rows:
    """The decoding state of a batch of sequences over one model, rows of any lengths.

    Backends that accept ragged caches (``model.supports_ragged``) decode all rows in one batched
    forward pass, each row at its own position; for the others each row has its own batch-1 cache and
    the rows run one after another. Either way ``forward`` takes (B, T) tokens, one block of T per row,
    and ``rewind`` takes one count per row.

    For continuous batching, rows can be taken out (:meth:`select`) and batches joined (:meth:`concat`);
    batched states must then share their capacity (e.g. the model's ``max_seq_len``). :meth:`snapshot` /
    :meth:`restore` undo whatever a failed forward pass appended.
    """

    def __init__(self, model, batch_size: int, capacity: int, batched: bool | None = None):
        self.model = model
        self.batched = model.supports_ragged if batched is None else batched
        if self.batched:
            self.caches = [model.new_cache(batch_size, capacity)]
        else:
            self.caches = [model.new_cache(1, capacity) for _ in range(batch_size)]
        self.forward_calls = 0  # batched forward passes (row-by-row mode counts one per batch too)

    @classmethod
    def _of(cls, model, batched: bool, caches: list) -> "Rows":
        rows = cls.__new__(cls)
        rows.model, rows.batched, rows.caches, rows.forward_calls = model, batched, caches, 0
        return rows

    def __len__(self) -> int:
        return len(self.caches[0].lengths) if self.batched else len(self.caches)

    def select(self, index: Sequence[int]) -> "Rows":
        """The rows ``index`` (in that order) as a new state: copies of their cache rows when batched, the same
        per-row caches otherwise."""
        index = [int(i) for i in index]
        if not self.batched:
            return Rows._of(self.model, False, [self.caches[i] for i in index])
        cache = self.caches[0]
        return Rows._of(self.model, True, [ModelCache([_split_layer(layer, index) for layer in cache.layers])])

    @staticmethod
    def concat(parts: Sequence["Rows"]) -> "Rows":
        """The rows of ``parts`` one after another, as one state."""
        parts = list(parts)
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if not first.batched:
            return Rows._of(first.model, False, [c for p in parts for c in p.caches])
        depth = len(first.caches[0].layers)
        layers = [_join_layers([p.caches[0].layers[i] for p in parts]) for i in range(depth)]
        return Rows._of(first.model, True, [ModelCache(layers)])

    def snapshot(self) -> list[list]:
        """Every layer's row lengths (what :meth:`restore` rewinds to)."""
        return [[list(layer.lengths) if hasattr(layer, "lengths") else layer.length for layer in cache.layers]
                for cache in self.caches]

    def restore(self, snapshot: list[list]) -> None:
        """Forget whatever was appended since ``snapshot`` (a failed pass may have reached only some layers)."""
        for cache, saved in zip(self.caches, snapshot):
            for layer, before in zip(cache.layers, saved):
                if isinstance(before, list):
                    layer.rewind([now - was for now, was in zip(layer.lengths, before)])
                else:
                    layer.rewind(layer.length - before)

    @property
    def lengths(self) -> list[int]:
        return self.caches[0].lengths if self.batched else [c.length for c in self.caches]

    def compiles(self, rows: int) -> bool:
        """Whether a pass over the first ``rows`` of these rows runs a compiled graph (whose shapes then matter:
        :mod:`efftx.generation.device_slots`); eager rows never do."""
        return False

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) new tokens -> (B, T, V) logits."""
        self.forward_calls += 1
        if self.batched:
            return self.model(tokens, cache=self.caches[0])
        return torch.cat([self.model(tokens[b:b + 1], cache=c) for b, c in enumerate(self.caches)])

    def rewind(self, counts: Sequence[int]) -> None:
        if self.batched:
            self.caches[0].rewind(list(counts))
        else:
            for cache, n in zip(self.caches, counts):
                cache.rewind(int(n))

    @torch.no_grad()
    def prefill(self, rows: list[list[int]]) -> torch.Tensor:
        """Feed each row's tokens; return each row's last-position logits (B, V). Rows may be empty
        (then their logits row is undefined)."""
        device = next(self.model.parameters()).device
        longest = max(len(r) for r in rows)
        if longest == 0:
            return None
        if not self.batched:
            out = []
            for row, cache in zip(rows, self.caches):
                if row:
                    out.append(self.model(torch.tensor([row], device=device), cache=cache)[:, -1])
                else:
                    out.append(torch.zeros(1, self.model.vocab_size, device=device))
            self.forward_calls += 1
            return torch.cat(out)
        # one pass over right-padded rows; the padding is rewound, so later tokens overwrite it
        padded = host_values([r + [0] * (longest - len(r)) for r in rows], torch.long, device)
        logits = self.forward(padded)  # (B, T, V)
        self.rewind([longest - len(r) for r in rows])
        last = host_values([max(len(r) - 1, 0) for r in rows], torch.long, device)
        return logits[torch.arange(len(rows), device=device), last]


def _tensor_names(layer) -> list[str]:
    return [name for name, value in vars(layer).items() if isinstance(value, torch.Tensor)]


# Slot caches given back (a running batch's slots grew, shrank or were dropped), per model and (slots, capacity): the
# next batch that needs as many slots takes one (zeroed) instead of new memory. On a CPU new memory costs about a
# millisecond per megabyte in page faults (the small pair's 8- and 16-slot caches: 6.4 and 12.6 ms new, against 0.4
# and 0.9 ms for memory the allocator kept, measured), paid in the round that admits a burst's rows. At most one
# cache per size (slots and positions) is kept, for dense models, whose every layer is a KVCache: without a budget
# this holds at most about twice the largest batch's cache per size of positions (slots that fit their rows take a
# few powers of two).
_FREE_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _pooled(cache) -> bool:
    return all(type(layer) is KVCache for layer in cache.layers)


_KV_ONLY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def kv_only(model) -> bool:
    """Whether every layer of ``model`` keeps a key/value cache (:class:`KVCache`: (rows, positions, Hkv, D), a row's
    tokens its first positions), checked once per model."""
    if model not in _KV_ONLY:
        _KV_ONLY[model] = _pooled(model.new_cache(1, 1))
    return _KV_ONLY[model]


def slots_cache(model, slots: int, capacity: int):
    """A zeroed cache of ``slots`` rows and ``capacity`` positions for ``model``: one given back earlier
    (:func:`give_back`), else new."""
    cache = _FREE_CACHES.get(model, {}).pop((slots, capacity), None)
    p = next(model.parameters())
    if cache is None or cache.layers[0].k.dtype != p.dtype or cache.layers[0].k.device != p.device:
        return model.new_cache(slots, capacity)
    for layer in cache.layers:
        layer.k.zero_()
        layer.v.zero_()
        layer.lengths = [0] * slots
    return cache


def free_memory(after: BaseException | None = None) -> None:
    """Drop every pooled cache (:func:`give_back`) and return the CUDA allocator's cached blocks to the device
    (after an out-of-memory error: the memory a retry needs may sit there). Nothing ``after`` a
    :class:`CacheBudgetFull`: the budget refused before anything was allocated (it drops its own pooled caches
    where they stand in the way)."""
    if isinstance(after, CacheBudgetFull):
        return
    _FREE_CACHES.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def give_back(model, cache, capacity: int, budget: "CacheBudget | None" = None) -> None:
    """Keep ``cache`` (no longer used) for the next :func:`slots_cache` of its size; under a ``budget``, only where
    it has room for it (else it is dropped: its memory goes back)."""
    if cache is not None and _pooled(cache) and (budget is None or budget.may_pool(cache_bytes(cache))):
        _FREE_CACHES.setdefault(model, {})[(len(cache.layers[0].lengths), capacity)] = cache


# Slots that fit their rows (Slots(fit=True)) hold at least this many positions, in powers of two: a handful of
# sizes, so that a batch's widenings and narrowings find caches given back (slots_cache) instead of new memory.
MIN_FIT_CAPACITY = 64


def fit_widths(model) -> list[int]:
    """The positions that slots fitting their rows may take for ``model`` (``Slots(fit=True)``): powers of two from
    :data:`MIN_FIT_CAPACITY`, and its context."""
    widths, width = [], MIN_FIT_CAPACITY
    while width < model.max_seq_len:
        widths.append(width)
        width *= 2
    return widths + [model.max_seq_len]


def pool_widths(model, slots: int, budget: "CacheBudget | None" = None) -> None:
    """Keep for reuse (:func:`give_back`) a cache of every power-of-two number of slots up to ``slots`` at every
    width that slots fitting their rows may take (:func:`fit_widths`), where none is kept yet (under a ``budget``,
    where it has room): a replica's warm-up does this, so that its first long requests widen their batch into
    memory the allocator has, instead of fresh memory (on a 2-core CPU the slots' size changes of
    ``bench/serve_load.py``'s 64 base requests took 30 ms without, against 6.5 ms for whole-context slots, whose
    every size the warm-up had pooled; measured)."""
    for width in fit_widths(model):
        size = 1
        while size <= bucket(slots):
            if (size, width) not in _FREE_CACHES.get(model, {}):
                give_back(model, model.new_cache(size, width), width, budget)
            size *= 2


def bucket(n: int) -> int:
    """``n`` rounded up to a power of two (1 for 0): the sizes slots grow through, and the rows of a compiled pass
    over ``n`` rows (:mod:`efftx.generation.device_slots`)."""
    b = 1
    while b < n:
        b *= 2
    return b


def cache_bytes(cache) -> int:
    """The bytes of a model cache's tensors."""
    return sum(value.nbytes for layer in cache.layers for value in vars(layer).values()
               if isinstance(value, torch.Tensor))


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


class CacheBudgetFull(torch.OutOfMemoryError):
    """Slots would take more memory than their :class:`CacheBudget` allows: refused before anything was allocated.
    An out-of-memory error, so that continuous batching treats it as the device's own (the rows wait for room)."""


class CacheBudget:
    """The most memory the caches of continuous batching may hold (one replica's, on its device): every running
    batch's slots (all of their slots, holding rows or not: each a row's cache of the slots' positions) and the
    caches kept for reuse (:func:`give_back`) of the same models. Where a device's memory is shared (weights,
    activations, other replicas), a budget keeps the caches to their share *before* allocating, instead of finding
    the limit by an out-of-memory error. A prefill's cache (its prompts' room, until its rows join the slots) and
    the passes' activations come on top.

    :class:`Slots` made with a budget ask it before they grow (:meth:`require`): pooled caches of its models are
    dropped where they are what stands in the way, and else :class:`CacheBudgetFull` is raised, the slots
    unchanged."""

    def __init__(self, limit: int, models: Sequence = ()):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ValueError(f"cache_budget must be a positive number of bytes, got {limit!r}")
        self.limit = limit
        self._held: "weakref.WeakKeyDictionary[Slots, int]" = weakref.WeakKeyDictionary()
        # the models whose pooled caches it counts: ``models`` from the start (a replica's target and draft: caches
        # a warm-up pooled for either count before the first slots of the other ask), and those of its slots
        self._models: "weakref.WeakSet" = weakref.WeakSet(m for m in models if m is not None)
        self._rows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {capacity: a row's bytes}

    def row_bytes(self, model, capacity: int) -> int:
        """The bytes of one row's cache of ``capacity`` positions for ``model`` (measured once)."""
        known = self._rows.setdefault(model, {})
        if capacity not in known:
            known[capacity] = cache_bytes(model.new_cache(1, capacity))
        return known[capacity]

    def held(self) -> int:
        """The bytes the slots under this budget hold."""
        return sum(self._held.values())

    def pooled(self) -> int:
        """The bytes of the caches kept for reuse of this budget's models."""
        return sum(cache_bytes(c) for m in list(self._models) for c in _FREE_CACHES.get(m, {}).values())

    def free_rows(self, slots: "Slots", *together: "Slots") -> int:
        """How many rows ``slots`` could hold, beside what the other slots under this budget hold; with
        ``together`` (a speculative batch's target and draft slots), how many rows each of them could hold at once."""
        group = (slots, *together)
        others = self.held() - sum(self._held.get(s, 0) for s in group)
        return max(self.limit - others, 0) // max(sum(s.row_bytes for s in group), 1)

    def require(self, slots: "Slots", nbytes: int, rows: int | None = None) -> None:
        """Room for ``slots`` to hold ``nbytes`` (instead of what they hold now; ``rows`` rows, for the message), else
        :class:`CacheBudgetFull`."""
        self._models.add(slots.model)
        others = self.held() - self._held.get(slots, 0)
        if others + nbytes > self.limit:
            rows = nbytes // max(slots.row_bytes, 1) if rows is None else rows
            raise CacheBudgetFull(f"{_mib(nbytes)} of caches for {rows} rows, beside "
                                  f"{_mib(others)} held, pass the cache budget of {_mib(self.limit)}")
        if others + nbytes + self.pooled() > self.limit:
            for model in list(self._models):
                _FREE_CACHES.pop(model, None)

    def hold(self, slots: "Slots", nbytes: int) -> None:
        """``slots`` now hold ``nbytes``."""
        self._models.add(slots.model)
        self._held[slots] = int(nbytes)

    def may_pool(self, nbytes: int) -> bool:
        """Whether a cache of ``nbytes`` may be kept for reuse."""
        return self.held() + self.pooled() + nbytes <= self.limit

    def report(self) -> dict[str, float]:
        """MiB: the budget, what the slots hold, what is pooled."""
        return {name: round(value / 2**20, 3)
                for name, value in (("limit_mib", self.limit), ("held_mib", self.held()),
                                    ("pooled_mib", self.pooled()))}


class Slots:
    """A running batch's rows in preallocated slots of one model's cache, for continuous batching.

    Rows live in slots ``0 .. len - 1``. :meth:`rows` gives a contiguous range of them as a :class:`Rows` whose
    caches are views of the slots (a forward pass over a range writes the slots in place: no copy of the batch);
    rows join with :meth:`put` (one row's cache copied into a slot) and leave or change places with :meth:`copy`
    (one row copied onto another): no step copies every row's cache, as :meth:`Rows.select` / ``concat`` do. The
    slots grow (doubling) when more rows join than they hold, and :meth:`shrink` gives memory back. With ``fit``
    (key/value caches only) their positions follow their rows: the power of two (from :data:`MIN_FIT_CAPACITY`, at
    most ``capacity``) that holds what the rows may need (:meth:`reserve`'s ``positions``), widened when a row needs
    more and narrowed when no row does (:meth:`shrink`), the rows copied; without it every slot holds ``capacity``
    positions (compiled passes: their graphs' shapes). Models whose
    caches cannot be split (:func:`splittable`) keep one batch-1 cache per row instead, and a range runs its rows
    one after another.
    """

    def __init__(self, model, capacity: int, rows: int = 4, batched: bool | None = None,
                 budget: CacheBudget | None = None, fit: bool = False):
        self.model, self.limit = model, int(capacity)
        self.batched = splittable(model) if batched is None else bool(batched)
        # fit: the slots' positions follow their rows' needs (key/value caches only: their rows are prefixes)
        self._kv = self.batched and kv_only(model)
        self.fits = bool(fit) and self._kv
        self.capacity = self._capacity_for(0) if self.fits else self.limit
        self.n = 0
        self._scratch: list | None = None  # a row's tensors, for swaps with every slot full (swap)
        self._ranges: dict[tuple, "_SlotRows"] = {}  # ranges' rows kept for the next pass (see _range_rows)
        self.budget = budget
        self.row_bytes = budget.row_bytes(model, self.capacity) if budget is not None else 0
        if self.batched:
            # under a budget none: slots hold its memory only while they hold rows (they grow as rows join)
            self._least = max(int(rows), 1) if budget is None else 0
            self._cache = slots_cache(model, self._least, self.capacity)
            self._names = [_tensor_names(layer) for layer in self._cache.layers]
        else:
            self._caches: list = []
        self._hold()

    def _fit(self, rows: int) -> int:
        """The most slots of at most ``rows`` that these slots may take (a subclass may allow only some sizes)."""
        return rows

    def _capacity_for(self, positions: int) -> int:
        """The positions of slots whose rows need ``positions``: with ``fit``, a power of two from
        :data:`MIN_FIT_CAPACITY` up, at most the limit; else the limit."""
        return min(max(bucket(int(positions)), MIN_FIT_CAPACITY), self.limit) if self.fits else self.limit

    def holds(self, positions: int) -> bool:
        """Whether a row that needs ``positions`` fits these slots' positions as they are (one past the limit does:
        its request fails its own check)."""
        return positions <= self.capacity or self.capacity >= self.limit

    def _hold(self) -> None:
        if self.budget is not None:
            self.budget.hold(self, self.row_bytes * (self.slots if self.batched else self.n))

    def __len__(self) -> int:
        return self.n

    @property
    def slots(self) -> int:
        return len(self._cache.layers[0].lengths) if self.batched else len(self._caches)

    @property
    def room(self) -> int:
        """The most rows these slots hold without asking for memory: their slots (row by row, under a budget: the
        rows it has room for; else those they hold)."""
        if not self.batched and self.budget is not None:
            return self.budget.free_rows(self)
        return self.slots

    def reserve(self, rows: int, positions: int = 0, fill: bool = True) -> None:
        """Room for ``rows`` rows of up to ``positions`` positions each: the slots grow, doubling until they hold
        them (sizes a later batch finds given back, :func:`slots_cache`), or, where the device has no memory for
        that (pooled caches dropped first), to just ``rows``; slots that ``fit`` widen to the power of two that
        holds ``positions`` (their rows copied). Raises ``torch.OutOfMemoryError`` with the slots unchanged (rows,
        caches) when not even that fits; where it is the :class:`CacheBudget` that refuses
        (:class:`CacheBudgetFull`), the slots first grow to as many as it has room for at the positions they have
        (their rows unchanged; not with ``fill`` False: slots that share the budget with others of one batch are
        filled together, :meth:`fill`)."""
        capacity = max(self.capacity, self._capacity_for(positions))
        if rows <= self.slots and capacity == self.capacity:
            return
        if not self.batched:  # a row's cache comes with its prefill: only the budget is asked
            if self.budget is not None:
                self.budget.require(self, rows * self.row_bytes)
            return
        size = max(self.slots, 1)
        while size < rows:
            size *= 2
        # doubling, else just the rows needed (widening slots drop their empty ones beyond ``rows``)
        for want in dict.fromkeys((size, max(rows, self.n))):
            try:
                self._reallocate(want, capacity)
                return
            except torch.OutOfMemoryError as exc:
                free_memory(exc)
                refused = exc
        if isinstance(refused, CacheBudgetFull) and fill:  # the slots take what the budget has room for
            self.fill(self.budget.free_rows(self))
        raise refused

    def fill(self, rows: int) -> None:
        """Take as many slots as fit ``rows`` (fewer than they have, down to their rows, or more; their rows
        unchanged): what a :class:`CacheBudget` that refused a growth has room for."""
        fit = max(self._fit(rows), self.n)
        if self.batched and fit != self.slots:
            self._reallocate(fit)

    def shrink(self, positions: int | None = None) -> None:
        """Give back memory after rows left: when at most a quarter of the slots hold rows, keep twice the rows
        (at least the first allocation's slots; under a budget, none when no row is left), rounded up to a power of
        two: the sizes the slots grew through, whose caches were given back (a new size costs fresh memory: on a
        2-core CPU, 5 ms of page faults for 6 slots of the small pair). Slots that ``fit`` narrow to the power of
        two their rows need (``positions``)."""
        if not self.batched:
            return
        size, capacity = self.slots, self.capacity
        if self.slots > self._least and 4 * self.n <= self.slots:
            keep = max(self._least, 2 * self.n)
            size = min(bucket(keep) if keep else 0, self.slots)
        if positions is not None:
            capacity = min(capacity, self._capacity_for(positions))
        if (size, capacity) == (self.slots, self.capacity):
            return
        try:
            self._reallocate(size, capacity)
        except torch.OutOfMemoryError:  # no memory for the smaller cache: keep the one it has
            free_memory()

    def _reallocate(self, slots: int, capacity: int | None = None) -> None:
        """The slots' cache becomes one of ``slots`` rows and ``capacity`` positions (default: theirs), their rows
        copied (positions: a key/value cache's first ones, which hold every row's tokens)."""
        old_capacity = self.capacity
        capacity = old_capacity if capacity is None else int(capacity)
        old, n = self._cache, self.n
        longest = max(old.layers[0].lengths[:n], default=0)
        if capacity < longest:
            raise ValueError(f"slots of {capacity} positions cannot hold a row of {longest}")
        row_bytes = self.budget.row_bytes(self.model, capacity) if self.budget is not None else 0
        if self.budget is not None:
            self.budget.require(self, slots * row_bytes, slots)
        self._cache = slots_cache(self.model, slots, capacity)
        # key/value caches: the rows' positions up to the longest row (the rest is never read); else whole rows
        end = longest if self._kv else None
        for mine, theirs, names in zip(self._cache.layers, old.layers, self._names):
            for name in names:
                if end is None:
                    getattr(mine, name)[:n].copy_(getattr(theirs, name)[:n])
                else:
                    getattr(mine, name)[:n, :end].copy_(getattr(theirs, name)[:n, :end])
            mine.lengths[:n] = theirs.lengths[:n]
        if capacity != old_capacity:
            self.capacity, self.row_bytes, self._scratch = capacity, row_bytes, None
        self._hold()
        give_back(self.model, old, old_capacity, self.budget)

    def lengths(self) -> list[int]:
        """Every slot's row length (batched slots; the first ``len(self)`` hold rows)."""
        return list(self._cache.layers[0].lengths)

    def release(self) -> None:
        """The batch is gone: its cache is kept for the next batch of this size (:func:`slots_cache`)."""
        if self.batched and self._cache is not None:
            cache, self._cache, self.n = self._cache, None, 0
            if self.budget is not None:
                self.budget.hold(self, 0)
            give_back(self.model, cache, self.capacity, self.budget)

    def _extend(self, slot: int) -> None:
        """Check ``slot`` (a row, or one past the last: then add it)."""
        if not 0 <= slot <= self.n:
            raise IndexError(f"slot {slot} of {self.n} rows")
        if slot == self.n:
            self.reserve(self.n + 1)
            self.n += 1
            if not self.batched:
                self._caches.append(None)
                self._hold()

    def rows(self, start: int, stop: int) -> Rows:
        """Rows ``start .. stop - 1`` as a :class:`Rows` over the slots themselves."""
        if not 0 <= start <= stop <= self.n:
            raise IndexError(f"rows {start}..{stop} of {self.n}")
        if not self.batched:
            return Rows._of(self.model, False, self._caches[start:stop])
        return self._range_rows(_SlotRows, start, stop)

    def _range_rows(self, cls: type, start: int, stop: int) -> "_SlotRows":
        """``cls(self, start, stop)``, kept for the next pass over the same range: where every layer is a
        :class:`~efftx.attention.cache.KVCache`, a range's views of the slots' tensors stay what they are while the
        slots keep their cache, and only its row lengths are taken again (building the views each step cost a few
        dozen microseconds of the host's time per pass: on a GPU, a sizeable part of a compiled step's)."""
        key = (cls, start, stop)
        kept = self._ranges.get(key)
        if kept is not None and kept._parents is self._cache.layers:
            return kept._refresh()
        rows = cls(self, start, stop)
        if all(type(layer) is KVCache for layer in self._cache.layers):
            if kept is None and len(self._ranges) >= 64:  # ranges of slots long gone: not kept for ever
                self._ranges.clear()
            self._ranges[key] = rows
        return rows

    def prefill(self, prompts: list[list[int]], capacity: int, compiled: bool = True
                ) -> tuple[Rows, torch.Tensor | None]:
        """Prefill ``prompts`` apart from the slots (their rows then join with :meth:`put`): a :class:`Rows` of
        ``capacity`` positions and each row's last-position logits (B, V) (None when every prompt is empty).
        Eager here; :class:`~efftx.generation.device_slots.CompiledSlots` runs short prompts compiled (unless
        ``compiled`` is False)."""
        rows = Rows(self.model, len(prompts), capacity, self.batched)
        return rows, rows.prefill(prompts)

    def put(self, source: Rows, index: int, slot: int) -> None:
        """Copy row ``index`` of ``source`` (prefilled apart, same model and capacity) into ``slot`` (at most one past
        the last row: the slots grow by one). Key/value caches (:class:`~efftx.attention.cache.KVCache`) may come
        with a smaller capacity (a prefill needs only its prompts' room): their positions fill the slot's first
        ones, and the rest, past the row's length, is never read."""
        if source.batched != self.batched:
            raise ValueError("a row-by-row state cannot join batched slots (or the other way round)")
        self._extend(slot)
        if not self.batched:
            self._caches[slot] = source.caches[index]
            return
        for mine, theirs, names in zip(self._cache.layers, source.caches[0].layers, self._names):
            for name in names:
                src, dst = getattr(theirs, name)[index], getattr(mine, name)[slot]
                if src.shape != dst.shape and type(theirs) is KVCache:  # (capacity, Hkv, D): the prefilled positions
                    if theirs.lengths[index] > dst.shape[0]:
                        raise ValueError(f"a row of {theirs.lengths[index]} positions cannot join slots of "
                                         f"{dst.shape[0]}")
                    keep = min(src.shape[0], dst.shape[0])
                    src, dst = src[:keep], dst[:keep]
                dst.copy_(src)
            mine.lengths[slot] = theirs.lengths[index]

    def copy(self, source: int, slot: int) -> None:
        """Row ``source``'s cache onto ``slot`` (a row, overwritten, or one past the last: the slots grow by one)."""
        if not 0 <= source < self.n:
            raise IndexError(f"row {source} of {self.n}")
        if source == slot:
            return
        self._extend(slot)
        if not self.batched:
            self._caches[slot] = self._caches[source]
            return
        for layer, names in zip(self._cache.layers, self._names):
            for name in names:
                t = getattr(layer, name)
                t[slot].copy_(t[source])
            layer.lengths[slot] = layer.lengths[source]

    def swap(self, a: int, b: int) -> None:
        """Rows ``a`` and ``b`` change places, through the first free slot (which keeps a copy of row ``a``, past
        any length: never read), or, where every slot holds a row, through a one-row scratch the slots keep from
        then on (allocated once: growing every row's slots for one swap took 30 ms of page faults on a 2-core CPU
        for 16 rows of the small pair; where the device has no memory for the scratch, ``torch.OutOfMemoryError``
        is raised, the rows unchanged)."""
        if a == b:
            return
        if not self.batched:
            self._caches[a], self._caches[b] = self._caches[b], self._caches[a]
            return
        if self.n < self.slots:
            via = [[getattr(layer, name)[self.n] for name in names]
                   for layer, names in zip(self._cache.layers, self._names)]
        else:
            if self._scratch is None:
                self._scratch = [[torch.empty_like(getattr(layer, name)[0]) for name in names]
                                 for layer, names in zip(self._cache.layers, self._names)]
            via = self._scratch
        for layer, names, buffers in zip(self._cache.layers, self._names, via):
            for name, buffer in zip(names, buffers):
                t = getattr(layer, name)
                buffer.copy_(t[a])
                t[a].copy_(t[b])
                t[b].copy_(buffer)
            layer.lengths[a], layer.lengths[b] = layer.lengths[b], layer.lengths[a]

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows (the others' slots become free)."""
        if not 0 <= n <= self.n:
            raise IndexError(f"cannot keep {n} of {self.n} rows")
        self.n = n
        if not self.batched:
            del self._caches[n:]
            self._hold()


class _SlotRows(Rows):
    """A range of :class:`Slots` as :class:`Rows`: its layer caches hold views of the slots' tensors and a copy of
    their row lengths; after every call the lengths, and any tensor a cache replaced instead of writing in place,
    go back to the slots."""

    def __init__(self, slots: Slots, start: int, stop: int):
        layers, self._made = [], []
        for layer, names in zip(slots._cache.layers, slots._names):
            view = copy.copy(layer)
            made = {name: getattr(layer, name)[start:stop] for name in names}
            for name, value in made.items():
                setattr(view, name, value)
            view.lengths = layer.lengths[start:stop]
            layers.append(view)
            self._made.append(made)
        self.model, self.batched, self.caches, self.forward_calls = slots.model, True, [ModelCache(layers)], 0
        self._parents, self._start, self._stop = slots._cache.layers, start, stop

    def _refresh(self) -> "_SlotRows":
        """The slots' row lengths taken again (they moved since: steps, rows joining, leaving, swapped)."""
        for parent, view in zip(self._parents, self.caches[0].layers):
            view.lengths = parent.lengths[self._start:self._stop]
        return self

    def _sync(self) -> None:
        for parent, view, made in zip(self._parents, self.caches[0].layers, self._made):
            parent.lengths[self._start:self._stop] = view.lengths
            for name, mine in made.items():
                now = getattr(view, name)
                if now is not mine:  # the cache replaced it (e.g. a rebuilt index): write it into the slots
                    mine.copy_(now)
                    setattr(view, name, mine)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        try:
            return super().forward(tokens)
        finally:
            self._sync()

    def rewind(self, counts: Sequence[int]) -> None:
        try:
            super().rewind(counts)
        finally:
            self._sync()

    def restore(self, snapshot: list[list]) -> None:
        try:
            super().restore(snapshot)
        finally:
            self._sync()

    def prefill(self, rows: list[list[int]]) -> torch.Tensor:
        try:
            return super().prefill(rows)
        finally:
            self._sync()

    def select(self, index: Sequence[int]) -> Rows:
        raise TypeError("take rows of Slots with Slots.rows, not select")


def generators(seed: int | Sequence[int | None] | None, n: int, device: torch.device | None = None
               ) -> list[Stream | None]:
    """Row r draws from its own :class:`~efftx.generation.sampling.Stream`, seeded ``seed + r`` (or ``seed[r]`` when
    a seed is given per row; None = the global RNG): a row's tokens do not depend on what else is in the batch, and
    every row with a stream draws in one call a step. ``device`` is not needed (kept for callers that pass it)."""
    seeds = [None if seed is None else seed + r for r in range(n)] if not isinstance(seed, (list, tuple)) else seed
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} rows")
    return [None if s is None else Stream(int(s)) for s in seeds]


@torch.no_grad()
def iter_generate(model, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, *,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  seed: int | Sequence[int | None] | None = None, compile: str = "off"):
    """Yield (B,) tokens one step at a time after ``prompts`` ((B, T) or lists of any lengths).

    Row r samples with seed ``seed + r`` (or ``seed[r]``), so its tokens are the same whatever else
    is in the batch.

    ``compile``: ``"off"`` (eager steps over the model's own caches), ``"on"`` or ``"auto"``: compiled
    one-token steps over a fixed-capacity cache with device-side lengths (:mod:`efftx.generation.compiled`;
    "auto" decodes eagerly, logging why, where the model or the machine cannot; "on" raises instead).
    The prompt is always prefilled eagerly; the tokens are the same either way (up to float rounding).
    """
    rows = as_rows(prompts)
    longest = max(len(r) for r in rows)
    total = longest + max_new_tokens
    if total > model.max_seq_len:
        raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) = {total} "
                         f"exceeds the model's max_seq_len={model.max_seq_len}")
    device = next(model.parameters()).device
    gens = generators(seed, len(rows), device)
    # the last token is sampled, never fed: the longest row reaches total - 1 positions
    static, _ = compiled.plan(model, compile, len(rows), total - 1)
    try:
        state = Rows(model, len(rows), total)
        logits = state.prefill(rows)
        if static is not None:
            static.load(state.caches[0], state.lengths)
            state = None  # the eager cache is not needed any more
            step = static
        else:
            def step(token):
                return state.forward(token[:, None])[:, -1]
        for i in range(max_new_tokens):
            if is_greedy(temperature):
                token = sample(logits, 0)
            else:
                token = draw(probabilities(logits, temperature, top_k, top_p), gens)
            yield token
            if i + 1 < max_new_tokens:
                logits = step(token)
    finally:
        if static is not None:
            static.release()


def generate(model, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """Sample ``max_new_tokens`` after each prompt with a cache; returns (B, max_new_tokens)."""
    return torch.stack(list(iter_generate(model, prompts, max_new_tokens, **sampling)), dim=1)


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")

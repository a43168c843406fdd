"""Turn logits into tokens: temperature, top-k, top-p. No host synchronisation in this path.

**Temperature floor.** ``temperature`` 0 is greedy (the argmax). Temperatures above 0 but below
:data:`MIN_TEMPERATURE` are greedy too: dividing float32 logits by such a value overflows to ±inf (or, below
float32's smallest subnormal, divides by zero), and the softmax of that is NaN; at any temperature this small
the distribution is one-hot at the argmax anyway, up to exact ties. **top_p** always keeps the most probable
token, so even a ``top_p`` that rounds to 0 in float32 (``1e-300``) leaves one token to draw.

**Per-row randomness.** A row of a batch with its own seed draws from a :class:`Stream`: counter-based noise, a fixed
function of the seed, the draw's number and the token's index, which one kernel call draws for every row of a step
(:func:`race_noise`). A row's tokens are then those it gets alone, whatever else runs beside it.
``torch.Generator`` rows (one ``exponential_`` call per row, exactly ``torch.multinomial``'s draw) stay supported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from efftx.host import host_values
from efftx.kernels import sampling_cpu
from efftx.kernels.row_noise import M32, M64, row_noise, splitmix64

MIN_TEMPERATURE = 1e-4  # temperatures below this (0 included) sample greedily


def is_greedy(temperature: float) -> bool:
    """Whether ``temperature`` samples greedily: 0, or anything below :data:`MIN_TEMPERATURE`."""
    return temperature < MIN_TEMPERATURE


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Mask (B, V) logits outside the top-k / nucleus top-p set with -inf (the most probable token always stays)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        drop[..., 0] = False  # ... and never less than the top token (a top_p that is 0 in float32)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def probabilities(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """The distribution tokens are drawn from; a greedy temperature (see :func:`is_greedy`) is one-hot at the argmax.
    Float32 CPU logits without autograd take the C++ kernel (:mod:`efftx.kernels.sampling_cpu`). A ``top_k`` of
    the vocabulary or more keeps every token, as 0 does (any Python int: the kernel takes 64 bits)."""
    if top_k >= logits.shape[-1]:
        top_k = 0
    fused = sampling_cpu.probabilities(logits, temperature, top_k, top_p)
    if fused is not None:
        return fused
    if is_greedy(temperature):
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)


def probabilities_per_row(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          *, kmax: int | None = None, nucleus: bool = True) -> torch.Tensor:
    """:func:`probabilities` with settings per row, in one pass for every row: (B, ..., V) logits, (B,) temperature
    (float), top_k (int, 0: none) and top_p (float) -> (B, ..., V) float32 distributions, row b's exactly
    ``probabilities(logits[b], temperature[b], top_k[b], top_p[b])`` (as float32): the same operations per row,
    a row's top-k threshold and nucleus taken from its own settings. ``kmax``: the largest top_k among the rows
    (None: work it out, a read from the device; 0: no row has one); ``nucleus`` False: no row has top_p < 1 (the
    sort is skipped). Greedy rows (:func:`is_greedy`) are one-hot at their argmax. Float32 CPU logits without
    autograd take the C++ kernel (:mod:`efftx.kernels.sampling_cpu`)."""
    v = logits.shape[-1]
    if kmax is None and sampling_cpu.takes(logits):
        kmax = int(top_k.max()) if top_k.numel() else 0  # on the CPU: no device to wait for
    fused = sampling_cpu.probabilities_rows(logits, temperature, top_k, top_p, kmax != 0, nucleus)
    if fused is not None:
        return fused
    shape = (logits.shape[0],) + (1,) * (logits.dim() - 1)
    greedy = (temperature < MIN_TEMPERATURE).view(shape)
    x = logits.float() / torch.where(greedy, 1.0, temperature.view(shape).float())
    if kmax is None:
        kmax = int(top_k.max()) if top_k.numel() else 0
    kmax = min(kmax, v)
    if kmax > 0:
        k = top_k.view(shape)
        has_k = (k > 0) & (k < v)  # rows without a top-k (or one past the vocabulary) keep every token
        kth = torch.topk(x, kmax, dim=-1).values.gather(-1, (torch.where(has_k, k, kmax) - 1).expand(*x.shape[:-1], 1))
        x = x.masked_fill(x < torch.where(has_k, kth, float("-inf")), float("-inf"))
    if nucleus:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        p = sorted_x.softmax(-1)
        drop = (p.cumsum(-1) - p >= top_p.view(shape).float()) & (top_p.view(shape) < 1.0)
        drop[..., 0] = False
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = x.softmax(-1)
    onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)  # one_hot reads its input
    return torch.where(greedy, onehot, probs)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens, every row from ``generator``: ``torch.multinomial(probs, 1, generator=...)``'s
    tokens (its exponential race, :func:`race`) without its input checks' host reads."""
    if is_greedy(temperature):
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    return _batch_race(probs, generator)


def _batch_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)``'s tokens: one noise draw for the whole batch."""
    return race(probs, torch.empty_like(probs).exponential_(generator=generator))


class Stream:
    """A row's random numbers, counter-based: the noise of its ``n``-th draw is a fixed function of its seed, ``n``
    and the element's index (:mod:`efftx.kernels.row_noise`). So the rows of a batch draw in one call (one kernel
    launch for every row, where a ``torch.Generator`` per row takes one per row), and a row draws the same values
    alone or in any batch, on any device (up to the last bit of a log). ``get_state`` / ``set_state``: the draws
    made so far, as a generator's state (a failed step is rewound by them)."""

    __slots__ = ("seed", "draws", "_base")

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64:
            raise ValueError(f"a seed must be an integer in [-2**63, 2**64), got {seed!r}")
        self.seed, self.draws = seed, 0
        self._base = splitmix64(seed & M64)

    @classmethod
    def fresh(cls) -> "Stream":
        """A stream seeded from torch's global RNG (a row given no seed: ``torch.manual_seed`` still repeats it)."""
        return cls(int(torch.randint(0, 2**62, ())))

    def key(self) -> tuple[int, int]:
        """The next draw's key (two 32-bit halves), counting the draw: :meth:`key_at` ``(draws)``."""
        key = self.key_at(self.draws)
        self.draws += 1
        return key

    def key_at(self, n: int) -> tuple[int, int]:
        """Draw ``n``'s key (two 32-bit halves), ``splitmix64(splitmix64(seed) ^ n)``, without counting a draw."""
        z = splitmix64(self._base ^ n)
        return z & M32, z >> 32

    def get_state(self) -> int:
        return self.draws

    def set_state(self, state: int) -> None:
        self.draws = int(state)

    def __repr__(self) -> str:
        return f"Stream(seed={self.seed}, draws={self.draws})"


def stream_noise(streams: Sequence[Stream | None], width: int, device: torch.device | str | None = None
                 ) -> torch.Tensor:
    """(B, width) float32 Exp(1) noise: row b the next draw of ``streams[b]`` (None: no draw, values never read),
    every row in one :func:`~efftx.kernels.row_noise.row_noise` call."""
    keys = [(0, 0) if s is None else s.key() for s in streams]
    return row_noise(host_values(keys, torch.int64, device).view(len(keys), 2), width)


def position_noise(streams: Sequence[Stream | None], count: int, width: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """(B, count, width) float32 Exp(1) noise of each row's next ``count`` draws, without counting them: row b's
    ``[i]`` is draw ``streams[b].draws + i`` (the noise :func:`stream_noise` would give it i draws later; None: a row
    that draws nothing, values never read), every row in one :func:`~efftx.kernels.row_noise.row_noise` call."""
    keys = [(0, 0) if s is None else s.key_at(s.draws + i) for s in streams for i in range(count)]
    return row_noise(host_values(keys, torch.int64, device).view(len(keys), 2), width).view(len(streams), count, width)


def race_noise(generators: list[torch.Generator | Stream | None], width: int, need: Sequence[bool] | None = None,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, width) Exp(1) noise for one draw per row (:func:`race`), row b drawn from ``generators[b]``: a
    :class:`Stream` (all such rows in one call), a ``torch.Generator`` (one ``exponential_`` call: the noise
    ``torch.multinomial`` draws with that generator for one sample) or None (the global RNG, likewise); rows with
    ``need[b]`` False hold 1 and leave their generator alone. Drawing does not depend on the distribution, so a
    step may draw its noise before the passes that use it."""
    wanted = [need is None or bool(need[b]) for b in range(len(generators))]
    if all(isinstance(g, Stream) for g in generators):
        noise = stream_noise([g if w else None for g, w in zip(generators, wanted)], width, device)
        if not all(wanted):
            noise = torch.where(host_values(wanted, torch.bool, noise.device)[:, None], noise, 1.0)
        return noise if dtype is None else noise.to(dtype)
    noise = torch.ones(len(generators), width, device=device, dtype=dtype)
    streams = [b for b, g in enumerate(generators) if isinstance(g, Stream) and wanted[b]]
    if streams:
        rows = host_values(streams, torch.long, noise.device)
        noise[rows] = stream_noise([generators[b] for b in streams], width, device).to(noise.dtype)
    for b, g in enumerate(generators):
        if wanted[b] and not isinstance(g, Stream):
            noise[b].exponential_(generator=g)
    return noise


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities, (B, V) :func:`race_noise` -> (B,) tokens: the exponential race argmax(p / E) (float32
    CPU tensors: in the C++ kernel, :mod:`efftx.kernels.sampling_cpu`)."""
    fused = sampling_cpu.race(probs, noise)
    return (probs / noise).argmax(-1) if fused is None else fused


def draw(probs: torch.Tensor, generators: list[torch.Generator | Stream | None],
         need: Sequence[bool] | None = None) -> torch.Tensor:
    """(B, V) probabilities -> (B,) tokens, row b drawn with ``generators[b]``, as the exponential race argmax(p / E),
    E ~ Exp(1) i.i.d. per token (:func:`race`): with a :class:`Stream`, E is its next draw (the rows of streams draw
    in one call); with a ``torch.Generator`` (None = the global RNG), exactly the token of
    ``torch.multinomial(probs[b][None], 1, generator=generators[b])``, which draws one sample that way (with every
    generator None, of ``torch.multinomial(probs, 1)``). One batched divide and argmax pick every row's token: no
    per-row call of ``multinomial``, whose input checks read two values back to the host per call (on a GPU, two
    synchronisations per row and step). Rows with ``need[b]`` False draw nothing (their generator is left alone) and
    get their argmax, a placeholder for the caller to ignore. Unlike ``multinomial``, invalid probabilities (NaN,
    negative) are not checked: they come from :func:`probabilities`, a softmax."""
    if need is None and all(g is None for g in generators):
        return _batch_race(probs, None)
    return race(probs, race_noise(generators, probs.shape[-1], need, probs.device, probs.dtype))

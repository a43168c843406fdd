"""Measured costs by size, for schedulers that choose by them (:mod:`efftx.serving.continuous`'s steps and prefills,
:mod:`efftx.generation.draft_length`'s speculative steps per draft length)."""

from __future__ import annotations

import bisect


class CostTable:
    """Measured seconds per size (a moving average each, the newest weighing ``weight``) and estimates between and
    beyond them, a cost growing about linearly in the size (rows of a step, prompt tokens of a prefill).

    A pass's time has outliers (a graph compiled at its first call, the machine's other work), which would make
    every round look unaffordable for many rounds: a sample under half the average replaces it (the average was
    the outlier), and one over twice the average counts as twice the average.

    Sizes up to ``EXACT`` are kept as they are (a step's rows, a short prompt's tokens); a larger one counts at the
    nearest of ``PER_OCTAVE`` sizes spaced evenly in its power-of-two octave (within 1/32 of it), so a long-lived
    replica's prefill table, which would gain a size for each new padded length, stays at a few hundred sizes."""

    EXACT, PER_OCTAVE = 64, 16

    def __init__(self, weight: float):
        self.weight = weight
        self.seconds: dict[int, float] = {}
        self._sizes: list[int] = []  # the sizes measured, in order (estimates run every round: no sort each time)

    @classmethod
    def key(cls, size: int) -> int:
        """The size that ``size``'s samples count at."""
        if size <= cls.EXACT:
            return size
        spacing = max(1, (1 << (size.bit_length() - 1)) // cls.PER_OCTAVE)  # the octave's lowest / PER_OCTAVE
        return round(size / spacing) * spacing

    def add(self, size: int, seconds: float) -> None:
        size = self.key(int(size))
        seconds = max(float(seconds), 0.0)
        old = self.seconds.get(size)
        if old is None:
            bisect.insort(self._sizes, size)
        if old is None or seconds < old / 2:
            self.seconds[size] = seconds
        else:
            self.seconds[size] = old + self.weight * (min(seconds, 2 * old) - old)

    def near(self, size: int, factor: float = 2.0) -> bool:
        """Whether a size within ``factor`` of ``size`` (either way) was measured."""
        at = bisect.bisect_left(self._sizes, size / factor)
        return at < len(self._sizes) and self._sizes[at] <= size * factor

    def estimate(self, size: int) -> float | None:
        """The seconds at ``size``: measured, else interpolated between the nearest sizes measured, else
        extrapolated from the two nearest (never below their line's floor: at least the nearest cost scaled by the
        sizes' ratio below it, at least the largest cost above it). None before anything was measured."""
        got = self.seconds.get(size)
        if got is not None or not self._sizes:
            return got
        sizes, at = self._sizes, bisect.bisect_left(self._sizes, size)  # sizes[at - 1] < size < sizes[at]
        if 0 < at < len(sizes):
            n1, n2 = sizes[at - 1], sizes[at]
            c1, c2 = self.seconds[n1], self.seconds[n2]
            return c1 + (c2 - c1) * (size - n1) / (n2 - n1)
        above = at == 0
        near = sizes[:2] if above else sizes[-2:]
        n1 = near[0] if above else near[-1]
        c1 = self.seconds[n1]
        slope = ((self.seconds[near[1]] - self.seconds[near[0]]) / (near[1] - near[0]) if len(near) == 2
                 else c1 / n1)
        line = c1 + max(slope, 0.0) * (size - n1)
        return max(line, c1 * size / n1) if above else max(line, c1)

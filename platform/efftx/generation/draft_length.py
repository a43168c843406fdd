"""Each step's draft length of a *coupled* speculative batch, chosen by its load.

Speculation pays where a step's cost hardly grows with the tokens it verifies: one row, or a GPU. On a CPU a batch's
verify pass soon costs its tokens (the small pair on a 2-core CPU, eager passes at 48 positions: a 16-row step
drafting 5 tokens, five draft passes and a verify pass of 6 tokens a row, cost 10.0 ms, a 16-row base step 2.2 ms),
so a full batch gets more tokens a second from short drafts or none. Coupled acceptance (:func:`~efftx.generation.speculative.accept_coupled`) makes every emitted token base
decoding's, whatever the draft length: the length may then follow the load without changing a request's tokens.

:class:`DraftLength` picks, for a step of B rows each drafting at most its own gamma, the length g (0: a base step,
the draft not run; its cache catches up at the next drafting step) with the most expected tokens a second:
``sum over rows of E(min(g, own)) / cost(B, g)``, where ``E(k) = 1 + a + ... + a^k`` (each draft accepted with
probability ``a``, independently) and ``cost(B, g)`` the measured seconds of such steps (a
:class:`~efftx.generation.cost_table.CostTable` per length, by rows). ``a`` is the batch's measured acceptance: drafts
accepted over drafts tried (a rejected one counts as tried; those after it do not). A length not measured yet within
a factor of two of the step's rows is tried first (largest first), so the tables fill from the first steps at each
batch size, and a cost is never only extrapolated from far smaller batches (which would keep a length that was
measured at this size over one that was not); :func:`~efftx.serving.continuous.warm_up` measures every length at a
replica's start.
"""

from __future__ import annotations

from collections.abc import Sequence

from efftx.generation.cost_table import CostTable


class DraftLength:
    """Draft lengths 0..``cap`` by measured step costs and acceptance (see the module docstring). ``least``: the
    shortest length it picks (1 where the draft's cache cannot catch up several tokens in one pass). ``sweep``: every
    step takes the next length in turn, 0, 1, ..., cap, 0, ... (a warm-up measuring them all)."""

    PRIOR = (1.0, 2.0)  # accepted, tried: an acceptance of 0.5 before any step
    DECAY = 0.95  # per step: the acceptance follows the batch's recent drafts

    def __init__(self, cap: int, weight: float = 0.25, least: int = 0):
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ValueError(f"a draft length cap must be an integer >= 1, got {cap!r}")
        if least not in (0, 1):
            raise ValueError(f"least must be 0 or 1, got {least!r}")
        self.cap, self.least = cap, least
        self.costs = {g: CostTable(weight) for g in range(cap + 1)}
        self.accepted, self.tried = self.PRIOR
        self.sweep = False
        self._turn = 0
        self.chosen = [0] * (cap + 1)  # steps run at each length

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tried

    @staticmethod
    def expected(a: float, k: int) -> float:
        """Tokens a row gets from a step drafting k tokens: 1 + a + ... + a^k."""
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def choose(self, own: Sequence[int]) -> int:
        """The length of a step whose rows draft at most ``own`` tokens each."""
        top = max(own)
        lengths = range(min(self.least, top), top + 1)
        if self.sweep:
            g = lengths[self._turn % len(lengths)]
            self._turn += 1
            return g
        rows, a = len(own), self.acceptance
        unmeasured = [g for g in lengths if not self.costs[g].near(rows)]
        if unmeasured:
            return unmeasured[-1]

        def rate(g: int) -> float:
            seconds = self.costs[g].estimate(rows)
            tokens = sum(self.expected(a, min(g, o)) for o in own)
            return tokens / seconds if seconds and seconds > 0 else float("inf")

        return max(reversed(lengths), key=rate)  # ties: the longer draft

    def forget_acceptance(self) -> None:
        """Back to the prior acceptance, the measured costs kept (after a warm-up, whose prompts are not the
        replica's)."""
        self.accepted, self.tried = self.PRIOR

    def alone(self) -> tuple[float, float] | None:
        """(seconds, expected tokens) of a step of one row drafting up to the cap, at the length it would take; None
        before every length it may take was measured."""
        if any(not self.costs[g].seconds for g in range(self.least, self.cap + 1)):
            return None
        g = max(range(self.least, self.cap + 1),
                key=lambda k: self.expected(self.acceptance, k) / self.costs[k].estimate(1))
        return self.costs[g].estimate(1), self.expected(self.acceptance, g)

    def record(self, g: int, rows: int, seconds: float, drafted: Sequence[int], accepted: Sequence[int]) -> None:
        """A step of length ``g`` over ``rows`` rows took ``seconds``; row r drafted ``drafted[r]`` and kept
        ``accepted[r]`` of them."""
        self.costs[g].add(rows, seconds)
        self.chosen[g] += 1
        tried = sum(n + (n < d) for d, n in zip(drafted, accepted) if d)
        if tried:
            self.accepted = self.DECAY * self.accepted + sum(accepted)
            self.tried = self.DECAY * self.tried + tried

    def report(self) -> dict:
        """The measured acceptance, steps per length and step costs (ms by rows) per length."""
        return {"acceptance": round(self.acceptance, 3), "steps": list(self.chosen),
                "step_ms": {str(g): {str(r): round(s * 1e3, 3) for r, s in sorted(t.seconds.items())}
                            for g, t in self.costs.items() if t.seconds}}

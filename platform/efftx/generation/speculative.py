"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a draft proposes, the target verifies.

One step, for one sequence whose caches hold every token but the last ("pending") one:

1. the draft decodes ``gamma`` tokens x_1..x_gamma one at a time, keeping its distributions q_i;
2. the target scores ``[pending, x_1..x_gamma]`` in one forward pass: distributions p_1..p_{gamma+1};
3. x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token is drawn
   from the normalised residual max(0, p_i - q_i) and the step ends; if all are accepted a bonus token is
   drawn from p_{gamma+1};
4. both caches are rewound past the rejected tokens.

Every emitted token is distributed exactly as the target would sample it; with greedy settings
(temperature 0) the output is token for token the target's greedy output. Batches run together with
per-row acceptance: each row rewinds its own caches, so rows advance by their own acceptance and
never see each other's tokens (see :func:`iter_speculative_rows`).

Adaptive gamma (``adaptive_gamma=True``): each row drafts its own number of tokens, from its recent
acceptance: one more after a step that accepted all its drafts, one fewer after a rejection, between 1 and
``max_gamma``. A batched step drafts as many tokens as its longest row needs; a row verifies only its own
(the extra draft tokens are rewound). Which tokens are proposed never changes what is emitted (the
acceptance rule is exact for any gamma), only how many target passes it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from efftx.generation.decode import Rows, as_rows, generators
from efftx.generation.sampling import draw, probabilities


@dataclass
class SpecStats:
    """Acceptance statistics of a speculative run."""

    gamma: int
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted draft tokens per step
    drafted: list[int] = field(default_factory=list)  # draft tokens verified per step (gamma, or a row's own)
    draft_calls: int = 0  # draft forward passes
    target_calls: int = 0  # target forward passes (the prefill included)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted over verified draft tokens."""
        return sum(self.accepted) / sum(self.drafted) if sum(self.drafted) else 0.0

    @property
    def histogram(self) -> list[int]:
        """histogram[n] = steps in which exactly n draft tokens were accepted (n = 0..gamma)."""
        counts = [0] * (self.gamma + 1)
        for n in self.accepted:
            counts[n] += 1
        return counts

    def result_fields(self) -> dict:
        """The acceptance fields of a serving result (ModeResult, StreamDone)."""
        return {"mean_accepted": self.mean_accepted, "acceptance_histogram": self.histogram,
                "draft_calls": self.draft_calls, "target_calls": self.target_calls}

    def to_dict(self) -> dict:
        return {"gamma": self.gamma, "steps": self.steps, "mean_accepted": self.mean_accepted,
                "histogram": self.histogram, "draft_calls": self.draft_calls, "target_calls": self.target_calls}


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); where p <= q everywhere (only possible when p == q), p itself."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def _one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs[None], 1, generator=generator)[0, 0])


def verify(p: torch.Tensor, q: torch.Tensor, drafted: list[int], ratios: list[float],
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """Accept/reject one row's drafted tokens. p: (gamma + 1, V) target distributions, q: (gamma, V)
    draft distributions, ``ratios[i]`` = p_i(x_i) / q_i(x_i). Returns (emitted tokens, accepted count)."""
    gamma = len(drafted)
    for i, x in enumerate(drafted):
        u = float(torch.rand((), generator=generator, device=p.device))
        if u < ratios[i]:  # accepted with probability min(1, p/q)
            continue
        return drafted[:i] + [_one(residual(p[i], q[i]), generator)], i
    return drafted + [_one(p[gamma], generator)], gamma  # all accepted: a bonus token from the target


def _check(target, draft, gamma: int, adaptive_gamma: bool = False, max_gamma: int | None = None) -> int:
    """Checks the arguments; returns the most tokens a row may draft in one step."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if max_gamma is not None and not adaptive_gamma:
        raise ValueError("max_gamma caps an adaptive gamma: it goes with adaptive_gamma=True")
    cap = gamma if max_gamma is None else int(max_gamma)
    if cap < gamma:
        raise ValueError(f"max_gamma ({max_gamma}) must be >= gamma ({gamma}), the starting value")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"target and draft vocabularies differ ({target.vocab_size} vs {draft.vocab_size})")
    return cap


def _draw_some(probs: torch.Tensor, generators: list[torch.Generator | None], need: list[bool]) -> torch.Tensor:
    """Like :func:`draw`, but only rows with ``need[b]`` draw (and use their generator); the others get their
    argmax, a placeholder that is never verified, so a row's random stream is the one it would use alone."""
    out = probs.argmax(-1)
    if all(g is None for g in generators):
        return torch.where(torch.tensor(need, device=probs.device), torch.multinomial(probs, 1).squeeze(-1), out)
    for b, (p, g) in enumerate(zip(probs, generators)):
        if need[b]:
            out[b] = torch.multinomial(p[None], 1, generator=g)[0, 0]
    return out


def next_gamma(gamma: int, drafted: int, accepted: int, cap: int) -> int:
    """A row's next draft length from its last step: one more after it accepted every draft (up to ``cap``),
    one fewer after a rejection (down to 1)."""
    return min(gamma + 1, cap) if accepted == drafted else max(1, gamma - 1)


@torch.no_grad()
def iter_speculative_rows(target, draft, prompts: Sequence[Sequence[int]] | torch.Tensor,
                          max_new_tokens: int | Sequence[int], *,
                          gamma: int = 5, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          seed: int | Sequence[int | None] | None = None, stats: SpecStats | None = None,
                          row_stats: list[SpecStats] | None = None, batched: bool | None = None,
                          adaptive_gamma: bool = False, max_gamma: int | None = None):
    """Speculative decoding of a batch of prompts (any lengths). Yields, per step, one list per row of
    the tokens that row emitted (empty once a row has its ``max_new_tokens``, which may be given per row).

    All rows draft and verify together: one batched draft pass per drafted token, one batched target
    pass per step, each row at its own position (ragged caches). Acceptance is decided per row, and
    each row's caches are rewound by its own count, so rows advance by different amounts and never
    see each other's tokens. Row r draws from its own generator (seed + r): its tokens are those it
    would get decoded alone (``seed`` may also be one seed per row). ``stats`` counts batched passes;
    ``row_stats[r]`` row r's own steps and the passes it took part in.
    ``batched=False`` (or a backend without ragged caches) runs the rows one after another.
    ``adaptive_gamma``: each row's draft length follows its acceptance (:func:`next_gamma`), starting at
    ``gamma``, at most ``max_gamma`` (default ``gamma``); the stats' histograms then run to ``max_gamma``.
    """
    cap = _check(target, draft, gamma, adaptive_gamma, max_gamma)
    rows = as_rows(prompts)
    n_rows = len(rows)
    limits = [int(max_new_tokens)] * n_rows if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(limits) != n_rows:
        raise ValueError(f"{len(limits)} max_new_tokens for {n_rows} prompts")
    longest = max(len(r) + m for r, m in zip(rows, limits))
    limit = min(target.max_seq_len, draft.max_seq_len)
    if longest + cap > limit:
        raise ValueError(f"prompt + max_new_tokens ({longest}) + {'max_gamma' if cap > gamma else 'gamma'} ({cap}) "
                         f"exceeds the models' max_seq_len={limit}")
    stats = stats if stats is not None else SpecStats(gamma=cap)
    row_stats = row_stats if row_stats is not None else [SpecStats(gamma=cap) for _ in rows]
    row_gamma = [gamma] * n_rows  # each row's draft length (fixed unless adaptive_gamma)
    device = next(target.parameters()).device
    gens = generators(seed, n_rows, device)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if batched is None:
        batched = target.supports_ragged and draft.supports_ragged
    total = longest + cap + 1
    t_rows, d_rows = Rows(target, n_rows, total, batched), Rows(draft, n_rows, total, batched)
    if max(len(r) for r in rows) > 1:  # caches hold every prompt token but the last: the first "pending"
        t_rows.prefill([r[:-1] for r in rows])
        d_rows.prefill([r[:-1] for r in rows])
        for s in [stats, *row_stats]:
            s.target_calls += 1
            s.draft_calls += 1
    pending = torch.tensor([r[-1] for r in rows], device=device)
    produced = [0] * n_rows
    while True:
        active = [n < m for n, m in zip(produced, limits)]
        if not any(active):
            return
        # this step drafts as many tokens as its longest-drafting row; a row verifies only its own
        gamma_step = max(g for g, a in zip(row_gamma, active) if a)
        tokens, q = [], []
        token = pending
        for i in range(gamma_step):
            dist = probabilities(d_rows.forward(token[:, None])[:, -1], **sampling)  # (B, V)
            need = [i < g for g in row_gamma]
            token = draw(dist, gens) if all(need) else _draw_some(dist, gens, need)
            tokens.append(token)
            q.append(dist)
        drafted, q = torch.stack(tokens, 1), torch.stack(q, 1)  # (B, gamma_step), (B, gamma_step, V)
        p = probabilities(t_rows.forward(torch.cat([pending[:, None], drafted], 1)), **sampling)  # (B, g+1, V)
        picked = drafted[..., None]
        ratios = (p[:, :gamma_step].gather(-1, picked) / q.gather(-1, picked).clamp_min(1e-30))[..., 0].tolist()
        drafted_list = drafted.tolist()
        emitted, accepted, keep = [], [], []
        for r in range(n_rows):
            if active[r]:
                g = row_gamma[r]
                out, n = verify(p[r, :g + 1], q[r, :g], drafted_list[r][:g], ratios[r][:g], gens[r])
            else:
                out, n = [], -1  # finished: this step is undone below
            out = out[: limits[r] - produced[r]]
            emitted.append(out)
            accepted.append(n)
            # tokens the caches keep after pending: the accepted ones, fewer where the output was cut at
            # the row's limit (so a finished row's caches end where its output ends); -1 = undo the step
            keep.append(min(n, len(out) - 1))
        # The target cache got pending + gamma_step drafted tokens; a row keeps pending + its kept tokens.
        t_rows.rewind([gamma_step - k for k in keep])
        # The draft saw pending + gamma_step - 1 drafted; a row that keeps all of them needs the last one too.
        held = gamma_step
        if gamma_step in keep:
            d_rows.forward(drafted[:, -1:])
            held = gamma_step + 1
        d_rows.rewind([held - 1 - k for k in keep])
        draft_passes = held
        for s in [stats] + [row_stats[r] for r in range(n_rows) if active[r]]:
            s.draft_calls += draft_passes
            s.target_calls += 1
        for r in range(n_rows):
            if active[r]:
                for s in (stats, row_stats[r]):
                    s.steps += 1
                    s.accepted.append(accepted[r])
                    s.drafted.append(row_gamma[r])
                produced[r] += len(emitted[r])
                if adaptive_gamma:
                    row_gamma[r] = next_gamma(row_gamma[r], row_gamma[r], accepted[r], cap)
        last = [e[-1] if e else int(t) for e, t in zip(emitted, pending.tolist())]
        pending = torch.tensor(last, device=device)
        yield emitted


def iter_speculative(target, draft, prompt: list[int], max_new_tokens: int, *, stats: SpecStats | None = None,
                     **kwargs):
    """Yield the tokens of each speculative step (a list of 1..gamma+1) for one prompt, up to max_new_tokens."""
    if not prompt:
        raise ValueError("the prompt is empty")
    for step in iter_speculative_rows(target, draft, [prompt], max_new_tokens, stats=stats, **kwargs):
        yield step[0]


def speculative_generate(target, draft, prompts: Sequence[Sequence[int]] | torch.Tensor,
                         max_new_tokens: int | Sequence[int], *,
                         gamma: int = 5, seed: int | None = None, batched: bool | None = None,
                         adaptive_gamma: bool = False, max_gamma: int | None = None,
                         **sampling) -> tuple[list[list[int]], SpecStats]:
    """Generate ``max_new_tokens`` per prompt (prompts may differ in length). Returns tokens and stats.

    Row r uses seed ``seed + r``; see :func:`iter_speculative_rows` (``adaptive_gamma``: a draft length per row
    from its acceptance, off by default: a fixed ``gamma``).
    """
    rows = as_rows(prompts)
    stats = SpecStats(gamma=max_gamma if adaptive_gamma and max_gamma is not None else gamma)
    outputs: list[list[int]] = [[] for _ in rows]
    for step in iter_speculative_rows(target, draft, rows, max_new_tokens, gamma=gamma, seed=seed, stats=stats,
                                      batched=batched, adaptive_gamma=adaptive_gamma, max_gamma=max_gamma,
                                      **sampling):
        for out, toks in zip(outputs, step):
            out.extend(toks)
    return outputs, stats

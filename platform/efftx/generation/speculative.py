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
    draft_calls: int = 0  # draft forward passes
    target_calls: int = 0  # target forward passes (the prefill included)

    @property
    def mean_accepted(self) -> float:
        return sum(self.accepted) / len(self.accepted) if self.accepted else 0.0

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


def _check(target, draft, gamma: int) -> None:
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"target and draft vocabularies differ ({target.vocab_size} vs {draft.vocab_size})")


@torch.no_grad()
def iter_speculative_rows(target, draft, prompts: Sequence[Sequence[int]] | torch.Tensor,
                          max_new_tokens: int | Sequence[int], *,
                          gamma: int = 5, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                          seed: int | Sequence[int | None] | None = None, stats: SpecStats | None = None,
                          row_stats: list[SpecStats] | None = None, batched: bool | None = None):
    """Speculative decoding of a batch of prompts (any lengths). Yields, per step, one list per row of
    the tokens that row emitted (empty once a row has its ``max_new_tokens``, which may be given per row).

    All rows draft and verify together: one batched draft pass per drafted token, one batched target
    pass per step, each row at its own position (ragged caches). Acceptance is decided per row, and
    each row's caches are rewound by its own count, so rows advance by different amounts and never
    see each other's tokens. Row r draws from its own generator (seed + r): its tokens are those it
    would get decoded alone (``seed`` may also be one seed per row). ``stats`` counts batched passes;
    ``row_stats[r]`` row r's own steps and the passes it took part in.
    ``batched=False`` (or a backend without ragged caches) runs the rows one after another.
    """
    _check(target, draft, gamma)
    rows = as_rows(prompts)
    n_rows = len(rows)
    limits = [int(max_new_tokens)] * n_rows if isinstance(max_new_tokens, int) else [int(m) for m in max_new_tokens]
    if len(limits) != n_rows:
        raise ValueError(f"{len(limits)} max_new_tokens for {n_rows} prompts")
    longest = max(len(r) + m for r, m in zip(rows, limits))
    limit = min(target.max_seq_len, draft.max_seq_len)
    if longest + gamma > limit:
        raise ValueError(f"prompt + max_new_tokens ({longest}) + gamma ({gamma}) "
                         f"exceeds the models' max_seq_len={limit}")
    stats = stats if stats is not None else SpecStats(gamma=gamma)
    row_stats = row_stats if row_stats is not None else [SpecStats(gamma=gamma) for _ in rows]
    device = next(target.parameters()).device
    gens = generators(seed, n_rows, device)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    if batched is None:
        batched = target.supports_ragged and draft.supports_ragged
    total = longest + gamma + 1
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
        tokens, q = [], []
        token = pending
        for _ in range(gamma):
            dist = probabilities(d_rows.forward(token[:, None])[:, -1], **sampling)  # (B, V)
            token = draw(dist, gens)
            tokens.append(token)
            q.append(dist)
        drafted, q = torch.stack(tokens, 1), torch.stack(q, 1)  # (B, gamma), (B, gamma, V)
        p = probabilities(t_rows.forward(torch.cat([pending[:, None], drafted], 1)), **sampling)  # (B, gamma+1, V)
        picked = drafted[..., None]
        ratios = (p[:, :gamma].gather(-1, picked) / q.gather(-1, picked).clamp_min(1e-30))[..., 0].tolist()
        drafted_list = drafted.tolist()
        emitted, accepted, keep = [], [], []
        for r in range(n_rows):
            if active[r]:
                out, n = verify(p[r], q[r], drafted_list[r], ratios[r], gens[r])
            else:
                out, n = [], -1  # finished: this step is undone below
            out = out[: limits[r] - produced[r]]
            emitted.append(out)
            accepted.append(n)
            # tokens the caches keep after pending: the accepted ones, fewer where the output was cut at
            # the row's limit (so a finished row's caches end where its output ends); -1 = undo the step
            keep.append(min(n, len(out) - 1))
        # The target cache got pending + gamma drafted tokens; a row keeps pending + its kept tokens.
        t_rows.rewind([gamma - k for k in keep])
        # The draft saw pending + gamma - 1 drafted; a row that keeps all needs the last one too.
        held = gamma
        if gamma in keep:
            d_rows.forward(drafted[:, -1:])
            held = gamma + 1
        d_rows.rewind([held - 1 - k for k in keep])
        draft_passes = gamma + (held - gamma)
        for s in [stats] + [row_stats[r] for r in range(n_rows) if active[r]]:
            s.draft_calls += draft_passes
            s.target_calls += 1
        for r in range(n_rows):
            if active[r]:
                for s in (stats, row_stats[r]):
                    s.steps += 1
                    s.accepted.append(accepted[r])
                produced[r] += len(emitted[r])
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
                         **sampling) -> tuple[list[list[int]], SpecStats]:
    """Generate ``max_new_tokens`` per prompt (prompts may differ in length). Returns tokens and stats.

    Row r uses seed ``seed + r``; see :func:`iter_speculative_rows`.
    """
    rows = as_rows(prompts)
    stats = SpecStats(gamma=gamma)
    outputs: list[list[int]] = [[] for _ in rows]
    for step in iter_speculative_rows(target, draft, rows, max_new_tokens, gamma=gamma, seed=seed, stats=stats,
                                      batched=batched, **sampling):
        for out, toks in zip(outputs, step):
            out.extend(toks)
    return outputs, stats

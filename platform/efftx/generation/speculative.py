"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a draft proposes, the target verifies.

One step, for one sequence whose caches hold every token but the last ("pending") one:

1. the draft decodes ``gamma`` tokens x_1..x_gamma one at a time, keeping its distributions q_i;
2. the target scores ``[pending, x_1..x_gamma]`` in one forward pass: distributions p_1..p_{gamma+1};
3. x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a token is drawn
   from the normalised residual max(0, p_i - q_i) and the step ends; if all are accepted a bonus token is
   drawn from p_{gamma+1};
4. both caches are rewound past the rejected tokens.

Every emitted token is distributed exactly as the target would sample it; with greedy settings
(temperature 0) the output is token for token the target's greedy output. Batches run row by row, each
row with its own caches, so rows advance by their own acceptance and never see each other's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from efftx.generation.decode import decode_one
from efftx.generation.sampling import probabilities


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

    def to_dict(self) -> dict:
        return {"gamma": self.gamma, "steps": self.steps, "mean_accepted": self.mean_accepted,
                "histogram": self.histogram, "draft_calls": self.draft_calls, "target_calls": self.target_calls}


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator)[..., 0]


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); where p <= q everywhere (only possible when p == q), p itself."""
    r = (p - q).clamp_min(0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


@torch.no_grad()
def speculative_step(target, draft, pending: torch.Tensor, t_cache, d_cache, gamma: int, sampling: dict,
                     generator: torch.Generator | None, stats: SpecStats) -> list[int]:
    """One draft-and-verify step for a single sequence (batch 1). Returns the emitted tokens (1..gamma+1)."""
    drafted, q = [], []
    token = pending
    for _ in range(gamma):
        dist = probabilities(decode_one(draft, token, d_cache), **sampling)[0]  # (V,)
        stats.draft_calls += 1
        token = _draw(dist, generator).view(1)
        drafted.append(token)
        q.append(dist)
    block = torch.cat([pending] + drafted).view(1, gamma + 1)
    p = probabilities(target(block, cache=t_cache)[0], **sampling)  # (gamma + 1, V)
    stats.target_calls += 1

    emitted, n = [], 0
    for i in range(gamma):
        x = int(drafted[i])
        ratio = p[i, x] / q[i][x].clamp_min(1e-30)
        u = torch.rand((), generator=generator, device=p.device)
        if u < ratio:  # accepted with probability min(1, p/q)
            emitted.append(x)
            n += 1
            continue
        emitted.append(int(_draw(residual(p[i], q[i]), generator)))
        break
    else:
        emitted.append(int(_draw(p[gamma], generator)))  # all accepted: a bonus token from the target

    # target cache holds pending + gamma drafted; keep pending + n accepted
    t_cache.rewind(gamma - n)
    # draft cache holds pending + gamma - 1 drafted; keep pending + n accepted
    if n == gamma:
        decode_one(draft, drafted[-1], d_cache)  # the last drafted token was never fed to the draft
        stats.draft_calls += 1
    else:
        d_cache.rewind(gamma - 1 - n)
    stats.steps += 1
    stats.accepted.append(n)
    return emitted


def _check(target, draft, gamma: int) -> None:
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"target and draft vocabularies differ ({target.vocab_size} vs {draft.vocab_size})")


@torch.no_grad()
def iter_speculative(target, draft, prompt: list[int], max_new_tokens: int, *, gamma: int = 5,
                     temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     stats: SpecStats | None = None):
    """Yield the tokens of each speculative step (a list of 1..gamma+1) for one prompt, up to max_new_tokens."""
    _check(target, draft, gamma)
    if not prompt:
        raise ValueError("the prompt is empty")
    limit = min(target.max_seq_len, draft.max_seq_len)
    if len(prompt) + max_new_tokens + gamma > limit:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) + gamma ({gamma}) "
                         f"exceeds the models' max_seq_len={limit}")
    stats = stats if stats is not None else SpecStats(gamma=gamma)
    device = next(target.parameters()).device
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    tokens = torch.tensor(prompt, dtype=torch.long, device=device)
    total = len(prompt) + max_new_tokens + gamma + 1
    t_cache, d_cache = target.new_cache(1, total), draft.new_cache(1, total)
    if len(prompt) > 1:
        target(tokens[None, :-1], cache=t_cache)
        draft(tokens[None, :-1], cache=d_cache)
        stats.target_calls += 1
        stats.draft_calls += 1
    pending = tokens[-1:]
    produced = 0
    while produced < max_new_tokens:
        emitted = speculative_step(target, draft, pending, t_cache, d_cache, gamma, sampling, gen, stats)
        emitted = emitted[: max_new_tokens - produced]
        produced += len(emitted)
        yield emitted
        pending = torch.tensor(emitted[-1:], dtype=torch.long, device=device)


def speculative_generate(target, draft, prompts: list[list[int]] | torch.Tensor, max_new_tokens: int, *,
                         gamma: int = 5, seed: int | None = None, **sampling) -> tuple[list[list[int]], SpecStats]:
    """Generate ``max_new_tokens`` per prompt (prompts may differ in length). Returns tokens and stats.

    Row r uses seed ``seed + r``; rows run one after another, each with its own caches.
    """
    _check(target, draft, gamma)
    rows = prompts.tolist() if isinstance(prompts, torch.Tensor) else [list(p) for p in prompts]
    stats = SpecStats(gamma=gamma)
    outputs = []
    for r, prompt in enumerate(rows):
        if not prompt:
            raise ValueError(f"prompt {r} is empty")
        row_seed = None if seed is None else seed + r
        steps = iter_speculative(target, draft, prompt, max_new_tokens, gamma=gamma, seed=row_seed,
                                 stats=stats, **sampling)
        outputs.append([tok for step in steps for tok in step])
    return outputs, stats

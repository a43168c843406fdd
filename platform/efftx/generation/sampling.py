"""Turn logits into tokens: temperature, top-k, top-p. No host synchronisation in this path.

**Temperature floor.** ``temperature`` 0 is greedy (the argmax). Temperatures above 0 but below
:data:`MIN_TEMPERATURE` are greedy too: dividing float32 logits by such a value overflows to ±inf (or, below
float32's smallest subnormal, divides by zero), and the softmax of that is NaN; at any temperature this small
the distribution is one-hot at the argmax anyway, up to exact ties. **top_p** always keeps the most probable
token, so even a ``top_p`` that rounds to 0 in float32 (``1e-300``) leaves one token to draw.
"""

from __future__ import annotations

import torch

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
    """The distribution tokens are drawn from; a greedy temperature (see :func:`is_greedy`) is one-hot at the argmax."""
    if is_greedy(temperature):
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens."""
    if is_greedy(temperature):
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """(B, V) probabilities -> (B,) tokens, row b drawn with ``generators[b]`` (None = the global RNG)."""
    if all(g is None for g in generators):
        return torch.multinomial(probs, 1).squeeze(-1)
    return torch.cat([torch.multinomial(p[None], 1, generator=g)[0] for p, g in zip(probs, generators)])

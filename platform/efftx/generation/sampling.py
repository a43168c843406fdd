"""Turn logits into tokens: temperature, top-k, top-p. No host synchronisation in this path.

**Temperature floor.** ``temperature`` 0 is greedy (the argmax). Temperatures above 0 but below
:data:`MIN_TEMPERATURE` are greedy too: dividing float32 logits by such a value overflows to ±inf (or, below
float32's smallest subnormal, divides by zero), and the softmax of that is NaN; at any temperature this small
the distribution is one-hot at the argmax anyway, up to exact ties. **top_p** always keeps the most probable
token, so even a ``top_p`` that rounds to 0 in float32 (``1e-300``) leaves one token to draw.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    """(B, V) logits -> (B,) tokens, every row from ``generator``: ``torch.multinomial(probs, 1, generator=...)``'s
    tokens (its exponential race, :func:`race`) without its input checks' host reads."""
    if is_greedy(temperature):
        return logits.argmax(-1)
    probs = probabilities(logits, temperature, top_k, top_p)
    return _batch_race(probs, generator)


def _batch_race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``torch.multinomial(probs, 1, generator=generator)``'s tokens: one noise draw for the whole batch."""
    return race(probs, torch.empty_like(probs).exponential_(generator=generator))


def race_noise(generators: list[torch.Generator | None], width: int, need: Sequence[bool] | None = None,
               device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(B, width) Exp(1) noise for one draw per row (:func:`race`): row b filled by one ``exponential_`` call with
    ``generators[b]`` (None = the global RNG), the noise ``torch.multinomial`` draws with that generator for one
    sample; rows with ``need[b]`` False hold 1 and leave their generator alone. Drawing does not depend on the
    distribution, so a step may draw its noise before the passes that use it."""
    noise = torch.ones(len(generators), width, device=device, dtype=dtype)
    for b, g in enumerate(generators):
        if need is None or need[b]:
            noise[b].exponential_(generator=g)
    return noise


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(B, V) probabilities, (B, V) :func:`race_noise` -> (B,) tokens: the exponential race argmax(p / E)."""
    return (probs / noise).argmax(-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None],
         need: Sequence[bool] | None = None) -> torch.Tensor:
    """(B, V) probabilities -> (B,) tokens, row b drawn with ``generators[b]`` (None = the global RNG): exactly the
    token of ``torch.multinomial(probs[b][None], 1, generator=generators[b])``, which draws one sample as the
    exponential race argmax(p / E), E ~ Exp(1) i.i.d. per token (with every generator None, of
    ``torch.multinomial(probs, 1)``). Each row fills its own row of one noise tensor from its generator and one
    batched divide and argmax pick every row's token: no per-row call of ``multinomial``, whose input checks read
    two values back to the host per call (on a GPU, two synchronisations per row and step). Rows with ``need[b]``
    False draw nothing (their generator is left alone) and get their argmax, a placeholder for the caller to
    ignore. Unlike ``multinomial``, invalid probabilities (NaN, negative) are not checked: they come from
    :func:`probabilities`, a softmax."""
    if need is None and all(g is None for g in generators):
        return _batch_race(probs, None)
    return race(probs, race_noise(generators, probs.shape[-1], need, probs.device, probs.dtype))

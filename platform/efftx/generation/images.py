"""Text-to-image sampling with DALL-E: image tokens one at a time (KV cache), then the dVAE decodes them.

    generate_image_tokens(model, text, num_images=1, filter_thres=0.5, top_p=1.0, temperature=1.0,
                          cond_scale=1.0, seed=None, use_cache=True) -> (P * num_images, M) codes
    generate_images(model, text, **same) -> ((P * num_images, C, S, S) images in [0, 1], codes)

``text`` holds P captions (caption ids, 0 = padding); row ``p * num_images + i`` is image i of caption p.

**Filtering.** ``filter_thres`` is the original's top-k: keep the ``ceil((1 - filter_thres) * K)``
largest of the K image logits (at least one); then ``top_p`` (nucleus) and ``temperature``
(0, or below ``MIN_TEMPERATURE``, = greedy), through :mod:`efftx.generation.sampling`.

**Guidance.** With ``cond_scale != 1`` every caption row has a twin whose caption is all padding (the
"null" caption the model saw with probability ``dalle.null_cond_prob`` in training). Both run as one
doubled batch through one cache, and each step samples from
``null + (cond - null) * cond_scale``; both twins are then fed the same sampled token. (The original
package ran the null pass through the conditional pass's cache, so its cached guided samples differ from
uncached ones.)

**Seeds.** ``seed`` is one int (one generator draws every row's tokens, in row order) or one seed per
row (``P * num_images`` entries, None = the global RNG): each row then draws from its own generator,
so a row's image does not depend on what else is in the batch. The image server batches requests
this way.

**Exactness.** ``use_cache=False`` recomputes the whole sequence at every step: the reference the cached
path is tested against. Both draw from the same seeded generator in the same order, so with the same seed
they give the same tokens (up to float rounding of the logits deciding a draw that lands on a boundary).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from efftx.generation.decode import generators
from efftx.generation.sampling import draw, is_greedy, probabilities, sample


def top_k_of_thres(filter_thres: float, vocab: int) -> int:
    """The original's ``filter_thres`` as a top-k: ceil((1 - filter_thres) * vocab), at least 1."""
    return max(1, math.ceil((1.0 - filter_thres) * vocab - 1e-9))


def _check(model, text, num_images, filter_thres, top_p, temperature, cond_scale) -> None:
    if text.ndim != 2 or text.shape[0] == 0 or text.shape[1] == 0:
        raise ValueError(f"text must be a non-empty (prompts, length) tensor of caption ids; got {tuple(text.shape)}")
    if text.shape[1] > model.text_seq_len:
        raise ValueError(f"captions of {text.shape[1]} tokens exceed dalle.text_seq_len={model.text_seq_len}")
    if text.is_floating_point() or text.min() < 0 or text.max() >= model.vocab_size:
        raise ValueError(f"caption ids must be integers in [0, {model.vocab_size}) (model.vocab_size)")
    if num_images < 1:
        raise ValueError(f"num_images must be >= 1, got {num_images}")
    if not 0 <= filter_thres <= 1:
        raise ValueError(f"filter_thres must be in [0, 1], got {filter_thres}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not math.isfinite(cond_scale) or cond_scale < 0:
        raise ValueError(f"cond_scale must be a finite number >= 0, got {cond_scale}")


@torch.no_grad()
def generate_image_tokens(model, text: torch.Tensor, *, num_images: int = 1, filter_thres: float = 0.5,
                          top_p: float = 1.0, temperature: float = 1.0, cond_scale: float = 1.0,
                          seed: int | Sequence[int | None] | None = None, use_cache: bool = True) -> torch.Tensor:
    """Sample the image codes of ``num_images`` images per caption: (P * num_images, M) long."""
    _check(model, text, num_images, filter_thres, top_p, temperature, cond_scale)
    device = model.text_emb.weight.device
    captions = text.to(device).repeat_interleave(num_images, dim=0)  # (R, L)
    rows = captions.shape[0]
    guided = cond_scale != 1
    prefix = model.prepare_text(captions)  # (R, N + 1)
    if guided:  # [conditional rows; null rows]
        prefix = torch.cat([prefix, model.prepare_text(torch.zeros_like(captions))])
    twin = (lambda t: torch.cat([t, t])) if guided else (lambda t: t)  # noqa: E731
    top_k = top_k_of_thres(filter_thres, model.num_image_tokens)
    if isinstance(seed, (list, tuple)):
        if len(seed) != rows:
            raise ValueError(f"seed: {len(seed)} seeds for {rows} images (one per image, or one int)")
        gens = generators(list(seed), rows, device)
        pick = lambda logits: (logits.argmax(-1) if is_greedy(temperature)  # noqa: E731
                               else draw(probabilities(logits, temperature, top_k, top_p), gens))
    else:
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        pick = lambda logits: sample(logits, temperature, top_k, top_p, gen)  # noqa: E731
    codes = torch.zeros(rows, model.image_seq_len, dtype=torch.long, device=device)

    cache = model.new_cache(prefix.shape[0]) if use_cache else None
    h = model.hidden(prefix, cache)[:, -1] if use_cache else None
    for i in range(model.image_seq_len):
        if not use_cache:
            h = model.hidden(torch.cat([prefix, twin(codes[:, :i])], dim=1))[:, -1]
        logits = model.image_logits(h).float()  # (R or 2R, K)
        if guided:
            cond, null = logits.chunk(2)
            logits = null + (cond - null) * cond_scale
        codes[:, i] = pick(logits)
        if use_cache and i + 1 < model.image_seq_len:
            h = model.hidden(twin(codes[:, i:i + 1]), cache)[:, -1]
    return codes


@torch.no_grad()
def generate_images(model, text: torch.Tensor, **sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample codes (see :func:`generate_image_tokens`) and decode them with the model's dVAE.
    -> (images (P * num_images, C, S, S) float32 in [0, 1], codes (P * num_images, M))."""
    codes = generate_image_tokens(model, text, **sampling)
    return model.vae.decode(codes).float(), codes

"""Prefill + one-token decoding over any model cache."""

from __future__ import annotations

import torch

from efftx.generation.sampling import sample


@torch.no_grad()
def prefill(model, tokens: torch.Tensor, cache) -> torch.Tensor:
    """Run the prompt (B, T) through the model, filling ``cache``; return last-position logits (B, V)."""
    return model(tokens, cache=cache)[:, -1]


@torch.no_grad()
def decode_one(model, token: torch.Tensor, cache) -> torch.Tensor:
    """Feed one token per row (B,), return next-token logits (B, V)."""
    return model(token[:, None], cache=cache)[:, -1]


@torch.no_grad()
def iter_generate(model, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
    """Yield (B,) tokens one step at a time after ``prompt`` (B, T), decoding with a cache."""
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise ValueError("prompt must be a non-empty (batch, length) tensor")
    total = prompt.shape[1] + max_new_tokens
    if total > model.max_seq_len:
        raise ValueError(f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} "
                         f"exceeds the model's max_seq_len={model.max_seq_len}")
    gen = None
    if seed is not None:
        gen = torch.Generator(device=prompt.device)
        gen.manual_seed(seed)
    cache = model.new_cache(prompt.shape[0], total)
    logits = prefill(model, prompt, cache)
    for i in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, gen)
        yield token
        if i + 1 < max_new_tokens:
            logits = decode_one(model, token, cache)


def generate(model, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
    """Sample ``max_new_tokens`` after ``prompt`` (B, T) with a cache; returns (B, max_new_tokens)."""
    return torch.stack(list(iter_generate(model, prompt, max_new_tokens, **sampling)), dim=1)


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(tokens) -> str:
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")

"""Decoder-only language model over bytes (or any token vocabulary).

    tokens (B, T) -> embed [-> emb_dim to dim] -> depth x Block (plain or reversible) -> norm -> logits (B, T, vocab)

With ``model.activation_checkpointing`` the plain blocks are recomputed in backward instead of storing their activations.

``forward(tokens, cache=None)``: with a cache (from ``new_cache``) the tokens continue the cached
sequence, which is how prefill and one-token decoding work for every attention backend.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from efftx.attention.base import AttentionSpec
from efftx.attention.cache import ModelCache
from efftx.flops import attention_cost
from efftx.kernels import linear_cpu
from efftx.kernels.linear_cpu import Linear
from efftx.models import cpu_plan
from efftx.models.layers import Block, Rotary, make_norm
from efftx.models.registry import numel
from efftx.models.registry import register
from efftx.models.reversible import ReversibleStack, run_blocks


class LM(nn.Module):
    """``LM(model, attention, seed=0)``: built from the model-only sections of a run config (``model.*`` and
    ``attention.*``, :class:`efftx.config.ModelConfig` / ``AttentionConfig``), so an export's config, a test
    or a benchmark rebuilds it without a run. ``seed`` seeds what backends draw at random (Performer
    features); runs pass ``train.seed``."""

    def __init__(self, model, attention, *, seed: int = 0):
        super().__init__()
        m = model
        self.model_cfg, self.attention_cfg, self.seed = model, attention, seed
        self.vocab_size = m.vocab_size
        self.max_seq_len = m.max_seq_len
        emb_dim = m.emb_dim or m.dim
        spec0 = AttentionSpec.from_config(m, attention, seed=seed)
        self.embed = nn.Embedding(m.vocab_size, emb_dim)
        # factorised embedding: a small table, projected up to the model width (and back for the logits)
        self.emb_in = Linear(emb_dim, m.dim, bias=False) if emb_dim != m.dim else None
        self.emb_out = Linear(m.dim, emb_dim, bias=False) if emb_dim != m.dim else None
        self.rotary = Rotary(spec0.head_dim, m.max_seq_len, m.rotary_base) if m.rotary else None
        self.pos = None if m.rotary else nn.Embedding(m.max_seq_len, m.dim)
        self.blocks = nn.ModuleList(
            Block(AttentionSpec.from_config(m, attention, layer_index=i, seed=seed), m.norm, m.mlp_mult, self.rotary, m.dropout,
                  m.ff_chunks)
            for i in range(m.depth)
        )
        self.reversible = ReversibleStack(list(self.blocks)) if m.reversible else None
        self.activation_checkpointing = m.activation_checkpointing  # recompute each block in backward
        self.norm = make_norm(m.norm, m.dim)
        self.head = None if m.tie_embeddings else Linear(emb_dim, m.vocab_size, bias=False)
        init_weights(self, m)

    @staticmethod
    def _init(module):
        """The initialisation before issue 20 (every Linear and Embedding N(0, 0.02)); DALL-E still applies it."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    @property
    def supports_ragged(self) -> bool:
        """Whether one cache may hold rows of different lengths (else rows decode one at a time)."""
        return all(blk.attention.inner.supports_ragged for blk in self.blocks)

    def new_cache(self, batch_size: int, max_len: int | None = None) -> ModelCache:
        p = self.embed.weight
        max_len = max_len or self.max_seq_len
        return ModelCache([blk.attention.inner.new_cache(batch_size, max_len, p.device, p.dtype)
                           for blk in self.blocks])

    def forward(self, tokens: torch.Tensor, cache: ModelCache | None = None) -> torch.Tensor:
        longest = (cache.end if cache is not None else 0) + tokens.shape[1]
        if longest > self.max_seq_len:
            raise ValueError(f"sequence of {longest} tokens exceeds model.max_seq_len={self.max_seq_len}")
        if cache is not None:  # a cached CPU pass all of whose calls take the C++ kernels: one flat run of them
            planned = cpu_plan.plan_for(self, tokens, cache)
            if planned is not None:
                return planned[0].run(tokens, cache, planned[1])
        return self.logits(tokens, cache)

    def _apply(self, fn, recurse=True):
        cpu_plan.forget(self)  # .to(), .double(), ...: the weights the plan holds may change device or type
        return super()._apply(fn, recurse)

    def logits(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        """``forward`` without its host-side length check: what compiled decoding traces (its cache keeps row
        lengths on the device, and the caller checks capacity on the host before each step)."""
        t = tokens.shape[1]
        offset = cache.offset() if cache is not None else 0  # int, or (B, 1) when rows differ in length
        x = self.embed(tokens)  # (B, T, emb_dim)
        if self.emb_in is not None:
            x = self.emb_in(x)  # (B, T, dim)
        if self.pos is not None:
            x = x + self.pos(offset + torch.arange(t, device=tokens.device))  # (T,) or (B, T) positions
        x = run_blocks(x, self.blocks, self.reversible, cache, checkpoint=self.activation_checkpointing)
        x = self.norm(x)
        if self.emb_out is not None:
            x = self.emb_out(x)  # (B, T, emb_dim)
        weight = self.embed.weight if self.head is None else self.head.weight
        return linear_cpu.linear(x, weight)  # (B, T, vocab)

    def num_params(self) -> int:
        return sum(numel(p) for p in self.parameters())  # ZeRO-3 partitions leave p.numel() 0

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 x matmul weights + 3 x each layer's attention forward FLOPs per token
        (:func:`efftx.flops.attention_cost`, per backend: 12·H·D·T per layer for full attention, PaLM appendix B).

        Embedding lookups are not matmuls; the output projection is (tied or not). Attention parameters not applied
        once per token (Sinkhorn's sort net, NSA's compression) are counted by the backend's cost instead. Reversible
        and checkpointed blocks recompute their forward in the backward pass: that extra work is not counted (MFU
        convention).
        """
        lookups = (numel(self.pos.weight) if self.pos is not None else 0)
        lookups += numel(self.embed.weight) if self.head is not None else 0
        attention_flops, excluded = 0.0, 0
        for blk in self.blocks:
            cost = attention_cost(blk.attention.spec, seq_len)
            attention_flops += 3 * cost.forward / seq_len
            excluded += sum(numel(p) for name, p in blk.attention.inner.named_parameters()
                            if name.startswith(cost.excluded))
        return 6 * (self.num_params() - lookups - excluded) + attention_flops


def init_weights(model: nn.Module, m) -> None:
    """Initialise ``model`` (an LM: ``embed``, optional ``pos``, ``blocks``) as ``model.init*`` say (ModelConfig).

    ``normal``: Linear weights N(0, init_std) and zero biases; the token embedding (also the tied output head) and
    learned positions N(0, emb_init_std); with ``residual_init_scale`` each block's attention output and MLP down
    projection N(0, init_std / sqrt(2 * depth)). ``torch``: the modules keep PyTorch's defaults."""
    if m.init == "torch":
        return
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=m.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=m.emb_init_std)
    if m.residual_init_scale:
        std = m.init_std / math.sqrt(2 * m.depth)
        for blk in model.blocks:
            for proj in (getattr(blk.attn.fn, "out", None), getattr(blk.mlp.fn, "down", None)):
                if isinstance(proj, nn.Linear):
                    nn.init.normal_(proj.weight, std=std)


@register("lm")
def _build(cfg) -> LM:
    return LM(cfg.model, cfg.attention, seed=cfg.train.seed)

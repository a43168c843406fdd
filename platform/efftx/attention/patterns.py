"""DALL-E's attention patterns over one text-then-image sequence: axial_row, axial_col, conv_like, sparse.

The sequence (an :class:`ImageLayout`): positions ``[0, text_len)`` are text (DALL-E's <bos> and caption),
position ``text_len + j`` is image token ``j``, at row ``j // fmap`` and column ``j % fmap`` of the token
grid. Every pattern is causal and keeps text fully causal:

* a **text** query sees every text position up to its own, and never an image position (they all come later);
* an **image** query sees every text position, and the earlier (or same) image positions its pattern allows:

  ==============  ===========================================================================================
  ``axial_row``   its own row (columns up to its own)
  ``axial_col``   its own column (rows up to its own)
  ``conv_like``   the ``kernel_size`` x ``kernel_size`` window ending at its own row and column: rows
                  ``r - a*dilation`` and columns ``c - b*dilation`` for ``a, b`` in ``[0, kernel_size)``
                  (above and to the left, itself included), as the original's causal convolution pattern
  ``sparse``      a fixed block-sparse layout over the whole sequence (blocks of ``block_size`` positions):
                  its own block and the ``local_blocks - 1`` before it, plus ``random_blocks`` older blocks
                  per query block, drawn once from ``train.seed`` and the layer index (so an export rebuilds
                  the same layout); text blocks are global, as in the original's DeepSpeed layout
  ==============  ===========================================================================================

The layout and the pattern's own options (``attention.conv_like``, ``attention.sparse``) reach the backend
as ``spec.options`` (an :class:`ImageLayout`), built by the DALL-E model from ``dalle.text_seq_len``, the
dVAE's token grid and the config; these backends cannot serve a plain language model.

**Masks.** A pattern is one boolean ``(S, S)`` mask, ``S = text_len + fmap**2``, built once per pattern and
device (layers with the same pattern share it). A forward pass with a cache slices the rows of its new
query positions and the columns of all cached keys, so prefill, chunked prefill and one-token decoding use
exactly the rows the full forward uses; the cache is the plain :class:`KVCache` (rewind included).
The masked scores cost what full attention costs: the patterns change what image tokens see (the model's
inductive bias), not the speed.

**Stable softmax** (``ImageLayout.stable``, from ``dalle.stable_softmax``): instead of SDPA, the explicit
path of the seed's ``stable`` flag: ``q`` is scaled down by ``alpha = 32**2`` before ``q @ k^T`` (so fp16
products cannot overflow), the row maximum is subtracted (detached), the scores are scaled back by
``alpha`` and the softmax is taken in fp32. The result is the same distribution (tested against SDPA).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import efftx.attention.registry as registry
from efftx.attention.base import AttentionBackend, AttentionSpec
from efftx.attention.cache import KVCache
from efftx.attention.registry import register
from efftx.errors import ConfigError

STABLE_ALPHA = 32.0 ** 2


@dataclass
class ConvLikeOptions:
    """attention.kind=conv_like, a DALL-E layer type (dalle.attn_types): an image token attends to every text
    token and to the kernel_size x kernel_size window of image tokens ending at its own row and column
    (above and to the left, itself included), ``dilation`` apart, as the original's convolution-like pattern."""

    kernel_size: int = 5  # odd
    dilation: int = 1

    def validate(self, spec: AttentionSpec) -> None:
        """Checks of this section; errors name the keys."""
        for key, value in {"kernel_size": self.kernel_size, "dilation": self.dilation}.items():
            if value < 1:
                raise ConfigError(f"attention.conv_like.{key} must be >= 1, got {value}")
        if self.kernel_size % 2 == 0:
            raise ConfigError(f"attention.conv_like.kernel_size must be odd, got {self.kernel_size}")


@dataclass
class SparseOptions:
    """attention.kind=sparse, a DALL-E layer type: a fixed block-sparse layout over the whole sequence (the
    original used DeepSpeed's variable sparsity: global text blocks, a local window and random blocks)."""

    block_size: int = 16  # tokens per block
    local_blocks: int = 4  # an image token sees its own block and the local_blocks - 1 blocks before it
    random_blocks: int = -1  # older blocks each query block also sees, drawn once from train.seed and the
    #                          layer index; -1 = (blocks in the sequence) // 4, as the original; 0 = none

    def validate(self, spec: AttentionSpec) -> None:
        """Checks of this section; errors name the keys."""
        for key, value in {"block_size": self.block_size, "local_blocks": self.local_blocks}.items():
            if value < 1:
                raise ConfigError(f"attention.sparse.{key} must be >= 1, got {value}")
        if self.random_blocks < -1:
            raise ConfigError(f"attention.sparse.random_blocks must be >= -1 (-1 = automatic), got "
                              f"{self.random_blocks}")


@dataclass(frozen=True)
class ImageLayout:
    """Where text and image tokens sit in the sequence, plus the pattern's options."""

    text_len: int  # text positions (DALL-E: <bos> + text_seq_len)
    fmap: int  # image tokens per side
    stable: bool = False  # explicit stable softmax (see the module docstring)
    options: Any = None  # the pattern's config section (attention.conv_like / attention.sparse), if it has one

    @property
    def seq_len(self) -> int:
        return self.text_len + self.fmap ** 2


def stable_attention(q, k, v, mask, dropout_p: float = 0.0, alpha: float = STABLE_ALPHA) -> torch.Tensor:
    """Masked softmax attention with the seed's stable softmax. q (B, H, Tq, D); k, v (B, Hkv, Tk, D);
    mask (Tq, Tk) bool, True = may attend (every row must allow one key). Returns (B, H, Tq, D)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # GQA: query head h reads kv head h // rep, as SDPA's enable_gqa
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q * (q.shape[-1] ** -0.5 / alpha)) @ k.transpose(-1, -2)  # (B, H, Tq, Tk), 1/alpha of the logits
    scores = scores.masked_fill(~mask, float("-inf"))
    scores = (scores - scores.amax(dim=-1, keepdim=True).detach()) * alpha
    probs = scores.float().softmax(dim=-1).to(v.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return probs @ v


class PatternAttention(AttentionBackend):
    """Causal attention under a text/image pattern mask; subclasses say which image keys an image query sees."""

    requires_image_layout = True  # spec.options must be an ImageLayout (tests/test_dalle.py runs the contract)

    def __init__(self, spec: AttentionSpec):
        if not isinstance(spec.options, ImageLayout):
            raise ConfigError(f"attention kind {self.name!r} is a DALL-E image pattern: use it in dalle.attn_types "
                              f"of a DALL-E model, not as attention.kind of a language model")
        super().__init__(spec)
        self.layout: ImageLayout = self.spec.options

    @classmethod
    def check(cls, spec: AttentionSpec) -> AttentionSpec:
        """As the base class, for the pattern's own options: inside the ImageLayout (a built layer), or bare
        (Config.validate, which has no layout)."""
        layout = spec.options
        if not isinstance(layout, ImageLayout):
            return super().check(spec)
        inner = super().check(dataclasses.replace(spec, options=layout.options)).options
        return dataclasses.replace(spec, options=dataclasses.replace(layout, options=inner))

    def image_allowed(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        """Bool, broadcast over absolute query positions q (S, 1) and key positions k (1, S): may image
        query q see image key k (causality and text are handled by the caller)."""
        raise NotImplementedError

    def _key(self) -> tuple:
        """What the mask depends on: layers with equal keys share one mask tensor."""
        opts = dataclasses.astuple(self.layout.options) if self.layout.options is not None else ()
        return (type(self).__name__, self.layout.text_len, self.layout.fmap, opts)

    def build_mask(self) -> torch.Tensor:
        """(S, S) bool on the CPU, True = query (row) may attend key (column)."""
        pos = torch.arange(self.layout.seq_len)
        q, k = pos[:, None], pos[None, :]
        text_q, text_k = q < self.layout.text_len, k < self.layout.text_len
        return (k <= q) & (text_q | text_k | self.image_allowed(q, k))

    def mask(self, device: torch.device) -> torch.Tensor:
        return _shared_mask(self._key(), str(device), self.build_mask)

    def coords(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, column) in the token grid of image positions (meaningless for text positions)."""
        j = pos - self.layout.text_len
        return j.div(self.layout.fmap, rounding_mode="floor"), j.remainder(self.layout.fmap)

    def forward(self, q, k, v, *, cache: KVCache | None = None, x=None):
        # q: (B, T, H, D); k, v: (B, T, Hkv, D)
        t_q = q.shape[1]
        if cache is not None:
            k, v = cache.append(k, v)  # (B, L, Hkv, D), L = tokens so far
        t_k = k.shape[1]
        if t_k > self.layout.seq_len:
            raise ValueError(f"position {t_k} is beyond the text + image sequence ({self.layout.seq_len} positions)")
        mask = self.mask(q.device)[t_k - t_q:t_k, :t_k]  # the query rows of the new positions
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        dropout = self.spec.dropout if self.training else 0.0
        if self.layout.stable:
            out = stable_attention(q, k, v, mask, dropout)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)  # (B, T, H, D)


_MASKS: dict[tuple, torch.Tensor] = {}


def _shared_mask(key: tuple, device: str, build) -> torch.Tensor:
    """One mask per (pattern, layout, device), built on first use."""
    if (key, device) not in _MASKS:
        cpu = _MASKS.get((key, "cpu"))
        if cpu is None:
            cpu = _MASKS[(key, "cpu")] = build()
        _MASKS[(key, device)] = cpu.to(device)
    return _MASKS[(key, device)]


@register("axial_row")
class AxialRowAttention(PatternAttention):
    def image_allowed(self, q, k):
        return self.coords(q)[0] == self.coords(k)[0]


@register("axial_col")
class AxialColAttention(PatternAttention):
    def image_allowed(self, q, k):
        return self.coords(q)[1] == self.coords(k)[1]


@register("conv_like", options=ConvLikeOptions)
class ConvLikeAttention(PatternAttention):
    def image_allowed(self, q, k):
        opts = self.layout.options
        size, dil = opts.kernel_size, opts.dilation
        (rq, cq), (rk, ck) = self.coords(q), self.coords(k)
        ok = torch.ones((), dtype=torch.bool)
        for d in (rq - rk, cq - ck):  # offsets above / to the left, on the dilated grid, inside the window
            ok = ok & (d >= 0) & (d <= (size - 1) * dil) & (d.remainder(dil) == 0)
        return ok


@register("sparse", options=SparseOptions)
class SparseAttention(PatternAttention):
    def _key(self) -> tuple:  # the random blocks depend on the seed and the layer
        return super()._key() + (self.spec.seed, self.spec.layer_index)

    def block_layout(self) -> np.ndarray:
        """(n_blocks, n_blocks) bool: key blocks an image query of each block sees besides the text."""
        opts, layout = self.layout.options, self.layout
        n = math.ceil(layout.seq_len / opts.block_size)
        n_random = n // 4 if opts.random_blocks < 0 else opts.random_blocks
        allowed = np.zeros((n, n), dtype=bool)
        rng = np.random.default_rng([self.spec.seed, self.spec.layer_index])
        for qb in range(n):
            allowed[qb, max(0, qb - opts.local_blocks + 1):qb + 1] = True
            # older blocks that hold image positions (text blocks are visible anyway)
            older = [kb for kb in range(qb - opts.local_blocks + 1) if (kb + 1) * opts.block_size > layout.text_len]
            if older and n_random:
                allowed[qb, rng.choice(older, size=min(n_random, len(older)), replace=False)] = True
        return allowed

    def image_allowed(self, q, k):
        bs = self.layout.options.block_size
        table = torch.from_numpy(self.block_layout())
        return table[q.div(bs, rounding_mode="floor"), k.div(bs, rounding_mode="floor")]


def pattern_names() -> tuple[str, ...]:
    """Registered backends that need an :class:`ImageLayout` (the DALL-E patterns)."""
    return tuple(n for n in registry.names() if getattr(registry.get(n), "requires_image_layout", False))

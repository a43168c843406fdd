"""Shared building blocks: norms, rotary positions, MLP, the outer attention module, Block.

The outer :class:`Attention` owns the projections, rotary and GQA head layout; the inner math is
an :mod:`efftx.attention` backend chosen by name.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from efftx import attention
from efftx.attention.base import AttentionSpec
from efftx.attention.cache import cache_limit, cache_offset
from efftx.errors import ConfigError
from efftx.kernels.linear_cpu import Linear
from efftx.kernels.rms_norm_cpu import RMSNorm


class ScaleNorm(nn.Module):
    """x * g / ||x|| with a single learned gain (Nguyen & Salazar, 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.g = nn.Parameter(torch.full((1,), math.sqrt(dim)))  # 1-d: DeepSpeed cannot broadcast 0-d params
        self.eps = eps

    def forward(self, x):
        return x * (self.g / x.norm(dim=-1, keepdim=True).clamp(min=self.eps))


NORMS = {
    "rmsnorm": lambda dim: RMSNorm(dim, eps=1e-6),  # nn.RMSNorm; decoding's calls on a CPU take a C++ kernel
    "layernorm": nn.LayerNorm,
    "scalenorm": ScaleNorm,
}


def make_norm(name: str, dim: int) -> nn.Module:
    if name not in NORMS:
        raise ConfigError(f"model.norm={name!r} is unknown; choose from {', '.join(sorted(NORMS))}")
    return NORMS[name](dim)


class Rotary(nn.Module):
    """Rotary position embedding applied to (B, T, H, D) tensors at absolute positions."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def angles(self, t: int, offset: int | torch.Tensor = 0, limit: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of ``t`` tokens from ``offset`` (an int, or (B, 1) per row for ragged caches): (T, 1, D/2) or
        (B, T, 1, D/2). A position beyond the table is an error naming max_seq_len; for ragged rows the caller that
        knows the longest row on the host passes ``limit`` (one past the last position, or a bound on it that it
        checked: :func:`~efftx.attention.cache.cache_limit`) and the check reads it, not the device positions (on a
        GPU that read would wait for every queued kernel, twice per layer and step)."""
        if isinstance(offset, torch.Tensor):
            pos = offset + torch.arange(t, device=offset.device)  # (B, T)
            # without a limit the check reads a device value: skipped inside a compiled graph (compiled decoding
            # checks its capacity on the host, see efftx.generation.compiled)
            top = limit if limit is not None else None if torch.compiler.is_compiling() else int(pos.max()) + 1
            if top is not None and top > self.cos.shape[0]:
                raise ValueError(f"position {top} beyond model.max_seq_len={self.cos.shape[0]}")
            return self.cos[pos][:, :, None], self.sin[pos][:, :, None]
        if offset + t > self.cos.shape[0]:
            raise ValueError(f"position {offset + t} beyond model.max_seq_len={self.cos.shape[0]}")
        return self.cos[offset:offset + t, None, :], self.sin[offset:offset + t, None, :]

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor = 0, limit: int | None = None) -> torch.Tensor:
        """x (B, T, H, D) rotated at the positions from ``offset`` (see :meth:`angles`)."""
        return rotate(x, *self.angles(x.shape[1], offset, limit))

    def pair(self, q: torch.Tensor, k: torch.Tensor, offset: int | torch.Tensor = 0, limit: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k (of as many tokens) rotated alike, the angles looked up once."""
        cos, sin = self.angles(q.shape[1], offset, limit)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`_rotate` through the autograd node :class:`_Rotate` where a gradient is recorded; directly where none
    is (decoding: the node's bookkeeping cost about a third of the rotation itself, twice per layer and step)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotate.apply(x, cos, sin)
    return _rotate(x, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each (x1, x2) half pair of the last dim rotated by the angle whose cos / sin are given, in float32,
    written into one output (no concatenation): (x1 cos - x2 sin, x2 cos + x1 sin)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    if torch.compiler.is_compiling():  # inductor fuses this form itself (and lowers no out= multiply)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    out = torch.empty_like(xf)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out.to(x.dtype)


class _Rotate(torch.autograd.Function):
    """Rotary as one autograd node: its gradient is the inverse rotation (angle -a) of the output gradient, the
    same values autograd derives from the elementwise form (bit for bit in float32) in a third of the ops: the
    rotary of q and k was ~15% of a full-attention train step on CPU, most of it in autograd's backward of
    chunk / mul / cat."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def _dropped(drop: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``drop(x)``, without the module call where it is the identity (no dropout, or not training): the same
    values, and no random numbers drawn either way; a decoding step skips a dozen calls of ~2.5 us each."""
    return drop(x) if drop.p and drop.training else x


class MLP(nn.Module):
    """GELU feed-forward; with ``chunks`` > 1 the sequence is processed in that many pieces, so the
    (T, mult x dim) hidden activation is never materialised whole (lower peak memory)."""

    def __init__(self, dim: int, mult: float, dropout: float = 0.0, chunks: int = 1):
        super().__init__()
        hidden = int(dim * mult)
        self.up = Linear(dim, hidden)
        self.down = Linear(hidden, dim)
        self.drop = nn.Dropout(dropout)
        self.chunks = chunks

    def _ff(self, x):
        return _dropped(self.drop, self.down(self.up(x, gelu=True)))  # GELU(up(x)), in the CPU kernel where it runs

    def forward(self, x, cache=None):
        """``cache`` is unused (a feed-forward has no decoding state): every residual branch is called as
        ``branch(x, cache)``, so a wrapper around it (DALL-E's token shift) can keep state in the layer cache."""
        if self.chunks <= 1 or x.shape[1] < self.chunks:
            return self._ff(x)
        return torch.cat([self._ff(c) for c in x.chunk(self.chunks, dim=1)], dim=1)


class PreNorm(nn.Module):
    """A residual branch: fn(norm(x), ...)."""

    def __init__(self, norm: nn.Module, fn: nn.Module):
        super().__init__()
        self.norm, self.fn = norm, fn

    def forward(self, x, *args):
        return self.fn(self.norm(x), *args)


class Attention(nn.Module):
    """Projections + rotary + GQA around an inner attention backend."""

    def __init__(self, spec: AttentionSpec, rotary: Rotary | None, dropout: float = 0.0):
        super().__init__()
        self.spec = spec
        h, hkv, d = spec.heads, spec.kv_heads, spec.head_dim
        self.q = Linear(spec.dim, h * d, bias=False)
        self.kv = Linear(spec.dim, 2 * hkv * d, bias=False)
        self.out = Linear(h * d, spec.dim, bias=False)
        self.inner = attention.build(spec)
        self.rotary = rotary
        if hasattr(self.inner, "use_rotary"):  # backends with keys of their own (nsa separate_kv) rotate them alike
            self.inner.use_rotary(rotary)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, cache=None):
        b, t, _ = x.shape
        s = self.spec
        q = self.q(x).view(b, t, s.heads, s.head_dim)  # (B, T, H, D)
        k, v = self.kv(x).view(b, t, 2, s.kv_heads, s.head_dim).unbind(2)  # (B, T, Hkv, D)
        y = None
        if self.rotary is not None:
            fused = getattr(self.inner, "attend_rotating", None)  # full attention's CPU decode kernel rotates itself
            y = fused(q, k, v, cache, self.rotary) if fused is not None else None
            if y is None:
                q, k = self.rotary.pair(q, k, cache_offset(cache), cache_limit(cache, t))
        if y is None:
            y = self.inner(q, k, v, cache=cache, x=x)  # (B, T, H, D)
        return _dropped(self.drop, self.out(y.reshape(b, t, s.heads * s.head_dim)))


class Shared(nn.Module):
    """Calls a module owned (registered) elsewhere in the model, without registering it again: the weights
    of layers that share a module appear once in ``parameters()`` and ``state_dict()`` (safetensors exports
    refuse aliased tensors)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.__dict__["target"] = module  # a plain attribute, not a child module

    def forward(self, *args, **kwargs):
        return self.target(*args, **kwargs)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x), cache); x + mlp(norm(x), cache).

    ``attn`` and ``mlp`` are the two residual branches; a reversible stack uses them as f and g.
    ``attn_fn`` / ``mlp_fn`` replace the branch modules built here (DALL-E passes modules shared between
    layers, or wrapped in a token shift); the norms are always the block's own.
    """

    def __init__(self, spec: AttentionSpec, norm: str, mlp_mult: float, rotary: Rotary | None,
                 dropout: float = 0.0, ff_chunks: int = 1, *, attn_fn: nn.Module | None = None,
                 mlp_fn: nn.Module | None = None):
        super().__init__()
        attn_fn = attn_fn if attn_fn is not None else Attention(spec, rotary, dropout)
        mlp_fn = mlp_fn if mlp_fn is not None else MLP(spec.dim, mlp_mult, dropout, ff_chunks)
        self.attn = PreNorm(make_norm(norm, spec.dim), attn_fn)
        self.mlp = PreNorm(make_norm(norm, spec.dim), mlp_fn)

    @property
    def attention(self) -> Attention:
        return self.attn.fn

    def forward(self, x, cache=None):
        x = x + self.attn(x, cache)
        return x + self.mlp(x, cache)

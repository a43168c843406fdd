"""Reversible residual stack (RevNet, Gomez et al. 2017; as used by the Reformer).

Two streams: ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``. The inputs of every block can be recomputed
from its outputs (``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)``), so the training forward keeps no
activations but the last block's outputs: activation memory does not grow with depth. The backward
pass walks the blocks in reverse, reconstructing inputs and recomputing f and g with gradients.

Randomness (dropout) is replayed exactly: each f/g call records the RNG state it started from.
Backends with side effects on forward (Performer's feature redraw counter) skip them while
:func:`efftx.attention.base.recomputing` is true.

The alternative, ``model.activation_checkpointing`` (:func:`run_blocks` with ``checkpoint=True``), keeps the plain
blocks and stores only each block's input: ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved)
recomputes the block's forward, under ``recomputing()``, when its backward needs the activations.
"""

from __future__ import annotations

import contextlib

import torch
import torch.utils.checkpoint
from torch import nn

from efftx.attention.base import recomputing


class _Replay:
    """Calls f or g; remembers the RNG state of its last recorded call and can replay it.

    A plain object, not a Module: the blocks stay owned (and named in the state dict) by the model.
    """

    def __init__(self, fn: nn.Module):
        self.fn = fn
        self.cpu_state = None
        self.cuda_state = None

    def __call__(self, x, *args, record: bool = False, replay: bool = False):
        if record:
            self.cpu_state = torch.get_rng_state()
            self.cuda_state = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        if not replay:
            return self.fn(x, *args)
        devices = [x.device] if x.is_cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_state)
            if self.cuda_state is not None:
                torch.cuda.set_rng_state(self.cuda_state, x.device)
            return self.fn(x, *args)


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, stack):
        ctx.stack = stack
        with torch.no_grad():
            for f, g in zip(stack.f, stack.g):
                x1 = x1 + f(x2, None, record=True)
                x2 = x2 + g(x1, record=True)
        ctx.save_for_backward(x1, x2)
        return x1, x2

    @staticmethod
    def backward(ctx, dy1, dy2):
        y1, y2 = ctx.saved_tensors
        stack = ctx.stack
        with recomputing():
            for f, g in zip(reversed(stack.f), reversed(stack.g)):
                with torch.enable_grad():
                    y1_ = y1.detach().requires_grad_()
                    gy1 = g(y1_, replay=True)
                    torch.autograd.backward(gy1, dy2)  # grads of g's parameters accumulate here
                with torch.no_grad():
                    x2 = y2 - gy1
                    dy1 = dy1 + y1_.grad
                with torch.enable_grad():
                    x2_ = x2.detach().requires_grad_()
                    fx2 = f(x2_, None, replay=True)
                    torch.autograd.backward(fx2, dy1)
                with torch.no_grad():
                    x1 = y1 - fx2
                    dy2 = dy2 + x2_.grad
                y1, y2 = x1, x2
        return dy1, dy2, None


class ReversibleStack:
    """Runs Blocks (each with residual branches ``attn`` = f and ``mlp`` = g) as a reversible stack
    over two copies of the input, returning the mean of the two streams."""

    def __init__(self, blocks):
        self.f = [_Replay(b.attn) for b in blocks]
        self.g = [_Replay(b.mlp) for b in blocks]

    def __call__(self, x, caches=None, memory_saving: bool = True):
        if caches is None and memory_saving and torch.is_grad_enabled() and x.requires_grad:
            y1, y2 = _ReversibleFunction.apply(x, x, self)
        else:  # decoding with caches, evaluation, or the plain-autograd reference
            y1, y2 = x, x
            for i, (f, g) in enumerate(zip(self.f, self.g)):
                y1 = y1 + f(y2, caches[i] if caches is not None else None)
                y2 = y2 + g(y1, caches[i] if caches is not None else None)
        return (y1 + y2) / 2


def _recompute_context():
    """torch.utils.checkpoint's ``context_fn``: nothing around the first forward, ``recomputing()`` around the
    recompute in backward (so backends with per-pass state, Performer's redraw counter, do not count it)."""
    return contextlib.nullcontext(), recomputing()


def checkpointed(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``block(x)`` keeping only ``x`` for backward: the block's forward runs again when its gradients are
    needed, with the RNG state of the first run (same dropout masks) and under ``recomputing()``."""
    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_recompute_context)


def run_blocks(x: torch.Tensor, blocks, reversible: ReversibleStack | None, cache=None,
               checkpoint: bool = False) -> torch.Tensor:
    """The decoder stack of a model: through ``reversible`` when it has one, else block by block;
    ``cache`` is the model's ModelCache (one layer cache per block) or None. ``checkpoint``
    (``model.activation_checkpointing``): recompute each block in backward instead of storing its
    activations; only when gradients are being recorded and there is no cache, else a plain forward."""
    caches = cache.layers if cache is not None else None
    if reversible is not None:
        return reversible(x, caches)
    if checkpoint and caches is None and torch.is_grad_enabled():
        for blk in blocks:
            x = checkpointed(blk, x)
        return x
    for i, blk in enumerate(blocks):
        x = blk(x, caches[i] if caches is not None else None)
    return x

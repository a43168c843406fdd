"""A dense LM's cached CPU pass as one flat run of kernel calls, without a module call (eager decoding's plan).

On a CPU an eager cached pass of a small model spends about as long in Python as in its kernels: every Linear,
norm and attention call goes through ``nn.Module.__call__``, attribute lookups and the kernels' checks of what
they take (``spec_target_small`` at batch 1: 0.96 ms a pass, of which its C++ kernels take about 0.5 ms). Where
the pass's norms and attention would take the C++ CPU kernels (:mod:`efftx.kernels.rms_norm_cpu`,
:mod:`~efftx.kernels.decode_attention_cpu`) and its products :mod:`efftx.kernels.linear_cpu`'s (or, past its rows,
torch's), :class:`CpuPlan` makes the same calls, on the
same tensors, in the same order, from a flat list of each layer's weights made once per model: the logits are bit
for bit the module path's (tests/test_cpu_plan.py holds the two together), in about 0.6 of its time.

:func:`plan_for` says, per pass, whether the plan runs it: the model a plain dense LM (full attention with the
rotary, RMSNorm, not reversible; :func:`unsupported` names what is not), no autograd recorded, float32 CPU
weights (the Linear weights float32 or bfloat16, :func:`~efftx.kernels.linear_cpu.bf16_weights`), any number of
tokens a row (passes of more than ``linear_cpu.MAX_ROWS`` rows x tokens, a batch's speculative verify, take torch's
products there, and passes of more than ``decode_attention_cpu.MAX_QUERIES`` tokens a row, prefills of longer
prompts, the rotary and torch's attention (:meth:`FullAttention.forward`'s SDPA), as the module path does), every
layer's cache a contiguous float32 :class:`~efftx.attention.cache.KVCache`, the three kernels switched on and
built, no dropout that would drop, and no forward hook on any module the pass would call (a hook runs where the
module path runs). A plan follows its model: made again after any module, parameter or buffer is registered
anywhere (a replaced weight; three process-wide registration hooks count them), and dropped by the model's
``_apply`` (``.to()``, ``.double()``). Everything else takes the module path, which stays the reference.

``EFFTX_CPU_PLAN=off`` (or :func:`disabled`, for side-by-side benches) keeps every pass on the module path.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from efftx.attention.cache import KVCache, ModelCache, cache_limit, cache_offset
from efftx.attention.full import FullAttention
from efftx.kernels import decode_attention_cpu, linear_cpu, rms_norm_cpu
from efftx.kernels.cpu_build import switch, switched_off
from efftx.kernels.rms_norm_cpu import RMSNorm
from efftx.models.layers import MLP, Attention, Block, PreNorm

_state = switch("EFFTX_CPU_PLAN")
# per model: (the registration count it was made at, its plan or why it has none)
_plans: "weakref.WeakKeyDictionary[nn.Module, tuple[int, CpuPlan | str]]" = weakref.WeakKeyDictionary()
# registrations of modules, parameters and buffers anywhere in the process: a plan made before the last one is
# made again (a weight or a module replaced by assignment). Counted from the first plan on.
_epoch = [0]
_hooked = threading.Lock()
_hooks: list = []
# forward hooks on every module, held by torch in these dicts: where one is set, the pass takes the module path
_GLOBAL_HOOKS = (torch_module._global_forward_hooks, torch_module._global_forward_pre_hooks)


def disabled():
    """Inside, every pass takes the module path (benches time the plan side by side with it)."""
    return switched_off(_state)


def _count_registration(*args) -> None:
    _epoch[0] += 1


def _watch_registrations() -> None:
    with _hooked:
        if not _hooks:
            _hooks.extend([torch_module.register_module_module_registration_hook(_count_registration),
                           torch_module.register_module_parameter_registration_hook(_count_registration),
                           torch_module.register_module_buffer_registration_hook(_count_registration)])


def _linear_ok(layer) -> bool:
    return isinstance(layer, linear_cpu.Linear) and type(layer).forward is linear_cpu.Linear.forward


def _norm_ok(norm) -> bool:
    """An RMSNorm whose calls take the kernel (it needs the weight and the eps)."""
    return type(norm) is RMSNorm and norm.weight is not None and norm.eps is not None


def unsupported(model) -> str | None:
    """Why ``model``'s cached passes cannot run as a plan (None: they can, subject to :func:`plan_for`'s per-pass
    conditions)."""
    if getattr(model, "reversible", None) is not None:
        return "a reversible stack"
    if getattr(model, "pos", None) is not None or getattr(model, "rotary", None) is None:
        return "learned positions (the plan covers rotary models)"
    embed = model.embed
    if type(embed) is not nn.Embedding or embed.padding_idx is not None or embed.max_norm is not None:
        return "an embedding with padding_idx or max_norm"
    for name in ("emb_in", "emb_out", "head"):
        layer = getattr(model, name)
        if layer is not None and not _linear_ok(layer):
            return f"{name} is not efftx's Linear"
    if not _norm_ok(model.norm):
        return f"the final norm is {type(model.norm).__name__}, not RMSNorm with a weight and an eps"
    for i, blk in enumerate(model.blocks):
        if type(blk) is not Block or type(blk.attn) is not PreNorm or type(blk.mlp) is not PreNorm:
            return f"block {i} is not a plain Block"
        attn, mlp = blk.attn.fn, blk.mlp.fn
        if not (_norm_ok(blk.attn.norm) and _norm_ok(blk.mlp.norm)):
            return f"block {i}'s norms are not RMSNorm with a weight and an eps"
        if type(attn) is not Attention or type(attn.inner) is not FullAttention or attn.rotary is not model.rotary:
            return f"block {i}'s attention is not full attention with the model's rotary"
        if type(mlp) is not MLP or mlp.chunks > 1:
            return f"block {i}'s feed-forward is not a plain MLP"
        if not all(_linear_ok(layer) for layer in (attn.q, attn.kv, attn.out, mlp.up, mlp.down)):
            return f"block {i}'s projections are not efftx's Linear"
    # float32 throughout, but for the Linear weights, which may be bfloat16 (linear_cpu.bf16_weights)
    linears = {id(m.weight) for m in model.modules() if isinstance(m, linear_cpu.Linear)}
    tensors = [p for p in model.parameters()] + [model.rotary.cos, model.rotary.sin]
    if any(t.device.type != "cpu" or not t.is_contiguous()
           or t.dtype not in (linear_cpu.WEIGHT_DTYPES if id(t) in linears else (torch.float32,)) for t in tensors):
        return "weights that are not contiguous float32 CPU tensors (Linear weights: float32 or bfloat16)"
    return None


class CpuPlan:
    """One model's cached pass as a flat run of kernel calls: each layer's weights, norms' eps and head sizes,
    read once. ``run(tokens, cache)`` is ``model(tokens, cache=cache)`` where :func:`plan_for` allows it."""

    def __init__(self, model):
        self.embed = model.embed.weight
        self.emb_in = model.emb_in.weight if model.emb_in is not None else None
        self.emb_out = model.emb_out.weight if model.emb_out is not None else None
        self.head = model.embed.weight if model.head is None else model.head.weight
        self.norm = (model.norm.weight, model.norm.eps)
        self.tables = (model.rotary.cos, model.rotary.sin)
        self.rotary = model.rotary
        self.layers = []  # each layer's weights, eps and sizes, and its FullAttention (for passes of many tokens a row)
        called: list[nn.Module] = [model.embed, model.norm, *(m for m in (model.emb_in, model.emb_out) if m)]
        self.dropping = []  # modules whose training flag makes the module path drop out
        for blk in model.blocks:
            attn, mlp = blk.attn.fn, blk.mlp.fn
            s = attn.spec
            self.layers.append((blk.attn.norm.weight, blk.attn.norm.eps, attn.q.weight, attn.q.bias, attn.kv.weight,
                                attn.kv.bias, attn.out.weight, attn.out.bias, blk.mlp.norm.weight, blk.mlp.norm.eps,
                                mlp.up.weight, mlp.up.bias, mlp.down.weight, mlp.down.bias, s.heads, s.kv_heads,
                                s.head_dim, s.causal, attn.inner))
            called += [blk, blk.attn, blk.attn.norm, attn, attn.q, attn.kv, attn.out, blk.mlp, blk.mlp.norm, mlp,
                       mlp.up, mlp.down]
            self.dropping += [d for d in (attn.drop, mlp.drop) if d.p]
            if s.dropout:
                self.dropping.append(attn.inner)
        # the forward hooks of every module the module path would call (a hook set later sends passes there)
        self.hooks = [*_GLOBAL_HOOKS, *(d for m in called for d in (m._forward_hooks, m._forward_pre_hooks))]

    def current(self) -> bool:
        """No forward hook set, no dropout that drops."""
        return not any(self.hooks) and not any(m.training for m in self.dropping)

    def run(self, tokens: torch.Tensor, cache: ModelCache, kernels: tuple) -> torch.Tensor:
        """``model(tokens, cache=cache)``; ``kernels``: the linear, RMSNorm and decode attention kernel modules."""
        b, t = tokens.shape
        # the products: the linear kernel's up to MAX_ROWS rows x tokens, torch's beyond (as linear_cpu.linear)
        lin = kernels[0].linear if b * t <= linear_cpu.MAX_ROWS else linear_cpu.torch_linear
        norm, attend = kernels[1].rms_norm, kernels[2]
        # more tokens a row than the attention kernel takes (a long prompt's prefill): the rotary and torch's
        # attention, as the module path runs them (on a 2-core CPU the kernel's attention costs several times SDPA's
        # at a thousand tokens); the rest of the pass stays flat (a 200-token prefill of spec_target_small: 12.9 ms
        # against the module path's 13.6)
        long = t > decode_attention_cpu.MAX_QUERIES
        x = torch.embedding(self.embed, tokens)
        if self.emb_in is not None:
            x = lin(x, self.emb_in, None, False)
        for weights, layer in zip(self.layers, cache.layers):
            n1, e1, qw, qb, kvw, kvb, ow, ob, n2, e2, uw, ub, dw, db, heads, kv_heads, dim, causal, inner = weights
            h = norm(x, n1, e1)
            q = lin(h, qw, qb, False).view(b, t, heads, dim)
            k, v = lin(h, kvw, kvb, False).view(b, t, 2, kv_heads, dim).unbind(2)
            if long:
                q, k = self.rotary.pair(q, k, cache_offset(layer), cache_limit(layer, t))
                y = inner(q, k, v, cache=layer)
            else:
                y = decode_attention_cpu.attend_with(attend, q, k, v, layer, causal, self.tables)
            x = x + lin(y.reshape(b, t, heads * dim), ow, ob, False)
            x = x + lin(lin(norm(x, n2, e2), uw, ub, True), dw, db, False)
        x = norm(x, *self.norm)
        if self.emb_out is not None:
            x = lin(x, self.emb_out, None, False)
        return lin(x, self.head, None, False)


def forget(model) -> None:
    """Drop ``model``'s plan (its weights moved or changed type: the next pass makes it again)."""
    _plans.pop(model, None)


def plan_for(model, tokens: torch.Tensor, cache) -> tuple[CpuPlan, tuple] | None:
    """The plan that runs this cached pass of ``model`` and the kernel modules it calls, or None where the module
    path must (see the module's docstring)."""
    if not (_state["enabled"] and linear_cpu._state["enabled"] and rms_norm_cpu._state["enabled"]
            and decode_attention_cpu._state["enabled"]) or torch.is_grad_enabled() or model.training:
        return None
    if tokens.device.type != "cpu" or type(cache) is not ModelCache or torch.compiler.is_compiling():
        return None
    for layer in cache.layers:
        if (type(layer) is not KVCache or layer.k.dtype != torch.float32 or not layer.k.is_contiguous()
                or not layer.v.is_contiguous()):
            return None
    kernels = (linear_cpu.kernel(), rms_norm_cpu.kernel(), decode_attention_cpu.kernel())
    if None in kernels:
        return None
    made = _plans.get(model)
    if made is None or made[0] != _epoch[0]:
        _watch_registrations()
        why = unsupported(model)
        made = _plans[model] = (_epoch[0], CpuPlan(model) if why is None else why)
    plan = made[1]
    return (plan, kernels) if type(plan) is CpuPlan and plan.current() else None

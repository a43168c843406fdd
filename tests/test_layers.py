"""Shared layer options the seeds use: reversible blocks, chunked feed-forward, ScaleNorm, factorised embedding."""

import pytest
import torch
import torch.nn.functional as F

from efftx import recipes
from efftx.models.layers import MLP, ScaleNorm
from efftx.models import build as build_model


def build(**overrides):
    cfg = recipes.get("lm_debug").override(overrides)
    torch.manual_seed(0)
    return build_model(cfg)


def loss_and_grads(model, x):
    model.zero_grad()
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_reversible_gradients_equal_plain_autograd(dropout):
    model = build(**{"model.reversible": True, "model.depth": 3, "model.dropout": dropout}).train()
    x = torch.randint(0, 256, (2, 33))
    torch.manual_seed(1)
    loss_rev, grads_rev = loss_and_grads(model, x)
    stack = model.reversible
    model.reversible = lambda h, caches: stack(h, caches, memory_saving=False)  # same maths, autograd stores all
    torch.manual_seed(1)
    loss_plain, grads_plain = loss_and_grads(model, x)
    torch.testing.assert_close(loss_rev, loss_plain)
    for name in grads_plain:
        torch.testing.assert_close(grads_rev[name], grads_plain[name], rtol=1e-4, atol=1e-6, msg=name)


def saved_bytes(model, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return total


def test_reversible_activation_memory_does_not_grow_with_depth():
    x = torch.randint(0, 256, (2, 64))
    plain = [saved_bytes(build(**{"model.depth": d}).train(), x) for d in (2, 6)]
    rev = [saved_bytes(build(**{"model.depth": d, "model.reversible": True}).train(), x) for d in (2, 6)]
    assert plain[1] > 2 * plain[0]
    assert rev[1] == rev[0]
    assert rev[1] < plain[1] / 3


def test_reversible_model_decodes_with_cache_like_full_forward():
    model = build(**{"model.reversible": True}).eval()
    x = torch.randint(0, 256, (2, 20))
    cache = model.new_cache(2, 64)
    parts = [model(x[:, :8], cache=cache)] + [model(x[:, i:i + 1], cache=cache) for i in range(8, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), model(x), rtol=1e-4, atol=1e-5)


def test_chunked_feed_forward_equals_unchunked():
    torch.manual_seed(0)
    mlp = MLP(16, 4.0, chunks=1)
    chunked = MLP(16, 4.0, chunks=5)
    chunked.load_state_dict(mlp.state_dict())
    x = torch.randn(2, 23, 16)
    torch.testing.assert_close(chunked(x), mlp(x))


def test_scalenorm_rescales_to_learned_gain():
    norm = ScaleNorm(8)
    x = torch.randn(3, 5, 8) * 7
    out = norm(x)
    torch.testing.assert_close(out.norm(dim=-1), torch.full((3, 5), 8 ** 0.5))


def test_factorised_embedding_is_smaller_and_trains():
    full = build(**{"model.dim": 64})
    factorised = build(**{"model.dim": 64, "model.emb_dim": 16})
    assert factorised.embed.weight.shape == (256, 16)
    assert factorised.num_params() < full.num_params()
    x = torch.randint(0, 256, (2, 17))
    _, grads = loss_and_grads(factorised.train(), x)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("name", [n for n in recipes.names() if n.endswith(("_debug", "_small"))])
def test_no_zero_dim_parameters(name):
    """DeepSpeed broadcasts parameters as byte views, which fails for 0-d tensors."""
    from efftx import models

    cfg = recipes.get(name)
    model = models.build(cfg)
    assert all(p.ndim >= 1 for p in model.parameters())


def test_dropout_runs_only_where_it_drops():
    """A block's dropout module is called only in training with p > 0 (there it drops activations: two draws
    differ); with p = 0 or in eval it is skipped, and the output is the same as with it (no random numbers drawn
    either way). Power: skipping it in training (``_dropped`` returning ``x``) fails the first part; calling it
    always fails the count."""
    x = torch.randint(0, 256, (2, 17))
    calls = []
    dropping = build(**{"model.dropout": 0.5}).train()
    for module in dropping.modules():
        if isinstance(module, torch.nn.Dropout):
            module.register_forward_pre_hook(lambda *_: calls.append(1))
    torch.manual_seed(1)
    first = dropping(x)
    second = dropping(x)
    assert calls and not torch.equal(first, second)
    calls.clear()
    with torch.no_grad():
        dropping.eval()
        torch.manual_seed(1)
        out = dropping(x)
        after = torch.rand(3)
        dropping.train()
        for module in dropping.modules():  # the same model with p = 0, training: the same values as eval
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        torch.manual_seed(1)
        same = dropping(x)
        assert torch.equal(torch.rand(3), after)  # neither drew a random number
    assert not calls and torch.equal(out, same)

"""model.activation_checkpointing: each block's forward is recomputed in backward (torch.utils.checkpoint,
non-reentrant, RNG state preserved, under ``recomputing()``) instead of storing its activations.

Gradients equal the stored-activation ones (dropout on, several attention kinds, DALL-E's shifted/shared
pattern layers); Performer's redraw counter counts each training pass once; saved activations grow with depth
by one block input per block instead of everything a block stores; decoding and evaluation are plain forwards.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from efftx import attention, models, recipes
from efftx.errors import ConfigError
from efftx.models import reversible

_spec = importlib.util.spec_from_file_location("activation_memory",
                                               Path(__file__).parents[1] / "bench" / "activation_memory.py")
activation_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(activation_memory)
saved_activation_bytes = activation_memory.saved_activation_bytes  # the bench's measure, tested here

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

DROPOUT = {"model.dropout": 0.2, "attention.dropout": 0.2}


def lm_cfg(kind: str = "full", **overrides):
    opts = {f"attention.{kind}.{k}": v for k, v in attention.get(kind).contract_options.items()}
    cfg = recipes.get("lm_debug").override({"attention.kind": kind, **opts, **overrides})
    cfg.name = "test"
    return cfg.validate()


def pair(cfg):
    """The same model (same weights, same features) without and with activation checkpointing."""
    torch.manual_seed(0)
    plain = models.build(cfg).train()
    cfg = cfg.copy().override({"model.activation_checkpointing": True})
    torch.manual_seed(0)
    ckpt = models.build(cfg).train()
    ckpt.load_state_dict(plain.state_dict())
    assert not plain.activation_checkpointing and ckpt.activation_checkpointing
    return plain, ckpt


def loss_and_grads(model, x, seed: int = 1):
    model.zero_grad()
    torch.manual_seed(seed)  # the dropout masks
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_config_field_and_reversible_are_alternatives():
    assert lm_cfg().model.activation_checkpointing is False
    assert lm_cfg(**{"model.activation_checkpointing": True}).model.activation_checkpointing
    with pytest.raises(ConfigError, match=r"model\.reversible and model\.activation_checkpointing"):
        lm_cfg(**{"model.activation_checkpointing": True, "model.reversible": True})
    # the performer/sinkhorn recipes are reversible: checkpointing them means turning reversible off
    cfg = recipes.get("performer_debug").override({"model.reversible": False, "model.activation_checkpointing": True})
    cfg.name = "test"
    cfg.validate()


@pytest.mark.parametrize("kind", ["full", "local", "sinkhorn", "performer", "nsa"])
def test_gradients_equal_stored_activations_with_dropout(kind):
    plain, ckpt = pair(lm_cfg(kind, **{"model.depth": 3}, **DROPOUT))
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    loss_plain, grads_plain = loss_and_grads(plain, x)
    loss_ckpt, grads_ckpt = loss_and_grads(ckpt, x)
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-6, atol=1e-7)
    assert grads_ckpt.keys() == grads_plain.keys() and len(grads_plain) > 10
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-5, atol=1e-7, msg=name)
    # the recompute runs the same kernels on the same inputs: on CPU the gradients are equal bit for bit (which is
    # why model.activation_checkpointing may change when a run resumes)
    assert all(torch.equal(grads_ckpt[n], grads_plain[n]) for n in grads_plain)
    # the dropout masks matter: another seed gives other gradients (so equal gradients mean replayed masks)
    _, other = loss_and_grads(plain, x, seed=5)
    assert any(not torch.allclose(other[n], grads_plain[n]) for n in grads_plain)


def test_performer_redraw_counter_counts_each_training_pass_once():
    """N training steps: the same losses, gradients, weights, redraw counters and features with and without
    checkpointing; the counter is N (the recompute in backward does not count, nor redraw)."""
    steps, interval = 7, 2  # a redraw at passes 2, 4, 6
    plain, ckpt = pair(lm_cfg("performer", **{"attention.performer.feature_redraw_interval": interval}, **DROPOUT))
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(2))
    runs = {}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses, grads = [], []
        for step in range(steps):
            loss, g = loss_and_grads(model, x, seed=10 + step)
            opt.step()
            losses.append(loss)
            grads.append(g)
        runs[name] = losses, grads
    for step in range(steps):
        torch.testing.assert_close(runs["ckpt"][0][step], runs["plain"][0][step], rtol=1e-6, atol=1e-7)
        for n, g in runs["plain"][1][step].items():
            torch.testing.assert_close(runs["ckpt"][1][step][n], g, rtol=1e-5, atol=1e-7, msg=(step, n))
    performers = lambda m: [mod for mod in m.modules() if isinstance(mod, attention.get("performer"))]  # noqa: E731
    assert len(performers(ckpt)) == 2
    for a, b in zip(performers(plain), performers(ckpt)):
        assert int(a.calls) == int(b.calls) == steps
        assert torch.equal(a.projection, b.projection) and torch.equal(b.projection, b.draw((steps - 1) // interval))
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)


def test_dalle_gradients_equal_stored_activations():
    """Shifted, shared, pattern layers (all DALL-E attention types) with dropout."""
    from test_dalle import K, M, MIXED, captions, config

    cfg = config(**MIXED, **DROPOUT, **{"dalle.shift_tokens": True, "dalle.shared_ff_ids": "a,b"})
    plain, ckpt = pair(cfg)
    text, codes = captions(), torch.randint(0, K, (2, M), generator=torch.Generator().manual_seed(4))

    def grads(model):
        model.zero_grad()
        torch.manual_seed(3)
        loss = model(text, codes)[0]
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    loss_plain, g_plain = grads(plain)
    loss_ckpt, g_ckpt = grads(ckpt)
    torch.testing.assert_close(loss_ckpt, loss_plain, rtol=1e-6, atol=1e-7)
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=1e-5, atol=1e-7, msg=name)


def test_only_training_forwards_are_checkpointed(monkeypatch):
    """Under no_grad and with a decoding cache the blocks run plainly (and decoding still matches)."""
    calls = []
    real = reversible.checkpointed
    monkeypatch.setattr(reversible, "checkpointed", lambda blk, x: calls.append(1) or real(blk, x))
    _, model = pair(lm_cfg(**{"model.depth": 3}))
    x = torch.randint(0, 256, (2, 20))
    model(x)
    assert len(calls) == 3
    model.eval()
    with torch.no_grad():
        full = model(x)
    cache = model.new_cache(2, 64)
    parts = [model(x[:, :8], cache=cache)] + [model(x[:, i:i + 1], cache=cache) for i in range(8, 20)]
    assert len(calls) == 3
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-4, atol=1e-5)


def test_saved_activations_per_block_shrink_to_the_block_input():
    x = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(2))
    overrides = {"model.max_seq_len": 128, **DROPOUT}
    plain, ckpt = {}, {}
    for depth in (2, 4):
        p, c = pair(lm_cfg(**overrides, **{"model.depth": depth}))
        plain[depth], ckpt[depth] = saved_activation_bytes(p, x), saved_activation_bytes(c, x)
    per_block_plain = (plain[4] - plain[2]) / 2
    per_block_ckpt = (ckpt[4] - ckpt[2]) / 2
    block_input = 2 * 128 * 64 * 4  # (B, T, dim) fp32
    print(f"\nsaved activation bytes (lm_debug, dim 64, B=2, T=128, dropout 0.2):"
          f"\n  depth 2: plain {plain[2]:,}  checkpointed {ckpt[2]:,}"
          f"\n  depth 4: plain {plain[4]:,}  checkpointed {ckpt[4]:,}"
          f"\n  per block: plain {per_block_plain:,.0f}  checkpointed {per_block_ckpt:,.0f} "
          f"(block input {block_input:,}); ratio {per_block_ckpt / per_block_plain:.3f}")
    assert per_block_plain > 4 * block_input  # a plain block keeps much more than its input
    assert per_block_ckpt < per_block_plain / 4
    assert per_block_ckpt <= 2 * block_input
    assert ckpt[4] < plain[4] and ckpt[4] < plain[2]

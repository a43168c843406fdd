"""Rotary positions as one autograd node (efftx.models.layers._Rotate): the same values and gradients, bit for
bit in float32, as the elementwise form autograd differentiates itself (the form it replaced)."""

from __future__ import annotations

import pytest
import torch

from efftx.models.layers import Rotary


def _elementwise(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


@pytest.mark.parametrize("offset", [0, 5, "rows"])
def test_rotary_node_matches_elementwise_autograd_bit_for_bit(offset):
    torch.manual_seed(0)
    rot = Rotary(16, 64)
    x = torch.randn(2, 12, 3, 16, requires_grad=True)
    grad = torch.randn(2, 12, 3, 16)
    if offset == "rows":  # ragged caches: one offset per row
        off = torch.tensor([[0], [7]])
        pos = off + torch.arange(12)
        cos, sin = rot.cos[pos][:, :, None], rot.sin[pos][:, :, None]
    else:
        off = offset
        cos, sin = rot.cos[offset:offset + 12, None, :], rot.sin[offset:offset + 12, None, :]
    out = rot(x, off)
    (gx,) = torch.autograd.grad(out, x, grad)
    ref = _elementwise(x, cos, sin)
    (gref,) = torch.autograd.grad(ref, x, grad)
    assert torch.equal(out, ref) and torch.equal(gx, gref)
    assert not torch.equal(out, x)  # it rotates something


def test_rotary_keeps_the_input_dtype_and_computes_in_float32():
    rot = Rotary(8, 16)
    x = torch.randn(1, 4, 2, 8).to(torch.bfloat16)
    out = rot(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _elementwise(x, rot.cos[:4, None], rot.sin[:4, None]), rtol=0, atol=0)


def test_ragged_positions_are_checked_on_the_host_when_the_caller_knows_the_longest_row():
    """With ``limit`` (one past the last position, from the cache's host lengths) the bound check never reads the
    device positions: on the meta device, where any read of a value fails, the rotation goes through with a limit
    and fails without one; a limit beyond the table is the usual error naming max_seq_len."""
    rot = Rotary(8, 16).to("meta")
    x = torch.empty(2, 1, 3, 8, device="meta")
    offset = torch.empty(2, 1, dtype=torch.long, device="meta")
    assert rot(x, offset, limit=10).shape == x.shape
    q, k = rot.pair(x, x[:, :, :1], offset, limit=10)
    assert q.shape == x.shape and k.shape == (2, 1, 1, 8)
    with pytest.raises((RuntimeError, NotImplementedError)):
        rot(x, offset)  # reads pos.max() from the device
    with pytest.raises(ValueError, match="position 17 beyond model.max_seq_len=16"):
        rot(x, offset, limit=17)
    with pytest.raises(ValueError, match="position 17 beyond model.max_seq_len=16"):
        Rotary(8, 16)(torch.zeros(2, 1, 3, 8), torch.tensor([[3], [16]]))  # no limit: read from the positions


def test_pair_rotates_q_and_k_as_two_calls_do():
    torch.manual_seed(0)
    rot = Rotary(16, 64)
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    for offset, limit in [(3, None), (torch.tensor([[0], [9]]), 14)]:
        pq, pk = rot.pair(q, k, offset, limit)
        assert torch.equal(pq, rot(q, offset)) and torch.equal(pk, rot(k, offset))


def test_ragged_decoding_passes_the_host_limit_to_every_rotary_call(monkeypatch):
    """Ragged rows decoded through a model (efftx.generation.decode.Rows: a cache per layer, full attention and NSA
    with its own window/compressed keys): every rotation at per-row positions is given its limit by the caller."""
    from efftx import recipes
    from efftx.generation.decode import Rows
    from efftx.models import build
    from efftx.models.layers import Rotary as R

    seen = []
    real = R.angles

    def angles(self, t, offset=0, limit=None):
        if isinstance(offset, torch.Tensor):
            seen.append(limit)
        return real(self, t, offset, limit)

    monkeypatch.setattr(R, "angles", angles)
    for overrides in ({}, {"attention.kind": "nsa", "attention.nsa.separate_kv": True,
                           "attention.nsa.compress_block_size": 4, "attention.nsa.selection_block_size": 4,
                           "attention.nsa.sliding_window_size": 4, "attention.nsa.num_selected_blocks": 1}):
        torch.manual_seed(0)
        model = build(recipes.get("lm_debug").override({"model.depth": 2, **overrides})).eval()
        with torch.no_grad():
            rows = Rows(model, 3, model.max_seq_len, True)
            rows.prefill([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]])
            for _ in range(3):
                rows.forward(torch.tensor([[1], [2], [3]]))
    assert seen and all(isinstance(limit, int) for limit in seen), seen


def test_without_a_gradient_to_record_rotary_skips_the_autograd_node_with_the_same_values(monkeypatch):
    from efftx.models import layers

    rot = Rotary(16, 64)
    x = torch.randn(2, 5, 3, 16)
    q = torch.randn(2, 5, 3, 16, requires_grad=True)
    want = _elementwise(x, rot.cos[3:8, None, :], rot.sin[3:8, None, :])
    applied = []
    real = layers._Rotate.apply
    monkeypatch.setattr(layers._Rotate, "apply", lambda *a: applied.append(a[0].shape) or real(*a))
    with torch.no_grad():
        a, b = rot.pair(x, q, 3)  # decoding: no node
    assert not applied and torch.equal(a, want) and not b.requires_grad
    out = rot(q, 3)  # training: the node, and a gradient
    out.sum().backward()
    assert applied == [q.shape] and q.grad is not None
    assert torch.equal(rot(x, 3), want)  # grad mode, but nothing to differentiate: no node
    assert len(applied) == 1

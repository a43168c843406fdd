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

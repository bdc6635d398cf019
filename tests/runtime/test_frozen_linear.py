"""Frozen linears: packed bf16 weights compute what F.linear computes, row by row the same
whatever the other rows are (what makes a verify step's logits equal plain decoding's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlite_ray.runtime.frozen_linear import FrozenLinear, PackedLinear, can_pack, freeze_linear, freeze_linears

needs_packing = pytest.mark.skipif(not can_pack(torch.zeros(1, 1, dtype=torch.bfloat16)),
                                   reason="no oneDNN bf16 packing on this build")


def test_float32_weights_are_not_packed():
    frozen = freeze_linear(torch.randn(8, 4))
    assert type(frozen) is FrozenLinear
    x = torch.randn(3, 4)
    assert torch.equal(frozen(x), F.linear(x, frozen.weight))


@needs_packing
def test_packed_linear_matches_f_linear():
    torch.manual_seed(0)
    w, b = torch.randn(96, 64).bfloat16(), torch.randn(96).bfloat16()
    packed = freeze_linear(w, b)
    assert isinstance(packed, PackedLinear)
    x = torch.randn(2, 5, 64).bfloat16()  # any leading shape
    out = packed(x)
    assert out.shape == (2, 5, 96) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=0.02, atol=0.05)


@needs_packing
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536)])
def test_packed_rows_do_not_depend_on_the_other_rows(shape):
    torch.manual_seed(1)
    packed = freeze_linear(torch.randn(*shape).bfloat16())
    x = torch.randn(32, shape[1]).bfloat16()
    together = packed(x)
    for rows in (1, 2, 6, 8, 16, 24, 31, 32):  # a decode row, verify rows, a small batch of them
        assert torch.equal(packed(x[:rows]), together[:rows])
    for i in range(32):
        assert torch.equal(packed(x[i:i + 1]), together[i:i + 1])


def test_freeze_linears_keeps_outputs_and_state_dict():
    torch.manual_seed(2)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x = torch.randn(3, 8)
    before, keys = module(x), list(module.state_dict())
    freeze_linears(module)
    assert isinstance(module[0].forward, FrozenLinear)
    assert torch.equal(module(x), before) and list(module.state_dict()) == keys

"""Frozen linears: packed weights compute what F.linear computes, each row the same whatever
the other rows are and however many there are (what makes a verify step's logits equal
plain decoding's): our own kernel by construction (RowLinear, where the CPU has it), oneDNN's
packed calls by padding short calls where the kernel was measured to need it."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.cpu_features import cpu_flags
from dlite_ray.runtime.frozen_linear import (
    EXACT_ROWS,
    LARGE_CALL_ROWS,
    FrozenLinear,
    PackedLinear,
    RowLinear,
    can_pack,
    fewest_exact_rows,
    freeze_linear,
    freeze_linears,
    large_calls_agree,
    probed_linear,
)

DTYPES = [torch.bfloat16, torch.float32]
needs_packing = pytest.mark.skipif(not all(can_pack(torch.zeros(1, 1, dtype=d)) for d in DTYPES),
                                   reason="no oneDNN packing on this build")
needs_row_linear = pytest.mark.skipif(not all(fused_ops.row_linear_serves(torch.zeros(1, 2, dtype=d)) for d in DTYPES),
                                      reason="our linear kernel needs AVX-512 (float32) and AVX-512 BF16 (bf16)")


# What freeze_linear makes on this machine, and oneDNN's probed linears (where our kernel does not serve).
FREEZERS = {"freeze_linear": freeze_linear, "onednn": functools.partial(probed_linear, PackedLinear)}


def test_half_precision_weights_are_not_packed():
    frozen = freeze_linear(torch.randn(8, 4).half())
    assert type(frozen) is FrozenLinear
    x = torch.randn(3, 4).half()
    assert torch.equal(frozen(x), F.linear(x, frozen.weight))


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("freeze", FREEZERS.values(), ids=FREEZERS)
@pytest.mark.parametrize("shape", [(96, 64), (200, 576)])  # a part-filled last panel of 64 outputs
def test_frozen_linear_matches_f_linear(shape, freeze, dtype):
    torch.manual_seed(0)
    w, b = torch.randn(*shape).to(dtype), torch.randn(shape[0]).to(dtype)
    frozen = freeze(w, b)
    x = torch.randn(2, 5, shape[1]).to(dtype)  # any leading shape
    out = frozen(x)
    assert out.shape == (2, 5, shape[0]) and out.dtype == dtype
    torch.testing.assert_close(out.float(), F.linear(x.float(), w.float(), b.float()), rtol=0.02, atol=0.05)


@needs_row_linear
@pytest.mark.parametrize("dtype", DTYPES)
def test_our_kernel_serves_where_the_cpu_has_it(dtype):
    assert isinstance(freeze_linear(torch.randn(96, 64).to(dtype)), RowLinear)


@needs_row_linear
def test_our_kernel_leaves_gradients_to_f_linear():
    """It has no backward: an input that needs gradients goes through F.linear."""
    w = torch.randn(8, 4)
    x = torch.randn(3, 4, requires_grad=True)
    out = freeze_linear(w)(x)
    out.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, 4))


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("freeze", FREEZERS.values(), ids=FREEZERS)
@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536)])  # SmolLM2's q/k/v, gate/up, down
def test_rows_do_not_depend_on_the_other_rows(shape, freeze, dtype):
    """On an AMD EPYC a one-row bf16 oneDNN call of the down projection rounds about one row
    in 25 differently, and float32 differs below 16 rows unpacked: 4 x 32 rows show both."""
    for seed in range(4):
        torch.manual_seed(seed)
        frozen = freeze(torch.randn(*shape).to(dtype))
        x = torch.randn(EXACT_ROWS, shape[1]).to(dtype)
        together = frozen(x)
        for rows in (1, 2, 6, 8, 16, 24, 31):  # a decode row, verify rows, a small batch of them
            assert torch.equal(frozen(x[:rows]), together[:rows])
        for i in range(EXACT_ROWS):
            assert torch.equal(frozen(x[i:i + 1]), together[i:i + 1])


def _rounding_where(rounds: Callable[[int], bool]) -> type[FrozenLinear]:
    """A linear computed row by row (so exact by construction), then off by a rounding in
    calls whose row count `rounds`: what a kernel that switches paths by row count does."""

    class RoundsSomeCalls(FrozenLinear):
        def _linear(self, flat: torch.Tensor) -> torch.Tensor:
            out = (flat[:, None, :].double() * self.weight[None].double()).sum(-1).to(flat.dtype)
            return out + torch.finfo(out.dtype).eps if rounds(len(flat)) else out

    return RoundsSomeCalls


@pytest.mark.parametrize("rows_needed, padded_to", [(1, 1), (2, 2), (3, 4), (9, 16), (20, EXACT_ROWS)])
def test_short_calls_are_padded_as_far_as_the_kernel_needs(rows_needed, padded_to):
    kind = _rounding_where(lambda rows: rows < rows_needed)
    assert fewest_exact_rows(kind, 12, 8, False, torch.float32, torch.device("cpu")) == padded_to
    frozen = kind(torch.randn(12, 8), min_rows=padded_to)
    x = torch.randn(EXACT_ROWS, 8)
    assert torch.equal(frozen(x[:1]), frozen(x)[:1]) == (padded_to >= rows_needed)


def test_freeze_linears_keeps_outputs_and_state_dict():
    torch.manual_seed(2)
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4, bias=False))
    x = torch.randn(3, 8)
    before, keys = module(x), list(module.state_dict())
    freeze_linears(module)
    assert isinstance(module[0].forward, FrozenLinear)
    torch.testing.assert_close(module(x), before)  # packed: other kernels, same values to rounding
    assert list(module.state_dict()) == keys


@pytest.mark.parametrize("rows", [EXACT_ROWS, 99, 1023, 1024])
def test_long_calls_are_split_where_the_kernel_rounds_them_differently(rows):
    """A kernel off in calls of more than `rows` rows: measured, and split where it is."""
    kind = _rounding_where(lambda n: n > rows)
    agree = large_calls_agree(kind, 12, 8, False, torch.float32, torch.device("cpu"))
    assert agree == (rows >= max(LARGE_CALL_ROWS))
    frozen = kind(torch.randn(12, 8), split_large=not agree)
    x = torch.randn(1100, 8)
    pieces = torch.cat([frozen(x[i:i + EXACT_ROWS]) for i in range(0, len(x), EXACT_ROWS)])
    if not agree:
        assert torch.equal(frozen(x[:rows + 1]), pieces[:rows + 1])
        assert torch.equal(frozen(x[None, :rows + 7]), pieces[None, :rows + 7])  # any leading shape
    else:  # beyond what was measured, a long call is taken as it is
        assert not torch.equal(frozen(x), pieces)


@needs_packing
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("freeze", FREEZERS.values(), ids=FREEZERS)
def test_long_calls_of_this_machine_give_rows_the_bits_of_short_ones(freeze, dtype):
    torch.manual_seed(0)
    w = torch.randn(960, 576).to(dtype)
    frozen = freeze(w)
    x = torch.randn(300, 576).to(dtype)
    pieces = torch.cat([frozen(x[i:i + EXACT_ROWS]) for i in range(0, 300, EXACT_ROWS)])
    assert torch.equal(frozen(x), pieces)  # whether the kernel agrees or the call was split


AMX_SCRIPT = """
import sys, torch
from dlite_ray.runtime import fused_ops  # the build this test's process uses (the same sources)
from dlite_ray.runtime.cpu_features import cpu_flags
torch.manual_seed(0)
w, x = torch.randn(960, 576).bfloat16(), torch.randn(8, 576).bfloat16()
torch.save(fused_ops.row_linear(x, fused_ops.pack_row_linear(w), None, 960), sys.argv[1])
"""


@needs_row_linear
@pytest.mark.skipif("amx_bf16" not in cpu_flags() or os.environ.get("DLITE_AMX") == "0",
                    reason="the tile unit (AMX) is a Xeon's from Sapphire Rapids on, and DLITE_AMX=0 refuses it")
def test_bf16_linears_run_on_the_tile_unit_where_the_cpu_has_it(tmp_path):
    """AMX for inner sizes that are multiples of 32, the dot-product path otherwise or with
    DLITE_AMX=0: the two agree closely but not in every bit, which is why the unit is fixed
    per process (row exactness on the tile unit: test_rows_do_not_depend_on_the_other_rows)."""
    assert fused_ops.kernels().row_linear_uses_amx(576) and not fused_ops.kernels().row_linear_uses_amx(100)
    outs = {}
    for amx in ("1", "0"):
        path = tmp_path / f"amx{amx}.pt"
        subprocess.run([sys.executable, "-c", AMX_SCRIPT, str(path)], check=True, env={**os.environ, "DLITE_AMX": amx})
        outs[amx] = torch.load(path)
    torch.testing.assert_close(outs["1"].float(), outs["0"].float(), rtol=0.02, atol=0.02)
    assert not torch.equal(outs["1"], outs["0"])

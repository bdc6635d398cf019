"""Inference-only linears: weights fixed at load time, packed for oneDNN where that pays.

On CPU, a bf16 `F.linear` lays the weight out for the matrix unit (AMX / AVX-512 bf16) on
every call, which makes it slower than float32 at batch 1. Packed once at load, a bf16
linear costs about one weight read for anything from 1 to ~16 rows, while a float32 one
grows with the rows. That is what makes verifying K + 1 drafted tokens nearly as cheap as
decoding one token on this kind of machine.

A packed bf16 linear computes each row exactly as it would alone, for up to 32 rows in a
call (measured on AMX: from 33 rows on, oneDNN switches kernels and rounds differently;
tests/runtime/test_frozen_linear.py checks this). So up to 32 tokens in a step (a verify
step at K = 7 for up to 4 requests) give exactly the logits plain decoding would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks its kernel from this row count hint; decode and verify steps are small.
PACKING_ROW_HINT = 8


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class FrozenLinear:
    """y = x W^T + b with W fixed; a plain callable, not a module (nothing here trains)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear(FrozenLinear):
    """A FrozenLinear whose weight oneDNN re-laid out once (CPU bf16 only, see can_pack).

    The packed copy sits next to the parameter (kept for state_dict and fingerprints), so
    packed weights take twice their memory (270 MB more for SmolLM2-135M in bf16). It is a
    snapshot: changing the weights or moving the model after freezing is not supported."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACKING_ROW_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def freeze_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> FrozenLinear:
    return PackedLinear(weight, bias) if can_pack(weight) else FrozenLinear(weight, bias)


def freeze_linears(module: nn.Module) -> None:
    """Inference only: every nn.Linear inside `module` computes through a FrozenLinear
    (packed where that pays); the parameters stay where they are, for state_dict."""
    for linear in module.modules():
        if isinstance(linear, nn.Linear):
            linear.forward = freeze_linear(linear.weight, linear.bias)

"""The draft backbone's decoder layers in one C++ call (csrc/draft_backbone.cpp).

A round's backbone is two small layers over a block of ~9 rows: ~40 calls a layer of a few
microseconds each, which in Python took ~0.9 ms a round at batch 1, about twice what its
weights take to read. `DraftLayerLoop` hands the layers to C++, which runs the same
operations in the same order with the same arguments, so every bit equals the eager
backbone's (tests/runtime/test_draft_layer_loop.py). The eager path stays the reference and
serves training, teacher windows, other devices and drafts the kernels do not cover;
DLITE_LAYER_LOOP=0 switches this loop off too.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.layers import add_frozen_layers, decoder_layers, row_linears

if TYPE_CHECKING:
    from dlite_ray.runtime.draft_model import DLiteDraftModel


class DraftLayerLoop:
    """A frozen draft's backbone layers (and final norm) as one call."""

    def __init__(self, draft: DLiteDraftModel):
        lc = draft.cfg.layers
        self._layers = fused_ops.loaded_kernels().DraftLayers(
            lc.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.intermediate_size, lc.rms_norm_eps,
            draft.cfg.conventions.context_layernorm, draft.norm.weight.detach())
        add_frozen_layers(self._layers, draft.layers)

    @classmethod
    def for_model(cls, draft: DLiteDraftModel) -> DraftLayerLoop | None:
        """The loop of a frozen draft, or None where it cannot stand in for the layers: the
        kernels switched off or not built, a linear not on `RowLinear`, q/k norms, or norms
        in another dtype than the linears (the eager norms would take another path)."""
        if os.environ.get("DLITE_LAYER_LOOP", "1") == "0" or fused_ops.kernels() is None:
            return None
        if draft.cfg.layers.qk_norm:
            return None
        dtype = draft.norm.weight.dtype
        for layer in decoder_layers(draft.layers):
            linears = row_linears(layer)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if linears is None or any(lin.weight.dtype != dtype for lin in linears):
                return None
            if any(n.dtype != dtype for n in norms):
                return None
        return cls(draft)

    def run(self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
            ctx_cos: torch.Tensor, ctx_signed_sin: torch.Tensor, group_size: int) -> torch.Tensor:
        """x [N, G + M, D] (tokens, then masks) and ctx [N, S, D] through the layers -> the
        final norm at the masks [N, M, D] (`DLiteDraftModel.backbone` without a history)."""
        return self._layers.forward(x, ctx, cos, signed_sin, ctx_cos, ctx_signed_sin, group_size)

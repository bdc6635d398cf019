"""A decode or verify forward's decoder layers in one C++ call (csrc/decoder_layers.cpp).

With our own kernels (`row_linear`, `decode_attention` and the fused small operations), a
SmolLM2 decode step on CPU spent about a quarter of its time in Python between the ~20
calls of each layer. `LayerLoop` hands the whole stack of layers to C++, which calls the
same kernels in the same order with the same arguments: every bit equals the
layer-by-layer path's (tests/runtime/test_layer_loop.py), which stays the reference and
serves every other forward (prefill chunks, other backends, a model the kernels do not
cover). DLITE_LAYER_LOOP=0 switches the loop off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.attention.metadata import AttentionMetadata, _context_slots
from dlite_ray.runtime.attention.sdpa import SdpaBackend, positioned
from dlite_ray.runtime.kv_cache import PagedKVCache
from dlite_ray.runtime.layers import add_frozen_layers, decoder_layers, row_linears

if TYPE_CHECKING:
    from dlite_ray.runtime.target_model import TargetModel


class LayerLoop:
    """The target's decoder layers as one call, for the forwards `serves` accepts."""

    def __init__(self, model: TargetModel):
        cfg = model.cfg
        self.group = cfg.num_heads // cfg.num_kv_heads
        self._layers = fused_ops.loaded_kernels().DecoderLayers(
            cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
        add_frozen_layers(self._layers, model.layers)

    @classmethod
    def for_model(cls, model: TargetModel) -> LayerLoop | None:
        """The loop of a frozen model, or None where it cannot stand in for the layers: the
        kernels switched off or not built, a linear not on `RowLinear`, q/k norms (Qwen3),
        or a head dim and dtype our decode kernel does not attend."""
        if os.environ.get("DLITE_LAYER_LOOP", "1") == "0" or fused_ops.kernels() is None:
            return None
        cfg, dtype = model.cfg, model.embed_tokens.weight.dtype
        if cfg.qk_norm or not fused_ops.decode_kernel_serves(cfg.head_dim, dtype):
            return None
        for layer in decoder_layers(model.layers):
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if row_linears(layer) is None or any(n.dtype != dtype for n in norms):
                return None
        return cls(model)

    def serves(self, meta: AttentionMetadata, cache: PagedKVCache, backend: object) -> bool:
        """Whether every sequence's rows go the position-exact way through our decode kernel
        (decode and verify steps on CPU), as the layer-by-layer path would send them."""
        return (isinstance(backend, SdpaBackend) and not backend.batched_windows and not cache.block_major
                and all(positioned(span, self.group) for span in meta.spans))

    def run(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, meta: AttentionMetadata,
            cache: PagedKVCache, tap_layers: tuple[int, ...]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x [T, D] through every layer -> (the last layer's output, each tap layer's output)."""
        rows = x.shape[0]
        spans = [(s.q_start, s.q_len, s.ctx_len - s.q_len, _context_slots(s, x.device), s.tree) for s in meta.spans]
        taps = sorted(set(tap_layers))
        x, tapped = self._layers.forward(x, cos.reshape(rows, -1), signed_sin.reshape(rows, -1), cache.k_layers,
                                         cache.v_layers, meta.slot_mapping, spans, taps)
        return x, dict(zip(taps, tapped))

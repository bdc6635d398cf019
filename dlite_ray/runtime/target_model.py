"""The target: a compact Llama-family decoder over a ragged batch and a paged KV cache.

`forward` returns logits only at the positions asked for and hidden states of the
selected layers only at the positions asked for (the DLite pivot features), so a long
prefill never materialises V-wide logits or every layer's activations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.attention.flash import FlashAttnBackend
from dlite_ray.runtime.attention.metadata import AttentionMetadata
from dlite_ray.runtime.attention.sdpa import SdpaBackend
from dlite_ray.runtime.config import ModelConfig
from dlite_ray.runtime.frozen_linear import freeze_linears
from dlite_ray.runtime.kv_cache import PagedKVCache
from dlite_ray.runtime.layer_loop import LayerLoop
from dlite_ray.runtime.layers import DecoderLayer, RMSNorm, Rotary, decoder_layers


@dataclass(slots=True)
class ForwardBatch:
    """A ragged batch: all sequences' new tokens flattened into one row of T tokens."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] true positions in each sequence
    attention: AttentionMetadata
    logit_indices: torch.Tensor  # [M] indices into T whose logits are wanted
    tap_indices: torch.Tensor | None = None  # [P] indices into T whose layer taps are wanted
    tap_layers: tuple[int, ...] = field(default=())
    # The last layer's tap after the final norm, as Hugging Face's hidden_states[L] (what a
    # public DLite draft reads); otherwise its raw residual output, like every other layer's.
    normed_last_tap: bool = False


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # [M, V] float32
    taps: torch.Tensor | None  # [P, S, D] hidden states *after* each selected layer (see normed_last_tap)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.layer_loop: LayerLoop | None = None  # set by freeze() where it serves

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache,
                backend: SdpaBackend | FlashAttnBackend) -> ForwardOutput:
        x = self.embed_tokens(batch.input_ids)  # [T, D]
        cos, sin = self.rotary.cos_sin(batch.positions, x.dtype)
        want_taps = batch.tap_indices is not None and batch.tap_indices.numel() > 0
        tap_layers = batch.tap_layers if want_taps else ()
        if self.layer_loop is not None and self.layer_loop.serves(batch.attention, cache, backend):
            x, taps = self.layer_loop.run(x, cos, sin, batch.attention, cache, tap_layers)
        else:
            x, taps = self.run_layers(x, cos, sin, batch.attention, cache, backend, tap_layers)
        if batch.tap_indices is not None:  # else no layer was tapped
            taps = {i: tap.index_select(0, batch.tap_indices) for i, tap in taps.items()}
        last_layer = len(self.layers) - 1
        if batch.normed_last_tap and last_layer in taps:
            taps[last_layer] = self.norm(taps[last_layer])
        last = self.norm(x.index_select(0, batch.logit_indices))
        logits = self.lm_head(last).float()
        stacked = torch.stack([taps[i] for i in batch.tap_layers], dim=1) if want_taps else None
        return ForwardOutput(logits, stacked)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                   cache: PagedKVCache, backend: SdpaBackend | FlashAttnBackend, tap_layers: tuple[int, ...]
                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The decoder layers one by one (the reference `LayerLoop` equals) -> (the last
        layer's output, each tap layer's output)."""
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            def attend(q, k, v, i=i):
                return backend.attend(cache, i, meta, q, k, v)

            x = layer(x, cos, sin, attend)
            if i in tap_layers:
                taps[i] = x
        return x, taps

    def freeze(self) -> None:
        """Inference only (the target is never trained here): fused q/k/v and gate/up weights,
        every linear fixed, and packed for the CPU's matrix unit where that pays."""
        for layer in decoder_layers(self.layers):
            layer.self_attn.freeze()
            layer.mlp.freeze()
        freeze_linears(self.lm_head)
        if self.embed_tokens.weight.device.type == "cpu":
            fused_ops.kernels()  # compiled (first time on a machine) at load, not in the first request
        self.layer_loop = LayerLoop.for_model(self)

    def fingerprint(self) -> str:
        """A cheap identity of the weights: features are only valid for the weights that made them."""
        from dlite_ray.runtime.loading import weights_fingerprint  # avoid a cycle

        return weights_fingerprint(self)

"""The triton backend (CUDA; on CPU only under TRITON_INTERPRET=1, for tests): decode and
verify rows through the paged Triton kernel (paged_triton.py), prefill chunks through SDPA.

Triton is an optional dependency (extra `triton`): imported when the backend is built.
"""

from __future__ import annotations

import torch

from dlite_ray.runtime.attention.flash import plan_flash
from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_TOKENS, AttentionMetadata
from dlite_ray.runtime.attention.paged_triton import PAGED_CHUNK, PAGED_TILE, paged_attention
from dlite_ray.runtime.attention.sdpa import attend_prefill_span
from dlite_ray.runtime.kv_cache import PagedKVCache


class TritonPagedBackend:
    """Paged attention over the block-major cache [blocks, block_size, Hkv, Dh].

    Decode and verify rows (spans of up to MAX_POSITIONED_TOKENS new tokens) are each their
    own query over the keys up to their position, split into fixed position-aligned chunks
    merged in position order: a row's bits do not depend on the step it is in. The rows'
    tokens, lengths and block tables are device tensors built once per forward by the first
    layer (flash-attn's plan, `plan_flash`). Prefill chunks go as one causal SDPA call each
    over their keys, gathered once per layer where their blocks are not consecutive
    (`sdpa.attend_prefill_span`): a kernel per row would read a long prompt's keys once per
    prompt token.
    """

    name = "triton"
    block_major = True

    def __init__(self, chunk: int = PAGED_CHUNK, tile: int = PAGED_TILE) -> None:
        """chunk: keys per stage-1 program (a multiple of tile, a power of two >= 16)."""
        self.chunk, self.tile = chunk, tile

    def attend(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; cache layers: [blocks, block_size, Hkv, Dh]
        cache.write(layer, meta.slot_mapping, k, v)
        k_cache, v_cache = cache.k_layers[layer], cache.v_layers[layer]
        if meta.flash_plan is None:
            meta.flash_plan = plan_flash(meta, q.device)
        plan = meta.flash_plan
        out = torch.empty_like(q)
        if plan.row_tokens is not None:
            paged_attention(q, k_cache, v_cache, plan.row_tokens, plan.row_seqlens, plan.row_tables,
                            plan.max_row_seqlen, out, self.chunk, self.tile)
        if plan.chunks:
            k_heads, v_heads = (c.flatten(0, 1).transpose(0, 1) for c in (k_cache, v_cache))  # [Hkv, slots, Dh] views
            for span in meta.spans:
                if span.q_len > MAX_POSITIONED_TOKENS:
                    out[span.q_start:span.q_start + span.q_len] = attend_prefill_span(q, k_heads, v_heads, span)
        return out

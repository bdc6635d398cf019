"""The triton backend (CUDA; on CPU only under TRITON_INTERPRET=1, for tests): decode and
verify rows through the paged Triton kernel (paged_triton.py), prefill chunks through SDPA.
Graph-safe: its decode and verify steps can be captured as CUDA graphs (graph_metadata).

Triton is an optional dependency (extra `triton`): imported when the backend is built.
"""

from __future__ import annotations

import torch

from dlite_ray.runtime.attention.device_rows import DeviceRows
from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_TOKENS, AttentionMetadata
from dlite_ray.runtime.attention.paged_triton import PAGED_CHUNK, PAGED_TILE, paged_attention
from dlite_ray.runtime.attention.row_plan import step_plan
from dlite_ray.runtime.attention.sdpa import attend_prefill_span
from dlite_ray.runtime.kv_cache import PagedKVCache


class TritonPagedBackend:
    """Paged attention over the block-major cache [blocks, block_size, Hkv, Dh].

    Decode and verify rows (spans of up to MAX_POSITIONED_TOKENS new tokens) are each their
    own query over the keys up to their position, split into fixed position-aligned chunks
    merged in position order: a row's bits do not depend on the step it is in. The rows'
    tokens, lengths and block tables are device tensors built once per forward by the first
    layer (`row_plan.step_plan`, as flash-attn's). Prefill chunks go as one causal SDPA call each
    over their keys, gathered once per layer where their blocks are not consecutive
    (`sdpa.attend_prefill_span`): a kernel per row would read a long prompt's keys once per
    prompt token.

    Under a CUDA graph (`graph_metadata`) the rows' tensors are derived on the device from
    the graph runner's static buffers instead (`DeviceRows`), and the grid is fixed by the
    block table's width rather than by the step's longest row.
    """

    name = "triton"
    block_major = True
    graph_safe = True  # engine/graph_runner.py's GraphSafeBackend

    def __init__(self, chunk: int = PAGED_CHUNK, tile: int = PAGED_TILE) -> None:
        """chunk: keys per stage-1 program (a multiple of tile, a power of two >= 16)."""
        self.chunk, self.tile = chunk, tile

    def attend(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; cache layers: [blocks, block_size, Hkv, Dh]
        cache.write(layer, meta.slot_mapping, k, v)
        k_cache, v_cache = cache.k_layers[layer], cache.v_layers[layer]
        plan = step_plan(meta, layer, q.device)
        out = torch.empty_like(q)
        if plan.row_tokens is not None:
            assert plan.row_seqlens is not None and plan.row_tables is not None  # a FlashPlan sets the three together
            paged_attention(q, k_cache, v_cache, plan.row_tokens, plan.row_seqlens, plan.row_tables,
                            plan.max_row_seqlen, out, self.chunk, self.tile)
        if plan.chunks:
            k_heads, v_heads = (c.flatten(0, 1).transpose(0, 1) for c in (k_cache, v_cache))  # [Hkv, slots, Dh] views
            for span in meta.spans:
                if span.q_len > MAX_POSITIONED_TOKENS:
                    out[span.q_start:span.q_start + span.q_len] = attend_prefill_span(q, k_heads, v_heads, span)
        return out

    def graph_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                       query_len: int, block_size: int) -> AttentionMetadata:
        """B sequences of `query_len` new tokens each, read from these tensors alone (refilled
        in place between forwards): slot_mapping [B * q], block_tables [B, M] and
        context_lens [B] (int64, each at least query_len: a row of no keys would divide by
        zero in stage 2; the graph runner's padding rows hold query_len)."""
        rows = DeviceRows(block_tables, context_lens, query_len, block_size)
        return AttentionMetadata(slot_mapping, [], [], block_size, device_rows=rows)

"""The flash-attn backend (CUDA, fp16 / bf16): paged `flash_attn_with_kvcache`, every
decode and verify row its own batch entry, so position-exact by construction.

flash-attn is an optional dependency (extra `gpu`): imported when the backend is built.
"""

from __future__ import annotations

import importlib.util

import torch

from dlite_ray.runtime.attention.device_rows import DeviceRows
from dlite_ray.runtime.attention.metadata import AttentionMetadata
from dlite_ray.runtime.attention.row_plan import step_plan
from dlite_ray.runtime.kv_cache import PagedKVCache

FLASH_ATTN_PAGE_MULTIPLE = 256  # flash-attn's paged KV needs blocks of a multiple of 256


class FlashAttnBackend:
    """Paged attention through flash-attn's `flash_attn_with_kvcache` (CUDA, fp16 / bf16).

    Position-exact by construction: every decode and verify row is its own batch entry of
    one query (seqlen_q = 1) over the keys up to its position, with the key split fixed
    (num_splits = 1), so a row runs the same kernel with the same reduction whether it is
    decoded alone, verified in a block or batched with any number of others. The price:
    a verify block of K + 1 rows reads its keys K + 1 times (from L2 mostly). Prefill
    chunks go as one causal call each.

    Graph-safe (engine/graph_runner.py): under a CUDA graph its rows' lengths and block
    tables are derived on the device from the graph runner's static buffers (`DeviceRows`),
    which `flash_attn_with_kvcache` reads as device tensors, as it does eagerly.
    """

    name = "flash_attn"
    block_major = True
    graph_safe = True  # engine/graph_runner.py's GraphSafeBackend

    def __init__(self, kernel=None) -> None:
        """kernel: `flash_attn_with_kvcache` or a function with its semantics (tests)."""
        if kernel is None:
            from flash_attn import flash_attn_with_kvcache  # optional dependency

            kernel = flash_attn_with_kvcache
        self._kernel = kernel

    def attend(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; cache layers: [blocks, block_size, Hkv, Dh]
        cache.write(layer, meta.slot_mapping, k, v)
        k_cache, v_cache = cache.k_layers[layer], cache.v_layers[layer]
        plan = step_plan(meta, layer, q.device)
        if plan.row_tokens is not None:
            rows = q.index_select(0, plan.row_tokens)[:, None]  # [P, 1, Hq, Dh]
            attended = self._kernel(rows, k_cache, v_cache, cache_seqlens=plan.row_seqlens,
                                    block_table=plan.row_tables, causal=True, num_splits=1)[:, 0]
            if not plan.chunks:  # a decode / verify step: every token, in order
                return attended
        out = torch.empty_like(q)
        if plan.row_tokens is not None:
            out[plan.row_tokens] = attended
        for start, n, seqlens, table in plan.chunks:
            out[start:start + n] = self._kernel(q[None, start:start + n], k_cache, v_cache, cache_seqlens=seqlens,
                                                block_table=table, causal=True)[0]
        return out


    def graph_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                       query_len: int, block_size: int) -> AttentionMetadata:
        """B sequences of `query_len` new tokens each, read from these tensors alone (refilled
        in place between forwards; see `TritonPagedBackend.graph_metadata`)."""
        rows = DeviceRows(block_tables, context_lens, query_len, block_size)
        return AttentionMetadata(slot_mapping, [], [], block_size, device_rows=rows)


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)

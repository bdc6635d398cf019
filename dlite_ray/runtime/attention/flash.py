"""The flash-attn backend (CUDA, fp16 / bf16): paged `flash_attn_with_kvcache`, every
decode and verify row its own batch entry, so position-exact by construction.

flash-attn is an optional dependency (extra `gpu`): imported when the backend is built.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_TOKENS, AttentionMetadata
from dlite_ray.runtime.kv_cache import PagedKVCache

FLASH_ATTN_PAGE_MULTIPLE = 256  # flash-attn's paged KV needs blocks of a multiple of 256


@dataclass(slots=True)
class FlashPlan:
    """flash-attn's (and the triton backend's) inputs for one forward, built by its first
    layer as int32 tensors."""

    row_tokens: torch.Tensor | None  # [P] the decode/verify tokens, each its own batch entry
    row_seqlens: torch.Tensor | None  # [P] keys each row sees: its position + 1
    row_tables: torch.Tensor | None  # [P, W] its sequence's block table, zero-padded
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # prefill: (q_start, q_len, seqlens [1], table [1, W])
    max_row_seqlen: int = 0  # the longest row's keys, known on the host (the triton backend's grid)


def plan_flash(meta: AttentionMetadata, device: torch.device) -> FlashPlan:
    """Decode / verify tokens (spans of up to MAX_POSITIONED_TOKENS) one row each, prefill
    chunks one call each; block tables and lengths as int32 tensors, once per forward."""
    tokens, seqlens, tables, chunks = [], [], [], []
    width = max(len(t) for t in meta.block_tables)
    for span, table in zip(meta.spans, meta.block_tables, strict=True):
        padded = table + [0] * (width - len(table))
        first = span.ctx_len - span.q_len
        if span.q_len <= MAX_POSITIONED_TOKENS:
            tokens += range(span.q_start, span.q_start + span.q_len)
            seqlens += range(first + 1, span.ctx_len + 1)
            tables += [padded] * span.q_len
        else:
            chunks.append((span.q_start, span.q_len, torch.tensor([span.ctx_len], dtype=torch.int32, device=device),
                           torch.tensor([table], dtype=torch.int32, device=device)))
    if not tokens:
        return FlashPlan(None, None, None, chunks)
    return FlashPlan(torch.tensor(tokens, dtype=torch.long, device=device),
                     torch.tensor(seqlens, dtype=torch.int32, device=device),
                     torch.tensor(tables, dtype=torch.int32, device=device), chunks, max(seqlens))


class FlashAttnBackend:
    """Paged attention through flash-attn's `flash_attn_with_kvcache` (CUDA, fp16 / bf16).

    Position-exact by construction: every decode and verify row is its own batch entry of
    one query (seqlen_q = 1) over the keys up to its position, with the key split fixed
    (num_splits = 1), so a row runs the same kernel with the same reduction whether it is
    decoded alone, verified in a block or batched with any number of others. The price:
    a verify block of K + 1 rows reads its keys K + 1 times (from L2 mostly). Prefill
    chunks go as one causal call each.
    """

    name = "flash_attn"
    block_major = True

    def __init__(self, kernel=None) -> None:
        """kernel: `flash_attn_with_kvcache` or a function with its semantics (tests)."""
        if kernel is None:
            from flash_attn import flash_attn_with_kvcache as kernel  # optional dependency
        self._kernel = kernel

    def attend(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, Dh]; k, v: [T, Hkv, Dh]; cache layers: [blocks, block_size, Hkv, Dh]
        cache.write(layer, meta.slot_mapping, k, v)
        k_cache, v_cache = cache.k_layers[layer], cache.v_layers[layer]
        if meta.flash_plan is None:
            meta.flash_plan = plan_flash(meta, q.device)
        plan = meta.flash_plan
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


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)

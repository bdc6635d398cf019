"""The per-row inputs of the paged decode / verify kernels (flash-attn's and the triton
backend's): every decode and verify token its own row, with its sequence's length up to it
and its block table, as int32 device tensors; prefill chunks one call each. Built once per
forward, by its first layer: from the step's metadata on the host (`plan_flash`), or under
a CUDA graph on the device from the graph runner's static buffers (`DeviceRows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_TOKENS, AttentionMetadata


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
    tokens: list[int] = []
    seqlens: list[int] = []
    tables, chunks = [], []
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


def step_plan(meta: AttentionMetadata, layer: int, device: torch.device) -> FlashPlan:
    """This forward's rows: derived on the device where a CUDA graph's metadata holds its
    static tensors, else built on the host once, by the forward's first layer."""
    if meta.device_rows is not None:
        return meta.device_rows.plan(layer)
    if meta.flash_plan is None:
        meta.flash_plan = plan_flash(meta, device)
    return meta.flash_plan

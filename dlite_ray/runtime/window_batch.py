"""Position-exact decode and verify attention on an accelerator: every window call of a
step (attention/sdpa.py, `_attend_positioned`) in one batched kernel call per key count.

A row at position p attends the keys of positions [0, end) with end = p - p % WINDOW +
WINDOW, masked after p, in a call of MAX_POSITIONED_ROWS query rows (padded): its kernel
call then has the same shape in a decode step (1 row) and in a verify step (K + 1 rows),
so it meets the same arithmetic. Calls of one step that share `end` are stacked as a
batch: each (call, head) is computed on its own, so batching changes no bits (checked on
the device by `dlite-ray gpu-check`). Keys are read in the cache's dtype (never a float32
copy of the context) and gathered once per layer.

What is the same in every layer of a forward (which rows go where, which slots to read,
the masks) is worked out once, by the first layer (`plan_windows`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


@dataclass(slots=True)
class WindowBatch:
    """The calls of one step that read `end` keys, stacked: B calls x Hkv heads x R rows
    (R = MAX_POSITIONED_ROWS, padded)."""

    end: int
    query_index: torch.Tensor  # [B, Hkv, R]: row of the flattened query [(T * Hq) + 1, Dh] (last: zeros)
    slots: torch.Tensor  # [B * end] cache slots of the keys (past a sequence's context: masked padding)
    mask: torch.Tensor  # [B, 1, R, end] additive, in the query dtype
    out_rows: torch.Tensor  # [P]: which rows of the flattened output [B * Hkv * R] are real
    out_targets: torch.Tensor  # [P]: where each lands in the flattened result [(T * Hq), Dh]


@dataclass(slots=True)
class WindowPlan:
    batches: list[WindowBatch]
    tokens: torch.Tensor  # [n] indices into T of every positioned token


def plan_windows(spans, context_slots: list[torch.Tensor], num_heads: int, num_kv_heads: int, window: int,
                 rows: int, dtype: torch.dtype, device: torch.device) -> WindowPlan:
    """spans: the positioned SequenceSpans of a step (few new tokens each), with each one's
    context as cache slots (on `device`); `window` and `rows` are WINDOW and
    MAX_POSITIONED_ROWS of attention/metadata.py."""
    group = num_heads // num_kv_heads
    per_call = rows // group
    by_end: dict[int, list[tuple]] = {}
    tokens: list[int] = []
    for span, slots in zip(spans, context_slots, strict=True):
        first = span.ctx_len - span.q_len
        i = 0
        while i < span.q_len:  # the rows of one window per call
            end = (first + i) - (first + i) % window + window
            j = min(span.q_len, end - first, i + per_call)
            by_end.setdefault(end, []).append((span, slots, i, j, first))
            i = j
        tokens += range(span.q_start, span.q_start + span.q_len)
    batches = [_batch(end, calls, num_heads, num_kv_heads, rows, dtype, device) for end, calls in by_end.items()]
    return WindowPlan(batches, torch.tensor(tokens, dtype=torch.long, device=device))


def _batch(end: int, calls: list[tuple], num_heads: int, num_kv_heads: int, rows: int, dtype: torch.dtype,
           device: torch.device) -> WindowBatch:
    group = num_heads // num_kv_heads
    # Padding rows read index -1: the last row of the flattened query, a row of zeros.
    query_index = torch.full((len(calls), num_kv_heads, rows), -1, dtype=torch.long)
    mask = torch.zeros(len(calls), 1, rows, end)
    slots, out_rows, out_targets = [], [], []
    keys = torch.arange(end)
    heads = torch.arange(num_kv_heads)[:, None] * group + torch.arange(group)[None, :]  # [Hkv, group]
    for b, (span, context, i, j, first) in enumerate(calls):
        m = j - i
        tok = torch.arange(span.q_start + i, span.q_start + j)  # [m] token index in T
        flat = (tok[None, None, :] * num_heads + heads[:, :, None]).reshape(num_kv_heads, group * m)  # rows (g, t)
        query_index[b, :, :group * m] = flat
        out_rows.append((torch.arange(group * m)[None, :] + (b * num_kv_heads + torch.arange(num_kv_heads)[:, None])
                         * rows).reshape(-1))
        out_targets.append(flat.reshape(-1))
        positions = (first + torch.arange(i, j)).repeat(group)  # row (g, t) sits at first + t
        mask[b, 0, :group * m] = torch.where(keys[None, :] > positions[:, None], float("-inf"), 0.0)
        slots.append(_window_slots(context, end))
    return WindowBatch(end, query_index.to(device), torch.cat(slots), mask.to(dtype).to(device),
                       torch.cat(out_rows).to(device), torch.cat(out_targets).to(device))


def _window_slots(context: torch.Tensor, end: int) -> torch.Tensor:
    """The slots of positions [0, end): the context's, then its last slot repeated (masked,
    so whatever it holds counts for nothing)."""
    ctx = context[:end]
    return torch.cat([ctx, ctx[-1:].expand(end - len(ctx))])


def attend_windows(plan: WindowPlan, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, Dh] (all tokens of the step); k_all, v_all [Hkv, slots, Dh] ->
    [n, Hq, Dh] for plan.tokens, in that order."""
    t, hq, dh = q.shape
    hkv = k_all.shape[0]
    q_flat = torch.cat([q.reshape(t * hq, dh), q.new_zeros(1, dh)])
    result = q.new_empty(t * hq, dh)
    for batch in plan.batches:
        b = batch.query_index.shape[0]
        rows = q_flat[batch.query_index]  # [B, Hkv, R, Dh]
        k = k_all.index_select(1, batch.slots).view(hkv, b, batch.end, dh).transpose(0, 1)
        v = v_all.index_select(1, batch.slots).view(hkv, b, batch.end, dh).transpose(0, 1)
        out = _sdpa(rows, k, v, batch.mask)  # [B, Hkv, R, Dh]
        result[batch.out_targets] = out.reshape(-1, dh)[batch.out_rows]
    return result.view(t, hq, dh).index_select(0, plan.tokens)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # One kernel for every call: the memory-efficient one on CUDA (flash takes no mask;
    # cuDNN could pick other algorithms by batch size). Off CUDA (tests), the math one.
    backend = SDPBackend.EFFICIENT_ATTENTION if q.device.type == "cuda" else SDPBackend.MATH
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

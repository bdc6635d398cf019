"""Attention metadata (built in one place) and the attention backends over the paged KV.

Backends: `sdpa` (PyTorch scaled_dot_product_attention, CPU and GPU) and `flash_attn`
(CUDA, paged `flash_attn_with_kvcache`, when the package is installed). `auto` picks
flash-attn on CUDA when importable, else SDPA.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dlite_ray.runtime.kv_cache import PagedKVCache

FLASH_ATTN_PAGE_MULTIPLE = 256  # flash-attn's paged KV needs blocks of a multiple of 256


@dataclass(slots=True)
class SequenceSpan:
    """One sequence of a ragged batch: its new tokens [q_start, q_start + q_len) attend to
    its first ctx_len cached positions (the new ones included)."""

    q_start: int
    q_len: int
    ctx_len: int
    kv_runs: list[slice]  # the context as runs of consecutive slots
    kv_slots: torch.Tensor | None = None  # [ctx_len] slots, built by the first layer that gathers
    folded_mask: torch.Tensor | None = None  # causal mask per GQA-folded row (prefill), built once
    window_reads: dict[int, WindowReads] = field(default_factory=dict)  # by a call's first position


@dataclass(slots=True)
class WindowReads:
    """Where one position-exact call reads its keys: the same in every layer of a forward,
    so it is worked out by the first layer only."""

    chunks: list[slice | torch.Tensor]  # before the window: a view's slots, or the slots to gather
    window: torch.Tensor  # [WINDOW] slots, padded with the last one
    mask: torch.Tensor  # [MAX_POSITIONED_ROWS, WINDOW] additive: -inf after each row's position


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    spans: list[SequenceSpan]
    block_tables: list[list[int]]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()


def build_attention_metadata(
    q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """New tokens of sequence i sit at positions [ctx_lens[i] - q_lens[i], ctx_lens[i])."""
    slot_mapping: list[int] = []
    spans: list[SequenceSpan] = []
    q_start = 0
    for q_len, ctx_len, table in zip(q_lens, ctx_lens, block_tables, strict=True):
        if q_len <= 0 or ctx_len < q_len:
            raise ValueError(f"bad span: q_len={q_len}, ctx_len={ctx_len}")
        if len(table) * block_size < ctx_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx_len} tokens")
        first = ctx_len - q_len
        slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(first, ctx_len)]
        spans.append(SequenceSpan(q_start, q_len, ctx_len, _context_runs(table, ctx_len, block_size)))
        q_start += q_len
    return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device), spans, block_tables, block_size)


def _context_runs(table: list[int], ctx_len: int, block_size: int) -> list[slice]:
    """Slot ranges of the first ctx_len positions, consecutive blocks merged into one run."""
    runs: list[slice] = []
    for i, block in enumerate(table[: -(-ctx_len // block_size)]):
        start = block * block_size
        stop = start + min(block_size, ctx_len - i * block_size)
        if runs and runs[-1].stop == start:
            runs[-1] = slice(runs[-1].start, stop)
        else:
            runs.append(slice(start, stop))
    return runs


def _causal_scores(keys_from: int, num_keys: int, rows_from: int, num_rows: int, group: int,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [group * num_rows, num_keys] (rows: group, position): -inf where a key's
    position is after the row's. Scores to add are what the fused CPU kernel takes as-is."""
    keys = torch.arange(keys_from, keys_from + num_keys, device=device)
    rows = torch.arange(rows_from, rows_from + num_rows, device=device)
    mask = torch.zeros(num_rows, num_keys, dtype=dtype, device=device)
    return mask.masked_fill(keys[None, :] > rows[:, None], float("-inf")).repeat(group, 1)


# Decode and verify steps (up to MAX_POSITIONED_TOKENS new tokens per sequence) go the
# position-exact way, in kernel calls of MAX_POSITIONED_ROWS GQA-folded query rows (query
# heads per KV head x new tokens). 48 rows hold all 16 positions of SmolLM2 (3 query heads
# per KV head) in one call per window: with 32, a step of 11-16 tokens (a long copy) took
# a second round of calls in every layer and cost 1.31x a 1-token step (300 tokens of
# context, bf16); with 48 it costs 1.12x.
# WINDOW: the part of the context each row attends masked; CHUNK: the fixed pieces the
# context before it is read in (a multiple of WINDOW: calls per layer grow as ctx / CHUNK).
MAX_POSITIONED_TOKENS, MAX_POSITIONED_ROWS, WINDOW, CHUNK = 16, 48, 256, 1024


class SdpaBackend:
    """PyTorch SDPA over the head-major cache.

    GQA is folded into the query rows ([Hkv, group * q_len, Dh] against [Hkv, ctx, Dh]):
    on CPU this is ~10x faster than SDPA's own `enable_gqa` path, which copies K/V per head.

    Decode and verify rows (a few new tokens) are computed so that a row's result depends
    on its position only, not on how many tokens the step verifies: otherwise a verify step
    would round differently from plain decoding (a fused kernel sums over a different
    number of keys), and in bf16 that flips greedy tokens. See `_attend_positioned`.

    Prefill chunks over consecutive blocks are one strided view. A fragmented context
    (prefix-cache hits, preemption, blocks reused after eviction) is gathered once per
    layer and attended by one fused SDPA call (measured: a 3.6K-token prefill over blocks
    scattered by eviction took 18.8 s attended run by run, 6.5 s gathered, ~7 s on
    consecutive blocks).
    """

    name = "sdpa"
    block_major = False

    def attend(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, Dh]; k, v: [T, Hkv, Dh] -> [T, Hq, Dh]
        cache.write(layer, meta.slot_mapping, k, v)
        k_all, v_all = cache.k[layer], cache.v[layer]  # [Hkv, slots, Dh]
        hkv, dh = k_all.shape[0], k_all.shape[2]
        group = q.shape[1] // hkv
        outs = []
        for span in meta.spans:
            n = span.q_len
            if n <= MAX_POSITIONED_TOKENS and group <= MAX_POSITIONED_ROWS:
                outs.append(_attend_positioned(q[span.q_start:span.q_start + n], k_all, v_all, span))
                continue
            qs = q[span.q_start:span.q_start + n].view(n, hkv, group, dh).permute(1, 2, 0, 3)
            qs = qs.reshape(hkv, group * n, dh)  # rows: (group, position)
            mask = None if n == 1 else _folded_mask(span, group, q.dtype, q.device)
            if len(span.kv_runs) == 1:
                run = span.kv_runs[0]
                out = F.scaled_dot_product_attention(qs[None], k_all[None, :, run], v_all[None, :, run],
                                                     attn_mask=mask)[0]
            else:
                slots = _context_slots(span, q.device)
                k_ctx, v_ctx = k_all.index_select(1, slots), v_all.index_select(1, slots)
                out = F.scaled_dot_product_attention(qs[None], k_ctx[None], v_ctx[None], attn_mask=mask)[0]
            outs.append(out.view(hkv, group, n, dh).permute(2, 0, 1, 3).reshape(n, hkv * group, dh))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _folded_mask(span: SequenceSpan, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The span's causal mask for GQA-folded rows, once per forward (not once per layer)."""
    if span.folded_mask is None:
        span.folded_mask = _causal_scores(0, span.ctx_len, span.ctx_len - span.q_len, span.q_len, group, dtype, device)
    return span.folded_mask


def _attend_positioned(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                       span: SequenceSpan) -> torch.Tensor:
    """Decode / verify rows q [n, Hq, Dh] -> [n, Hq, Dh], each computed the same way whatever
    step it is in and wherever its blocks sit. The context of the row at position p splits
    at w = p - p % WINDOW:
      - positions [0, w) in chunks at fixed positions (multiples of CHUNK): one call each,
        a view when the chunk's slots are consecutive, else gathered (same values, same
        shape, same arithmetic), no mask;
      - the window [w, w + WINDOW): gathered, padded, masked after p, one call.
    Every call has exactly MAX_POSITIONED_ROWS query rows (padded), so the kernel picks the
    same arithmetic for a decode step and a verify step; the parts are merged per row by
    their log-sum-exp (one softmax over all keys, up to rounding)."""
    n, hq, _ = q.shape
    per_call = MAX_POSITIONED_ROWS // (hq // k_all.shape[0])  # positions per kernel call
    first = span.ctx_len - n  # position of the first new token
    outs, i = [], 0
    while i < n:  # the rows of one window at a time (a verify step may cross into the next)
        start = (first + i) - (first + i) % WINDOW
        j = min(n, start + WINDOW - first, i + per_call)
        outs.append(_attend_window_rows(q[i:j], k_all, v_all, span, start, first + i))
        i = j
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_window_rows(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, span: SequenceSpan,
                        start: int, first: int) -> torch.Tensor:
    """Rows q [m, Hq, Dh] at positions first.. first + m - 1, all in the window from `start`."""
    m, hq, dh = q.shape
    hkv = k_all.shape[0]
    group = hq // hkv
    real = group * m
    rows = q.view(m, hkv, group, dh).permute(1, 2, 0, 3).reshape(hkv, real, dh)
    rows = F.pad(rows, (0, 0, 0, MAX_POSITIONED_ROWS - real))
    reads = _window_reads(span, start, first, m, group, q.dtype, q.device)
    parts = [_attend_with_lse(rows, *_read(k_all, v_all, chunk)) for chunk in reads.chunks]
    parts.append(_attend_with_lse(rows, *_read(k_all, v_all, reads.window), reads.mask))
    out = parts[0][0] if len(parts) == 1 else _merge(parts, q.dtype)
    return out[:, :real].reshape(hkv, group, m, dh).permute(2, 0, 1, 3).reshape(m, hq, dh)


def _window_reads(span: SequenceSpan, start: int, first: int, m: int, group: int, dtype: torch.dtype,
                  device: torch.device) -> WindowReads:
    """The reads of the call whose m rows start at position `first` (window from `start`)."""
    if first not in span.window_reads:
        slots = _context_slots(span, device)
        chunks = []
        for a in range(0, start, CHUNK):
            b = min(start, a + CHUNK)
            run = _inside_one_run(span.kv_runs, a, b)
            chunks.append(run if run is not None else slots[a:b])  # a view when it can be, no copy
        window = slots[start:start + WINDOW]
        window = torch.cat([window, window[-1:].expand(WINDOW - window.numel())])  # padding, masked below
        mask = F.pad(_causal_scores(start, WINDOW, first, m, group, dtype, device),
                     (0, 0, 0, MAX_POSITIONED_ROWS - group * m))
        span.window_reads[first] = WindowReads(chunks, window, mask)
    return span.window_reads[first]


def _read(k_all: torch.Tensor, v_all: torch.Tensor, slots: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(slots, slice):
        return k_all[:, slots], v_all[:, slots]
    return k_all.index_select(1, slots), v_all.index_select(1, slots)


def _inside_one_run(runs: list[slice], a: int, b: int) -> slice | None:
    """The slots of positions [a, b) when one run of consecutive slots holds them all."""
    offset = 0
    for run in runs:
        length = run.stop - run.start
        if offset <= a and b <= offset + length:
            return slice(run.start + a - offset, run.start + b - offset)
        if a < offset + length:
            return None  # the range starts in this run and goes past it
        offset += length
    return None


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """Attention over the union of the parts' keys, from each part's output and log-sum-exp."""
    outs, lses = zip(*parts, strict=True)
    weights = torch.stack(lses).softmax(dim=0)[..., None]  # [parts, Hkv, rows, 1]
    return (torch.stack(outs).float() * weights).sum(dim=0).to(dtype)


def _context_slots(span: SequenceSpan, device: torch.device) -> torch.Tensor:
    """The span's context as one slot index per position, built once per forward."""
    if span.kv_slots is None:
        span.kv_slots = torch.cat([torch.arange(r.start, r.stop, device=device) for r in span.kv_runs])
    return span.kv_slots


def _attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     additive_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, R, Dh] over k, v [H, L, Dh] -> (out [H, R, Dh], log-sum-exp of the scores [H, R])."""
    if q.device.type == "cpu":  # the fused kernel reads strided views and returns the LSE
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], attn_mask=additive_mask)
        return out[0], lse[0].float()
    scores = (q.float() @ k.float().transpose(1, 2)) * q.shape[-1] ** -0.5
    if additive_mask is not None:
        scores = scores + additive_mask.float()
    return (scores.softmax(dim=-1) @ v.float()).to(q.dtype), scores.logsumexp(dim=-1)


class FlashAttnBackend:
    """Paged attention through flash-attn's kvcache kernel (CUDA only)."""

    name = "flash_attn"
    block_major = True

    def __init__(self) -> None:
        from flash_attn import flash_attn_with_kvcache  # optional dependency

        self._kernel = flash_attn_with_kvcache

    def attend(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache.write(layer, meta.slot_mapping, k, v)
        # Rows with the same q_len go in one kernel call: [B, q_len, H, Dh].
        by_len: dict[int, list[int]] = {}
        for i, span in enumerate(meta.spans):
            by_len.setdefault(span.q_len, []).append(i)
        result = torch.empty_like(q)
        for q_len, rows in by_len.items():
            spans = [meta.spans[i] for i in rows]
            qb = torch.stack([q[s.q_start:s.q_start + q_len] for s in spans])
            width = max(len(meta.block_tables[i]) for i in rows)
            table = torch.zeros(len(rows), width, dtype=torch.int32, device=q.device)
            for r, i in enumerate(rows):
                table[r, :len(meta.block_tables[i])] = torch.tensor(meta.block_tables[i], dtype=torch.int32)
            lens = torch.tensor([s.ctx_len for s in spans], dtype=torch.int32, device=q.device)
            out = self._kernel(qb, cache.k[layer], cache.v[layer], cache_seqlens=lens, block_table=table, causal=True)
            for r, s in enumerate(spans):
                result[s.q_start:s.q_start + q_len] = out[r]
        return result


def flash_attn_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


def make_backend(name: str, device: torch.device) -> SdpaBackend | FlashAttnBackend:
    if name == "auto":
        name = "flash_attn" if device.type == "cuda" and flash_attn_available() else "sdpa"
    if name == "sdpa":
        return SdpaBackend()
    if name == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package (extra 'gpu')")
        return FlashAttnBackend()
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, sdpa or flash_attn")

"""Attention metadata (built in one place) and the attention backends over the paged KV.

Backends: `sdpa` (PyTorch scaled_dot_product_attention, CPU and GPU) and `flash_attn`
(CUDA, paged `flash_attn_with_kvcache`, when the package is installed). `auto` picks
flash-attn on CUDA when importable, else SDPA.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.kv_cache import PagedKVCache
from dlite_ray.runtime.window_batch import WindowPlan, attend_windows, plan_windows

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

    keys: slice | torch.Tensor  # positions [0, end): a view's slots, or the slots to gather (padded)
    mask: torch.Tensor  # [rows, end] additive: -inf after each row's position; rows: the call's, padding included
    split_keys: bool = False  # attend the two key halves as a batch of two (`_attend_key_halves`)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    spans: list[SequenceSpan]
    block_tables: list[list[int]]
    block_size: int
    window_plan: WindowPlan | None = None  # accelerators' decode/verify calls (window_batch.py), built once
    flash_plan: FlashPlan | None = None  # flash-attn's tensors for the step, built once

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
# position-exact way: one kernel call per window of rows, over the keys of positions
# [0, w + WINDOW) where w = p - p % WINDOW, masked after each row's position p. The key
# count is then a function of the position alone, so a row sees the same arithmetic in a
# decode step and in a verify step. A call holds at most MAX_POSITIONED_ROWS GQA-folded
# query rows (query heads per KV head x new tokens): 48 hold all 16 positions of SmolLM2
# (3 query heads per KV head). A call reads WINDOW / 2 masked keys on average, and a verify
# step crosses into the next window (a second call) in about K / WINDOW of steps: at 300
# positions, a window of 64 instead of 256 made a forward 5% (1 row) to 8% (8 rows) faster.
MAX_POSITIONED_TOKENS, MAX_POSITIONED_ROWS, WINDOW = 16, 48, 64


class SdpaBackend:
    """PyTorch SDPA over the head-major cache.

    GQA is folded into the query rows ([Hkv, group * q_len, Dh] against [Hkv, ctx, Dh]):
    on CPU this is ~10x faster than SDPA's own `enable_gqa` path, which copies K/V per head.

    Decode and verify rows (a few new tokens) are computed so that a row's result depends
    on its position only, not on how many tokens the step verifies: otherwise a verify step
    would round differently from plain decoding (a fused kernel sums over a different
    number of keys), and in bf16 that flips greedy tokens. With a head dim of 64 or 128 on
    a CPU with AVX-512 (AVX-512 BF16 for bf16; SmolLM2 on this project's machines), a kernel
    of our own does it by construction (`fused_ops.decode_attention`: in bf16 2-4x faster
    than the flash kernel for one new token, 1.4-2x for eight; in float32 ~2x for one, about
    even for eight); elsewhere the flash kernel, called position-exactly (`_attend_positioned`).
    On an accelerator, every decode / verify call of a step goes in batched calls of the
    same position-exact shapes, in the cache's dtype (`window_batch.py`).

    Prefill chunks over consecutive blocks read one strided view. A fragmented context
    (prefix-cache hits, preemption, blocks reused after eviction) is gathered once per
    layer (measured: a 3.6K-token prefill over blocks scattered by eviction took 18.8 s
    attended run by run, 6.5 s gathered, ~7 s on consecutive blocks). On CPU a chunk is
    attended causally in two fused calls (`_attend_prefill_cpu`), elsewhere in one masked
    call over GQA-folded rows.
    """

    name = "sdpa"
    block_major = False

    def __init__(self, batched_windows: bool | None = None):
        """batched_windows: decode/verify rows through `window_batch` (one batched call per
        key count, in the cache's dtype). None: on accelerators, not on CPU, whose own
        kernels below are faster there; tests set it to run the accelerator path on CPU."""
        self.batched_windows = batched_windows

    def attend(self, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
               q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, Dh]; k, v: [T, Hkv, Dh] -> [T, Hq, Dh]
        cache.write(layer, meta.slot_mapping, k, v)
        k_all, v_all = cache.k_layers[layer], cache.v_layers[layer]  # [Hkv, slots, Dh]
        batched = self.batched_windows if self.batched_windows is not None else q.device.type != "cpu"
        if batched:
            return _attend_accelerator(meta, q, k_all, v_all)
        group = q.shape[1] // k_all.shape[0]
        outs = []
        for span in meta.spans:
            n = span.q_len
            rows = q if len(meta.spans) == 1 else q[span.q_start:span.q_start + n]
            if _positioned(span, group):
                if fused_ops.attends_decode_rows(rows):
                    first = span.ctx_len - n
                    outs.append(fused_ops.decode_attention(rows, k_all, v_all, _context_slots(span, q.device), first))
                else:
                    outs.append(_attend_positioned(rows, k_all, v_all, span))
                continue
            outs.append(_attend_prefill_cpu(rows, *_context_kv(span, k_all, v_all)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _context_kv(span: SequenceSpan, k_all: torch.Tensor, v_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill span's keys and values [Hkv, ctx, Dh]: a view over consecutive blocks, else
    gathered once (measured in the class docstring)."""
    if len(span.kv_runs) == 1:
        return k_all[:, span.kv_runs[0]], v_all[:, span.kv_runs[0]]
    slots = _context_slots(span, k_all.device)
    return k_all.index_select(1, slots), v_all.index_select(1, slots)


def _positioned(span: SequenceSpan, group: int) -> bool:
    """Whether a span's rows go the position-exact way (decode and verify steps)."""
    return span.q_len <= MAX_POSITIONED_TOKENS and group <= MAX_POSITIONED_ROWS


def _attend_accelerator(meta: AttentionMetadata, q: torch.Tensor, k_all: torch.Tensor,
                        v_all: torch.Tensor) -> torch.Tensor:
    """Decode and verify rows of every sequence in batched position-exact calls
    (window_batch.py); prefill chunks one by one, causally masked over GQA-folded rows."""
    hkv, dh = k_all.shape[0], k_all.shape[2]
    group = q.shape[1] // hkv
    positioned = [s for s in meta.spans if _positioned(s, group)]
    if positioned and meta.window_plan is None:
        meta.window_plan = plan_windows(positioned, [_context_slots(s, q.device) for s in positioned], q.shape[1],
                                        hkv, WINDOW, MAX_POSITIONED_ROWS, q.dtype, q.device)
    if len(positioned) == len(meta.spans):  # a decode / verify step: the plan covers every token, in order
        return attend_windows(meta.window_plan, q, k_all, v_all)
    out = torch.empty_like(q)
    if positioned:
        out[meta.window_plan.tokens] = attend_windows(meta.window_plan, q, k_all, v_all)
    for span in meta.spans:
        if _positioned(span, group):
            continue
        n = span.q_len
        k_ctx, v_ctx = _context_kv(span, k_all, v_all)
        rows = q[span.q_start:span.q_start + n]
        qs = rows.view(n, hkv, group, dh).permute(1, 2, 0, 3).reshape(hkv, group * n, dh)  # rows: (group, position)
        attended = F.scaled_dot_product_attention(qs[None], k_ctx[None], v_ctx[None],
                                                  attn_mask=_folded_mask(span, group, q.dtype, q.device))[0]
        out[span.q_start:span.q_start + n] = attended.view(hkv, group, n, dh).permute(2, 0, 1, 3).reshape(n, -1, dh)
    return out


def _attend_prefill_cpu(q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor) -> torch.Tensor:
    """Prefill rows q [n, Hq, Dh], the last n positions of a context k_ctx, v_ctx [Hkv, ctx, Dh].
    The chunk attends its own keys causally, where the fused kernel skips the blocks above
    the diagonal, and the keys before it in full; the two are merged by log-sum-exp. Each
    query head reads its KV head through a stride-0 view (no copy). Measured per layer
    (SmolLM2, bf16): a first chunk of 1024 tokens 20.8 -> 12.5 ms, a 976-token chunk after
    1024 tokens 19.9 -> 15.9 ms, against one call over every key with a causal mask."""
    n, hq, dh = q.shape
    hkv, ctx, _ = k_ctx.shape
    group, before = hq // hkv, ctx - n
    heads = q.view(n, hkv, group, dh).permute(1, 2, 0, 3)  # [Hkv, group, n, Dh]

    def attend(keys: slice, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = (t[:, None, keys].expand(hkv, group, -1, dh) for t in (k_ctx, v_ctx))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(heads, k, v, is_causal=causal)[:2]

    out, lse = attend(slice(before, ctx), causal=True)
    if before:
        out_before, lse_before = attend(slice(0, before), causal=False)
        weights = torch.stack([lse_before, lse]).softmax(dim=0)[..., None]
        out = (out_before.float() * weights[0] + out.float() * weights[1]).to(q.dtype)
    return out.permute(2, 0, 1, 3).reshape(n, hq, dh)


def _folded_mask(span: SequenceSpan, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The span's causal mask for GQA-folded rows, once per forward (not once per layer)."""
    if span.folded_mask is None:
        span.folded_mask = _causal_scores(0, span.ctx_len, span.ctx_len - span.q_len, span.q_len, group, dtype, device)
    return span.folded_mask


def _attend_positioned(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                       span: SequenceSpan) -> torch.Tensor:
    """Decode / verify rows q [n, Hq, Dh] -> [n, Hq, Dh], each computed the same way whatever
    step it is in and wherever its blocks sit. The row at position p attends, in one kernel
    call, the keys of positions [0, w + WINDOW) with w = p - p % WINDOW, masked after p: the
    rows of a step that fall in one window share the call. The keys are a view of the cache
    when the sequence's slots are consecutive, else gathered (same values, same shape);
    slots past the context are masked, so what they hold never counts."""
    n, hq, _ = q.shape
    per_call = MAX_POSITIONED_ROWS // (hq // k_all.shape[0])  # positions per kernel call
    first = span.ctx_len - n  # position of the first new token
    outs, i = [], 0
    while i < n:  # the rows of one window at a time (a verify step may cross into the next)
        end = (first + i) - (first + i) % WINDOW + WINDOW
        j = min(n, end - first, i + per_call)
        outs.append(_attend_window_rows(q if j - i == n else q[i:j], k_all, v_all, span, end, first + i))
        i = j
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _attend_window_rows(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, span: SequenceSpan,
                        end: int, first: int) -> torch.Tensor:
    """Rows q [m, Hq, Dh] at positions first.. first + m - 1, all before position `end`."""
    m, hq, dh = q.shape
    hkv = k_all.shape[0]
    group = hq // hkv
    real = group * m
    rows = q.view(m, hkv, group, dh).permute(1, 2, 0, 3).reshape(hkv, real, dh)
    reads = _window_reads(span, k_all.shape[1], end, first, group, q)
    num_rows = reads.mask.shape[0]  # the real rows, or padded (see _kernel_rows)
    if num_rows > real:
        rows = F.pad(rows, (0, 0, 0, num_rows - real))
    attend = _attend_key_halves if reads.split_keys else _attend_masked
    out = attend(rows, *_read(k_all, v_all, reads.keys), reads.mask)
    return out[:, :real].reshape(hkv, group, m, dh).permute(2, 0, 1, 3).reshape(m, hq, dh)


def _kernel_rows(real: int, group: int, q: torch.Tensor) -> int:
    """How many query rows a position-exact call gives the kernel for `real` rows: the real
    ones, padded only as far as the CPU kernel needs to compute every row as it would in a
    full MAX_POSITIONED_ROWS call (measured once, `_smallest_exact_tail`), else always
    MAX_POSITIONED_ROWS, so that a decode step and a verify step run the same arithmetic
    either way. A decode call has 3 real rows of 48 for SmolLM2: it costs ~4x less at 4
    rows than at 48 (240 -> 58 us a layer at 300 tokens of context)."""
    tail = _kernel_plan(q.dtype, q.shape[-1], group).tail if q.device.type == "cpu" else None
    return MAX_POSITIONED_ROWS if tail is None else _padded(real, tail)


@dataclass(frozen=True, slots=True)
class KernelPlan:
    """How position-exact calls use the CPU kernel, as measured for a dtype and head shape."""

    tail: int | None  # fewest rows in a call's last 32-row block; None: always MAX_POSITIONED_ROWS
    split_keys: bool  # long calls may attend their key halves as a batch of two (`_attend_key_halves`)


@functools.cache
def _kernel_plan(dtype: torch.dtype, head_dim: int, group: int) -> KernelPlan:
    """`tail`: the padding short calls need (`_smallest_exact_tail`). `split_keys`: whether
    splitting the keys leaves rows as exact as one call: with every call padded to the
    full count there is nothing to check (same shapes, rows independent); with short calls
    the split path itself is measured (bf16 and float32 on the EPYC: yes)."""
    tail = _smallest_exact_tail(dtype, head_dim, group)
    split = tail is None or _short_calls_match_full(dtype, head_dim, group, tail, split_keys=True)
    return KernelPlan(tail, split)


# The CPU kernel works in blocks of this many query rows; a last block of very few rows
# takes other code paths that round differently (measured: blocks of 1 row on one Xeon,
# of 1-3 rows on another).
KERNEL_BLOCK_ROWS = 32


def _padded(real: int, tail: int) -> int:
    """`real` rows padded so that the last block of the call holds at least `tail` rows."""
    last = real % KERNEL_BLOCK_ROWS
    return min(real + tail - last, MAX_POSITIONED_ROWS) if 0 < last < tail else real


@functools.cache
def _smallest_exact_tail(dtype: torch.dtype, head_dim: int, group: int) -> int | None:
    """The fewest rows the kernel's last block may hold for every row to come out with the
    same bits as in a full MAX_POSITIONED_ROWS call, whatever the call's row count (random
    inputs, masked, 88 key counts up to 3100; ~0.1-0.5 s a try, once per process and
    shape); None if no padding short of the full count does it. A rounding difference shows
    only for some inputs: with no padding, this finds it within the first 45 key counts."""
    for tail in (1, 2, 4, 8, 16):
        if _short_calls_match_full(dtype, head_dim, group, tail, split_keys=False):
            return tail
    return None


def _short_calls_match_full(dtype: torch.dtype, head_dim: int, group: int, tail: int, split_keys: bool) -> bool:
    """Whether calls of every row count a step may make, padded to `tail`, give each row the
    bits a full MAX_POSITIONED_ROWS call gives it: through one kernel call, or through the
    key halves (then over the key counts such calls have, rows seeing keys past the middle
    as real rows do)."""
    attend = _attend_key_halves if split_keys else _attend_masked
    gen = torch.Generator().manual_seed(0)
    counts = sorted({_padded(group * m, tail) for m in range(1, MAX_POSITIONED_ROWS // group + 1)})
    key_counts = (*range(1, 1100, 13), 1287, 2049, 3100)  # across the kernel's 512-key blocks
    if split_keys:  # whole windows from SPLIT_KEYS on
        key_counts = (*range(SPLIT_KEYS, SPLIT_KEYS + 513, WINDOW), 2048, 3072, 4096)
    for num_keys in key_counts:
        q = torch.randn(3, MAX_POSITIONED_ROWS, head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(3, num_keys, head_dim, generator=gen).to(dtype) for _ in range(2))
        last_key = torch.randint(num_keys // 2 if split_keys else 0, num_keys, (MAX_POSITIONED_ROWS, 1), generator=gen)
        mask = torch.zeros(MAX_POSITIONED_ROWS, num_keys, dtype=dtype)
        mask = mask.masked_fill(torch.arange(num_keys)[None, :] > last_key, float("-inf"))
        full = attend(q, k, v, mask)
        if any(not torch.equal(attend(q[:, :r], k, v, mask[:r]), full[:, :r]) for r in counts):
            return False
    return True


def _window_reads(span: SequenceSpan, num_slots: int, end: int, first: int, group: int,
                  q: torch.Tensor) -> WindowReads:
    """The reads of the call whose rows q [m, Hq, Dh] start at position `first` (keys of
    [0, end)); the mask has the call's row count, real or padded (`_kernel_rows`)."""
    if first not in span.window_reads:
        m = q.shape[0]
        known = min(end, span.ctx_len)
        run = _inside_one_run(span.kv_runs, 0, known)
        if run is not None and run.start + end <= num_slots:
            keys = slice(run.start, run.start + end)  # a view; slots past the context are masked
        else:
            slots = _context_slots(span, q.device)[:known]
            keys = torch.cat([slots, slots[-1:].expand(end - known)])  # padding, masked below
        mask = _causal_scores(0, end, first, m, group, q.dtype, q.device)
        mask = F.pad(mask, (0, 0, 0, _kernel_rows(group * m, group, q) - group * m))
        split = (q.device.type == "cpu" and _kernel_plan(q.dtype, q.shape[-1], group).split_keys
                 and _worth_splitting(q.shape[1] // group, end))
        span.window_reads[first] = WindowReads(keys, mask, split)
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


def _context_slots(span: SequenceSpan, device: torch.device) -> torch.Tensor:
    """The span's context as one slot index per position, built once per forward."""
    if span.kv_slots is None:
        span.kv_slots = torch.cat([torch.arange(r.start, r.stop, device=device) for r in span.kv_runs])
    return span.kv_slots


# The CPU kernel shares out its work by (head, block of 32 query rows): a decode or verify
# call of SmolLM2 has 3 KV heads, which 2 threads split 2 : 1. From this many keys on, a
# call attends the two halves of its keys as two batch entries instead (6 items, split
# evenly) and merges them by log-sum-exp: measured, 250 -> 190 us a layer for 4 rows over
# 4096 keys, 738 -> 575 us for 24 rows. Where the keys split depends on their count alone,
# which is a function of the position (`_attend_positioned`), so decode and verify rows
# still meet the same arithmetic.
SPLIT_KEYS = 1024


def _worth_splitting(num_heads: int, num_keys: int) -> bool:
    """Whether a call's heads share out unevenly over the threads and its keys are many."""
    return num_keys >= SPLIT_KEYS and num_keys % 2 == 0 and num_heads % torch.get_num_threads() != 0


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
    """q [H, R, Dh] over k, v [H, L, Dh] with an additive mask [R, L] -> [H, R, Dh], by the
    CPU's fused kernel (it reads strided views)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q[None], k[None], v[None], attn_mask=additive_mask)[0][0]


def _attend_key_halves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
    """`_attend_masked` on CPU in one kernel call over the two halves of the keys as a batch
    of 2. Every row must see a key in each half: the kernel gives a row that sees none a
    log-sum-exp of 0, not -inf. Position-exact calls hold: their rows sit in the last
    window of their keys (past the middle from SPLIT_KEYS on), and padding rows see all."""
    rows, half = q.shape[1], k.shape[1] // 2
    k2, v2 = (t.unflatten(1, (2, half)).transpose(0, 1) for t in (k, v))  # [2, H, L/2, Dh] views
    mask2 = additive_mask.unflatten(1, (2, half)).transpose(0, 1)[:, None]  # [2, 1, R, L/2]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.expand(2, *q.shape), k2, v2, attn_mask=mask2)[:2]
    # The weights' exp runs vectorised on whole vectors and scalar on a remainder, so the
    # row count would decide which exp a row gets: at MAX_POSITIONED_ROWS it never does.
    weights = F.pad(lse, (0, MAX_POSITIONED_ROWS - rows)).softmax(dim=0)[..., :rows, None]
    return (out.float() * weights).sum(dim=0).to(q.dtype)


@dataclass(slots=True)
class FlashPlan:
    """flash-attn's inputs for one forward, built by its first layer as int32 tensors."""

    row_tokens: torch.Tensor | None  # [P] the decode/verify tokens, each its own batch entry
    row_seqlens: torch.Tensor | None  # [P] keys each row sees: its position + 1
    row_tables: torch.Tensor | None  # [P, W] its sequence's block table, zero-padded
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # prefill: (q_start, q_len, seqlens [1], table [1, W])


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
                     torch.tensor(tables, dtype=torch.int32, device=device), chunks)


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


def make_backend(name: str, device: torch.device, dtype: torch.dtype) -> SdpaBackend | FlashAttnBackend:
    """`auto`: flash-attn on CUDA in fp16 / bf16 when it is installed, else SDPA."""
    if name == "auto":
        flash = device.type == "cuda" and dtype in FLASH_ATTN_DTYPES and flash_attn_available()
        name = "flash_attn" if flash else "sdpa"
    if name == "sdpa":
        return SdpaBackend()
    if name == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package (extra 'gpu')")
        if dtype not in FLASH_ATTN_DTYPES:
            raise ValueError(f"attention_backend='flash_attn' runs in float16 or bfloat16, not {dtype}; "
                             "use attention_backend='sdpa' (or 'auto') for this dtype")
        return FlashAttnBackend()
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, sdpa or flash_attn")

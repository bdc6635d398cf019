"""The SDPA backend: PyTorch's fused attention over the head-major paged cache, on CPU and
on accelerators, decode and verify rows computed position-exactly (`SdpaBackend`).

How the CPU kernel is called exactly is measured in cpu_exactness.py; the accelerators'
batched window calls are in runtime/window_batch.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.attention.cpu_exactness import (
    _attend_key_halves,
    _attend_masked,
    _kernel_plan,
    _kernel_rows,
    _worth_splitting,
)
from dlite_ray.runtime.attention.metadata import (
    MAX_POSITIONED_ROWS,
    MAX_POSITIONED_TOKENS,
    WINDOW,
    AttentionMetadata,
    SequenceSpan,
    WindowReads,
    _context_slots,
    _inside_one_run,
)
from dlite_ray.runtime.kv_cache import PagedKVCache
from dlite_ray.runtime.window_batch import attend_windows, plan_windows


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
    call over GQA-folded rows. Where our decode kernel serves the rows and its per-call
    partial results stay bounded (`fused_ops.attends_prefill_rows`), it attends prefill
    chunks too, reading the keys through their slots: a bf16 SmolLM2 prefill of 4K tokens
    took 6.3 s against 8.4 s (scripts/step_bench.py), and each row then has its decoded
    bits however the prompt was cut into chunks (tests/runtime/test_layer_loop.py).
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
        i = 0
        while i < len(meta.spans):
            span = meta.spans[i]
            chains = _tree_chains(meta.spans, i)
            if len(chains) > 1 and all(positioned(c, group) for c in chains) and fused_ops.attends_decode_rows(q):
                outs.append(_attend_tree(q, k_all, v_all, chains))
                i += len(chains)
                continue
            i += 1
            n = span.q_len
            rows = q if len(meta.spans) == 1 else q[span.q_start:span.q_start + n]
            exact = positioned(span, group)
            if fused_ops.attends_decode_rows(rows) if exact else fused_ops.attends_prefill_rows(rows, span.ctx_len):
                first = span.ctx_len - n
                outs.append(fused_ops.decode_attention(rows, k_all, v_all, _context_slots(span, q.device), first))
            elif exact:
                outs.append(_attend_positioned(rows, k_all, v_all, span))
            else:
                outs.append(_attend_prefill_cpu(rows, *_context_kv(span, k_all, v_all)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _tree_chains(spans: list[SequenceSpan], i: int) -> list[SequenceSpan]:
    """The spans from spans[i] on that are chains of its tree (just spans[i] if none)."""
    j = i + 1
    while spans[i].tree >= 0 and j < len(spans) and spans[j].tree == spans[i].tree:
        j += 1
    return spans[i:j]


def _attend_tree(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, chains: list[SequenceSpan]) -> torch.Tensor:
    """A tree's chains in one kernel call that reads their shared context once."""
    start = chains[0].q_start
    rows = q[start:chains[-1].q_start + chains[-1].q_len]
    firsts = [c.ctx_len - c.q_len for c in chains]
    return fused_ops.tree_attention(rows, k_all, v_all, [(c.q_start - start, c.q_len, f, _context_slots(c, q.device))
                                                         for c, f in zip(chains, firsts)], min(firsts))


def _context_kv(span: SequenceSpan, k_all: torch.Tensor, v_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill span's keys and values [Hkv, ctx, Dh]: a view over consecutive blocks, else
    gathered once (measured in the class docstring)."""
    if len(span.kv_runs) == 1:
        return k_all[:, span.kv_runs[0]], v_all[:, span.kv_runs[0]]
    slots = _context_slots(span, k_all.device)
    return k_all.index_select(1, slots), v_all.index_select(1, slots)


def positioned(span: SequenceSpan, group: int) -> bool:
    """Whether a span's rows go the position-exact way (decode and verify steps)."""
    return span.q_len <= MAX_POSITIONED_TOKENS and group <= MAX_POSITIONED_ROWS


def _attend_accelerator(meta: AttentionMetadata, q: torch.Tensor, k_all: torch.Tensor,
                        v_all: torch.Tensor) -> torch.Tensor:
    """Decode and verify rows of every sequence in batched position-exact calls
    (window_batch.py); prefill chunks one by one, causally masked over GQA-folded rows."""
    hkv = k_all.shape[0]
    group = q.shape[1] // hkv
    exact = [s for s in meta.spans if positioned(s, group)]
    plan = meta.window_plan  # set by the forward's first layer where it has exact spans
    if exact and plan is None:
        plan = meta.window_plan = plan_windows(exact, [_context_slots(s, q.device) for s in exact], q.shape[1],
                                               hkv, WINDOW, MAX_POSITIONED_ROWS, q.dtype, q.device)
    if plan is not None and len(exact) == len(meta.spans):  # a decode / verify step: the plan covers every token
        return attend_windows(plan, q, k_all, v_all)
    out = torch.empty_like(q)
    if exact and plan is not None:
        out[plan.tokens] = attend_windows(plan, q, k_all, v_all)
    for span in meta.spans:
        if not positioned(span, group):
            out[span.q_start:span.q_start + span.q_len] = attend_prefill_span(q, k_all, v_all, span)
    return out


def attend_prefill_span(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, span: SequenceSpan) -> torch.Tensor:
    """A prefill chunk's rows of q [T, Hq, Dh] -> [q_len, Hq, Dh], over its context in
    k_all, v_all [Hkv, slots, Dh] (a view, or gathered once), causally masked, GQA folded
    into the rows: one SDPA call (the accelerators' way, and the triton backend's)."""
    n, hq, dh = span.q_len, q.shape[1], q.shape[2]
    hkv = k_all.shape[0]
    group = hq // hkv
    k_ctx, v_ctx = _context_kv(span, k_all, v_all)
    rows = q[span.q_start:span.q_start + n]
    qs = rows.view(n, hkv, group, dh).permute(1, 2, 0, 3).reshape(hkv, group * n, dh)  # rows: (group, position)
    attended = F.scaled_dot_product_attention(qs[None], k_ctx[None], v_ctx[None],
                                              attn_mask=_folded_mask(span, group, q.dtype, q.device))[0]
    return attended.view(hkv, group, n, dh).permute(2, 0, 1, 3).reshape(n, hq, dh)


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


def _causal_scores(keys_from: int, num_keys: int, rows_from: int, num_rows: int, group: int,
                   dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [group * num_rows, num_keys] (rows: group, position): -inf where a key's
    position is after the row's. Scores to add are what the fused CPU kernel takes as-is."""
    keys = torch.arange(keys_from, keys_from + num_keys, device=device)
    rows = torch.arange(rows_from, rows_from + num_rows, device=device)
    mask = torch.zeros(num_rows, num_keys, dtype=dtype, device=device)
    return mask.masked_fill(keys[None, :] > rows[:, None], float("-inf")).repeat(group, 1)


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


def _window_reads(span: SequenceSpan, num_slots: int, end: int, first: int, group: int,
                  q: torch.Tensor) -> WindowReads:
    """The reads of the call whose rows q [m, Hq, Dh] start at position `first` (keys of
    [0, end)); the mask has the call's row count, real or padded (`_kernel_rows`)."""
    if first not in span.window_reads:
        m = q.shape[0]
        known = min(end, span.ctx_len)
        run = _inside_one_run(span.kv_runs, 0, known)
        keys: slice | torch.Tensor
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

"""The accelerator attention paths, run on CPU: SDPA's batched position-exact windows
(window_batch.py) and the flash-attn backend with a reference written from
`flash_attn_with_kvcache`'s documented semantics injected in place of the package.

Both must equal plain causal attention on a mixed step (prefill chunks, decode rows,
verify blocks crossing a window, fragmented block tables), and give a decode row and the
same row inside a verify block the same kernel inputs, so the same bits on the device
(measured there by `dlite-ray gpu-check`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dlite_ray.runtime import attention
from dlite_ray.runtime.attention import make_backend
from dlite_ray.runtime.attention.flash import FlashAttnBackend
from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_ROWS, WINDOW, _context_slots, build_attention_metadata
from dlite_ray.runtime.attention.sdpa import SdpaBackend
from dlite_ray.runtime.kv_cache import PagedKVCache
from dlite_ray.runtime.window_batch import plan_windows

HKV, GROUP, DH = 2, 3, 8


def _cache(num_blocks: int, block_size: int, block_major: bool) -> PagedKVCache:
    cfg = SimpleNamespace(num_kv_heads=HKV, head_dim=DH, num_layers=2)
    return PagedKVCache(cfg, num_blocks, block_size, torch.float32, "cpu", block_major=block_major)


def _step(block_size: int, num_blocks: int):
    """One ragged step over sequences whose history is already cached: a prefill chunk,
    two decode rows, a verify block that crosses into the next window, and one more
    verify block; each with its own (scattered) blocks."""
    q_lens = [40, 1, 1, 8, 5]
    ctx_lens = [40 + 2 * block_size + 3, 17, 3 * WINDOW + 1, 2 * WINDOW + 3, WINDOW - 2]
    tables, free = [], list(range(num_blocks))[::-1]
    for ctx in ctx_lens:
        tables.append([free.pop(3 * (i % 5) % len(free)) for i in range(-(-ctx // block_size))])
    return q_lens, ctx_lens, tables


def _fill(cache: PagedKVCache, layer: int, ctx_lens, tables, seed: int):
    """Random keys/values at every cached position; returns them per sequence [ctx, Hkv, Dh]."""
    gen = torch.Generator().manual_seed(seed)
    kv = []
    for ctx, table in zip(ctx_lens, tables, strict=True):
        k, v = torch.randn(ctx, HKV, DH, generator=gen), torch.randn(ctx, HKV, DH, generator=gen)
        slots = torch.tensor([table[p // cache.block_size] * cache.block_size + p % cache.block_size
                              for p in range(ctx)])
        cache.write(layer, slots, k, v)
        kv.append((k, v))
    return kv


def _reference(q: torch.Tensor, kv, q_lens, ctx_lens) -> torch.Tensor:
    """Causal attention per token in float64 over its sequence's keys."""
    outs, start = [], 0
    for (k, v), n, ctx in zip(kv, q_lens, ctx_lens, strict=True):
        for i in range(n):
            pos = ctx - n + i
            qi = q[start + i].double().view(HKV, GROUP, DH)
            scores = torch.einsum("hgd,phd->hgp", qi, k[:pos + 1].double()) * DH ** -0.5
            outs.append(torch.einsum("hgp,phd->hgd", scores.softmax(-1), v[:pos + 1].double()).reshape(-1, DH))
        start += n
    return torch.stack(outs)


def _attend(backend, cache, q_lens, ctx_lens, tables, seed=0):
    kv = _fill(cache, 0, [c - n for c, n in zip(ctx_lens, q_lens, strict=True)], tables, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    total = sum(q_lens)
    q = torch.randn(total, HKV * GROUP, DH, generator=gen)
    k_new, v_new = torch.randn(total, HKV, DH, generator=gen), torch.randn(total, HKV, DH, generator=gen)
    full, start = [], 0
    for (k, v), n in zip(kv, q_lens, strict=True):
        full.append((torch.cat([k, k_new[start:start + n]]), torch.cat([v, v_new[start:start + n]])))
        start += n
    meta = build_attention_metadata(q_lens, ctx_lens, tables, cache.block_size, torch.device("cpu"))
    out = backend.attend(cache, 0, meta, q, k_new, v_new)
    return out, _reference(q, full, q_lens, ctx_lens), meta


def test_batched_windows_equal_causal_attention():
    q_lens, ctx_lens, tables = _step(block_size=16, num_blocks=256)
    out, ref, meta = _attend(SdpaBackend(batched_windows=True), _cache(256, 16, False), q_lens, ctx_lens, tables)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    ends = sorted(b.end for b in meta.window_plan.batches)
    assert ends == sorted(set(ends)), "one batched call per key count"
    assert len(ends) < sum(q_lens[1:]), "calls of one key count share a kernel call"


def test_a_decode_row_and_its_verify_row_meet_the_same_kernel_inputs():
    """Decode position p alone, then verify a block holding p: the call holding p has the
    same key count, row count, mask row and unmasked keys either way (masked keys count
    for nothing whatever they hold: the cache keeps only finite values)."""
    ctx = 2 * WINDOW + 5
    table = list(range(-(-(ctx + 8) // 16)))
    decode = build_attention_metadata([1], [ctx], [table], 16, torch.device("cpu")).spans
    verify = build_attention_metadata([8], [ctx + 6], [table], 16, torch.device("cpu")).spans  # p is row 1

    def call_of(spans, row):
        plan = plan_windows(spans, [_context_slots(s, torch.device("cpu")) for s in spans], HKV * GROUP,
                            HKV, WINDOW, MAX_POSITIONED_ROWS, torch.float32, torch.device("cpu"))
        for batch in plan.batches:
            hit = (batch.query_index == row * HKV * GROUP).nonzero()  # query head 0 of the row
            if len(hit):
                b, _, r = hit[0].tolist()
                keys = batch.slots.view(-1, batch.end)[b]
                return batch.end, batch.query_index.shape[-1], keys, batch.mask[b, 0, r]
        raise AssertionError("row not planned")

    a, b = call_of(decode, 0), call_of(verify, 1)
    assert a[0] == b[0] and a[1] == b[1] == MAX_POSITIONED_ROWS
    assert torch.equal(a[3], b[3])
    seen = a[3] == 0
    assert torch.equal(a[2][seen], b[2][seen]) and seen.sum() == ctx


class ReferenceFlash:
    """`flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, causal,
    num_splits)` as documented: q [B, Sq, Hq, Dh]; paged k/v [blocks, page, Hkv, Dh];
    block_table [B, W] int32; cache_seqlens [B] int32; causal aligned bottom-right (query
    i sees keys <= cache_seqlens - Sq + i). Records each call."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, k_cache, v_cache, cache_seqlens, block_table, causal=False, num_splits=0):
        assert block_table.dtype == torch.int32 and cache_seqlens.dtype == torch.int32
        assert k_cache.shape[1] % 256 == 0, "flash-attn pages hold a multiple of 256 tokens"
        self.calls.append(SimpleNamespace(q_len=q.shape[1], num_splits=num_splits, table=block_table))
        page, out = k_cache.shape[1], torch.empty_like(q)
        for b in range(q.shape[0]):
            n_keys, sq = int(cache_seqlens[b]), q.shape[1]
            slots = torch.arange(n_keys)
            blocks = block_table[b].long()[slots // page]
            k, v = k_cache[blocks, slots % page], v_cache[blocks, slots % page]  # [n, Hkv, Dh]
            group = q.shape[2] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            scores = torch.einsum("shd,nhd->hsn", q[b].float(), k.float()) * q.shape[-1] ** -0.5
            if causal:
                limit = n_keys - sq + torch.arange(sq)
                scores = scores.masked_fill(slots[None, None, :] > limit[None, :, None], float("-inf"))
            out[b] = torch.einsum("hsn,nhd->shd", scores.softmax(-1), v.float()).to(q.dtype)
        return out


def test_flash_backend_equals_causal_attention_one_kernel_path():
    kernel = ReferenceFlash()
    q_lens, ctx_lens, tables = _step(block_size=256, num_blocks=16)
    cache = _cache(16, 256, True)
    kernel_backend = FlashAttnBackend(kernel=kernel)
    out, ref, meta = _attend(kernel_backend, cache, q_lens, ctx_lens, tables)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    rows = [c for c in kernel.calls if c.q_len == 1]
    assert len(rows) == 1 and rows[0].table.shape[0] == sum(q_lens[1:]), "every decode/verify row in one call"
    assert all(c.num_splits == 1 for c in rows), "the key split never depends on the batch"
    # a second layer reuses the step's tensors instead of rebuilding them
    kernel_backend.attend(cache, 1, meta, *(torch.randn(sum(q_lens), h, DH) for h in (HKV * GROUP, HKV, HKV)))
    assert kernel.calls[-2].table is rows[0].table


def test_flash_attn_refuses_float32_and_auto_falls_back(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        make_backend("flash_attn", cuda, torch.float32)
    assert isinstance(make_backend("auto", cuda, torch.float32), SdpaBackend)
    with pytest.raises(ValueError, match="needs CUDA"):
        make_backend("flash_attn", torch.device("cpu"), torch.bfloat16)

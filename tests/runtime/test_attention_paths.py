"""The SDPA backend's three ways to read a context (one view, run-by-run views, one
gather) give the same attention as the same tokens on consecutive blocks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dlite_ray.runtime.attention import MAX_VIEW_RUNS, WINDOW, SdpaBackend, build_attention_metadata
from dlite_ray.runtime.kv_cache import PagedKVCache

BS, HKV, GROUP, DH, CTX = 4, 2, 2, 8, 40


def _attend_all(table: list[int], q, k, v, new: int) -> torch.Tensor:
    """Prefill CTX - new tokens, then `new` tokens in one step (a decode or a verify row);
    returns both outputs concatenated."""
    cache = PagedKVCache(SimpleNamespace(num_kv_heads=HKV, head_dim=DH, num_layers=1), 64, BS, torch.float32, "cpu")
    backend = SdpaBackend()
    meta = build_attention_metadata([CTX - new], [CTX - new], [table], BS, torch.device("cpu"))
    first = backend.attend(cache, 0, meta, q[:-new], k[:-new], v[:-new])
    meta = build_attention_metadata([new], [CTX], [table], BS, torch.device("cpu"))
    return torch.cat([first, backend.attend(cache, 0, meta, q[-new:], k[-new:], v[-new:])])


@pytest.mark.parametrize("new", [1, 3, 6])  # a decode row; verify rows inside one block and across two
@pytest.mark.parametrize("table", [
    [40, 41, 42, 3, 4, 5, 6, 50, 51, 52],  # 3 runs: decode and verify read views, prefill gathers
    [9, 1, 30, 17, 3, 60, 25, 11, 44, 7],  # 10 runs (> MAX_VIEW_RUNS): everything gathers
])
def test_fragmented_contexts_attend_like_consecutive_ones(table, new):
    torch.manual_seed(0)
    q = torch.randn(CTX, HKV * GROUP, DH)
    k, v = torch.randn(CTX, HKV, DH), torch.randn(CTX, HKV, DH)
    consecutive = _attend_all(list(range(10)), q, k, v, new)
    torch.testing.assert_close(_attend_all(table, q, k, v, new), consecutive, rtol=1e-5, atol=1e-5)


def test_parts_merge_like_one_softmax_in_bfloat16():
    """The log-sum-exp merge of views is as close to one softmax as bf16 rounding allows."""
    torch.manual_seed(1)
    q = torch.randn(CTX, HKV * GROUP, DH)
    k, v = torch.randn(CTX, HKV, DH), torch.randn(CTX, HKV, DH)
    reference = _attend_all(list(range(10)), q, k, v, 3)
    cache = PagedKVCache(SimpleNamespace(num_kv_heads=HKV, head_dim=DH, num_layers=1), 64, BS, torch.bfloat16, "cpu")
    table = [40, 41, 42, 3, 4, 5, 6, 50, 51, 52]
    backend = SdpaBackend()
    bf = [t.bfloat16() for t in (q, k, v)]
    meta = build_attention_metadata([CTX - 3], [CTX - 3], [table], BS, torch.device("cpu"))
    backend.attend(cache, 0, meta, *(t[:-3] for t in bf))
    meta = build_attention_metadata([3], [CTX], [table], BS, torch.device("cpu"))
    out = backend.attend(cache, 0, meta, *(t[-3:] for t in bf))
    torch.testing.assert_close(out.float(), reference[-3:], rtol=0.03, atol=0.03)


def test_the_scattered_table_is_past_the_view_limit():
    span = build_attention_metadata([1], [CTX], [[9, 1, 30, 17, 3, 60, 25, 11, 44, 7]], BS,
                                    torch.device("cpu")).spans[0]
    assert len(span.kv_runs) > MAX_VIEW_RUNS  # so the second case above exercises the gather


def _prefill_then(table: list[int], q, k, v, ctx: int, steps: list[int], dtype) -> torch.Tensor:
    """Prefill all but sum(steps) tokens, then run the rest in steps of the given sizes
    (1, 1, 1 = plain decoding; 4 = one verify step); the outputs of those last tokens."""
    cache = PagedKVCache(SimpleNamespace(num_kv_heads=HKV, head_dim=DH, num_layers=1), 256, BS, dtype, "cpu")
    backend = SdpaBackend()
    done = ctx - sum(steps)
    meta = build_attention_metadata([done], [done], [table], BS, torch.device("cpu"))
    backend.attend(cache, 0, meta, q[:done], k[:done], v[:done])
    outs = []
    for n in steps:
        meta = build_attention_metadata([n], [done + n], [table], BS, torch.device("cpu"))
        outs.append(backend.attend(cache, 0, meta, q[done:done + n], k[done:done + n], v[done:done + n]))
        done += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("ctx", "table"), [
    (40, list(range(10))),  # consecutive blocks
    (40, [40, 41, 42, 3, 4, 5, 6, 50, 51, 52]),  # 3 runs
    (40, [9, 1, 30, 17, 3, 60, 25, 11, 44, 7]),  # 10 runs
    (WINDOW + 3, list(range(100))),  # the verify step crosses into the next window
    (WINDOW + 3, [*range(40, 60), *range(40), *range(60, 100)]),  # ... over 3 runs
    (WINDOW + 3, list(range(0, 200, 2))),  # ... after 64 one-block runs (gathered)
])
def test_verify_rows_equal_plain_decoding_bit_for_bit(ctx, table, dtype):
    """A verify step must compute each row exactly as decoding that token alone would, or
    greedy speculative output could differ from plain decoding by a rounding (bf16 does)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(ctx, HKV * GROUP, DH, generator=gen).to(dtype)
    k, v = (torch.randn(ctx, HKV, DH, generator=gen).to(dtype) for _ in range(2))
    decoded = _prefill_then(table, q, k, v, ctx, [1] * 6, dtype)
    for steps in ([6], [2, 4], [5, 1]):
        assert torch.equal(_prefill_then(table, q, k, v, ctx, steps, dtype), decoded), steps

"""The SDPA backend over the paged cache: every read path (prefill views and gathers, the
position-exact decode / verify path, padded or not) equals plain causal attention, and a
decode or verify row is computed bit for bit the same whatever step it is in and wherever
its blocks sit."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from dlite_ray.runtime.attention import cpu_exactness, sdpa
from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_ROWS, WINDOW, build_attention_metadata
from dlite_ray.runtime.attention.sdpa import SdpaBackend
from dlite_ray.runtime.kv_cache import PagedKVCache

BS, HKV, GROUP, DH = 4, 2, 3, 8
NUM_BLOCKS = 512
LONG = 20 * WINDOW + 7  # past SPLIT_KEYS and, in the last 16 steps, a window crossing


def _tables(ctx: int) -> dict[str, list[int]]:
    blocks = -(-ctx // BS)
    shuffled = list(range(NUM_BLOCKS))
    random.Random(ctx).shuffle(shuffled)
    return {
        "consecutive": list(range(blocks)),
        "three runs": [*range(200, 200 + blocks // 3), *range(blocks // 3),
                       *range(400, 400 + blocks - 2 * (blocks // 3))],
        "scattered": shuffled[:blocks],  # every block its own run
    }


def _cache(dtype) -> PagedKVCache:
    return PagedKVCache(SimpleNamespace(num_kv_heads=HKV, head_dim=DH, num_layers=1), NUM_BLOCKS, BS, dtype, "cpu")


def _run(table: list[int], q, k, v, steps: list[int], dtype, cache: PagedKVCache | None = None) -> torch.Tensor:
    """Prefill all but sum(steps) tokens, then the rest in steps of the given sizes
    (1, 1, 1 = plain decoding; 4 = one verify step); every token's output."""
    cache = cache if cache is not None else _cache(dtype)
    backend = SdpaBackend()
    outs, done = [], 0
    for n in [q.shape[0] - sum(steps), *steps]:
        meta = build_attention_metadata([n], [done + n], [table], BS, torch.device("cpu"))
        outs.append(backend.attend(cache, 0, meta, q[done:done + n], k[done:done + n], v[done:done + n]))
        done += n
    return torch.cat(outs)


def _inputs(ctx: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(ctx, HKV * GROUP, DH, generator=gen)
    k, v = torch.randn(ctx, HKV, DH, generator=gen), torch.randn(ctx, HKV, DH, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _reference(q, k, v) -> torch.Tensor:
    """Plain causal attention on contiguous K/V, in float64."""
    qh = q.double().transpose(0, 1)  # [Hq, T, Dh]
    kh, vh = (t.double().repeat_interleave(GROUP, dim=1).transpose(0, 1) for t in (k, v))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)


@pytest.mark.parametrize("steps", [[1] * 6, [6], [2, 4], [17, 18]])  # decoding; one verify step; two; prefill chunks
@pytest.mark.parametrize("ctx", [40, LONG])
@pytest.mark.parametrize("layout", ["consecutive", "three runs", "scattered"])
def test_every_path_equals_plain_causal_attention(layout, ctx, steps):
    q, k, v = _inputs(ctx, torch.float32)
    out = _run(_tables(ctx)[layout], q, k, v, steps, torch.float32)
    torch.testing.assert_close(out.double(), _reference(q, k, v), rtol=1e-5, atol=1e-5)


@pytest.fixture(params=["measured", "padded"])
def row_policy(request, monkeypatch):
    """Kernel calls carry their real rows, padded only as far as the kernel was measured to
    need, or always the full padded count (what kernels that need more get)."""
    if request.param == "padded":  # the plan is cached: replace it, not what it is made of
        for module in (cpu_exactness, sdpa):  # both read it by their own name
            monkeypatch.setattr(module, "_kernel_plan", lambda *shape: cpu_exactness.KernelPlan(None, True))
    return request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ctx", [40, WINDOW + 3, LONG])
@pytest.mark.parametrize("layout", ["consecutive", "three runs", "scattered"])
def test_verify_rows_equal_plain_decoding_bit_for_bit(layout, ctx, dtype, row_policy):
    """A verify step must compute each row exactly as decoding that token alone would, or
    greedy speculative output could differ from plain decoding by a rounding (bf16 does)."""
    q, k, v = _inputs(ctx, dtype, seed=3)
    table = _tables(ctx)[layout]
    decoded = _run(table, q, k, v, [1] * 16, dtype)[-16:]
    # up to MAX_POSITIONED_TOKENS rows in one step (a copy of 15 tokens after the anchor)
    for steps in ([1] * 10 + [6], [1] * 10 + [2, 4], [1] * 10 + [5, 1], [16], [8, 8], [11, 5]):
        assert torch.equal(_run(table, q, k, v, steps, dtype)[-16:], decoded), steps


@pytest.mark.parametrize("ctx", [WINDOW + 3, LONG])
def test_decode_rows_do_not_depend_on_where_the_blocks_sit(ctx):
    """Two requests allocating in turn, eviction or a prefix-cache hit give the same tokens
    other blocks: their decode rows must still be bit-identical (bf16)."""
    q, k, v = _inputs(ctx, torch.bfloat16, seed=5)
    outs = [_run(table, q, k, v, [1] * 4, torch.bfloat16)[-4:] for table in _tables(ctx).values()]
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("rounds_below", [2, 4, 100])
def test_a_kernel_that_rounds_by_row_count_gets_padded_calls(monkeypatch, rounds_below):
    """The measurement behind short calls must catch a kernel whose rows depend on the
    call's row count, as the real one does for a last block of 1 row (one Xeon) or 1-3
    rows (another): it pads such blocks, or every call when short ones never come out right."""
    kernel, full = cpu_exactness._attend_masked, MAX_POSITIONED_ROWS

    def rounds_by_row_count(q, k, v, mask):
        rows = q.shape[1]  # computed as in a full call, then off by a rounding where short
        out = kernel(F.pad(q, (0, 0, 0, full - rows)), k, v, F.pad(mask, (0, 0, 0, full - rows)))[:, :rows]
        short = rows < full and (0 < rows % cpu_exactness.KERNEL_BLOCK_ROWS < rounds_below or rows < rounds_below)
        return out + torch.finfo(out.dtype).eps if short else out

    monkeypatch.setattr(cpu_exactness, "_attend_masked", rounds_by_row_count)
    cpu_exactness._smallest_exact_tail.cache_clear()
    try:
        tail = cpu_exactness._smallest_exact_tail(torch.bfloat16, DH, GROUP)
    finally:
        cpu_exactness._smallest_exact_tail.cache_clear()
    assert tail == {2: 2, 4: 4, 100: None}[rounds_below]


def test_a_sequence_that_overflowed_does_not_disturb_another():
    """A decode row reads its keys as a view that runs past its context into slots other
    sequences wrote (masked). One whose keys and values overflowed (NaN, inf) there must
    not change the row: the cache keeps only finite values."""
    ctx = 40
    q, k, v = _inputs(ctx, torch.bfloat16, seed=7)
    table = list(range(-(-ctx // BS)))  # consecutive from block 0
    clean = _run(table, q, k, v, [1] * 4, torch.bfloat16)
    cache = _cache(torch.bfloat16)
    bad = torch.tensor([float("nan"), float("inf"), -float("inf")]).repeat(ctx)[:ctx, None, None].expand(ctx, HKV, DH)
    _run(list(range(len(table), 2 * len(table))), q, bad.bfloat16(), bad.bfloat16(), [1] * 4, torch.bfloat16, cache)
    assert torch.equal(_run(table, q, k, v, [1] * 4, torch.bfloat16, cache), clean)


@pytest.fixture
def odd_thread_count(monkeypatch):
    """Three threads: HKV = 2 heads then do not share out evenly, so long calls split their keys."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    monkeypatch.setattr(cpu_exactness, "SPLIT_THREADS", 3)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_key_halves_equal_plain_attention(dtype):
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(HKV, 12, DH, generator=gen).to(dtype)
    k, v = (torch.randn(HKV, 4 * WINDOW, DH, generator=gen).to(dtype) for _ in range(2))
    last_key = torch.randint(2 * WINDOW, 4 * WINDOW, (12, 1), generator=gen)  # causal, past the middle
    mask = torch.zeros(12, 4 * WINDOW, dtype=dtype).masked_fill(torch.arange(4 * WINDOW) > last_key, float("-inf"))
    split = cpu_exactness._attend_key_halves(q, k, v, mask)
    scores = (q.double() @ k.double().transpose(1, 2)) * DH ** -0.5 + mask.double()
    reference = scores.softmax(dim=-1) @ v.double()
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(split.double(), reference, **tol)


def _fixed_rows_kernel(q, k, v, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """An exact stand-in for the CPU kernel (`cpu_exactness._cpu_kernel`): every call padded
    to MAX_POSITIONED_ROWS rows and computed in float64, so a row's bits cannot depend on how
    many rows the call has (the same shapes, the same arithmetic).
    q [B, H, R, Dh], k, v [B, H, L, Dh], mask [R, L] or [B, 1, R, L] -> (out, lse [B, H, R])."""
    rows, pad = q.shape[2], MAX_POSITIONED_ROWS - q.shape[2]
    q = F.pad(q.double(), (0, 0, 0, pad)) * q.shape[-1] ** -0.5
    mask = F.pad(mask.double(), (0, 0, 0, pad))
    scores = q @ k.double().transpose(-1, -2) + mask  # [B, H, MAX_POSITIONED_ROWS, L]
    out, lse = scores.softmax(dim=-1) @ v.double(), scores.logsumexp(dim=-1)
    return out[:, :, :rows].to(k.dtype), lse[:, :, :rows].float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_key_halves_give_a_row_the_same_bits_whatever_the_row_count(dtype, monkeypatch):
    """Each row the same bits in a call of every row count a step may make, unpadded: the
    merge's exp must not depend on the row count, as a softmax over a row-count-wide tensor
    does (vectorised for some rows, scalar for the rest). Over an exact kernel, so the merge
    is what is checked, on every CPU (the real kernel's own rounding is measured by the
    engine, `_kernel_plan`, and checked below)."""
    monkeypatch.setattr(cpu_exactness, "_cpu_kernel", _fixed_rows_kernel)
    assert cpu_exactness._short_calls_match_full(dtype, 64, GROUP, 1, split_keys=True)


def test_key_halves_that_round_by_row_count_are_measured_inexact(monkeypatch):
    """The measurement behind `split_keys` must catch key halves whose rows depend on the
    call's row count: the engine then attends long calls in one piece (exact halves measure
    exact: the test above)."""
    monkeypatch.setattr(cpu_exactness, "_cpu_kernel", _fixed_rows_kernel)
    monkeypatch.setattr(cpu_exactness, "_smallest_exact_tail", lambda *shape: 1)  # short calls unpadded
    exact = cpu_exactness._attend_key_halves

    def rounds_by_row_count(q, k, v, mask):
        out = exact(q, k, v, mask)
        return out + torch.finfo(out.dtype).eps if q.shape[1] < MAX_POSITIONED_ROWS else out

    monkeypatch.setattr(cpu_exactness, "_attend_key_halves", rounds_by_row_count)
    plan = cpu_exactness._kernel_plan.__wrapped__(torch.bfloat16, DH, GROUP)  # measured afresh, not cached
    assert plan == cpu_exactness.KernelPlan(1, False)


@pytest.mark.parametrize("split_measured", ["as here", "inexact"])
@pytest.mark.parametrize("layout", ["consecutive", "scattered"])
def test_verify_rows_equal_plain_decoding_where_keys_split(layout, row_policy, split_measured, odd_thread_count,
                                                           monkeypatch):
    """Rows exact whether the keys split or not, and split only where the plan allows it
    (the plan as this CPU measured it, or one that found splitting inexact: no skip)."""
    split_calls = []
    halves = sdpa._attend_key_halves
    monkeypatch.setattr(sdpa, "_attend_key_halves", lambda *a: split_calls.append(1) or halves(*a))
    if split_measured == "inexact":
        measured = cpu_exactness._kernel_plan
        for module in (cpu_exactness, sdpa):
            monkeypatch.setattr(module, "_kernel_plan", lambda *shape: replace(measured(*shape), split_keys=False))
    plan = cpu_exactness._kernel_plan(torch.bfloat16, DH, GROUP)
    q, k, v = _inputs(LONG, torch.bfloat16, seed=13)
    table = _tables(LONG)[layout]
    decoded = _run(table, q, k, v, [1] * 16, torch.bfloat16)[-16:]
    for steps in ([1] * 10 + [6], [16], [8, 8]):
        assert torch.equal(_run(table, q, k, v, steps, torch.bfloat16)[-16:], decoded), steps
    assert bool(split_calls) == plan.split_keys  # always split where padded (the plan is replaced)

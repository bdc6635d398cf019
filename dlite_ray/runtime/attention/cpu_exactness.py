"""The CPU kernel calls of position-exact attention, and how to make them exact.

A decode or verify row must come out with the same bits whatever step it is in. The CPU's
fused kernel works in blocks of KERNEL_BLOCK_ROWS query rows and may round a short last
block differently, so how far a call's rows are padded (`KernelPlan.tail`) and whether a
long call may attend its keys in two halves (`KernelPlan.split_keys`) are measured once per
process, dtype and head shape (`_kernel_plan`), on the very functions that attend
(`_attend_masked`, `_attend_key_halves`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_ROWS, WINDOW


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


# The CPU kernel shares out its work by (head, block of 32 query rows): a decode or verify
# call of SmolLM2 has 3 KV heads, which 2 threads split 2 : 1. From this many keys on, a
# call attends the two halves of its keys as two batch entries instead (6 items, split
# evenly) and merges them by log-sum-exp: measured, 250 -> 190 us a layer for 4 rows over
# 4096 keys, 738 -> 575 us for 24 rows. Where the keys split depends on their count alone,
# which is a function of the position (`_attend_positioned`), so decode and verify rows
# still meet the same arithmetic.
SPLIT_KEYS = 1024
# The threads the split is planned for: the cores this process may run on, not torch's
# current count, which a server changes with its load (serve/cpu_threads.py). A row's
# arithmetic must not change with the load, or a reply at T = 0 would depend on it.
SPLIT_THREADS = len(os.sched_getaffinity(0))


def _worth_splitting(num_heads: int, num_keys: int) -> bool:
    """Whether a call's heads share out unevenly over the cores and its keys are many."""
    return num_keys >= SPLIT_KEYS and num_keys % 2 == 0 and num_heads % SPLIT_THREADS != 0


def _attend_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
    """q [H, R, Dh] over k, v [H, L, Dh] with an additive mask [R, L] -> [H, R, Dh], by the
    CPU's fused kernel (it reads strided views)."""
    return _cpu_kernel(q[None], k[None], v[None], additive_mask)[0][0]


def _cpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                additive_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU's fused kernel: q [B, H, R, Dh] over k, v [B, H, L, Dh] -> (out [B, H, R, Dh],
    log-sum-exp [B, H, R]). One name for it, so a test can put an exact kernel in its place
    and check what is built on it (the key halves' merge) on any CPU."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=additive_mask)[:2]
    return out, lse


def _attend_key_halves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
    """`_attend_masked` on CPU in one kernel call over the two halves of the keys as a batch
    of 2. Every row must see a key in each half: the kernel gives a row that sees none a
    log-sum-exp of 0, not -inf. Position-exact calls hold: their rows sit in the last
    window of their keys (past the middle from SPLIT_KEYS on), and padding rows see all."""
    rows, half = q.shape[1], k.shape[1] // 2
    k2, v2 = (t.unflatten(1, (2, half)).transpose(0, 1) for t in (k, v))  # [2, H, L/2, Dh] views
    mask2 = additive_mask.unflatten(1, (2, half)).transpose(0, 1)[:, None]  # [2, 1, R, L/2]
    out, lse = _cpu_kernel(q.expand(2, *q.shape), k2, v2, mask2)
    # The weights' exp runs vectorised on whole vectors and scalar on a remainder, so the
    # row count would decide which exp a row gets: at MAX_POSITIONED_ROWS it never does.
    weights = F.pad(lse, (0, MAX_POSITIONED_ROWS - rows)).softmax(dim=0)[..., :rows, None]
    return (out.float() * weights).sum(dim=0).to(q.dtype)

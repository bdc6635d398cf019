"""The triton backend's paged attention alone on the device (runtime/attention/paged_triton.py):
time per call by CUDA events for each key chunk, so the device run picks the split by
measurement; its error against float32 softmax attention in torch; and whether a row keeps
its bits alone, in a batch and in a verify span (`..._equal`).

`attention_times(device, small=False)` is what gpu-check calls; `small=True` runs tiny
shapes on a CPU under TRITON_INTERPRET=1 (tests/gpu_check/test_attention_timing.py).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass

import torch

from dlite_ray.constants import KV_BLOCK_SIZE
from dlite_ray.gpu_check.exactness import VERIFY_ROWS
from dlite_ray.gpu_check.random_models import QWEN3_8B, QWEN3_SMALL
from dlite_ray.runtime.attention.paged_triton import PAGED_TILE, paged_attention


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    cases: list[tuple[int, int, int]]  # (batch, context, rows per sequence): 1 row decodes, VERIFY_ROWS verify
    chunks: list[int]  # the stage-1 splits to time
    tile: int
    repeats: int


FULL = AttentionPlan(QWEN3_8B["num_attention_heads"], QWEN3_8B["num_key_value_heads"], QWEN3_8B["head_dim"],
                     [(1, 4096, 1), (8, 4096, 1), (64, 4096, 1), (1, 32768, 1), (1, 4096, VERIFY_ROWS)],
                     [128, 256, 512, 1024], PAGED_TILE, 20)
SMALL = AttentionPlan(QWEN3_SMALL["num_attention_heads"], QWEN3_SMALL["num_key_value_heads"], QWEN3_SMALL["head_dim"],
                      [(3, 100, 1), (1, 100, VERIFY_ROWS)], [32, 64], 16, 1)


@dataclass(slots=True)
class PagedInputs:
    """One step's rows over a random block-major cache, blocks scattered over the pool."""

    q: torch.Tensor  # [P, Hq, Dh]
    k_cache: torch.Tensor  # [blocks, block_size, Hkv, Dh]
    v_cache: torch.Tensor
    tokens: torch.Tensor  # [P]
    seqlens: torch.Tensor  # [P] int32
    tables: torch.Tensor  # [P, W] int32
    max_seqlen: int

    def rows(self, index: torch.Tensor) -> PagedInputs:
        """The same rows, fewer of them (their own step)."""
        return PagedInputs(self.q[index], self.k_cache, self.v_cache, torch.arange(len(index), device=self.q.device),
                           self.seqlens[index], self.tables[index], int(self.seqlens[index].max()))


def attention_times(device: torch.device, dtype: torch.dtype = torch.bfloat16, small: bool = False,
                    chunks: list[int] | None = None, block_size: int = KV_BLOCK_SIZE) -> dict:
    """Each case at each chunk: median ms per call, the KV bytes it must read per ms, the
    max abs error against float32 attention; and the row-exactness flags at the first chunk."""
    plan = SMALL if small else FULL
    chunks = chunks or plan.chunks
    cases, flags = [], {}
    for batch, context, rows in plan.cases:
        inputs = _inputs(plan, batch, context, rows, block_size, dtype, device)
        reference = _reference(inputs)
        kv_bytes = 2 * batch * context * plan.num_kv_heads * plan.head_dim * inputs.k_cache.element_size()
        for chunk in chunks:
            out = torch.empty_like(inputs.q)
            ms = _timed_ms(functools.partial(_attend, inputs, out, chunk, plan.tile), device, plan.repeats)
            cases.append({"batch": batch, "context": context, "rows": rows, "chunk": chunk, "ms": ms,
                          "kv_gb_per_s": kv_bytes / (ms / 1000) / 1e9,
                          "max_abs_error": (out.float() - reference).abs().max().item()})
        flags.update(_row_flags(inputs, batch, rows, chunks[0], plan.tile))
    return {"block_size": block_size, "tile": plan.tile, "cases": cases, "best_chunk": _best_chunks(cases),
            "exact": flags}


def _inputs(plan: AttentionPlan, batch: int, context: int, rows: int, block_size: int, dtype: torch.dtype,
            device: torch.device) -> PagedInputs:
    gen = torch.Generator().manual_seed(batch * 100003 + context + rows)
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq + 1
    shape = (num_blocks, block_size, plan.num_kv_heads, plan.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    blocks = torch.randperm(num_blocks, generator=gen)[:batch * per_seq].view(batch, per_seq)  # scattered
    tables = blocks.repeat_interleave(rows, 0).to(torch.int32)
    positions = torch.arange(context - rows, context).repeat(batch)  # each sequence's last `rows` positions
    q = torch.randn(batch * rows, plan.num_heads, plan.head_dim, generator=gen).to(dtype)
    return PagedInputs(q.to(device), k_cache, v_cache, torch.arange(batch * rows, device=device),
                       (positions + 1).to(torch.int32).to(device), tables.to(device), context)


def _attend(inputs: PagedInputs, out: torch.Tensor, chunk: int, tile: int) -> torch.Tensor:
    return paged_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.tokens, inputs.seqlens, inputs.tables,
                           inputs.max_seqlen, out, chunk, tile)


def _reference(inputs: PagedInputs) -> torch.Tensor:
    """Softmax attention in float32, row by row over its own keys."""
    block_size, hkv = inputs.k_cache.shape[1], inputs.k_cache.shape[2]
    group = inputs.q.shape[1] // hkv
    outs = []
    for row in range(inputs.q.shape[0]):
        pos = torch.arange(int(inputs.seqlens[row]), device=inputs.q.device)
        blocks = inputs.tables[row].long()[pos // block_size]
        k = inputs.k_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)  # [n, Hq, Dh]
        v = inputs.v_cache[blocks, pos % block_size].float().repeat_interleave(group, 1)
        scores = torch.einsum("hd,nhd->hn", inputs.q[row].float(), k) * inputs.q.shape[-1] ** -0.5
        outs.append(torch.einsum("hn,nhd->hd", scores.softmax(-1), v))
    return torch.stack(outs)


def _row_flags(inputs: PagedInputs, batch: int, rows: int, chunk: int, tile: int) -> dict[str, bool]:
    """The first sequence's last row alone against its output in the step: a batch of
    other sequences (batch > 1) or a verify span (rows > 1)."""
    if batch == 1 and rows == 1:
        return {}
    together = _attend(inputs, torch.empty_like(inputs.q), chunk, tile)[rows - 1]
    alone_inputs = inputs.rows(torch.tensor([rows - 1], device=inputs.q.device))
    alone = _attend(alone_inputs, torch.empty_like(alone_inputs.q), chunk, tile)[0]
    name = f"triton_row_batch{batch}_equal" if rows == 1 else f"triton_row_verify{rows}_equal"
    return {name: torch.equal(alone, together)}


def _timed_ms(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median ms per call: CUDA events around each call on CUDA (the first calls compile),
    the host clock elsewhere (the interpreter, where only the plumbing is checked)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return 1000 * (time.perf_counter() - start)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def _best_chunks(cases: list[dict]) -> list[dict]:
    """The fastest chunk of each (batch, context, rows)."""
    best: dict[tuple, dict] = {}
    for case in cases:
        key = (case["batch"], case["context"], case["rows"])
        if key not in best or case["ms"] < best[key]["ms"]:
            best[key] = case
    return [{"batch": b, "context": c, "rows": r, "chunk": case["chunk"], "ms": case["ms"]}
            for (b, c, r), case in best.items()]


def main(argv: list[str] | None = None) -> None:
    """`python -m dlite_ray.gpu_check.attention_timing [--small] [--chunks 128 256] [--out FILE]`:
    the section alone, before gpu-check carries it."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (a CPU under TRITON_INTERPRET=1)")
    parser.add_argument("--chunks", type=int, nargs="+", help="stage-1 splits to time (default: the plan's)")
    parser.add_argument("--out", help="write the JSON here (default: stdout)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.small and not torch.cuda.is_available() else "cuda")
    text = json.dumps(attention_times(device, small=args.small, chunks=args.chunks), indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()

"""Decode and verify forwards replayed from CUDA graphs, one per padded row-count bucket.

A decode step launches ~1,300-2,200 kernels from Python; a CUDA graph replays them in one
call (nano-vllm's `capture_cudagraph`, vLLM's cudagraph runner). A graph fixes every
shape and address, so:

- a step's B sequences (each with the same q new tokens: q = 1 decodes, q = K + 1
  verifies) run as the smallest bucket of `graph_buckets` holding B: 1, 2, 4, 8, then
  steps of 16;
- its inputs are static device buffers (token ids, positions, slot mapping, per-row
  context lengths, block tables) written in place, from one pinned host buffer by one
  host-to-device copy;
- padding rows point at a scratch KV block that no sequence owns (`ModelRunner` allocates
  it past the pool it hands out), so they write nowhere real;
- logits and taps come out in the graph's static outputs, sliced back to the real rows.

Prefill chunks, mixed steps, trees and rows of unequal length stay eager. Only a backend
that attends from device tensors alone can be captured: it says so with a class attribute
`graph_safe = True` and builds its metadata from the static buffers
(`GraphSafeBackend.graph_metadata`). A capture that fails runs that bucket eagerly, with
the reason logged. With `capture=False` the same bucketing and padding run eagerly: the
CPU test checks the real rows get the unpadded forward's bits.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, TypeVar

import torch

from dlite_ray.runtime.attention import build_attention_metadata
from dlite_ray.runtime.attention.metadata import AttentionMetadata
from dlite_ray.runtime.frozen_linear import EXACT_ROWS, cover_row_counts
from dlite_ray.runtime.target_model import ForwardBatch, ForwardOutput

if TYPE_CHECKING:
    from dlite_ray.engine.model_runner import ModelRunner, RowInput, RowOutput

log = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16
T = TypeVar("T")
DEFAULT_GRAPH_ROWS = 64  # sequences in the largest bucket (a verify bucket holds q times as many tokens)


@dataclass(slots=True)
class GraphConfig:
    """max_rows: sequences in the largest bucket; query_lens: the new tokens per sequence
    graphs are made for (1: decode; K + 1: verify); capture: False pads and buckets
    eagerly, without CUDA graphs (the CPU test, or a check of the padding on a device)."""

    max_rows: int = DEFAULT_GRAPH_ROWS
    query_lens: tuple[int, ...] = (1,)
    capture: bool = True

    def __post_init__(self) -> None:
        if self.max_rows < 1 or not self.query_lens or min(self.query_lens) < 1:
            raise ValueError(f"graph buckets need max_rows >= 1 and query lengths >= 1: {self}")
        self.query_lens = tuple(sorted(set(self.query_lens)))


class GraphSafeBackend(Protocol):
    """An attention backend whose decode / verify forward reads only device tensors."""

    graph_safe: bool  # a class attribute, True

    def graph_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                       query_len: int, block_size: int) -> AttentionMetadata:
        """Metadata for B rows of `query_len` new tokens each that reads these tensors and
        nothing from the host: slot_mapping [B * q], block_tables [B, M], context_lens [B]
        (int64, each row's context including its new tokens). They are refilled in place
        before every replay, so the metadata must hold the tensors, not their values."""
        ...


def is_graph_safe(backend: object) -> TypeGuard[GraphSafeBackend]:
    return bool(getattr(backend, "graph_safe", False))


def capture_graph(run: Callable[[], T], device: torch.device, pool: Any) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` captured as a CUDA graph in `pool` (None: a new one), after one warm-up call on a
    side stream (lazy initialisation, autotuning and kernel compiles stay outside the
    capture) -> (the graph, run's output: its static outputs, rewritten by every replay).
    RuntimeError where capture fails (an operation that syncs with the host)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output


def graph_buckets(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then steps of 16, up to max_rows (the last bucket is max_rows itself)."""
    buckets = [b for b in SMALL_BUCKETS if b < max_rows]
    buckets += range(BUCKET_STEP, max_rows, BUCKET_STEP)
    return tuple(sorted(set(buckets) | {max_rows}))


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket holding `rows` sequences."""
    i = bisect.bisect_left(buckets, rows)
    if rows < 1 or i == len(buckets):
        raise ValueError(f"{rows} rows fit no bucket of {buckets}")
    return buckets[i]


@dataclass(slots=True)
class StaticInputs:
    """One bucket's views of the static device buffer."""

    input_ids: torch.Tensor  # [B * q]
    positions: torch.Tensor  # [B * q]
    slot_mapping: torch.Tensor  # [B * q]
    context_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, M]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: ForwardOutput  # the graph's static outputs, rewritten by every replay


@dataclass(slots=True)
class GraphStats:
    captured: list[tuple[int, int]] = field(default_factory=list)  # (q, bucket)
    failed: dict[str, str] = field(default_factory=dict)  # "q x bucket" -> why it runs eagerly
    replays: int = 0
    padded_eager: int = 0  # steps bucketed and padded but run eagerly

    def to_dict(self) -> dict:
        return {"captured": [f"{q}x{b}" for q, b in self.captured], "failed": dict(self.failed),
                "replays": self.replays, "padded_eager": self.padded_eager}


class GraphRunner:
    """Owned by a ModelRunner: its decode and verify steps, bucketed, padded and (with
    capture) replayed from CUDA graphs."""

    def __init__(self, runner: ModelRunner, config: GraphConfig, scratch_block: int):
        self.runner, self.config = runner, config
        self.buckets = graph_buckets(config.max_rows)
        self.scratch_block = scratch_block
        self.block_size = runner.block_size
        if max(config.query_lens) > self.block_size:
            raise ValueError(f"query lengths {config.query_lens} exceed the scratch block ({self.block_size} slots)")
        self.table_width = -(-runner.max_context // self.block_size)  # M: blocks of the longest sequence
        self.stats = GraphStats()
        self._max_tokens = config.max_rows * max(config.query_lens)
        # Layout of the buffer: [ids | positions | slots] of max_tokens each, [context lens] of
        # max_rows, then the block tables row by row: a bucket's inputs end at its last table
        # row, so one copy of that prefix fills them all.
        self._tables_at = 3 * self._max_tokens + config.max_rows
        size = self._tables_at + config.max_rows * self.table_width
        device = runner.device
        self._host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self._device = self._host if device.type == "cpu" else torch.zeros(size, dtype=torch.long, device=device)
        self._arange = torch.arange(self._max_tokens, device=device)
        # The host buffer is rewritten by the next step: not before the last copy out of it ran.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._graphs: dict[tuple[int, int], _Graph | None] = {}
        self._pool: Any = None  # torch's graph memory-pool handle, once the first graph is captured
        counts = sorted({b * q for b in self.buckets for q in config.query_lens if b * q > EXACT_ROWS})
        split = cover_row_counts(runner.target, tuple(counts))
        if split:
            log.info("%d linears split into %d-row calls: calls of %s rows round rows differently", split,
                     EXACT_ROWS, counts)

    # -- which steps --------------------------------------------------------------------------
    def serves(self, rows: list[RowInput]) -> bool:
        """Decode or verify steps only: every row a chain of the same q new tokens (q one of
        the configured lengths), all of them outputs, no more rows than the largest bucket."""
        if not rows or len(rows) > self.config.max_rows:
            return False
        q = len(rows[0].tokens)
        return q in self.config.query_lens and all(
            len(r.tokens) == q and r.num_outputs == q and r.parents is None
            and len(r.seq.block_table) <= self.table_width for r in rows)

    # -- one step -----------------------------------------------------------------------------
    def run(self, rows: list[RowInput]) -> list[RowOutput]:
        from dlite_ray.engine.model_runner import RowOutput  # the runner imports this module

        q, n = len(rows[0].tokens), len(rows)
        bucket = bucket_for(n, self.buckets)
        views = self._fill(rows, q, bucket)
        graph = self._graph(q, bucket) if self.config.capture else None
        if graph is not None:
            graph.graph.replay()
            self.stats.replays += 1
            out = graph.output
        else:
            self.stats.padded_eager += 1
            out = self._forward(views, self._metadata(views, rows, q, bucket), q * bucket)
        real = n * q
        # A graph's outputs are rewritten by its next replay; a row's taps outlive the step.
        logits = out.logits[:real].clone() if graph is not None else out.logits[:real]
        taps = None
        if out.taps is not None:
            taps = out.taps[:real].clone() if graph is not None else out.taps[:real]
        return [RowOutput(lg, tp) for lg, tp in zip(logits.split(q), taps.split(q) if taps is not None else [None] * n)]

    def _fill(self, rows: list[RowInput], q: int, bucket: int) -> StaticInputs:
        """Write the step's inputs (padding rows on the scratch block) into the pinned host
        buffer and copy the bucket's prefix of it to the device in one go."""
        if self._copied is not None:
            self._copied.synchronize()
        host, m, bs = self._host.numpy(), self._max_tokens, self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        lens: list[int] = []
        tables = host[self._tables_at:self._tables_at + bucket * self.table_width].reshape(bucket, self.table_width)
        tables[:] = self.scratch_block  # unused entries too: a kernel reading past a row's end reads scratch
        for i, row in enumerate(rows):
            start, table = row.seq.num_computed, row.seq.block_table
            ids += row.tokens
            positions += range(start, start + q)
            slots += (table[p // bs] * bs + p % bs for p in range(start, start + q))
            lens.append(start + q)
            tables[i, :len(table)] = table
        pad = bucket - len(rows)
        scratch = self.scratch_block * bs
        ids += [0] * (pad * q)
        positions += list(range(q)) * pad
        slots += list(range(scratch, scratch + q)) * pad
        lens += [q] * pad
        t = bucket * q
        host[:t], host[m:m + t], host[2 * m:2 * m + t] = ids, positions, slots
        host[3 * m:3 * m + bucket] = lens
        end = self._tables_at + bucket * self.table_width
        if self._copied is not None:  # on CUDA: the device buffer is another tensor
            self._device[:end].copy_(self._host[:end], non_blocking=True)
            self._copied.record()
        return self._views(q, bucket)

    def _views(self, q: int, bucket: int) -> StaticInputs:
        d, m, t = self._device, self._max_tokens, bucket * q
        tables = d[self._tables_at:self._tables_at + bucket * self.table_width].view(bucket, self.table_width)
        return StaticInputs(d[:t], d[m:m + t], d[2 * m:2 * m + t], d[3 * m:3 * m + bucket], tables)

    def _metadata(self, views: StaticInputs, rows: list[RowInput], q: int, bucket: int) -> AttentionMetadata:
        """A graph-safe backend's metadata over the static buffers; any other backend's (only
        ever run eagerly) built on the host as the runner builds it, its KV writes still
        going through the static slot mapping."""
        backend = self.runner.backend
        if is_graph_safe(backend):
            return backend.graph_metadata(views.slot_mapping, views.block_tables, views.context_lens, q,
                                          self.block_size)
        pad = bucket - len(rows)
        tables = [r.seq.block_table for r in rows] + [[self.scratch_block]] * pad
        ctx = [r.seq.num_computed + q for r in rows] + [q] * pad
        meta = build_attention_metadata([q] * bucket, ctx, tables, self.block_size, self.runner.device)
        meta.slot_mapping = views.slot_mapping
        return meta

    def _forward(self, views: StaticInputs, meta: AttentionMetadata, tokens: int) -> ForwardOutput:
        runner = self.runner
        every = self._arange[:tokens]
        batch = ForwardBatch(views.input_ids, views.positions, meta, every, every if runner.tap_layers else None,
                             runner.tap_layers, runner.normed_last_tap)
        return runner.target(batch, runner.cache, runner.backend)

    # -- capture ------------------------------------------------------------------------------
    def _graph(self, q: int, bucket: int) -> _Graph | None:
        key = (q, bucket)
        if key not in self._graphs:
            self._graphs[key] = self._capture(q, bucket)
        return self._graphs[key]

    def _capture(self, q: int, bucket: int) -> _Graph | None:
        """The bucket's forward as a CUDA graph, or None (logged) where it cannot be: the
        backend is not graph-safe, or capture failed (an operation that syncs with the host
        or allocates outside the pool). The inputs are the current step's, already written:
        capture reads nothing but addresses, and the warm-up writes only the step's own slots."""
        name = f"{q}x{bucket}"
        backend, device = self.runner.backend, self.runner.device
        if device.type != "cuda" or not is_graph_safe(backend):
            self.stats.failed[name] = f"the {getattr(backend, 'name', backend)} backend on {device} is not graph-safe"
            return None
        views = self._views(q, bucket)
        try:
            meta = self._metadata(views, [], q, bucket)
            graph, output = capture_graph(lambda: self._forward(views, meta, q * bucket), device, self._pool)
        except RuntimeError as exc:
            log.warning("CUDA graph capture of %s rows failed; that bucket runs eagerly: %s", name, exc)
            self.stats.failed[name] = f"capture failed: {exc}"
            return None
        self._pool = graph.pool()  # every bucket's graph in one memory pool
        self.stats.captured.append((q, bucket))
        return _Graph(graph, output)

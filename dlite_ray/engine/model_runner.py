"""ModelRunner: owns every target tensor (weights, paged KV, backend) and runs ragged batches.

It reads each row's `seq.block_table` and writes the new tokens' KV into those slots; it
never allocates: in the engine the Scheduler reserves every row's blocks before a step
and hands over the block copies to apply (`run`). Drivers without a scheduler (runtime
tests, GPU checks) use `forward` / `commit` / `release`, which keep a pool of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dlite_ray.engine.block_manager import BlockManager
from dlite_ray.engine.graph_runner import GraphConfig, GraphRunner, is_graph_safe
from dlite_ray.engine.sequence import InvalidRequest, Sequence
from dlite_ray.runtime.attention import FLASH_ATTN_PAGE_MULTIPLE, build_attention_metadata, make_backend
from dlite_ray.runtime.attention.metadata import tree_positions
from dlite_ray.runtime.kv_cache import PagedKVCache
from dlite_ray.runtime.target_model import ForwardBatch, TargetModel

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RowInput:
    """New tokens of one sequence, written at positions seq.num_computed onwards.

    With `parents`, the tokens are a tree of candidates (tree verification): token j follows
    token parents[j] and sits at the position of its depth, while its KV is stored at
    position seq.num_computed + j until `keep_branch` moves the accepted branch into place
    (attention/metadata.py, `build_attention_metadata`)."""

    seq: Sequence
    tokens: list[int]
    num_outputs: int = 1  # logits/taps at the last this-many new tokens (len(tokens) for a verify block)
    parents: list[int] | None = None  # [-1, parent of token 1, ...]; None: a chain

    def __post_init__(self) -> None:
        assert 1 <= self.num_outputs <= len(self.tokens), "outputs must lie among the new tokens"
        assert self.parents is None or len(self.parents) == len(self.tokens), "one parent per tree token"


@dataclass(slots=True)
class RowOutput:
    logits: torch.Tensor  # [n, V] float32
    taps: torch.Tensor | None  # [n, S, D]


class ModelRunner:
    def __init__(self, target: TargetModel, tap_layers: tuple[int, ...], max_kv_tokens: int, block_size: int,
                 attention_backend: str = "auto", enable_prefix_cache: bool = True, normed_last_tap: bool = False,
                 graphs: GraphConfig | None = None):
        """normed_last_tap: the last layer's tap is taken after the final norm (see ForwardBatch);
        graphs: decode and verify steps bucketed and padded (engine/graph_runner.py), as CUDA
        graphs where `graphs.capture` and the backend is graph-safe on CUDA (else they run as
        before, the reason logged); None: every step eager and unpadded."""
        self.target = target
        self.tap_layers = tap_layers
        self.normed_last_tap = normed_last_tap
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.backend = make_backend(attention_backend, self.device, self.dtype)
        if self.backend.name == "flash_attn" and block_size % FLASH_ATTN_PAGE_MULTIPLE:
            block_size = FLASH_ATTN_PAGE_MULTIPLE
        num_blocks = -(-max_kv_tokens // block_size)
        self.num_blocks, self.block_size = num_blocks, block_size  # the pool's shape, for its owner
        graphs = _usable(graphs, self.device, self.backend)
        # A graph's padding rows write to one block past the pool handed out: never a sequence's.
        self.cache = PagedKVCache(target.cfg, num_blocks + (graphs is not None), block_size, self.dtype, self.device,
                                  block_major=self.backend.block_major)
        self.max_context = target.cfg.max_position_embeddings
        self.enable_prefix_cache = enable_prefix_cache
        self._own_blocks: BlockManager | None = None  # only for drivers without a scheduler
        self.graphs = GraphRunner(self, graphs, scratch_block=num_blocks) if graphs is not None else None

    def run(self, rows: list[RowInput], copies: Iterable[tuple[int, int]] = ()) -> list[RowOutput]:
        """One ragged forward. Each row's block table already holds its new positions;
        `copies` (src, dst) are applied first (blocks copied before a shared one is written)."""
        for src, dst in copies:
            self.cache.copy_block(src, dst)
        for row in rows:
            seq = row.seq
            end = seq.num_computed + len(row.tokens)
            if end > self.max_context:
                raise InvalidRequest(f"sequence of {end} tokens exceeds the model context of {self.max_context}")
            assert len(seq.block_table) * self.block_size >= end, "KV not reserved before the forward"
        if self.graphs is not None and self.graphs.serves(rows):
            return self.graphs.run(rows)
        batch = self._build_batch(rows)
        out = self.target(batch, self.cache, self.backend)
        counts = [r.num_outputs for r in rows]
        logits = out.logits.split(counts)
        taps = out.taps.split(counts) if out.taps is not None else [None] * len(rows)
        return [RowOutput(lg, tp) for lg, tp in zip(logits, taps)]

    @property
    def verifies_trees(self) -> bool:
        """Whether rows may be trees: the backend must read keys through slots (flash-attn's
        paged kernel reads whole block tables)."""
        return not self.backend.block_major

    def keep_branch(self, seq: Sequence, branch: list[int]) -> None:
        """After a tree row: its tokens `branch` (indices into the row, the first token first,
        each the parent of the next) become positions seq.num_computed onwards, as if they had
        been verified as a chain. Moves the KV of those stored elsewhere."""
        start = seq.num_computed
        moved = [(start + node, start + depth) for depth, node in enumerate(branch) if node != depth]
        if moved:
            table, bs = seq.block_table, self.block_size
            src, dst = ([table[p // bs] * bs + p % bs for p in ps] for ps in zip(*moved))
            self.cache.move_slots(src, dst)

    def _build_batch(self, rows: list[RowInput]) -> ForwardBatch:
        ids: list[int] = []
        positions: list[int] = []
        wanted: list[int] = []
        q_lens, ctx_lens = [], []
        if any(r.parents is not None for r in rows) and not self.verifies_trees:
            raise ValueError(f"the {self.backend.name} backend does not verify trees")
        for row in rows:
            start, n = row.seq.num_computed, len(row.tokens)
            first = len(ids)
            ids += row.tokens
            depths = range(n) if row.parents is None else tree_positions(row.parents)
            positions += (start + d for d in depths)
            wanted += range(first + n - row.num_outputs, first + n)
            q_lens.append(n)
            ctx_lens.append(start + n)
        meta = build_attention_metadata(q_lens, ctx_lens, [r.seq.block_table for r in rows],
                                        self.cache.block_size, self.device, [r.parents for r in rows])
        wanted_t = torch.tensor(wanted, dtype=torch.long, device=self.device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attention=meta, logit_indices=wanted_t,
            tap_indices=wanted_t if self.tap_layers else None, tap_layers=self.tap_layers,
            normed_last_tap=self.normed_last_tap,
        )

    # -- drivers without a scheduler (runtime tests, GPU checks) -------------------------------
    @property
    def blocks(self) -> BlockManager:
        """The pool `forward` reserves from: never the engine's (its Scheduler owns that one)."""
        if self._own_blocks is None:
            self._own_blocks = BlockManager(self.num_blocks, self.block_size, self.enable_prefix_cache)
        return self._own_blocks

    def forward(self, rows: list[RowInput]) -> list[RowOutput]:
        """`run`, reserving each row's KV from this runner's own pool first."""
        for row in rows:
            self.blocks.prepare_write(row.seq.block_table, row.seq.num_computed, row.seq.num_computed + len(row.tokens))
        return self.run(rows, self.blocks.take_copies())

    def release(self, seq: Sequence) -> None:
        """Free a sequence's KV in this runner's own pool."""
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed = 0
        seq.pivot_features = None

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Keep the first `num_computed` positions (roll back the rest) in this runner's own pool."""
        seq.num_computed = num_computed
        self.blocks.commit(seq.block_table, seq.block_hashes, seq.token_ids, num_computed)


def _usable(graphs: GraphConfig | None, device: torch.device, backend: object) -> GraphConfig | None:
    """The graph config where it applies: capture needs CUDA and a graph-safe backend, so
    elsewhere steps stay eager and unpadded (padding without a graph only costs)."""
    if graphs is None or not graphs.capture:
        return graphs
    if device.type != "cuda" or not is_graph_safe(backend):
        log.info("CUDA graphs off: the %s backend on %s is not graph-safe", getattr(backend, "name", backend), device)
        return None
    return graphs

"""ModelRunner: owns every target tensor (weights, paged KV, backend) and runs ragged batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlite_ray.engine.block_manager import BlockManager
from dlite_ray.engine.sequence import InvalidRequest, Sequence
from dlite_ray.runtime.attention import FLASH_ATTN_PAGE_MULTIPLE, build_attention_metadata, make_backend
from dlite_ray.runtime.kv_cache import PagedKVCache
from dlite_ray.runtime.target_model import ForwardBatch, TargetModel


@dataclass(slots=True)
class RowInput:
    """New tokens of one sequence, written at positions seq.num_computed onwards."""

    seq: Sequence
    tokens: list[int]
    num_outputs: int = 1  # logits/taps at the last this-many new tokens (len(tokens) for a verify block)

    def __post_init__(self) -> None:
        assert 1 <= self.num_outputs <= len(self.tokens), "outputs must lie among the new tokens"


@dataclass(slots=True)
class RowOutput:
    logits: torch.Tensor  # [n, V] float32
    taps: torch.Tensor | None  # [n, S, D]


class ModelRunner:
    def __init__(self, target: TargetModel, tap_layers: tuple[int, ...], max_kv_tokens: int, block_size: int,
                 attention_backend: str = "auto", enable_prefix_cache: bool = True, normed_last_tap: bool = False):
        """normed_last_tap: the last layer's tap is taken after the final norm (see ForwardBatch)."""
        self.target = target
        self.tap_layers = tap_layers
        self.normed_last_tap = normed_last_tap
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.backend = make_backend(attention_backend, self.device, self.dtype)
        if self.backend.name == "flash_attn" and block_size % FLASH_ATTN_PAGE_MULTIPLE:
            block_size = FLASH_ATTN_PAGE_MULTIPLE
        num_blocks = -(-max_kv_tokens // block_size)
        self.cache = PagedKVCache(target.cfg, num_blocks, block_size, self.dtype, self.device,
                                  block_major=self.backend.block_major)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache)
        self.max_context = target.cfg.max_position_embeddings

    def forward(self, rows: list[RowInput]) -> list[RowOutput]:
        for row in rows:
            seq = row.seq
            end = seq.num_computed + len(row.tokens)
            if end > self.max_context:
                raise InvalidRequest(f"sequence of {end} tokens exceeds the model context of {self.max_context}")
            first_block = seq.num_computed // self.blocks.block_size
            if first_block < len(seq.block_table):  # writing into a block that may be shared
                self.blocks.copy_on_write(seq.block_table, first_block)
            self.blocks.ensure_capacity(seq.block_table, end)
        self._apply_block_copies()
        batch = self._build_batch(rows)
        out = self.target(batch, self.cache, self.backend)
        counts = [r.num_outputs for r in rows]
        logits = out.logits.split(counts)
        taps = out.taps.split(counts) if out.taps is not None else [None] * len(rows)
        return [RowOutput(lg, tp) for lg, tp in zip(logits, taps)]

    def _build_batch(self, rows: list[RowInput]) -> ForwardBatch:
        ids, positions, wanted = [], [], []
        q_lens, ctx_lens = [], []
        for row in rows:
            start, n = row.seq.num_computed, len(row.tokens)
            first = len(ids)
            ids += row.tokens
            positions += range(start, start + n)
            wanted += range(first + n - row.num_outputs, first + n)
            q_lens.append(n)
            ctx_lens.append(start + n)
        meta = build_attention_metadata(q_lens, ctx_lens, [r.seq.block_table for r in rows],
                                        self.cache.block_size, self.device)
        wanted_t = torch.tensor(wanted, dtype=torch.long, device=self.device)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=self.device),
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            attention=meta, logit_indices=wanted_t,
            tap_indices=wanted_t if self.tap_layers else None, tap_layers=self.tap_layers,
            normed_last_tap=self.normed_last_tap,
        )

    def _apply_block_copies(self) -> None:
        for src, dst in self.blocks.copies:
            self.cache.copy_block(src, dst)
        self.blocks.copies.clear()

    def release(self, seq: Sequence) -> None:
        """Free a sequence's KV (its committed full blocks stay in the prefix cache)."""
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed = 0
        seq.pivot_features = None

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Keep the first `num_computed` positions (roll back the rest) and publish full blocks."""
        seq.num_computed = num_computed
        self.blocks.crop(seq.block_table, num_computed)
        self.blocks.register_full_blocks(seq.block_table, seq.block_hashes, seq.token_ids, num_computed)

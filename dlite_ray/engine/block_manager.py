"""Paged KV bookkeeping in plain Python: which blocks each sequence owns.

The tensors live in `runtime.kv_cache.PagedKVCache`; here a sequence's block table grows
as tokens are written, and shrinks on rollback (crop) or when the sequence is freed.
Blocks are handed out lowest-id first so a lone sequence gets consecutive blocks, which
the SDPA backend reads as one zero-copy slice.
"""

from __future__ import annotations

import heapq


class OutOfBlocks(RuntimeError):
    """The KV pool cannot hold the tokens asked for."""


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: list[int] = list(range(num_blocks))  # a min-heap
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(table) <= self.num_free_blocks

    def ensure_capacity(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` in place until it holds `num_tokens` positions."""
        missing = self.blocks_needed(num_tokens) - len(table)
        if missing > self.num_free_blocks:
            raise OutOfBlocks(f"need {missing} more KV blocks, {self.num_free_blocks} free")
        for _ in range(missing):
            block = heapq.heappop(self._free)
            self._ref_counts[block] = 1
            table.append(block)

    def crop(self, table: list[int], num_tokens: int) -> None:
        """Roll back: keep only the blocks that hold the first `num_tokens` positions."""
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        while table:
            self._release(table.pop())

    def _release(self, block: int) -> None:
        assert self._ref_counts[block] > 0, f"block {block} freed twice"
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            heapq.heappush(self._free, block)

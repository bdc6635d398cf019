"""Boundary features: what lets a later turn resume with no target recompute at all.

When a sequence finishes (or a conversation pauses) its KV blocks, the anchor and the
pivot features are kept, stamped with a FeatureVersion. A new request whose tokens are
exactly those KV tokens plus one more (its anchor) resumes straight into drafting.
Features are only valid for the weights that made them: a version with another target
or draft fingerprint is never used.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from dlite_ray.engine.block_manager import BlockManager


@dataclass(frozen=True, slots=True)
class FeatureVersion:
    target_fingerprint: str
    draft_fingerprint: str
    prefix_len: int


@dataclass(slots=True)
class Boundary:
    version: FeatureVersion
    tokens: tuple[int, ...]  # the KV tokens (prefix_len of them)
    anchor: int
    pivot_features: torch.Tensor | None
    blocks: list[int]  # pinned KV blocks holding `tokens`
    block_hashes: list[int]


class BoundaryStore:
    def __init__(self, blocks: BlockManager, capacity: int = 64):
        self.blocks, self.capacity = blocks, capacity
        self._entries: OrderedDict[int, Boundary] = OrderedDict()
        self.hits = 0
        self.stale = 0

    def __len__(self) -> int:
        return len(self._entries)

    def save(self, tokens: list[int], num_computed: int, pivot_features: torch.Tensor | None, block_table: list[int],
             block_hashes: list[int], target_fp: str, draft_fp: str) -> None:
        if num_computed == 0 or num_computed != len(tokens) - 1:
            return  # only a sequence whose KV holds everything but its anchor
        kv_tokens = tuple(tokens[:num_computed])
        key = hash(kv_tokens)
        self._drop(key)
        used = self.blocks.blocks_needed(num_computed)
        for b in block_table[:used]:
            self.blocks.hold(b)
        self._entries[key] = Boundary(FeatureVersion(target_fp, draft_fp, num_computed), kv_tokens, tokens[-1],
                                      pivot_features, list(block_table[:used]), list(block_hashes))
        while len(self._entries) > self.capacity:
            self.evict_oldest()

    def take(self, tokens: list[int], target_fp: str, draft_fp: str) -> Boundary | None:
        """The boundary for exactly tokens[:-1], if one with this version is stored. The
        caller receives one reference to each block (the store keeps its own)."""
        kv_tokens = tuple(tokens[:-1])
        key = hash(kv_tokens)
        entry = self._entries.get(key)
        if entry is None or entry.tokens != kv_tokens:
            return None
        if entry.version != FeatureVersion(target_fp, draft_fp, len(kv_tokens)):
            self.stale += 1
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        for b in entry.blocks:
            self.blocks.hold(b)
        self.hits += 1
        return entry

    def evict_oldest(self) -> bool:
        if not self._entries:
            return False
        self._drop(next(iter(self._entries)))
        return True

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            for b in entry.blocks:
                self.blocks.release(b)

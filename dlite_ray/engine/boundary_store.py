"""Boundary features: what lets a later turn resume with no target recompute at all.

When a sequence finishes (or a conversation pauses) its KV blocks, the anchor and the
pivot features are kept, stamped with a FeatureVersion. A new request whose tokens are
exactly those KV tokens plus one more (its anchor) resumes straight into drafting.
Features are only valid for the weights that made them: a version with another target
or draft fingerprint is never used.

Leases: a paused conversation's boundary can be saved under a lease name. A leased entry
is outside the LRU capacity and is given up only when released (lease expiry, delete) or,
as a last resort, under memory pressure; then its name is reported by `take_evicted_leases`
so the server can tell the router the conversation must re-prefill elsewhere. Pressure
takes a lease of the namespace (tenant) holding the most, its oldest first: one tenant's
many long leases push out its own, not everyone else's.

Namespaces: an entry is found only by the namespace (tenant) that saved it, as the prefix
cache's chains are (block_manager.py says why).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
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
    lease: str | None = None
    namespace: str | None = None  # the tenant that saved it, the only one that may take it


class BoundaryStore:
    def __init__(self, blocks: BlockManager, capacity: int = 64):
        self.blocks, self.capacity = blocks, capacity
        self._entries: OrderedDict[int, Boundary] = OrderedDict()
        self._leases: dict[str, int] = {}  # lease -> entry key
        self._evicted_leases: list[str] = []
        self.hits = 0
        self.stale = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def leases(self) -> list[str]:
        return list(self._leases)

    def save(self, tokens: list[int], num_computed: int, pivot_features: torch.Tensor | None, block_table: list[int],
             block_hashes: list[int], target_fp: str, draft_fp: str, lease: str | None = None,
             namespace: str | None = None) -> None:
        """Keep a finished sequence's KV + anchor + features; under `lease`, until released
        (a lease holds one boundary: its conversation's latest)."""
        if lease is not None:
            self.release_lease(lease)
        if num_computed == 0 or num_computed != len(tokens) - 1:
            return  # only a sequence whose KV holds everything but its anchor
        kv_tokens = tuple(tokens[:num_computed])
        key = hash((namespace, kv_tokens))
        self._drop(key)
        used = self.blocks.blocks_needed(num_computed)
        for b in block_table[:used]:
            self.blocks.hold(b)
        self._entries[key] = Boundary(FeatureVersion(target_fp, draft_fp, num_computed), kv_tokens, tokens[-1],
                                      pivot_features, list(block_table[:used]), list(block_hashes), lease, namespace)
        if lease is not None:
            self._leases[lease] = key
            if lease in self._evicted_leases:  # its older boundary went, this newer one is pinned
                self._evicted_leases.remove(lease)
        while len(self._entries) - len(self._leases) > self.capacity and self._drop_oldest(leased=False):
            pass

    def take_evicted_leases(self) -> list[str]:
        """Leases whose boundary was dropped since the last call."""
        out, self._evicted_leases = self._evicted_leases, []
        return out

    def release_lease(self, lease: str) -> bool:
        """The lease ended: its boundary joins the LRU (still reusable until evicted)."""
        key = self._leases.pop(lease, None)
        if key is None:
            return False
        self._entries[key].lease = None
        return True

    def take(self, tokens: list[int], target_fp: str, draft_fp: str, namespace: str | None = None
             ) -> Boundary | None:
        """The boundary `namespace` saved for exactly tokens[:-1], if one with this version
        is stored. The caller receives one reference to each block (the store keeps its own)."""
        kv_tokens = tuple(tokens[:-1])
        key = hash((namespace, kv_tokens))
        entry = self._entries.get(key)
        if entry is None or entry.tokens != kv_tokens or entry.namespace != namespace:
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
        """Free memory: the least recently used unleased boundary, else (pressure) the
        oldest lease of the namespace holding the most leases."""
        return self._drop_oldest(leased=False) or self._drop_oldest(leased=True, namespace=self._most_leased())

    def _most_leased(self) -> str | None:
        counts = Counter(self._entries[key].namespace for key in self._leases.values())
        return max(counts, key=counts.__getitem__) if counts else None  # ties: the first to lease

    def _drop_oldest(self, leased: bool, namespace: str | None = None) -> bool:
        for key, entry in self._entries.items():
            if (entry.lease is not None) == leased and (not leased or entry.namespace == namespace):
                self._drop(key)
                return True
        return False

    def _drop(self, key: int) -> None:
        """Forget an entry; a leased one is reported (its conversation must re-prefill)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            if entry.lease is not None:
                self._leases.pop(entry.lease, None)
                self._evicted_leases.append(entry.lease)
            for b in entry.blocks:
                self.blocks.release(b)

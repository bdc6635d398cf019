"""Block manager and prefix cache, without a model."""

from __future__ import annotations

import pytest

from dlite_ray.engine.block_manager import BlockManager, OutOfBlocks


def test_allocation_crop_free_and_ref_counts():
    bm = BlockManager(8, 4)
    table: list[int] = []
    bm.ensure_capacity(table, 10)
    assert table == [0, 1, 2] and bm.num_free_blocks == 5
    bm.crop(table, 4)
    assert table == [0] and bm.num_free_blocks == 7
    bm.free(table)
    assert table == [] and bm.num_free_blocks == 8
    with pytest.raises(OutOfBlocks):
        bm.ensure_capacity(table, 40)
    assert bm.num_free_blocks == 8  # a refused allocation takes nothing


def test_hash_chain_shares_full_committed_blocks():
    bm = BlockManager(16, 4)
    tokens = list(range(10))
    a, ha = [], []
    bm.ensure_capacity(a, 10)
    bm.register_full_blocks(a, ha, tokens, 10)
    assert len(ha) == 2  # two full blocks; the partial third is never shared
    blocks, hashes = bm.match_prefix(tokens + [99], 10)
    assert blocks == a[:2] and hashes == ha
    assert bm.ref_count(a[0]) == 2
    # a different first block breaks the chain even if the second block's tokens match
    other, _ = bm.match_prefix([7] + tokens[1:], 10)
    assert other == []


def test_chain_depends_on_the_parent():
    bm = BlockManager(16, 2)
    a, ha = [], []
    bm.ensure_capacity(a, 4)
    bm.register_full_blocks(a, ha, [1, 2, 3, 4], 4)
    assert bm.match_prefix([9, 9, 3, 4], 4)[0] == []


def test_unreferenced_cached_blocks_are_evicted_lru():
    bm = BlockManager(3, 2)
    a, ha = [], []
    bm.ensure_capacity(a, 4)
    bm.register_full_blocks(a, ha, [1, 2, 3, 4], 4)
    a_blocks = list(a)
    bm.free(a)
    assert bm.num_free_blocks == 3  # cached blocks count as free
    fresh: list[int] = []
    bm.ensure_capacity(fresh, 2)  # takes the never-used block, not a cached one
    assert fresh == [2]
    hit, _ = bm.match_prefix([1, 2, 3, 4], 4)
    assert hit == a_blocks
    bm.free(hit)
    more: list[int] = []
    # freeing releases tail first, so the tail is least recently used and evicted first:
    # the head of the chain stays usable
    bm.ensure_capacity(more, 2)
    assert more == [a_blocks[1]]
    assert bm.match_prefix([1, 2, 3, 4], 4)[0] == [a_blocks[0]]


def test_copy_on_write_of_a_shared_block():
    bm = BlockManager(8, 4)
    a, ha = [], []
    bm.ensure_capacity(a, 8)
    bm.register_full_blocks(a, ha, list(range(8)), 8)
    b, _ = bm.match_prefix(list(range(8)), 8)
    bm.copy_on_write(b, 1)
    assert b[1] != a[1] and bm.copies == [(a[1], b[1])]
    assert bm.ref_count(a[1]) == 1
    own: list[int] = []
    bm.ensure_capacity(own, 3)
    bm.copy_on_write(own, 0)  # an unshared, unpublished block is written in place
    assert bm.copies == [(a[1], b[1])]


def test_hash_collision_is_not_trusted(monkeypatch):
    import dlite_ray.engine.block_manager as m

    monkeypatch.setattr(m, "chain_hash", lambda parent, tokens: 42)
    bm = BlockManager(8, 2)
    a, ha = [], []
    bm.ensure_capacity(a, 2)
    bm.register_full_blocks(a, ha, [1, 2], 2)
    assert bm.match_prefix([3, 4], 2)[0] == []  # same hash, other tokens: no match


def test_sequences_growing_in_turn_keep_their_blocks_consecutive():
    """Attention reads a sequence on consecutive blocks as one view and gathers any other:
    two sequences that take blocks in turn must not interleave them."""
    bm = BlockManager(64, 4)
    a: list[int] = []
    b: list[int] = []
    for tokens in range(4, 80, 4):  # one block each, in turn
        bm.ensure_capacity(a, tokens)
        bm.ensure_capacity(b, tokens)
    assert a == list(range(a[0], a[0] + 19)) and b == list(range(b[0], b[0] + 19))
    assert a[0] == 0 and b[0] == 32  # b started in the middle of the gap a grows into


def test_a_run_continues_after_its_last_block_when_that_is_free():
    bm = BlockManager(16, 4)
    a: list[int] = []
    bm.ensure_capacity(a, 8)
    b: list[int] = []
    bm.ensure_capacity(b, 4)  # b starts in the middle of the free blocks after a
    bm.free(a)
    bm.ensure_capacity(b, 12)
    assert b == [b[0], b[0] + 1, b[0] + 2]

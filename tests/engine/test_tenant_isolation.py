"""One tenant learns nothing of another's prompts from the KV caches, and cannot push the
others' leases out with its own (issue 53, item 9)."""

from __future__ import annotations

import random

from dlite_ray.engine.block_manager import BlockManager, prefix_seed
from dlite_ray.engine.boundary_store import BoundaryStore
from dlite_ray.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine


def _prompt(seed: int, n: int = 30) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def _run(engine, prompt, tenant, lease=None):
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=6, ignore_eos=True), lease=lease,
                             namespace=tenant)
    while not seq.is_finished:
        engine.step()
    return seq


def test_another_tenants_identical_prompt_is_no_cache_hit(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft, block_size=4)
    secret = _prompt(0)
    first = _run(engine, secret, "tenant-a", lease="conv-a")
    guess = _run(engine, secret, "tenant-b")
    assert guess.stats.cached_prompt_tokens == 0
    again = _run(engine, secret, "tenant-a")
    assert again.stats.cached_prompt_tokens >= len(secret) // 4 * 4 - 4  # A's own repeat hits
    # nor can another tenant (C: B's guess left B a boundary of its own) resume A's
    # conversation from its stored boundary (A's KV + anchor)
    c_resume = _run(engine, list(first.token_ids), "tenant-c")
    assert not c_resume.stats.resumed_from_boundary and c_resume.stats.cached_prompt_tokens == 0
    assert _run(engine, list(first.token_ids), "tenant-a").stats.resumed_from_boundary


def test_prefix_chains_start_from_the_tenant():
    blocks = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(3, 15))
    table: list[int] = []
    hashes: list[int] = []
    blocks.ensure_capacity(table, len(tokens))
    blocks.commit(table, hashes, tokens, len(tokens), prefix_seed("a"))
    assert blocks.match_prefix(tokens, len(tokens), prefix_seed("b")) == ([], [])
    assert blocks.match_prefix(tokens, len(tokens), None) == ([], [])
    assert blocks.match_prefix(tokens, len(tokens), prefix_seed("a"))[0] == table


def _lease(store: BoundaryStore, name: str, tenant: str, seed: int) -> None:
    """A finished, leased conversation of 8 KV tokens (2 blocks) + its anchor."""
    tokens = _prompt(seed, 9)
    table: list[int] = []
    store.blocks.ensure_capacity(table, 8)
    store.save(tokens, 8, None, table, [], "t", "d", lease=name, namespace=tenant)
    store.blocks.free(table)  # the store keeps its own references


def test_one_tenants_flood_of_leases_evicts_its_own_first():
    store = BoundaryStore(BlockManager(num_blocks=64, block_size=4))
    _lease(store, "b-1", "tenant-b", 0)  # the oldest lease, B's only one
    for i in range(4):
        _lease(store, f"a-{i}", "tenant-a", 10 + i)
    for _ in range(3):
        assert store.evict_oldest()
    assert store.take_evicted_leases() == ["a-0", "a-1", "a-2"]
    assert set(store.leases) == {"b-1", "a-3"}
    assert store.evict_oldest()  # a tie: the first tenant to lease gives one up
    assert store.take_evicted_leases() == ["b-1"]

"""Conversation leases: a paused conversation's KV and boundary features stay pinned
until the lease is released, survive the boundary LRU, and are given up (and reported)
only under memory pressure; outputs never change."""

from __future__ import annotations

import random

from dlite_ray.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine

NEW = 12


def _prompt(seed: int, n: int = 20) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128) for _ in range(n)]


def _run(engine, prompt, lease=None):
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True), lease=lease)
    while not seq.is_finished:
        engine.step()
    return seq


def _continue(engine, seq):
    """The conversation's next request: everything so far (its KV + the anchor)."""
    return _run(engine, list(seq.token_ids))


def test_a_leased_conversation_outlives_the_boundary_lru(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft, block_size=4, boundary_capacity=1)
    held = _run(engine, _prompt(0), lease="conv-a")
    loose = _run(engine, _prompt(1))
    for i in range(2, 5):  # other traffic overflows the one-entry LRU
        _run(engine, _prompt(i))
    assert engine.held_leases == ["conv-a"]
    assert _continue(engine, held).stats.resumed_from_boundary
    assert not _continue(engine, loose).stats.resumed_from_boundary


def test_released_lease_becomes_ordinary_cache(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft, block_size=4, boundary_capacity=1)
    held = _run(engine, _prompt(0), lease="conv-a")
    assert engine.release_lease("conv-a") and not engine.release_lease("conv-a")
    for i in range(2, 5):
        _run(engine, _prompt(i))
    assert engine.held_leases == []
    assert not _continue(engine, held).stats.resumed_from_boundary


def test_next_turn_moves_the_lease_to_the_newest_boundary(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft, block_size=4, boundary_capacity=8)
    first = _run(engine, _prompt(0), lease="conv-a")
    second = _run(engine, list(first.token_ids) + _prompt(9, 5), lease="conv-a")
    assert engine.held_leases == ["conv-a"] and len(engine.scheduler.boundaries) == 2
    assert _continue(engine, second).stats.resumed_from_boundary


def test_memory_pressure_evicts_a_lease_reports_it_and_keeps_outputs(tiny_target, tiny_draft):
    ar = make_engine(tiny_target, enable_prefix_cache=False)
    expected = [ar.generate(_prompt(i, 30), max_new_tokens=NEW, ignore_eos=True)[0].token_ids for i in range(3)]
    # a pool of 24 blocks x 4 = 96 positions: one 42-token request fits beside one lease, not two
    engine = make_engine(tiny_target, tiny_draft, block_size=4, max_kv_tokens=96, boundary_capacity=8)
    got = [_run(engine, _prompt(i, 30), lease=f"conv-{i}").output_ids for i in range(3)]
    assert got == expected
    evicted = engine.take_evicted_leases()
    assert evicted and set(evicted) | set(engine.held_leases) == {"conv-0", "conv-1", "conv-2"}
    assert engine.take_evicted_leases() == []


def test_async_engine_pins_and_releases_between_steps(tiny_target, tiny_draft):
    import asyncio
    import time

    from dlite_ray.engine.async_engine import AsyncEngine

    engine = AsyncEngine(make_engine(tiny_target, tiny_draft, block_size=4))

    async def turn():
        async for _ in engine.generate(_prompt(0), SamplingParams(max_new_tokens=NEW), lease="conv-a"):
            pass

    try:
        asyncio.run(turn())
        # visible as soon as the reply is: a router asking right away must see the pin
        assert engine.held_leases == ("conv-a",) and engine.stats().held_leases == 1
        deadline = time.time() + 5
        engine.release_lease("conv-a")
        while engine.held_leases and time.time() < deadline:
            time.sleep(0.05)
        assert engine.held_leases == ()
    finally:
        engine.shutdown()


def test_a_speculated_reply_is_pinned_and_its_blocks_cached(tiny_target):
    """With an oracle draft whole rounds are accepted. The lease pins the reply, and a
    follow-up turn finds every full block of prompt + reply in the prefix cache: blocks are
    hashed with the tokens they hold (they once were hashed before the round's accepted
    drafts were appended, and never matched)."""
    from dlite_ray.bench.oracle import OracleDraftTransport

    prompt = _prompt(1)
    ar = make_engine(tiny_target, enable_prefix_cache=False)
    reference = ar.generate(prompt, max_new_tokens=40, ignore_eos=True)[0].token_ids
    engine = make_engine(tiny_target, OracleDraftTransport([prompt + reference]), block_size=4)
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True), lease="conv-a")
    while not seq.is_finished:
        engine.step()
    assert seq.output_ids == reference[:10] and max(seq.stats.accept_lengths) > 2
    assert engine.held_leases == ["conv-a"]
    history = list(seq.token_ids) + [5, 6, 7]
    follow = engine.generate(history, max_new_tokens=2, ignore_eos=True)[0]
    assert follow.stats.cached_prompt_tokens >= (len(seq.token_ids) - 1) // 4 * 4 - 1

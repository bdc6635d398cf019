"""A request whose caller leaves before its last chunk is given up, whatever the engine
thread was doing then: one cancelled while its "add" still waits in the inbox never
decodes (issue 53 item 2), and a conversation turn that finished unread does not keep
its KV pinned."""

from __future__ import annotations

import asyncio
import threading

from dlite_ray.engine.async_engine import AsyncEngine
from dlite_ray.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine

PROMPT = [5, 9, 17, 33, 12, 7, 21, 40]
LONG = 400  # far more steps than the rest of the test takes, were it to run


class GatedSteps:
    """`before_step` that holds the engine thread in its first step until `go` is set."""

    def __init__(self):
        self.entered, self.go = threading.Event(), threading.Event()

    def __call__(self, _unfinished: int) -> None:
        self.entered.set()
        self.go.wait()


async def _drain(gen) -> list[int]:
    return [t async for chunk in gen for t in chunk.token_ids]


async def _until(condition, what: str) -> None:
    """Yield to the loop until `condition()` holds (state, not time, is what the test waits on)."""
    for _ in range(30_000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"never happened: {what}")


def test_a_request_cancelled_before_the_engine_admits_it_never_runs(tiny_target):
    gate = GatedSteps()
    engine = AsyncEngine(make_engine(tiny_target), before_step=gate)

    async def main() -> tuple[int, int]:
        first = asyncio.create_task(_drain(engine.generate(PROMPT, SamplingParams(max_new_tokens=3,
                                                                                   ignore_eos=True))))
        await asyncio.to_thread(gate.entered.wait)  # the engine thread is inside a step now
        orphan = asyncio.create_task(_drain(engine.generate(PROMPT[::-1], SamplingParams(
            max_new_tokens=LONG, ignore_eos=True), request_id="orphan", lease="conv-o")))
        await _until(lambda: engine._inbox.qsize() == 1, "the orphan's add is queued")
        orphan.cancel()
        await asyncio.gather(orphan, return_exceptions=True)
        gate.go.set()
        await first
        # a request added after the orphan's add (and its give-up) runs behind them in the inbox
        await _drain(engine.generate(PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True)))
        load = engine.stats()
        return load.running + load.waiting, len(engine.held_leases)

    try:
        unfinished, held = asyncio.run(main())
    finally:
        engine.shutdown()
    assert unfinished == 0  # without the give-up, the orphan decodes its 400 tokens for nobody
    assert held == 0


def test_a_turn_that_finished_unread_unpins_its_conversation(tiny_target):
    engine = AsyncEngine(make_engine(tiny_target, block_size=4))

    async def main() -> tuple[tuple[str, ...], tuple[str, ...]]:
        gen = engine.generate(PROMPT, SamplingParams(max_new_tokens=12, ignore_eos=True), lease="conv-u")
        first = await anext(gen)
        assert not first.finished
        await _until(lambda: "conv-u" in engine.held_leases, "the reply finished and pinned its KV")
        pinned = engine.held_leases
        await gen.aclose()  # its caller leaves without reading the last chunk
        await _drain(engine.generate(PROMPT, SamplingParams(max_new_tokens=2, ignore_eos=True)))
        return pinned, engine.held_leases

    try:
        pinned, after = asyncio.run(main())
    finally:
        engine.shutdown()
    assert pinned == ("conv-u",)
    assert after == ()

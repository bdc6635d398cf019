"""AsyncEngine tells its owner, before each step, how many requests the step carries (a
server sizes its CPU threads with it: serve/cpu_threads.py)."""

from __future__ import annotations

import asyncio

from dlite_ray.engine.async_engine import AsyncEngine
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.sequence import SamplingParams
from tests.engine.test_requests import CharTokenizer


def test_before_step_sees_each_steps_load(tiny_target):
    loads: list[int] = []
    engine = DLiteEngine(tiny_target, CharTokenizer(), None, adaptive_draft_length=False, lookup_tokens=0)
    async_engine = AsyncEngine(engine, before_step=loads.append)

    async def reply(prompt: str, tokens: int) -> int:
        params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
        return sum([len(c.token_ids) async for c in async_engine.generate(prompt, params)])

    async def main() -> list[int]:
        return await asyncio.gather(reply("hello", 120), reply("world", 4))

    try:
        assert asyncio.run(main()) == [120, 4]
        assert 2 in loads and loads[-1] == 1 and set(loads) == {1, 2}  # the longer reply ends alone
    finally:
        async_engine.shutdown()

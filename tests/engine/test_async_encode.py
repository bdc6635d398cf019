"""A prompt is tokenized off the event loop that streams every other request's tokens: a
slow tokenizer must not stop that loop (issue 37: one oversized prompt froze every stream)."""

from __future__ import annotations

import asyncio
import threading

from dlite_ray.engine.async_engine import AsyncEngine
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.sequence import SamplingParams
from tests.engine.test_requests import CharTokenizer


class GatedTokenizer(CharTokenizer):
    """Tokenizes only once the event loop has shown it still runs (or gives up after a while)."""

    def __init__(self):
        self.started, self.loop_ran = threading.Event(), threading.Event()
        self.saw_loop_run: bool | None = None

    def __call__(self, text, add_special_tokens=False):
        self.started.set()
        self.saw_loop_run = self.loop_ran.wait(timeout=5)  # a blocked loop never sets it: the wait runs out
        return super().__call__(text, add_special_tokens)


def test_a_slow_tokenizer_leaves_the_event_loop_running(tiny_target):
    tokenizer = GatedTokenizer()
    engine = DLiteEngine(tiny_target, tokenizer, None, adaptive_draft_length=False, lookup_tokens=0)
    async_engine = AsyncEngine(engine)

    async def loop_watch() -> None:
        while not tokenizer.started.is_set():  # noqa: ASYNC110 - a threading.Event, set by the tokenizer's thread
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.005)  # the loop turns while the prompt is being tokenized
        tokenizer.loop_ran.set()

    async def main() -> list[int]:
        watch = asyncio.create_task(loop_watch())
        ids = [t async for chunk in async_engine.generate("a long prompt", SamplingParams(max_new_tokens=2))
               for t in chunk.token_ids]
        await watch
        return ids

    try:
        assert len(asyncio.run(main())) == 2
        assert tokenizer.saw_loop_run is True
    finally:
        async_engine.shutdown()

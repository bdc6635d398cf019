"""Lease releases and eviction reports between the ConversationRouter, the ingress and the
TargetWorkers (issue 53 items 5, 6 and 7), without Ray:

- a release meant for a replica that is gone lands on another, which keeps its own copy;
- a release a replica never answers holds up neither lease nor claim expiry;
- a conversation evicted while a plain completion ran reads "evicted" in the registry.
"""

from __future__ import annotations

import asyncio

from dlite_ray.engine.sequence import SamplingParams
from tests.serve.local_handles import local_args, target_worker, tiny_engine

HELLO = [{"role": "user", "content": "hello"}]


# -- item 5: a release routed to a gone replica ---------------------------------------------------
def test_a_worker_keeps_its_copy_when_a_release_meant_for_another_replica_lands_on_it(tiny_serving_model, tmp_path):
    worker = target_worker(local_args(tmp_path, {}), tiny_engine(tiny_serving_model))

    async def main() -> tuple[tuple, tuple]:
        async for _ in worker.generate("a turn", SamplingParams(max_new_tokens=2), conversation="c"):
            pass
        await worker.release_lease("c", route_to="other")  # the drained replica it was meant for is gone
        await _engine_applied(worker)
        kept = worker.async_engine.held_leases
        await worker.release_lease("c", route_to=worker.replica_id)
        await _engine_applied(worker)
        return kept, worker.async_engine.held_leases

    try:
        kept, released = asyncio.run(main())
    finally:
        worker.async_engine.shutdown()
    assert kept == ("c",)
    assert released == ()  # meant for it: released


async def _engine_applied(worker) -> None:
    """A request behind what the worker queued: once it ends, the engine thread applied it."""
    async for _ in worker.generate("x", SamplingParams(max_new_tokens=1)):
        pass

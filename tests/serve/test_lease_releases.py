"""Lease releases and eviction reports between the ConversationRouter, the ingress and the
TargetWorkers (issue 53 items 5, 6 and 7), without Ray:

- a release meant for a replica that is gone lands on another, which keeps its own copy;
- a release a replica never answers holds up neither lease nor claim expiry;
- a conversation evicted while a plain completion ran reads "evicted" in the registry.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.serve import router as router_module
from dlite_ray.serve.config import AppArgs
from dlite_ray.serve.conversation_store import EVICTED, PAUSED
from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.worker_messages import GenerateChunk
from tests.serve.local_handles import AsgiClient, LocalHandle, local_args, target_worker, tiny_engine

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


# -- item 6: a release that never returns ---------------------------------------------------------
class HungWorker:
    """A TargetWorker at its max_ongoing_requests: a release queues and never returns."""

    def __init__(self):
        self.releases: list[tuple[str, str | None]] = []

    async def release_lease(self, conversation: str, route_to: str | None = None, strict: bool = True) -> str:
        self.releases.append((conversation, route_to))
        await asyncio.Event().wait()
        return "never"


def test_a_release_that_never_returns_does_not_stop_expiry(tmp_path, monkeypatch):
    monkeypatch.setattr(router_module, "RELEASE_TIMEOUT_S", 0.05)
    worker = HungWorker()
    args = AppArgs(conversations={"store_path": str(tmp_path / "c.db")})
    router = ConversationRouter(LocalHandle(worker), args, live_actors=lambda: None)
    store = router.store
    t = time.time()
    leased = [store.create("a", HELLO) for _ in range(2)]
    for conv in leased:
        store.begin_turn("a", conv.id, [], claim_s=30, now=t)
        store.finish_turn("a", conv.id, 1, "hi", "hung-replica", 1)
    claimed = store.create("a", HELLO)
    store.begin_turn("a", claimed.id, [], claim_s=30, now=t)

    async def main() -> None:
        await router.expire_round(now=t + 10)  # both leases ended; the claim has not
        await router.expire_round(now=t + 40)  # the claim ended: this round runs too

    asyncio.run(asyncio.wait_for(main(), 60))  # (a hung round fails the test here instead of hanging it)
    assert {c for c, _ in worker.releases} == {c.id for c in leased}  # both were asked, at once
    assert {store.get("a", c.id).state for c in [*leased, claimed]} == {EVICTED}


# -- item 7: evicted by a plain completion ---------------------------------------------------------
class EvictingWorker:
    """A TargetWorker whose plain reply gave up a conversation's KV under memory pressure."""

    def __init__(self, replica: str):
        self.replica, self.evicts = replica, []

    async def generate(self, prompt, params, **_routing):
        yield GenerateChunk([1], "x", finished=True, finish_reason="stop", replica=self.replica,
                            evicted=self.evicts)


@pytest.mark.parametrize("stream", [False, True])
def test_a_conversation_evicted_by_a_plain_completion_reads_evicted(tmp_path, stream):
    args = local_args(tmp_path, {"tenant-a": "key-a"})
    worker = EvictingWorker("r1")
    router = ConversationRouter(LocalHandle(worker), args, live_actors=lambda: None)
    conv = router.store.create("tenant-a", HELLO)
    router.store.begin_turn("tenant-a", conv.id, [])
    router.store.finish_turn("tenant-a", conv.id, 1, "hi", "r1", 300)
    worker.evicts = [conv.id]

    async def main() -> int:
        from dlite_ray.serve.ingress import DLiteIngress

        client = AsgiClient(DLiteIngress(LocalHandle(worker), LocalHandle(router), args))
        r = await client.post("/v1/completions", {"prompt": "other traffic", "max_tokens": 1, "stream": stream},
                              headers={"authorization": "Bearer key-a"})
        await r.read()
        return r.status

    assert router.store.get("tenant-a", conv.id).state == PAUSED
    assert asyncio.run(main()) == 200
    after = router.store.get("tenant-a", conv.id)
    assert after.state == EVICTED and after.replica is None  # its next turn re-prefills from history

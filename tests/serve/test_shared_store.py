"""Two ConversationRouters over one PostgreSQL database (issue 56): what one router writes
the other serves, and a tenant creating conversations as fast as it can through both is
stopped at its cap (429 naming the limit) while another tenant's turns go on; the routers'
background rounds delete what is idle past the retention and tell the holding replica."""

from __future__ import annotations

import asyncio
import time

import pytest

from dlite_ray.serve.conversation_store import EVICTED
from dlite_ray.serve.errors import ConversationNotFound
from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.worker_messages import GenerateChunk
from tests.serve.local_handles import AsgiClient, LocalHandle, local_args

KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
AUTH = {t: {"authorization": f"Bearer {k}"} for t, k in KEYS.items()}
HELLO = [{"role": "user", "content": "hello"}]
CAP = 5
FLOOD = 40


class ReplyWorker:
    def __init__(self):
        self.releases: list[tuple[str, str | None]] = []

    async def generate(self, prompt, params, **_routing):
        yield GenerateChunk([1], "ok", finished=True, finish_reason="stop", replica="r1")

    async def release_lease(self, conversation: str, route_to: str | None = None, strict: bool = True) -> str:
        self.releases.append((conversation, route_to))
        return "released"


def _routers(tmp_path, url: str, n: int = 2, **conversations) -> tuple[list[ConversationRouter], ReplyWorker, object]:
    args = local_args(tmp_path, KEYS)
    args.conversations.store_url = url
    args.conversations.max_conversations_per_tenant = CAP
    for name, value in conversations.items():
        setattr(args.conversations, name, value)
    worker = ReplyWorker()
    return [ConversationRouter(LocalHandle(worker), args, live_actors=lambda: None) for _ in range(n)], worker, args


def test_a_flooding_tenant_stops_at_its_cap_across_both_routers_and_another_goes_on(tmp_path, database):
    from dlite_ray.serve.ingress import DLiteIngress

    routers, worker, args = _routers(tmp_path, database)
    # one ingress per router: tenant-a's creates reach the database through both at once
    clients = [AsgiClient(DLiteIngress(LocalHandle(worker), LocalHandle(r), args)) for r in routers]

    async def create(i: int, tenant: str) -> int:
        r = await clients[i % 2].post("/v1/conversations", {"messages": HELLO}, headers=AUTH[tenant])
        body = await r.json()
        if r.status == 429:
            assert f"max_conversations_per_tenant = {CAP}" in body["error"]["message"]
        return r.status

    async def b_turns() -> tuple[str, list[int]]:
        r = await clients[0].post("/v1/conversations", {"messages": HELLO}, headers=AUTH["tenant-b"])
        cid = (await r.json())["id"]
        statuses = []
        for i in range(4):  # each turn through the other router than the last
            t = await clients[i % 2].post(f"/v1/conversations/{cid}/messages",
                                          {"messages": [{"role": "user", "content": f"turn {i}"}], "max_tokens": 2},
                                          headers=AUTH["tenant-b"])
            await t.read()
            statuses.append(t.status)
        return cid, statuses

    async def main():
        flood = asyncio.gather(*(create(i, "tenant-a") for i in range(FLOOD)))
        return await asyncio.gather(flood, b_turns())

    created, (b_id, b_statuses) = asyncio.run(main())
    assert sorted(created) == [200] * CAP + [429] * (FLOOD - CAP)
    assert b_statuses == [200] * 4
    history = routers[1].store.get("tenant-b", b_id).messages
    assert [m["content"] for m in history] == ["hello"] + [x for i in range(4) for x in (f"turn {i}", "ok")]


def test_the_retention_round_deletes_idle_conversations_and_releases_their_kv(tmp_path, database):
    # a lease longer than the idle time: the retention, not the lease's end, lets r1's copy go
    (router, other), worker, _ = _routers(tmp_path, database, retention_days=1.0, max_lease_s=1e7)

    async def main():
        idle = await router.create("tenant-a", HELLO)
        turn = await router.begin_turn("tenant-a", idle["id"], [])
        await router.finish_turn("tenant-a", idle["id"], turn["version"], "hi", "r1", 10**7)  # pinned on r1
        later = time.time() + 2 * 86400  # two days on: idle past a one-day retention
        recent = await other.create("tenant-a", HELLO)
        other.store.begin_turn("tenant-a", recent["id"], [], now=later - 3600)  # its last use, an hour before
        await asyncio.gather(router.expire_round(now=later), other.expire_round(now=later))
        return idle["id"], recent["id"]

    idle_id, recent_id = asyncio.run(main())
    assert worker.releases == [(idle_id, "r1")]  # once, though both routers ran the round
    with pytest.raises(ConversationNotFound):
        other.store.get("tenant-a", idle_id)
    assert router.store.get("tenant-a", recent_id).state == EVICTED  # its claim ended; it is kept

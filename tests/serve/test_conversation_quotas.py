"""Per-tenant caps on stored conversations and history bytes (issue 53 item 10): a tenant
at a cap is refused with HTTP 429 / gRPC RESOURCE_EXHAUSTED naming the limit, while
another tenant still creates conversations and takes turns. The caps live in the
conversation store (enforced with the write they guard); here through the real ingress,
router and store, over a worker that answers every turn with one chunk."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dlite_ray.serve.conversation_store import ConversationStore, TenantQuota
from dlite_ray.serve.errors import QuotaExceeded
from dlite_ray.serve.proto import dlite_pb2
from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.worker_messages import GenerateChunk
from tests.serve.local_handles import AsgiClient, LocalGrpc, LocalHandle, local_args

KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
AUTH = {t: {"authorization": f"Bearer {k}"} for t, k in KEYS.items()}
HELLO = [{"role": "user", "content": "hello"}]
MAX_CONVERSATIONS, MAX_BYTES = 2, 4096


class ReplyWorker:
    async def generate(self, prompt, params, **_routing):
        yield GenerateChunk([1], "ok", finished=True, finish_reason="stop", replica="r1")


def _app(tmp_path):
    from dlite_ray.serve.ingress import DLiteIngress

    args = local_args(tmp_path, KEYS)
    args.conversations.max_conversations_per_tenant = MAX_CONVERSATIONS
    args.conversations.max_stored_bytes_per_tenant = MAX_BYTES
    worker = LocalHandle(ReplyWorker())
    ingress = DLiteIngress(worker, LocalHandle(ConversationRouter(worker, args, live_actors=lambda: None)), args)
    return AsgiClient(ingress), LocalGrpc(ingress)


async def _create(http: AsgiClient, tenant: str, messages=HELLO) -> tuple[int, dict]:
    r = await http.post("/v1/conversations", {"messages": messages}, headers=AUTH[tenant])
    return r.status, await r.json()


async def _turn(http: AsgiClient, tenant: str, cid: str, content: str = "and then?") -> tuple[int, dict]:
    r = await http.post(f"/v1/conversations/{cid}/messages",
                        {"messages": [{"role": "user", "content": content}], "max_tokens": 4}, headers=AUTH[tenant])
    return r.status, await r.json()


def test_a_tenant_at_its_conversation_cap_is_refused_and_another_is_not(tmp_path):
    http, rpc = _app(tmp_path)

    async def main():
        created = [await _create(http, "tenant-a") for _ in range(MAX_CONVERSATIONS)]
        over = await _create(http, "tenant-a")
        _, over_grpc = await rpc.unary("CreateConversation", dlite_pb2.CreateConversationRequest(
            messages=[dlite_pb2.Message(**m) for m in HELLO]), (("authorization", "Bearer key-a"),))
        b_status, b_conv = await _create(http, "tenant-b")
        b_turn = await _turn(http, "tenant-b", b_conv["id"])
        a_turn = await _turn(http, "tenant-a", created[0][1]["id"])  # its existing ones still work
        deleted = await http.delete(f"/v1/conversations/{created[0][1]['id']}", headers=AUTH["tenant-a"])
        await deleted.read()
        after_delete = await _create(http, "tenant-a")
        return created, over, over_grpc, b_status, b_turn, a_turn, after_delete

    created, over, over_grpc, b_status, b_turn, a_turn, after_delete = asyncio.run(main())
    assert [status for status, _ in created] == [200] * MAX_CONVERSATIONS
    status, body = over
    assert status == 429 and "max_conversations_per_tenant" in body["error"]["message"]
    assert over_grpc.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_conversations_per_tenant" in over_grpc.details
    assert b_status == 200 and b_turn[0] == 200 and b_turn[1]["message"]["content"] == "ok"
    assert a_turn[0] == 200
    assert after_delete[0] == 200  # a deleted conversation frees its place


def test_a_tenant_at_its_byte_cap_is_refused_and_another_is_not(tmp_path):
    http, _ = _app(tmp_path)
    big = "x" * (MAX_BYTES // 2)

    async def main():
        a_status, a_conv = await _create(http, "tenant-a", [{"role": "user", "content": big}])
        too_big_turn = await _turn(http, "tenant-a", a_conv["id"], big)
        too_big_create = await _create(http, "tenant-a", [{"role": "user", "content": big}])
        b_status, b_conv = await _create(http, "tenant-b", [{"role": "user", "content": big}])
        b_turn = await _turn(http, "tenant-b", b_conv["id"])
        a_history = await http.get(f"/v1/conversations/{a_conv['id']}", headers=AUTH["tenant-a"])
        return a_status, too_big_turn, too_big_create, b_status, b_turn, await a_history.json()

    a_status, too_big_turn, too_big_create, b_status, b_turn, a_history = asyncio.run(main())
    assert a_status == 200
    for status, body in (too_big_turn, too_big_create):
        assert status == 429 and "max_stored_bytes_per_tenant" in body["error"]["message"]
    assert a_history["messages"] == [{"role": "user", "content": big}]  # the refused turn appended nothing
    assert b_status == 200 and b_turn[0] == 200


def test_the_caps_hold_in_the_store_itself(tmp_path):
    """Any caller of the store (any backend behind its contract) meets the caps."""
    store = ConversationStore(tmp_path / "c.db", TenantQuota(max_conversations=1, max_stored_bytes=10_000))
    store.create("a", HELLO)
    with pytest.raises(QuotaExceeded, match="max_conversations_per_tenant"):
        store.create("a", HELLO)
    store.create("b", HELLO)
    reopened = ConversationStore(tmp_path / "c.db", TenantQuota(max_conversations=1))  # counted from the file
    with pytest.raises(QuotaExceeded):
        reopened.create("a", HELLO)

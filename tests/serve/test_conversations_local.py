"""Conversations without Ray: the real DLiteIngress, ConversationRouter (SQLite under
tmp_path) and TargetWorker (a tiny random model, in-process draft) over local handles.
A turn at T = 0 answers as the library engine does for the conversation's whole history."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest

from dlite_ray.serve.proto import dlite_pb2
from tests.serve.local_handles import GrpcContext, LocalApp, local_args, tiny_engine

KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
AUTH_A, AUTH_B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
GRPC_A, GRPC_B = (("authorization", "Bearer key-a"),), (("authorization", "Bearer key-b"),)
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
TOOL_RESULT = {"role": "tool", "content": "result: 42"}
NEW = 16


@pytest.fixture(scope="module")
def library(tiny_serving_model):
    return tiny_engine(tiny_serving_model)


@pytest.fixture(scope="module")
def served_engine(tiny_serving_model):
    return tiny_engine(tiny_serving_model)


@pytest.fixture
def app(served_engine, tmp_path):
    local = LocalApp(local_args(tmp_path, KEYS), served_engine)
    yield local
    local.close()


def _expected(library, history: list[dict]) -> str:
    return library.generate(history, max_new_tokens=NEW)[0].text


async def _create(app: LocalApp, messages=MESSAGES) -> str:
    r = await app.http.post("/v1/conversations", {"messages": messages}, headers=AUTH_A)
    assert r.status == 200
    return (await r.json())["id"]


async def _turn(app: LocalApp, cid: str, body: dict, headers=AUTH_A) -> tuple[int, dict]:
    r = await app.http.post(f"/v1/conversations/{cid}/messages", {"max_tokens": NEW, **body}, headers=headers)
    return r.status, await r.json()


async def _get(app: LocalApp, cid: str, headers=AUTH_A) -> tuple[int, dict]:
    r = await app.http.get(f"/v1/conversations/{cid}", headers=headers)
    return r.status, await r.json()


def test_a_conversation_over_http_answers_as_the_library_engine(app, library):
    async def go():
        cid = await _create(app)
        first = await _turn(app, cid, {})
        second = await _turn(app, cid, {"messages": [TOOL_RESULT]})
        stored = await _get(app, cid)
        held = cid in app.worker.async_engine.held_leases  # its KV pinned between turns (the lease)
        other = await _get(app, cid, AUTH_B)
        deleted = await (await app.http.delete(f"/v1/conversations/{cid}", headers=AUTH_A)).json()
        gone = await _get(app, cid)
        return cid, first, second, stored, held, other, deleted, gone

    cid, (s1, first), (s2, second), (_, stored), held, other, deleted, gone = asyncio.run(go())
    reply1 = _expected(library, MESSAGES)
    reply2 = _expected(library, MESSAGES + [{"role": "assistant", "content": reply1}, TOOL_RESULT])
    assert (s1, s2) == (200, 200)
    assert first["message"] == {"role": "assistant", "content": reply1} and first["conversation_id"] == cid
    assert second["message"]["content"] == reply2 and second["replica"] == "local"
    assert second["stats"]["cached_prompt_tokens"] > 0  # the history's KV was reused
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert stored["messages"][-1]["content"] == reply2
    assert (stored["version"], stored["state"]) == (2, "paused") and "claim_holder" not in stored
    assert held
    assert other[0] == 404 and other[1]["error"]["type"] == "not_found_error"  # another tenant's
    assert deleted == {"deleted": True} and gone[0] == 404
    deadline = time.time() + 10  # the delete unpins its KV on the worker (between engine steps)
    while cid in app.worker.async_engine.held_leases:
        assert time.time() < deadline, "the deleted conversation's KV stayed pinned"
        time.sleep(0.05)


def test_a_turn_retried_with_its_idempotency_key_is_stored_once(app):
    keyed = {**AUTH_A, "idempotency-key": "turn-1"}

    async def go():
        cid = await _create(app, [{"role": "system", "content": "s"}])
        body = {"messages": MESSAGES}
        first = await _turn(app, cid, body, keyed)
        again = await _turn(app, cid, body, keyed)
        _, stored = await _get(app, cid)
        other = await _turn(app, cid, {"messages": [{"role": "user", "content": "else"}]}, keyed)
        too_long_key = await _turn(app, cid, body, {**AUTH_A, "idempotency-key": "k" * 300})
        return first, again, stored, other, too_long_key

    (s1, first), (s2, again), stored, other, too_long_key = asyncio.run(go())
    assert s1 == s2 == 200
    assert again["message"] == first["message"] and again["finish_reason"] == first["finish_reason"]
    assert first["stats"] and again["stats"] == {}  # replayed from the store: nothing generated
    assert [m["role"] for m in stored["messages"]] == ["system", "user", "assistant"] and stored["version"] == 1
    assert other[0] == 400  # the same key for other messages
    assert too_long_key[0] == 400


def test_an_unservable_turn_is_refused_before_anything_is_appended(app, library):
    too_long = {"role": "user", "content": "word " * 2000}  # beyond the tiny model's 512 positions

    async def go():
        cid = await _create(app)
        refused = [await _turn(app, cid, {"messages": [too_long]}) for _ in range(2)]  # a client retrying
        _, stored = await _get(app, cid)
        after = await _turn(app, cid, {})
        return refused, stored, after

    refused, stored, (status, after) = asyncio.run(go())
    for code, body in refused:
        assert code == 400 and "context" in body["error"]["message"], body
    assert [m["role"] for m in stored["messages"]] == ["user"] and stored["state"] != "generating"
    assert status == 200 and after["message"]["content"] == _expected(library, MESSAGES)


def test_one_turn_at_a_time_and_malformed_turns_are_client_errors(app):
    async def go():
        cid = await _create(app)
        running = app.ingress.AppendAndGenerate(dlite_pb2.AppendRequest(conversation_id=cid, max_tokens=NEW),
                                                GrpcContext(GRPC_A))
        await anext(running)  # a turn is generating
        busy = await _turn(app, cid, {"messages": [TOOL_RESULT]})
        rest = [c async for c in running]
        malformed = []
        for body in ([1, 2], "hi", {"lease_seconds": "soon"}, {"messages": [{"role": "wizard", "content": "x"}]}):
            r = await app.http.post(f"/v1/conversations/{cid}/messages", body, headers=AUTH_A)
            malformed.append(r.status)
        created = await app.http.post("/v1/conversations", [1, 2], headers=AUTH_A)
        _, stored = await _get(app, cid)
        return busy, rest, malformed, created.status, stored

    (busy, body), rest, malformed, created, stored = asyncio.run(go())
    assert busy == 409 and body["error"]["type"] == "conflict_error"
    assert rest[-1].finish_reason  # the running turn finished regardless
    assert malformed == [400] * 4 and created == 400
    assert stored["version"] == 1 and [m["role"] for m in stored["messages"]] == ["user", "assistant"]


def test_a_tool_loop_over_grpc_conversations(app, library):
    async def go():
        conv, ok = await app.grpc.unary("CreateConversation", dlite_pb2.CreateConversationRequest(
            messages=[dlite_pb2.Message(**m) for m in MESSAGES]), GRPC_A)
        cid = conv.conversation_id
        first, _ = await app.grpc.stream("AppendAndGenerate", dlite_pb2.AppendRequest(
            conversation_id=cid, max_tokens=NEW), GRPC_A)
        second, _ = await app.grpc.stream("AppendAndGenerate", dlite_pb2.AppendRequest(
            conversation_id=cid, messages=[dlite_pb2.Message(**TOOL_RESULT)], max_tokens=NEW), GRPC_A)
        stored, _ = await app.grpc.unary("GetConversation", dlite_pb2.GetConversationRequest(conversation_id=cid),
                                         GRPC_A)
        others = [(await app.grpc.unary(method, request(conversation_id=cid), GRPC_B))[1].code
                  for method, request in (("GetConversation", dlite_pb2.GetConversationRequest),
                                          ("DeleteConversation", dlite_pb2.DeleteConversationRequest))]
        chunks, other_turn = await app.grpc.stream("AppendAndGenerate", dlite_pb2.AppendRequest(
            conversation_id=cid, max_tokens=4), GRPC_B)
        deleted, _ = await app.grpc.unary("DeleteConversation", dlite_pb2.DeleteConversationRequest(
            conversation_id=cid), GRPC_A)
        _, gone = await app.grpc.unary("GetConversation", dlite_pb2.GetConversationRequest(conversation_id=cid),
                                       GRPC_A)
        return ok.code, first, second, stored, others, (chunks, other_turn.code), deleted, gone.code

    created, first, second, stored, others, (refused, other_turn), deleted, gone = asyncio.run(go())
    assert created is None
    reply1 = library.generate(MESSAGES, max_new_tokens=NEW)[0]
    assert [t for c in first for t in c.token_ids] == reply1.token_ids
    assert "".join(c.text for c in first) == reply1.text
    history = MESSAGES + [{"role": "assistant", "content": reply1.text}, TOOL_RESULT]
    assert "".join(c.text for c in second) == _expected(library, history)
    assert second[-1].stats.cached_prompt_tokens > 0
    assert [m.role for m in stored.messages] == ["user", "assistant", "tool", "assistant"]
    assert (stored.version, stored.state) == (2, "paused")
    assert others == [grpc.StatusCode.NOT_FOUND] * 2 and other_turn == grpc.StatusCode.NOT_FOUND
    assert [c.finish_reason for c in refused] == ["error"]
    assert deleted.deleted and gone == grpc.StatusCode.NOT_FOUND


PICK = {"type": "function", "function": {"name": "pick", "description": "Pick a digit.", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"]}}}


def test_a_turn_forces_a_call_to_the_conversations_tools_with_tool_choice(app):
    """tool_choice in a turn is over the tools the conversation opened with: a named one or
    "required" decodes a call to it; a name the conversation does not offer is a 400 that
    appends nothing."""
    named = {"type": "function", "function": {"name": "pick"}}

    async def go():
        r = await app.http.post("/v1/conversations", {"messages": MESSAGES, "tools": [PICK]}, headers=AUTH_A)
        cid = (await r.json())["id"]
        forced = await _turn(app, cid, {"max_tokens": 24, "tool_choice": named})
        unknown = await _turn(app, cid, {"messages": [TOOL_RESULT], "tool_choice": {
            "type": "function", "function": {"name": "other"}}})
        _, stored = await _get(app, cid)
        required, _ = await app.grpc.stream("AppendAndGenerate", dlite_pb2.AppendRequest(
            conversation_id=cid, messages=[dlite_pb2.Message(**TOOL_RESULT)], max_tokens=24, tool_choice="required"),
            GRPC_A)
        return forced, unknown, stored, required

    (status, forced), (refused, body), stored, required = asyncio.run(go())
    assert status == 200 and forced["finish_reason"] == "tool_calls", forced
    call = forced["message"]["tool_calls"][0]["function"]
    assert call["name"] == "pick" and 0 <= json.loads(call["arguments"])["n"] <= 9
    assert refused == 400 and "tool_choice" in body["error"]["message"]
    assert [m["role"] for m in stored["messages"]] == ["system", "user", "assistant"]  # the refused turn left nothing
    assert required[-1].finish_reason == "tool_calls" and required[-1].tool_calls[0].name == "pick"

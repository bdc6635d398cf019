"""The durable conversation registry, without Ray."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import pytest

from dlite_ray.serve.config import AppArgs, LimitArgs
from dlite_ray.serve.conversation_db import LAYOUT
from dlite_ray.serve.conversation_store import EVICTED, GENERATING, PAUSED, ConversationStore, TurnOutcome
from dlite_ray.serve.errors import BadRequest, ConversationBusy, ConversationNotFound, PayloadTooLarge
from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.turn_claims import replay_chunk

HELLO = [{"role": "user", "content": "hello"}]
TOOL = [{"role": "tool", "content": "a.txt"}]


def test_a_tool_loop_turn_by_turn(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    assert len(conv.id) >= 24 and conv.state == PAUSED
    turn = store.begin_turn("a", conv.id, [])
    assert turn.state == GENERATING and turn.version == 1
    store.finish_turn("a", conv.id, 1, "call(ls)", replica="r1", lease_s=60)
    turn = store.begin_turn("a", conv.id, [{"role": "tool", "content": "a.txt"}])
    assert turn.version == 2 and [m["role"] for m in turn.messages] == ["user", "assistant", "tool"]


def test_one_generation_at_a_time(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, [])
    with pytest.raises(ConversationBusy):
        store.begin_turn("a", conv.id, [])


def test_tenants_cannot_see_each_other(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    for action in (lambda: store.get("b", conv.id), lambda: store.begin_turn("b", conv.id, []),
                   lambda: store.delete("b", conv.id)):
        with pytest.raises(ConversationNotFound):
            action()
    assert store.get("a", conv.id).messages == HELLO


def test_history_survives_a_restart_and_expiry_keeps_it(tmp_path):
    path = tmp_path / "c.db"
    store = ConversationStore(path)
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, [])
    store.finish_turn("a", conv.id, 1, "hi", replica="r1", lease_s=0.0)
    reopened = ConversationStore(path)
    expired = reopened.expire(now=10**12)
    assert [c.id for c in expired] == [conv.id]
    again = reopened.get("a", conv.id)
    assert again.state == EVICTED and again.replica is None and len(again.messages) == 2


def test_draining_a_replica_evicts_what_it_held(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    ids = [store.create("a", HELLO).id for _ in range(3)]
    for i, cid in enumerate(ids):
        store.begin_turn("a", cid, [])
        store.finish_turn("a", cid, 1, "x", replica="r1" if i < 2 else "r2", lease_s=600)
    assert store.evict_replica("r1") == 2
    assert [store.get("a", c).state for c in ids] == [EVICTED, EVICTED, PAUSED]


def test_delete_removes_history(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    store.delete("a", conv.id)
    with pytest.raises(ConversationNotFound):
        store.get("a", conv.id)


def test_holding_replicas_lists_only_paused_holders(tmp_path):
    store = ConversationStore(tmp_path / "c.sqlite3")
    a = store.create("t", [{"role": "user", "content": "hi"}])
    b = store.create("t", [{"role": "user", "content": "yo"}])
    store.begin_turn("t", a.id, [])
    store.finish_turn("t", a.id, 1, "hello", "replica-1", 60)
    store.begin_turn("t", b.id, [])  # generating: not pinned anywhere yet
    assert store.holding_replicas() == {"replica-1"}
    assert store.evict_replica("replica-1") == 1 and store.holding_replicas() == set()


# -- idempotency keys: a retried turn is not appended twice ---------------------------------------

def test_a_retried_turn_gets_its_stored_reply_instead_of_a_second_append(tmp_path):
    path = tmp_path / "c.db"
    store = ConversationStore(path)
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    store.finish_turn("a", conv.id, 1, "the reply", "r1", 60, finish_reason="length")
    # the client never saw the reply (the server shut down as it was stored) and retries
    retry = ConversationStore(path).begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    assert retry.replayed == TurnOutcome("the reply", "length")
    assert retry.version == 1 and retry.state == PAUSED
    assert [m["role"] for m in retry.messages] == ["user", "tool", "assistant"]
    assert store.get("a", conv.id).messages == retry.messages
    # a later turn with a new key runs as usual; the old key still replays its own reply
    assert store.begin_turn("a", conv.id, TOOL, idempotency_key="k2").replayed is None
    store.finish_turn("a", conv.id, 2, "second", "r1", 60)
    assert store.begin_turn("a", conv.id, TOOL, idempotency_key="k1").replayed.reply == "the reply"


def test_a_failed_keyed_turn_is_claimed_again_without_appending_its_messages_twice(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    with pytest.raises(ConversationBusy):  # still generating: the retry does not start a second one
        store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    store.abandon_turn("a", conv.id)
    again = store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    assert again.replayed is None and again.state == GENERATING and again.version == 2
    assert again.messages == HELLO + TOOL
    store.finish_turn("a", conv.id, 2, "done", None, 60)
    assert store.begin_turn("a", conv.id, TOOL, idempotency_key="k1").replayed.reply == "done"


def test_a_key_is_bound_to_its_messages_and_its_place_in_the_history(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    store.abandon_turn("a", conv.id)
    with pytest.raises(BadRequest):
        store.begin_turn("a", conv.id, HELLO, idempotency_key="k1")
    store.begin_turn("a", conv.id, [], idempotency_key="k2")  # another turn went on from here
    store.finish_turn("a", conv.id, 2, "x", None, 60)
    with pytest.raises(ConversationBusy):  # k1's failed turn was superseded
        store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    with pytest.raises(BadRequest):
        store.begin_turn("a", conv.id, TOOL, idempotency_key="k" * 256)
    with pytest.raises(ConversationNotFound):  # keys are per conversation and tenant
        store.begin_turn("b", conv.id, TOOL, idempotency_key="k2")


def test_the_router_hands_the_replayed_outcome_to_the_ingress(tmp_path):
    router = ConversationRouter(None, AppArgs(conversations={"store_path": str(tmp_path / "c.db")}))

    async def go():
        conv = await router.create("a", HELLO)
        first = await router.begin_turn("a", conv["id"], TOOL, idempotency_key="k1")
        assert first["replayed"] is None
        await router.finish_turn("a", conv["id"], first["version"], "hi", None, None, finish_reason="stop")
        retry = await router.begin_turn("a", conv["id"], TOOL, idempotency_key="k1")
        assert retry["replayed"] == {"reply": "hi", "finish_reason": "stop"}
        assert replay_chunk(retry["replayed"]).text == "hi"
        assert "replayed" not in await router.get("a", conv["id"])
        return retry

    assert len(asyncio.run(go())["messages"]) == 3


# -- the file: deleted text is overwritten; an older file is migrated in place --------------------

@pytest.fixture
def insecure_sqlite(monkeypatch):
    """Connections start with secure_delete off, as in SQLite builds without SQLITE_SECURE_DELETE
    (this one has it on by default)."""
    real_connect = sqlite3.connect

    def connect_without_secure_delete(*args, **kwargs):
        db = real_connect(*args, **kwargs)
        db.execute("PRAGMA secure_delete = OFF")
        return db

    monkeypatch.setattr(sqlite3, "connect", connect_without_secure_delete)


def test_a_deleted_conversations_text_leaves_the_file(tmp_path, insecure_sqlite):
    path = tmp_path / "c.db"
    store = ConversationStore(path)
    keep = store.create("a", [{"role": "user", "content": "keep this"}])
    small = store.create("a", [{"role": "user", "content": "SECRET-small"}])
    big = store.create("a", [{"role": "user", "content": "SECRET-big " * 2000}])  # overflow pages
    store.begin_turn("a", small.id, [{"role": "tool", "content": "SECRET-tool"}], idempotency_key="SECRET-key")
    store.finish_turn("a", small.id, 1, "SECRET-reply", None, 60)
    store.delete("a", small.id)
    store.delete("a", big.id)
    data = path.read_bytes()
    assert b"SECRET" not in data and b"keep this" in data
    assert store.get("a", keep.id).messages[0]["content"] == "keep this"


LAYOUT_0 = """
CREATE TABLE conversations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL,
    replica TEXT, lease_deadline REAL, messages TEXT NOT NULL, created REAL NOT NULL
);
CREATE INDEX by_lease ON conversations (state, lease_deadline);
"""


def test_a_file_of_the_first_layout_is_migrated_and_its_stuck_turns_end(tmp_path, insecure_sqlite):
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.executescript(LAYOUT_0)
    rows = [("stuck", "a", 3, GENERATING, "r1", None, json.dumps(HELLO), 0.0),
            ("paused", "a", 1, PAUSED, "r1", time.time() + 600, json.dumps(HELLO), 0.0),
            ("gone", "a", 1, PAUSED, None, None, json.dumps([{"role": "user", "content": "SECRET-old " * 4000}]), 0.0)]
    db.executemany("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.execute("DELETE FROM conversations WHERE id = 'gone'")
    db.close()
    assert b"SECRET-old" in path.read_bytes()

    store = ConversationStore(path)
    assert b"SECRET-old" not in path.read_bytes()  # scrubbed once, on migration
    assert store.get("a", "paused").state == PAUSED and store.get("a", "paused").replica == "r1"
    ended = store.expire_claims()  # the old router's claim, holder unknown, has ended
    assert [c.id for c in ended] == ["stuck"] and ended[0].replica == "r1"
    turn = store.begin_turn("a", "stuck", TOOL, idempotency_key="k")
    assert turn.version == 4 and turn.messages == HELLO + TOOL
    reopened = ConversationStore(path)  # the migration runs once
    assert reopened.get("a", "stuck").state == GENERATING
    assert sqlite3.connect(path).execute("PRAGMA user_version").fetchone() == (LAYOUT,)


def test_a_refused_turn_leaves_the_conversation_as_it_was(tmp_path):
    """The engine refused the turn (over the context) after begin_turn appended its messages:
    refuse_turn takes them out, the version back and the key away (a retry appends again),
    and the KV hold stays."""
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, [])
    store.finish_turn("a", conv.id, 1, "hi", "r1", 60)
    store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    assert store.refuse_turn("a", conv.id, 2, TOOL)
    after = store.get("a", conv.id)
    assert (after.messages, after.version, after.state, after.replica) == (HELLO + [
        {"role": "assistant", "content": "hi"}], 1, PAUSED, "r1")
    retry = store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    assert retry.replayed is None and retry.messages[-1] == TOOL[-1] and retry.version == 2
    assert not store.refuse_turn("a", conv.id, 1, TOOL)  # not the turn holding it: nothing changes


def test_begin_turn_refuses_a_history_over_max_prompt_chars_before_appending(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    limits = LimitArgs(max_prompt_chars=sum(len(m["content"]) for m in HELLO) + 1)
    with pytest.raises(PayloadTooLarge, match="max_prompt_chars"):
        store.begin_turn("a", conv.id, [{"role": "tool", "content": "xx"}], limits=limits)
    assert store.get("a", conv.id).messages == HELLO and store.get("a", conv.id).version == 0


def test_the_public_view_is_the_record_without_its_claim():
    """ConversationView (the typed view across Serve handles) lists the record's fields but
    the claim's holder and token: a field added to Conversation must be added to the view
    (or kept private) on purpose."""
    from dataclasses import fields

    from dlite_ray.serve.store_contract import Conversation, ConversationView

    private = {"claim_holder", "claim_token"}
    view_keys = set(ConversationView.__required_keys__) | set(ConversationView.__optional_keys__)
    assert view_keys == {f.name for f in fields(Conversation)} - private
    assert ConversationView.__optional_keys__ == frozenset({"replayed"})

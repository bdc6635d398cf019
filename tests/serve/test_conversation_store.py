"""The durable conversation registry, without Ray."""

from __future__ import annotations

import pytest

from dlite_ray.serve.conversation_store import EVICTED, GENERATING, PAUSED, ConversationStore
from dlite_ray.serve.errors import ConversationBusy, ConversationNotFound

HELLO = [{"role": "user", "content": "hello"}]


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

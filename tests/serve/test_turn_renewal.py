"""A turn's claim renewal takes the conversation back only where the claim ended without
the turn giving up (deadline passed, holder judged gone): a renewal that lands after the
turn was abandoned or refused is refused (issue 53 item 11), or every retry gets 409
until the renewed claim runs out."""

from __future__ import annotations

import time

import pytest

from dlite_ray.serve.conversation_store import EVICTED, GENERATING, ConversationStore
from dlite_ray.serve.errors import ConversationBusy

HELLO = [{"role": "user", "content": "hello"}]
TOOL = [{"role": "tool", "content": "42"}]
INGRESS = "SERVE_REPLICA::dlite#DLiteIngress#aaaa"


def test_a_renewal_after_abandon_is_refused_and_the_next_turn_proceeds(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    t = time.time()
    store.begin_turn("a", conv.id, TOOL, holder=INGRESS, claim_s=30, now=t)
    assert store.abandon_turn("a", conv.id, version=1)
    with pytest.raises(ConversationBusy):  # the renewer's last call, landing late
        store.renew_turn("a", conv.id, 1, 30, now=t + 1)
    assert store.get("a", conv.id).state == EVICTED
    retry = store.begin_turn("a", conv.id, [], holder=INGRESS, claim_s=30, now=t + 2)  # no 409
    assert retry.version == 2 and retry.state == GENERATING


def test_a_renewal_after_a_refused_turn_is_refused(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, [], claim_s=30)
    store.finish_turn("a", conv.id, 1, "hi", "r1", 60)
    store.begin_turn("a", conv.id, TOOL, claim_s=30)
    assert store.refuse_turn("a", conv.id, 2, TOOL)
    with pytest.raises(ConversationBusy):
        store.renew_turn("a", conv.id, 2, 30)


@pytest.mark.parametrize("ended_by", ["deadline", "holder gone"])
def test_a_claim_that_ended_without_giving_up_is_renewed(tmp_path, ended_by):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    t = time.time()
    store.begin_turn("a", conv.id, [], holder=INGRESS, claim_s=30, now=t)
    ended = store.expire_claims(now=t + 31) if ended_by == "deadline" else store.release_holder(INGRESS)
    assert [c.id for c in ended] == [conv.id] and store.get("a", conv.id).state == EVICTED
    assert store.renew_turn("a", conv.id, 1, 30, now=t + 32) == t + 62
    assert store.get("a", conv.id).state == GENERATING

"""The conversation store's contract (store_contract), the same tests on both backends: a
SQLite file and a real PostgreSQL server that the suite starts itself (postgres_server).

Two store objects on one file or one database stand for two router replicas: what one
writes the other reads, and of two claims on one conversation exactly one wins, by a
compare-and-set in the database (no lock of this process is shared between them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from dlite_ray.serve.conversation_store import EVICTED, GENERATING, PAUSED, TenantQuota, TurnOutcome, open_store
from dlite_ray.serve.errors import BadRequest, ConversationBusy, ConversationNotFound, QuotaExceeded
from dlite_ray.serve.sql_store import SqlConversationStore
from tests.serve.postgres_server import PostgresServer

HELLO = [{"role": "user", "content": "hello"}]
TOOL = [{"role": "tool", "content": "a.txt"}]
RACERS = 8
INTERLOPER_GRACE_S = 2.0  # what an interloper that is not kept waiting needs, many times over (_interleaved)


Opener = Callable[..., SqlConversationStore]


@pytest.fixture(params=["sqlite", "postgresql"])
def open_same(request, tmp_path) -> Opener:
    """`open_same(quota=None)`: a new store object on this test's file or database (a new
    connection: another router replica)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'c.db'}"
    else:
        server: PostgresServer = request.getfixturevalue("postgres")
        url = server.new_database()
    opened: list[SqlConversationStore] = []

    def make(quota: TenantQuota | None = None) -> SqlConversationStore:
        store = open_store(url, quota)
        assert isinstance(store, SqlConversationStore)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def test_a_tool_loop_turn_by_turn_reads_the_same_from_another_replica(open_same):
    store, other = open_same(), open_same()
    conv = store.create("a", HELLO)
    assert len(conv.id) >= 24 and conv.state == PAUSED and conv.version == 0
    turn = store.begin_turn("a", conv.id, [])
    assert turn.state == GENERATING and turn.version == 1
    store.finish_turn("a", conv.id, 1, "call(ls)", replica="r1", lease_s=60)
    turn = other.begin_turn("a", conv.id, TOOL)
    assert turn.version == 2 and [m["role"] for m in turn.messages] == ["user", "assistant", "tool"]
    other.finish_turn("a", conv.id, 2, "done", replica="r2", lease_s=60)
    seen = store.get("a", conv.id)
    assert (seen.state, seen.replica, seen.version, seen.messages[-1]["content"]) == (PAUSED, "r2", 2, "done")


def test_tenants_cannot_see_each_other_and_delete_removes_the_history(open_same):
    store = open_same()
    conv = store.create("a", HELLO)
    for action in (lambda: store.get("b", conv.id), lambda: store.begin_turn("b", conv.id, []),
                   lambda: store.delete("b", conv.id)):
        with pytest.raises(ConversationNotFound):
            action()
    assert store.get("a", conv.id).messages == HELLO
    store.delete("a", conv.id)
    with pytest.raises(ConversationNotFound):
        open_same().get("a", conv.id)


def test_one_turn_at_a_time_until_its_claim_ends(open_same):
    store = open_same()
    conv = store.create("a", HELLO)
    t = time.time()
    store.begin_turn("a", conv.id, [], claim_s=60, now=t)
    with pytest.raises(ConversationBusy):
        store.begin_turn("a", conv.id, [], now=t + 59)
    taken = open_same().begin_turn("a", conv.id, TOOL, now=t + 61)  # the claim's deadline passed
    assert taken.version == 2 and taken.messages == HELLO + TOOL


def test_of_concurrent_claims_from_many_replicas_exactly_one_wins(open_same):
    stores = [open_same() for _ in range(RACERS)]
    conv = stores[0].create("a", HELLO)
    start = threading.Barrier(RACERS)
    won: list[int] = []
    busy: list[int] = []

    def claim(i: int) -> None:
        start.wait()
        try:
            stores[i].begin_turn("a", conv.id, [{"role": "tool", "content": str(i)}])
            won.append(i)
        except ConversationBusy:
            busy.append(i)

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(RACERS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(won) == 1 and len(busy) == RACERS - 1
    after = stores[0].get("a", conv.id)
    assert after.version == 1 and after.messages == HELLO + [{"role": "tool", "content": str(won[0])}]


def _interleaved(open_same: Opener, hook_name: str, interloper: Callable[[SqlConversationStore], None],
                 quota: TenantQuota | None = None) -> tuple[SqlConversationStore, list[BaseException]]:
    """A store whose first `hook_name` step (after it read, before it wrote) lets another
    replica run `interloper` in a thread, given INTERLOPER_GRACE_S to finish. On PostgreSQL
    a read locks nothing, so a claim's interloper finishes first and this write must find
    the row changed; a quota check's waits on the tenant's lock. On SQLite every interloper
    waits for this write transaction to end. Either way exactly one of the two wins."""
    other = open_same(quota)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            interloper(other)
        except Exception as exc:  # noqa: BLE001 - the test reads which one lost
            failures.append(exc)

    store = open_same(quota)
    step = getattr(store, hook_name)

    def hooked(*args, **kwargs):
        out = step(*args, **kwargs)
        if not threads:  # the first time only: the retry after a lost compare-and-set reads anew
            threads.append(threading.Thread(target=run))
            threads[0].start()
            threads[0].join(INTERLOPER_GRACE_S)
        return out

    threads: list[threading.Thread] = []
    setattr(store, hook_name, hooked)  # this object's step only: the interloper's is untouched
    store._joined = threads  # type: ignore[attr-defined]
    return store, failures


def _join(store: SqlConversationStore) -> None:
    for th in store._joined:  # type: ignore[attr-defined]
        th.join()


def test_a_claim_whose_row_changed_after_its_read_does_not_win(open_same):
    conv = open_same().create("a", HELLO)
    store, interloper_failed = _interleaved(open_same, "_load_for_write",
                                            lambda other: other.begin_turn("a", conv.id, [{"role": "tool",
                                                                                           "content": "other"}]))
    mine_failed = None
    try:
        store.begin_turn("a", conv.id, [{"role": "tool", "content": "mine"}])
    except ConversationBusy as exc:
        mine_failed = exc
    _join(store)
    outcomes = [mine_failed is None, not interloper_failed]
    assert outcomes.count(True) == 1, (mine_failed, interloper_failed)
    after = store.get("a", conv.id)
    assert after.version == 1 and len(after.messages) == 2


def test_a_quota_check_that_another_replica_raced_still_holds(open_same):
    quota = TenantQuota(max_conversations=1)
    store, interloper_failed = _interleaved(open_same, "_check_quota", lambda other: other.create("a", HELLO),
                                            quota)
    store.create("a", HELLO)
    _join(store)
    assert len(interloper_failed) == 1 and isinstance(interloper_failed[0], QuotaExceeded)


def test_quotas_on_conversations_and_bytes_name_their_limit(open_same):
    store = open_same(TenantQuota(max_conversations=2, max_stored_bytes=200))
    first = store.create("a", HELLO)
    store.create("a", HELLO)
    with pytest.raises(QuotaExceeded, match="max_conversations_per_tenant = 2"):
        store.create("a", HELLO)
    other_tenant = store.create("b", HELLO)  # another tenant is unaffected
    with pytest.raises(QuotaExceeded, match="max_stored_bytes_per_tenant = 200"):
        store.begin_turn("a", first.id, [{"role": "tool", "content": "x" * 200}])
    assert store.get("a", first.id).messages == HELLO and store.get("a", first.id).version == 0
    store.begin_turn("b", other_tenant.id, TOOL)
    store.delete("a", first.id)  # a deleted conversation frees its place, counted by a new replica
    open_same(TenantQuota(max_conversations=2)).create("a", HELLO)


def test_an_idempotent_retry_replays_a_finished_turn_and_reclaims_a_failed_one(open_same):
    store = open_same()
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    with pytest.raises(ConversationBusy):  # still generating: the retry does not start a second one
        store.begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    assert store.abandon_turn("a", conv.id)
    again = open_same().begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    assert again.replayed is None and again.version == 2 and again.messages == HELLO + TOOL
    store.finish_turn("a", conv.id, 2, "done", "r1", 60, finish_reason="length")
    replay = open_same().begin_turn("a", conv.id, TOOL, idempotency_key="k1")
    assert replay.replayed == TurnOutcome("done", "length") and replay.version == 2 and replay.state == PAUSED
    with pytest.raises(BadRequest):
        store.begin_turn("a", conv.id, HELLO, idempotency_key="k1")  # the key is bound to its messages
    store.begin_turn("a", conv.id, [], idempotency_key="k2")
    assert store.refuse_turn("a", conv.id, 3, [])
    assert store.begin_turn("a", conv.id, [], idempotency_key="k2").version == 3  # a refused turn's key is forgotten


def test_a_refused_turn_leaves_the_conversation_as_it_was(open_same):
    store = open_same()
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, [])
    store.finish_turn("a", conv.id, 1, "hi", "r1", 60)
    store.begin_turn("a", conv.id, TOOL)
    assert not store.refuse_turn("a", conv.id, 1, TOOL)  # not the turn holding it
    assert store.refuse_turn("a", conv.id, 2, TOOL)
    after = store.get("a", conv.id)
    assert (after.messages[-1]["content"], after.version, after.state, after.replica) == ("hi", 1, PAUSED, "r1")


def test_claims_end_by_deadline_or_lost_holder_and_a_late_renewal_after_abandon_is_refused(open_same):
    store = open_same()
    a, b, c = (store.create("a", HELLO) for _ in range(3))
    t = time.time()
    store.begin_turn("a", a.id, [], holder="h1", claim_s=30, now=t)
    store.begin_turn("a", b.id, [], holder="h2", claim_s=300, now=t)
    store.begin_turn("a", c.id, [], holder="h2", claim_s=30, now=t)
    assert store.claim_holders() == {"h1", "h2"}
    assert store.renew_turn("a", c.id, 1, 30, now=t + 20) == t + 50
    assert [x.id for x in store.expire_claims(now=t + 31)] == [a.id]  # c was renewed
    assert {x.id for x in open_same().release_holder("h2")} == {b.id, c.id}
    assert store.claim_holders() == set()
    assert store.renew_turn("a", a.id, 1, 30, now=t + 40) == t + 70  # ended without giving up: taken back
    assert store.abandon_turn("a", a.id, version=1)
    with pytest.raises(ConversationBusy):
        store.renew_turn("a", a.id, 1, 30, now=t + 41)
    assert store.get("a", a.id).state == EVICTED


def test_leases_expire_and_a_gone_replica_holds_nothing(open_same):
    store = open_same()
    ids = [store.create("a", HELLO).id for _ in range(4)]
    for i, cid in enumerate(ids):
        store.begin_turn("a", cid, [])
        store.finish_turn("a", cid, 1, "x", replica="r1" if i < 2 else "r2", lease_s=600 if i else 0.0)
    ended = store.expire(now=time.time() + 1)
    assert [(x.id, x.replica) for x in ended] == [(ids[0], "r1")]  # returned as they were
    assert store.holding_replicas() == {"r1", "r2"}
    assert open_same().evict_replica("r1") == 1
    assert store.mark_evicted([ids[2], ids[3]], "r2") == 2 and store.mark_evicted([ids[2]], "r2") == 0
    assert store.holding_replicas() == set()
    assert [store.get("a", c).state for c in ids] == [EVICTED] * 4
    assert all(len(store.get("a", c).messages) == 2 for c in ids)  # histories kept


def test_retention_deletes_conversations_idle_past_it_and_never_a_generating_one(open_same):
    store = open_same()
    t = time.time()
    idle = store.create("a", HELLO)
    store.begin_turn("a", idle.id, TOOL, idempotency_key="k")
    store.finish_turn("a", idle.id, 1, "old", "r1", 600)
    generating = store.create("a", HELLO)
    store.begin_turn("a", generating.id, [], claim_s=10**9)
    recent = store.create("a", HELLO)
    store.begin_turn("a", recent.id, [], claim_s=30, now=t + 60)  # its last use
    store.expire_claims(now=t + 100)  # expiry is not a use
    deleted = open_same().delete_idle(idle_s=50, now=t + 100)
    assert [(c.id, c.replica) for c in deleted] == [(idle.id, "r1")]
    with pytest.raises(ConversationNotFound):
        store.get("a", idle.id)
    assert store.get("a", generating.id).state == GENERATING and store.get("a", recent.id).state == EVICTED


def test_health_says_reachable_with_a_latency_until_the_store_is_gone(open_same):
    store = open_same()
    health = store.health()
    assert health.reachable and health.latency_s is not None and health.latency_s >= 0
    assert health.backend == store.backend and health.error is None
    store.close()
    gone = store.health()
    assert not gone.reachable and gone.latency_s is None and gone.error


def test_a_claim_and_a_finish_repeated_after_their_answers_were_lost_change_nothing_twice(open_same):
    """A router replica that died after the store took the call: the ingress calls again,
    through another replica (conversation_turn._through_router)."""
    store = open_same()
    conv = store.create("a", HELLO)
    store.begin_turn("a", conv.id, TOOL, claim_token="request-1")
    again = open_same().begin_turn("a", conv.id, TOOL, claim_token="request-1")  # its own claim, back
    assert (again.version, again.state, again.messages) == (1, GENERATING, HELLO + TOOL)
    with pytest.raises(ConversationBusy):  # another request's claim is refused as ever
        store.begin_turn("a", conv.id, TOOL, claim_token="request-2")
    store.finish_turn("a", conv.id, 1, "the reply", "r1", 60)
    repeated = open_same().finish_turn("a", conv.id, 1, "the reply", "r1", 60)
    assert repeated.messages == HELLO + TOOL + [{"role": "assistant", "content": "the reply"}]
    assert store.get("a", conv.id).messages == repeated.messages
    assert store.begin_turn("a", conv.id, [], claim_token="request-1").version == 2  # a finished claim is gone

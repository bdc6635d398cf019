"""A turn that loses its holder never leaves its conversation "generating" for good: the
claim ends at its deadline or as soon as the router finds its holder gone, across restarts,
and the conversation is usable again with its history, without a DELETE."""

from __future__ import annotations

import asyncio
import time

import pytest

from dlite_ray.serve.config import AppArgs
from dlite_ray.serve.conversation_store import EVICTED, GENERATING, PAUSED, ConversationStore
from dlite_ray.serve.errors import ConversationBusy
from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.turn_claims import UNRENEWED_CLAIM_S, holder_gone, renewed

HELLO = [{"role": "user", "content": "hello"}]
TOOL = [{"role": "tool", "content": "42"}]
INGRESS_1 = "SERVE_REPLICA::dlite#DLiteIngress#aaaa"
INGRESS_2 = "SERVE_REPLICA::dlite#DLiteIngress#bbbb"


def _router(path, live: set[str]) -> ConversationRouter:
    args = AppArgs(conversations={"store_path": str(path)})
    return ConversationRouter(None, args, live_actors=lambda: set(live))


def test_a_turn_whose_holder_died_frees_the_conversation_on_the_next_turn(tmp_path, monkeypatch):
    monkeypatch.setattr("dlite_ray.serve.router.LIVENESS_CACHE_S", 0.0)  # no cached view of who lives
    live = {INGRESS_1, INGRESS_2}
    router = _router(tmp_path / "c.db", live)

    async def go():
        conv = await router.create("a", HELLO)
        await router.begin_turn("a", conv["id"], [], holder=INGRESS_1)
        with pytest.raises(ConversationBusy):  # its holder is alive: one turn at a time
            await router.begin_turn("a", conv["id"], TOOL, holder=INGRESS_2)
        live.discard(INGRESS_1)  # the ingress replica is killed mid-turn
        turn = await router.begin_turn("a", conv["id"], TOOL, holder=INGRESS_2)
        assert turn["state"] == GENERATING and turn["version"] == 2
        assert turn["messages"] == HELLO + TOOL
        assert "claim_holder" not in turn and "claim_holder" not in await router.get("a", conv["id"])
        return conv["id"]

    asyncio.run(go())


def test_a_claim_left_by_a_dead_process_does_not_survive_a_restart(tmp_path):
    path = tmp_path / "c.db"
    first = _router(path, {INGRESS_1})

    async def before():
        conv = await first.create("a", HELLO)
        await first.begin_turn("a", conv["id"], TOOL, holder=INGRESS_1)
        return conv["id"]

    cid = asyncio.run(before())
    restarted = _router(path, {INGRESS_2})  # a full restart: every replica is new

    async def after():
        await restarted.expire_round()  # the background round, before any client asks
        conv = await restarted.get("a", cid)
        assert conv["state"] == EVICTED and conv["messages"] == HELLO + TOOL
        turn = await restarted.begin_turn("a", cid, [], holder=INGRESS_2)
        assert turn["version"] == 2 and turn["messages"] == HELLO + TOOL

    asyncio.run(after())


def test_a_claim_ends_at_its_deadline_when_nobody_can_tell_its_holder_is_gone(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    t = time.time()
    store.begin_turn("a", conv.id, [], claim_s=60, now=t)  # no holder: only the deadline ends it
    with pytest.raises(ConversationBusy):
        store.begin_turn("a", conv.id, [], now=t + 59)
    assert store.expire_claims(now=t + 59) == []
    ended = store.expire_claims(now=t + 61)
    assert [c.id for c in ended] == [conv.id] and ended[0].state == GENERATING
    again = store.get("a", conv.id)
    assert again.state == EVICTED and again.messages == HELLO
    assert again.claim_deadline == t + 60  # kept: the claim ended by its deadline, so a late renewal may take it back
    # a late reply of that turn is still stored: nobody took over
    assert store.finish_turn("a", conv.id, 1, "late", "r1", 60).state == PAUSED


def test_the_default_claim_outlasts_a_turn_and_a_taken_over_turn_cannot_finish(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    t = time.time()
    assert store.begin_turn("a", conv.id, [], now=t).claim_deadline == t + UNRENEWED_CLAIM_S
    taken = store.begin_turn("a", conv.id, TOOL, now=t + UNRENEWED_CLAIM_S + 1)  # the claim ended: taken over
    assert taken.version == 2 and taken.messages == HELLO + TOOL
    with pytest.raises(ConversationBusy):
        store.finish_turn("a", conv.id, 1, "stale", "r1", 60)
    with pytest.raises(ConversationBusy):
        store.renew_turn("a", conv.id, 1, 30)
    assert not store.abandon_turn("a", conv.id, version=1)  # the stale turn leaves its successor alone
    assert store.get("a", conv.id).state == GENERATING
    assert store.abandon_turn("a", conv.id, version=2) and store.get("a", conv.id).state == EVICTED


def test_renewing_keeps_a_claim_alive(tmp_path):
    store = ConversationStore(tmp_path / "c.db")
    conv = store.create("a", HELLO)
    t = time.time()
    store.begin_turn("a", conv.id, [], claim_s=30, now=t)
    assert store.renew_turn("a", conv.id, 1, 30, now=t + 20) == t + 50
    assert store.expire_claims(now=t + 40) == []
    with pytest.raises(ConversationBusy):
        store.begin_turn("a", conv.id, [], now=t + 40)
    # late (a stalled renewer): the claim ended, but nobody took over, so it is claimed again
    assert len(store.expire_claims(now=t + 51)) == 1
    store.renew_turn("a", conv.id, 1, 30, now=t + 52)
    assert store.get("a", conv.id).state == GENERATING
    store.finish_turn("a", conv.id, 1, "done", None, 60)
    with pytest.raises(ConversationBusy):  # a finished turn holds nothing
        store.renew_turn("a", conv.id, 1, 30)


def test_only_replicas_that_are_gone_lose_their_claims():
    assert holder_gone(INGRESS_1, {INGRESS_2})
    assert not holder_gone(INGRESS_1, {INGRESS_1})
    assert not holder_gone(INGRESS_1, None)  # no view of the cluster: only the deadline
    assert not holder_gone("library-caller", set())  # not an actor name: cannot be judged
    assert not holder_gone(None, set())


def test_renewed_streams_renew_while_a_chunk_is_slow_and_stop_when_the_claim_is_lost():
    """The chunks wait on renewals (events the test sets, no sleeps): each comes only once the
    claim was renewed while it was pending, the first after a failed renewal was retried."""
    async def go():
        calls = []
        reached = {3: asyncio.Event(), 5: asyncio.Event()}  # renewal count -> set once reached

        async def renew():
            calls.append(len(calls))
            for n, event in reached.items():
                if len(calls) >= n:
                    event.set()
            if len(calls) == 1:
                raise RuntimeError("router restarting")  # retried at the next period

        async def slow_chunks():
            for i, n in enumerate(reached):
                await reached[n].wait()
                yield {"i": i}

        got = [c async for c in renewed(slow_chunks(), renew, claim_s=0.03)]
        assert [c["i"] for c in got] == [0, 1]

        lost_seen = asyncio.Event()

        async def lost():
            lost_seen.set()
            raise ConversationBusy("taken over")

        async def chunks_after_the_loss():
            await lost_seen.wait()
            for i in range(3):
                yield {"i": i}

        got = []
        with pytest.raises(ConversationBusy):
            async for chunk in renewed(chunks_after_the_loss(), lost, claim_s=0.03):
                got.append(chunk)
        assert got == []  # no chunk goes out once the claim is known lost

    # a bound on a hang (a stream that never renews would wait for ever), not a timing check
    asyncio.run(asyncio.wait_for(go(), timeout=120))


# -- with Ray: holders are real Serve replicas, found gone by their actor names -----------------

@pytest.fixture(scope="module")
def claims_app(ray_serve, tmp_path_factory):
    from ray import serve

    from dlite_ray.serve.router import ConversationRouterDeployment

    args = AppArgs(conversations={"store_path": str(tmp_path_factory.mktemp("claims") / "c.db")})

    @serve.deployment(name="DLiteIngress", ray_actor_options={"num_cpus": 0})
    class Holder:
        def identity(self) -> str | None:
            from dlite_ray.serve.turn_claims import holder_identity

            return holder_identity()

    app = ConversationRouterDeployment.options(ray_actor_options={"num_cpus": 0}).bind(None, args)
    router = serve.run(app, name="claims-router", route_prefix=None)
    holder = serve.run(Holder.bind(), name="claims-holder", route_prefix=None)
    yield router, holder
    serve.delete("claims-router")
    serve.delete("claims-holder")


def test_killing_the_turns_ingress_and_the_router_leaves_no_stuck_conversation(claims_app):
    import ray

    router, holder = claims_app
    ident = holder.identity.remote().result()
    assert ident.startswith("SERVE_REPLICA::claims-holder#DLiteIngress#")
    cid = router.create.remote("a", HELLO).result()["id"]
    router.begin_turn.remote("a", cid, TOOL, holder=ident).result()
    with pytest.raises(ConversationBusy):  # the holder lives: one turn at a time
        router.begin_turn.remote("a", cid, [], holder=ident).result()
    ray.kill(ray.get_actor(ident, namespace="serve"))  # the ingress replica dies mid-turn ...
    routers = [a for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith("SERVE_REPLICA::claims-router#ConversationRouter#")]
    ray.kill(ray.get_actor(routers[0]["name"], namespace=routers[0]["namespace"]))  # ... and the router restarts
    deadline = time.time() + 60
    while True:
        try:
            turn = router.begin_turn.remote("a", cid, [], holder=None).result()
            break
        except ConversationBusy:
            pytest.fail("the dead holder's claim outlived it")
        except Exception:  # noqa: BLE001 - the router is restarting
            assert time.time() < deadline, "the router never came back"
            time.sleep(0.5)
    assert turn["version"] == 2 and turn["messages"] == HELLO + TOOL

"""Two ConversationRouter replicas under Ray Serve over one PostgreSQL server (issue 56): 20
agent loops of 3 turns, each turn run by the ingress's own turn logic (ConversationTurns, the
worker's reply stood in for), through Serve's handle to the router deployment. One router
replica's actor is killed mid-run, then the database server restarts. Every conversation ends
with exactly the turns its client saw: none lost, none twice, none left generating."""

from __future__ import annotations

import asyncio
import time

import pytest

from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.serve.conversation_store import GENERATING, open_store
from dlite_ray.serve.conversation_turn import ConversationTurns
from dlite_ray.serve.errors import ConversationBusy, unwrap
from dlite_ray.serve.request_types import ConversationTurn
from dlite_ray.serve.worker_messages import GenerateChunk

APP = "routers56"
AGENTS, TURNS = 20, 3
CLIENT_ATTEMPTS = 200  # a client's tries of one turn before the test calls it stuck (a hang guard)
DOWN_FAILURES = 5  # router calls that meet the stopped database before it starts again
READY_WAIT_S = 120.0  # Serve bringing the replacement replica up (a wait, not a threshold)


@pytest.fixture(scope="module")
def routers(ray_serve, postgres, tmp_path_factory):
    from ray import serve

    from dlite_ray.serve.config import AppArgs
    from dlite_ray.serve.router import ConversationRouterDeployment

    args = AppArgs(api_keys_env=None, conversations={"store_url": postgres.url, "router_replicas": 2,
                                                     "store_path": str(tmp_path_factory.mktemp("unused") / "x")})
    deployment = ConversationRouterDeployment.options(num_replicas=args.conversations.router_replicas,
                                                      ray_actor_options={"num_cpus": 0})
    handle = serve.run(deployment.bind(None, args), name=APP, route_prefix=None)
    yield handle
    serve.delete(APP)


def _router_actors() -> list[dict]:
    import ray

    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{APP}#ConversationRouter#")]


class Counted:
    """Serve's handle to the routers, counting the calls that failed, by the error the ingress
    saw (it repeats those that were lost: conversation_turn._through_router)."""

    def __init__(self, handle):
        self.handle, self.failed = handle, {}

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        method, failed = getattr(self.handle, name), self.failed

        class Method:
            @staticmethod
            async def remote(*args, **kwargs):
                try:
                    return await method.remote(*args, **kwargs)
                except Exception as exc:
                    kind = type(unwrap(exc)).__name__
                    failed[kind] = failed.get(kind, 0) + 1
                    raise

        return Method


async def _reply(prompt, params, **_routing):
    async def chunks():
        yield GenerateChunk([1], f"re: {prompt[-1]['content']}", finished=True, finish_reason="stop", replica=None)

    return chunks(), lambda: None


def test_agent_loops_survive_a_killed_router_replica_and_a_database_restart(routers, postgres):
    import ray

    assert len(_router_actors()) == 2
    counted = Counted(routers)
    turns = ConversationTurns(counted, None, _reply)
    done = {"turns": 0}
    retries: dict[str, int] = {}

    async def agent(n: int) -> tuple[str, list[tuple[str, str]]]:
        conv = await routers.create.remote("tenant", [{"role": "user", "content": "go"}])
        seen: list[tuple[str, str]] = []
        for turn in range(TURNS):
            content = f"agent {n} turn {turn}"
            for _ in range(CLIENT_ATTEMPTS):  # a client retries a turn under its idempotency key
                try:
                    text = "".join([c.text async for c in turns.run(
                        "tenant", conv["id"], ConversationTurn([{"role": "user", "content": content}],
                                                               SamplingParams(max_new_tokens=2)),
                        idempotency_key=f"{conv['id']}-{turn}")])
                except Exception as exc:  # noqa: BLE001 - which errors reach a client is counted
                    kind = type(unwrap(exc)).__name__
                    retries[kind] = retries.get(kind, 0) + 1
                    assert isinstance(unwrap(exc), ConversationBusy) or "Unavailable" in kind or "Died" in kind, exc
                    await asyncio.sleep(0.05)
                    continue
                seen.append((content, text))
                done["turns"] += 1
                break
            else:
                raise AssertionError(f"agent {n}'s turn {turn} never went through: stuck")
        return conv["id"], seen

    async def progress(n: int, agents: list[asyncio.Task]) -> None:
        # a count the agents' tasks bump (a Condition would need every bump to notify)
        while done["turns"] < n and not all(a.done() for a in agents):  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    async def main():
        agents = [asyncio.create_task(agent(n)) for n in range(AGENTS)]
        await progress(AGENTS * TURNS // 4, agents)
        victim = _router_actors()[0]
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]))
        await progress(AGENTS * TURNS // 2, agents)
        postgres.stop()  # on the event loop: no turn moves on until the server is gone
        failures = counted.failed
        while failures.get("StoreUnavailable", 0) < DOWN_FAILURES and not all(a.done() for a in agents):  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # down until turns in flight have met it
        await asyncio.to_thread(postgres.start)
        return victim["name"], await asyncio.gather(*agents)

    victim, results = asyncio.run(main())
    store = open_store(postgres.url)
    for cid, seen in results:
        conv = store.get("tenant", cid)
        expected = [{"role": "user", "content": "go"}] + [m for content, reply in seen for m in (
            {"role": "user", "content": content}, {"role": "assistant", "content": reply})]
        assert conv.messages == expected  # no turn lost, none twice
        assert conv.state != GENERATING and conv.version == TURNS
    assert all(len(seen) == TURNS for _, seen in results)
    deadline = time.monotonic() + READY_WAIT_S  # Serve replaces the killed replica
    while victim in {a["name"] for a in _router_actors()} or len(_router_actors()) < 2:
        assert time.monotonic() < deadline, _router_actors()
        time.sleep(0.5)
    store.close()
    assert counted.failed.get("StoreUnavailable", 0) > 0  # the restart did fail router calls mid-run
    print(f"router calls failed (repeated by the ingress): {counted.failed}; turns a client retried: {retries}")

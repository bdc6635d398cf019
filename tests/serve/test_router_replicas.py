"""Two ConversationRouter replicas over one PostgreSQL server (issue 56): 20 agent loops of 3
turns in flight through the real ingress; one router replica dies mid-run, with calls in
flight on it (some reached the store before their answer was lost, some never did), then the
database server restarts. Every conversation ends with exactly the turns its client saw: none
lost, none twice, none left generating.

The routers, the ingress and the database are real; what stands in for Serve is the handle
between ingress and routers (`RouterReplicas`): it spreads calls over the live replicas as
Serve's router does, and a replica's death reaches a caller as Ray's ActorDiedError. The
same drill against Ray Serve itself (killing the replica's actor) is not run here."""

from __future__ import annotations

import asyncio
import inspect

from ray.exceptions import ActorDiedError

from dlite_ray.serve.conversation_store import GENERATING
from dlite_ray.serve.errors import StoreUnavailable
from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.worker_messages import GenerateChunk
from tests.serve.local_handles import AsgiClient, LocalHandle, crossed, local_args

KEYS = {"tenant-a": "key-a"}
AUTH = {"authorization": "Bearer key-a"}
AGENTS, TURNS = 20, 3
LOST_CALLS = 6  # calls in flight on the dying replica: the odd ones had reached the store
DOWN_FAILURES = 5  # router calls that meet the stopped database before it starts again
CLIENT_ATTEMPTS = 400  # a client's tries of one turn before the test calls it stuck (a hang guard)


class EchoWorker:
    """Replies to the last message, so a reply names its turn."""

    async def generate(self, prompt, params, **_routing):
        last = prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)
        await asyncio.sleep(0)
        yield GenerateChunk([1], f"re: {last}", finished=True, finish_reason="stop", replica="r1")

    async def release_lease(self, conversation: str, route_to: str | None = None, strict: bool = True) -> str:
        return "released"


class RouterReplicas:
    """A DeploymentHandle over router replicas: each call goes to the next live one. `kill(i)`:
    replica i dies with LOST_CALLS calls in flight (ActorDiedError; the odd ones had run on
    it), then receives nothing more."""

    def __init__(self, routers: list[ConversationRouter]):
        self.routers, self.live = routers, list(range(len(routers)))
        self._next, self._dying = 0, {}
        self.lost = {"after the store": 0, "before the store": 0}
        self.store_unavailable = 0  # calls that met the database restart

    def kill(self, i: int) -> None:
        self._dying[i] = LOST_CALLS

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        replicas = self

        class Method:
            @staticmethod
            def remote(*args, **kwargs):
                return replicas._call(name, *crossed((args, kwargs)))

        return Method

    async def _call(self, name: str, args: tuple, kwargs: dict):
        i = self.live[self._next % len(self.live)]
        self._next += 1
        left = self._dying.get(i)
        if left == 0:  # dead: Serve routes around it
            self.live.remove(i)
            del self._dying[i]
            return await self._call(name, args, kwargs)
        if left is not None:
            self._dying[i] = left - 1
            if left % 2:
                await self._run(i, name, args, kwargs)  # the store took it; the answer is lost
                self.lost["after the store"] += 1
            else:
                self.lost["before the store"] += 1
            raise ActorDiedError()
        return crossed(await self._run(i, name, args, kwargs))

    async def _run(self, i: int, name: str, args: tuple, kwargs: dict):
        try:
            out = getattr(self.routers[i], name)(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except StoreUnavailable:
            self.store_unavailable += 1
            raise


def test_agent_loops_survive_a_dead_router_replica_and_a_database_restart(tmp_path, postgres, database):
    from dlite_ray.serve.ingress import DLiteIngress

    args = local_args(tmp_path, KEYS)
    args.conversations.store_url = database
    args.conversations.router_replicas = 2
    args.limits.max_in_flight_per_tenant = AGENTS
    worker = LocalHandle(EchoWorker())
    replicas = RouterReplicas([ConversationRouter(worker, args, live_actors=lambda: None) for _ in range(2)])
    http = AsgiClient(DLiteIngress(worker, replicas, args))
    done = {"turns": 0}
    refusals: dict[int, int] = {}

    async def until_created() -> str:
        for _ in range(CLIENT_ATTEMPTS):
            r = await http.post("/v1/conversations", {"messages": [{"role": "user", "content": "go"}]}, headers=AUTH)
            body = await r.json()
            if r.status == 200:
                return body["id"]
            refusals[r.status] = refusals.get(r.status, 0) + 1
            await asyncio.sleep(0.02)
        raise AssertionError("a create never succeeded")

    async def agent(n: int) -> tuple[str, list[tuple[str, str]]]:
        cid, seen = await until_created(), []
        for turn in range(TURNS):
            content = f"agent {n} turn {turn}"
            for _ in range(CLIENT_ATTEMPTS):  # a client retries a turn under its idempotency key
                r = await http.post(f"/v1/conversations/{cid}/messages",
                                    {"messages": [{"role": "user", "content": content}], "max_tokens": 2},
                                    headers={**AUTH, "idempotency-key": f"{cid}-{turn}"})
                body = await r.json()
                if r.status == 200:
                    seen.append((content, body["message"]["content"]))
                    done["turns"] += 1
                    break
                assert r.status in (409, 503), body  # busy or unavailable: worth a retry, nothing else is
                refusals[r.status] = refusals.get(r.status, 0) + 1
                await asyncio.sleep(0.02)
            else:
                raise AssertionError(f"agent {n}'s turn {turn} never went through: stuck")
        return cid, seen

    async def progress(turns: int, agents: list[asyncio.Task]) -> None:
        # a count the agents' tasks bump (a Condition would need every bump to notify)
        while done["turns"] < turns and not all(a.done() for a in agents):  # noqa: ASYNC110
            await asyncio.sleep(0.005)

    async def main():
        agents = [asyncio.create_task(agent(n)) for n in range(AGENTS)]
        await progress(AGENTS * TURNS // 4, agents)
        replicas.kill(0)
        await progress(AGENTS * TURNS // 2, agents)
        postgres.stop()  # on the event loop: no turn moves on until the server is gone
        while replicas.store_unavailable < DOWN_FAILURES and not all(a.done() for a in agents):  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # down until turns in flight have met it
        await asyncio.to_thread(postgres.start)
        return await asyncio.gather(*agents)

    results = asyncio.run(main())
    store = replicas.routers[1].store
    for cid, seen in results:
        conv = store.get("tenant-a", cid)
        expected = [{"role": "user", "content": "go"}] + [m for content, reply in seen for m in (
            {"role": "user", "content": content}, {"role": "assistant", "content": reply})]
        assert conv.messages == expected  # no turn lost, none twice
        assert [reply for _, reply in seen] == [f"re: {content}" for content, _ in seen]
        assert conv.state != GENERATING and conv.version == TURNS
    assert len(results) == AGENTS and all(len(seen) == TURNS for _, seen in results)
    assert replicas.live == [1] and replicas.lost == {"after the store": LOST_CALLS // 2,
                                                      "before the store": LOST_CALLS // 2}
    assert replicas.store_unavailable > 0  # the restart did fail router calls mid-run

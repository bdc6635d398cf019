"""The conversation store's health on /healthz and /metrics (issue 56), through the real
ingress and router over a real PostgreSQL server that the test stops and starts again: the
store going away reads as degraded (completions still serve) and dlite_store_up 0, and a
conversation call is 503 until the server is back, with no restart of the router; a restart
while the router is idle costs no request an error."""

from __future__ import annotations

import asyncio

import pytest

from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.worker_messages import GenerateChunk, WorkerStats
from tests.serve.local_handles import AsgiClient, LocalHandle, local_args
from tests.serve.postgres_server import PostgresServer

KEYS = {"tenant-a": "key-a"}
AUTH = {"authorization": "Bearer key-a"}
HELLO = [{"role": "user", "content": "hello"}]


class StatsWorker:
    async def stats(self, route_to=None) -> WorkerStats:
        return WorkerStats(replica="r1", running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=8, held_leases=0,
                           draft_connected=True)

    async def generate(self, prompt, params, **_routing):
        yield GenerateChunk([1], "ok", finished=True, finish_reason="stop", replica="r1")


@pytest.fixture(scope="module")
def postgres():
    server = PostgresServer()
    server.start()
    yield server
    server.remove()


def _client(tmp_path, store_url: str | None) -> AsgiClient:
    from dlite_ray.serve.ingress import DLiteIngress

    args = local_args(tmp_path, KEYS, worker_probe_ttl_s=0)  # every probe asks anew
    args.conversations.store_url = store_url
    worker = LocalHandle(StatsWorker())
    return AsgiClient(DLiteIngress(worker, LocalHandle(ConversationRouter(worker, args, live_actors=lambda: None)),
                                   args))


async def _read(http: AsgiClient) -> tuple[int, dict, str, int]:
    metrics = await http.get("/metrics", headers=AUTH)  # first: its gauges come from its own probe
    health = await http.get("/healthz")
    created = await http.post("/v1/conversations", {"messages": HELLO}, headers=AUTH)
    await created.read()
    return health.status, await health.json(), (await metrics.read()).decode(), created.status


def _gauge(metrics: str, name: str) -> float:
    (line,) = [line for line in metrics.splitlines() if line.startswith(name)]
    return float(line.rsplit(" ", 1)[1])


def test_a_store_that_goes_away_and_comes_back_reads_so_on_healthz_and_metrics(tmp_path, postgres):
    http = _client(tmp_path, postgres.url)
    up = asyncio.run(_read(http))
    postgres.stop()
    try:
        down = asyncio.run(_read(http))
    finally:
        postgres.start()
    back = asyncio.run(_read(http))
    postgres.stop()  # a restart while the router is idle: its kept connections are dead, it finds out at BEGIN
    postgres.start()
    again = asyncio.run(_read(http))

    assert up[:2] == (200, {"status": "ok"}) and up[3] == 200
    assert _gauge(up[2], 'dlite_store_up{backend="postgresql"}') == 1
    assert _gauge(up[2], 'dlite_store_latency_seconds{backend="postgresql"}') > 0
    assert down[:2] == (200, {"status": "degraded", "reason": "the conversation store is unreachable"})
    assert _gauge(down[2], 'dlite_store_up{backend="postgresql"}') == 0
    assert down[3] == 503  # StoreUnavailable: retry
    assert back[:2] == (200, {"status": "ok"}) and back[3] == 200  # the same router reconnected
    assert _gauge(back[2], 'dlite_store_up{backend="postgresql"}') == 1
    assert again[:2] == (200, {"status": "ok"}) and again[3] == 200  # and no request saw the restart


def test_the_default_sqlite_store_reads_up_with_its_latency(tmp_path):
    status, body, metrics, created = asyncio.run(_read(_client(tmp_path, None)))
    assert (status, body, created) == (200, {"status": "ok"}, 200)
    assert _gauge(metrics, 'dlite_store_up{backend="sqlite"}') == 1
    assert _gauge(metrics, 'dlite_store_latency_seconds{backend="sqlite"}') > 0

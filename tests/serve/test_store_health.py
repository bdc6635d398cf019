"""The conversation store's health on /healthz, /metrics and gRPC GetStats (issue 56), through
the real ingress and router over a real PostgreSQL server that the test stops and starts
again: the store going away reads as degraded (completions still serve), dlite_store_up 0 and
GetStats' store unreachable, and a conversation call is 503 until the server is back, with no
restart of the router; a restart while the router is idle costs no request an error."""

from __future__ import annotations

import asyncio
import json

from dlite_ray.serve.proto import dlite_pb2
from dlite_ray.serve.router import ConversationRouter
from dlite_ray.serve.worker_messages import GenerateChunk, WorkerStats
from tests.serve.local_handles import AsgiClient, LocalGrpc, LocalHandle, local_args

KEYS = {"tenant-a": "key-a"}
AUTH = {"authorization": "Bearer key-a"}
GRPC_AUTH = (("authorization", "Bearer key-a"),)
HELLO = [{"role": "user", "content": "hello"}]


class StatsWorker:
    async def stats(self, route_to=None) -> WorkerStats:
        return WorkerStats(replica="r1", running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=8, held_leases=0,
                           draft_connected=True)

    async def generate(self, prompt, params, **_routing):
        yield GenerateChunk([1], "ok", finished=True, finish_reason="stop", replica="r1")


def _client(tmp_path, store_url: str | None) -> tuple[AsgiClient, LocalGrpc]:
    from dlite_ray.serve.ingress import DLiteIngress

    args = local_args(tmp_path, KEYS, worker_probe_ttl_s=0)  # every probe asks anew
    args.conversations.store_url = store_url
    worker = LocalHandle(StatsWorker())
    ingress = DLiteIngress(worker, LocalHandle(ConversationRouter(worker, args, live_actors=lambda: None)), args)
    return AsgiClient(ingress), LocalGrpc(ingress)


async def _read(client: tuple[AsgiClient, LocalGrpc]) -> tuple[int, dict, str, int, dict, dict]:
    """/healthz, /metrics, a create; then GetStats without a key and with one."""
    http, grpc = client
    metrics = await http.get("/metrics", headers=AUTH)  # first: its gauges come from its own probe
    health = await http.get("/healthz")
    created = await http.post("/v1/conversations", {"messages": HELLO}, headers=AUTH)
    await created.read()
    bare, _ = await grpc.unary("GetStats", dlite_pb2.GetStatsRequest())
    full, _ = await grpc.unary("GetStats", dlite_pb2.GetStatsRequest(), GRPC_AUTH)
    return (health.status, await health.json(), (await metrics.read()).decode(), created.status,
            json.loads(bare.json), json.loads(full.json))


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

    # GetStats: without a key it says what /healthz says; with one, the store's health
    for read in (up, down, back, again):
        assert read[4] == read[1]
        assert read[5]["status"] == read[1]["status"] and read[5]["worker"]["replica"] == "r1"
    assert up[5]["store"]["backend"] == "postgresql" and up[5]["store"]["reachable"] is True
    assert up[5]["store"]["latency_s"] > 0
    assert down[5]["store"]["backend"] == "postgresql" and down[5]["store"]["reachable"] is False
    assert down[5]["store"]["latency_s"] is None and down[5]["store"]["error"]
    assert back[5]["store"]["reachable"] is True and again[5]["store"]["reachable"] is True


def test_the_default_sqlite_store_reads_up_with_its_latency(tmp_path):
    status, body, metrics, created, bare, full = asyncio.run(_read(_client(tmp_path, None)))
    assert (status, body, created, bare) == (200, {"status": "ok"}, 200, {"status": "ok"})
    assert full["store"]["backend"] == "sqlite" and full["store"]["reachable"] is True
    assert full["store"]["latency_s"] > 0
    assert _gauge(metrics, 'dlite_store_up{backend="sqlite"}') == 1
    assert _gauge(metrics, 'dlite_store_latency_seconds{backend="sqlite"}') > 0

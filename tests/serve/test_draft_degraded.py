"""A pair whose draft never joins says so (issue 53 item 8, issue 52 item 5): failed joins
are counted, past the bound the replica is degraded with a reason on /healthz, GetStats and
/metrics, the rounds it decodes without a draft are counted, and with `require_draft` its
health check fails (Serve routes nothing to it). The launcher is an injected fake that
always fails; the ingress, worker and engine are the real ones (local_handles.py)."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from dlite_ray.engine.draft_transport import DraftInfo, DraftUnavailable
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.serve.config import EngineArgs
from dlite_ray.serve.draft_process import PairLink
from dlite_ray.serve.engine_factory import engine_config
from dlite_ray.serve.proto import dlite_pb2
from tests.serve.local_handles import LocalApp, local_args

KEYS = {"tenant-a": "key-a"}
AUTH = {"authorization": "Bearer key-a"}
BOUND = 3  # max_join_failures
WAIT_S = 60  # a guard against a hang, not a figure under test


class NeverJoins:
    """A DraftLauncher whose draft never comes up; `tried` is set once the link has failed
    BOUND times (the attempt after the bound-th has begun, so the bound-th was recorded)."""

    def __init__(self):
        self.attempts = 0
        self.tried = threading.Event()

    def address(self, authkey: bytes) -> tuple[str, int]:
        self.attempts += 1
        if self.attempts > BOUND:
            self.tried.set()
        raise ConnectionError("the draft actor could not be placed")

    def restart(self) -> None: ...

    def kill(self) -> None: ...

    def close(self) -> None: ...


def _link(info: DraftInfo, vocab_size: int, launcher: NeverJoins) -> PairLink:
    return PairLink(info, vocab_size, launcher, retry_s=0.01, heartbeat_s=600, max_join_failures=BOUND)


def test_a_link_whose_draft_never_joins_counts_its_failures_and_is_degraded():
    launcher = NeverJoins()
    link = _link(DraftInfo("fp", 1, 7, (0,)), 32, launcher)
    try:
        assert launcher.tried.wait(WAIT_S)
        assert link.join_failures >= BOUND and not link.connected
        assert "no draft has joined" in link.degraded_reason
        assert "could not be placed" in link.last_join_error
        with pytest.raises(DraftUnavailable):
            link.propose(None)
        assert link.rounds_without_draft == 1
    finally:
        link.close()


@pytest.fixture
def degraded_engine(tiny_serving_model):
    """The served engine, its draft behind a link whose launcher never brings one up."""
    target_dir, draft_dir = tiny_serving_model
    launcher = NeverJoins()
    links: list[PairLink] = []

    def make_draft(draft_path, info, target, target_path, config):
        links.append(_link(info, target.cfg.vocab_size, launcher))
        return links[-1]

    args = EngineArgs(target=str(target_dir), draft=str(draft_dir), dtype="float32", adaptive_draft_length=False,
                      max_kv_tokens=8192)
    engine = DLiteEngine.from_config(engine_config(args), make_draft)
    assert launcher.tried.wait(WAIT_S)
    yield engine
    links[0].close()


def test_a_replica_without_its_draft_reads_degraded_and_counts_plain_rounds(degraded_engine, tmp_path):
    app = LocalApp(local_args(tmp_path, KEYS), degraded_engine)

    async def go():
        reply = await app.http.post("/v1/completions", {"prompt": "Hello", "max_tokens": 6}, headers=AUTH)
        assert reply.status == 200
        await reply.read()
        health = await app.http.get("/healthz")
        metrics = await app.http.get("/metrics", headers=AUTH)
        bare, _ = await app.grpc.unary("GetStats", dlite_pb2.GetStatsRequest())
        return health.status, await health.json(), (await metrics.read()).decode(), json.loads(bare.json)

    try:
        status, health, metrics, stats = asyncio.run(go())
        worker = asyncio.run(app.worker.stats())
        app.worker.check_health()  # require_draft off: degraded, yet ready
    finally:
        app.close()
    assert status == 200  # it still serves, plainly
    assert health["status"] == "degraded" and health["replica"] == "local"
    assert "no draft has joined" in health["reason"]
    assert stats["status"] == "degraded" and stats["reason"] == health["reason"]
    assert 'dlite_replica_degraded{replica="local"} 1.0' in metrics
    assert 'dlite_draft_connected{replica="local"} 0.0' in metrics
    assert worker.draft_join_failures >= BOUND and worker.rounds_without_draft > 0


def test_require_draft_fails_the_health_check_of_a_replica_without_its_draft(degraded_engine, tmp_path):
    app = LocalApp(local_args(tmp_path, KEYS, require_draft=True), degraded_engine)
    try:
        with pytest.raises(RuntimeError, match="require_draft: no draft has joined"):
            app.worker.check_health()
    finally:
        app.close()

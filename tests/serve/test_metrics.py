"""/metrics carries the draft's real state: connected only while its last round or heartbeat
answered, and how often the link brought it back. The first test reads it off a real worker
(ingress, TargetWorker, engine and a draft in a child process: local_handles.py) while the
draft runs, after it is killed and while it cannot come back, and once it is back; the others
check that the figures a worker reports are rendered."""

from __future__ import annotations

import asyncio
import threading

import pytest

from dlite_ray.engine.draft_transport import DraftInfo
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.serve.config import EngineArgs
from dlite_ray.serve.draft_process import DraftSource, LocalDraftProcess, PairLink
from dlite_ray.serve.engine_factory import engine_config
from dlite_ray.serve.metrics import Metrics
from dlite_ray.serve.worker_messages import WorkerStats
from tests.serve.local_handles import LocalApp, local_args

# the draft's figures carry the replica they are of (issue 53 item 8)
CONNECTED, RESTARTS = 'dlite_draft_connected{replica="r"}', 'dlite_draft_restarts{replica="r"}'
KEYS = {"tenant-a": "key-a"}
AUTH = {"authorization": "Bearer key-a"}
WAIT_S = 120  # a guard against a hang (a draft child's start included), not a figure under test


class GatedLauncher:
    """The real child-process launcher, behind a gate the test holds: while `gate` is
    clear, the link's attempt to bring a draft back waits, so a lost draft stays lost."""

    def __init__(self, process: LocalDraftProcess):
        self.process = process
        self.gate = threading.Event()
        self.gate.set()

    def address(self, authkey: bytes) -> tuple[str, int]:
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("the test never opened the gate")
        return self.process.address(authkey)

    def restart(self) -> None:
        self.process.restart()

    def kill(self) -> None:
        self.process.kill()

    def close(self) -> None:
        self.gate.set()
        self.process.close()


@pytest.fixture
def paired(tiny_serving_model):
    """(engine, link, launcher): the served engine, its draft in a child process behind a
    PairLink that pings it often (a killed draft is found without a request)."""
    target_dir, draft_dir = tiny_serving_model
    launchers: list[GatedLauncher] = []
    links: list[PairLink] = []

    def make_draft(draft_path, info: DraftInfo, target, target_path, config) -> PairLink:
        process = LocalDraftProcess(DraftSource(str(draft_path), str(target_path)), "cpu", 1, WAIT_S)
        launchers.append(GatedLauncher(process))
        links.append(PairLink(info, target.cfg.vocab_size, launchers[-1], payload="host", heartbeat_s=0.2,
                              retry_s=0.2, join_timeout_s=WAIT_S))
        return links[-1]

    args = EngineArgs(target=str(target_dir), draft=str(draft_dir), dtype="float32", adaptive_draft_length=False,
                      max_kv_tokens=8192)
    engine = DLiteEngine.from_config(engine_config(args), make_draft)
    try:
        assert links[0].wait_connected(WAIT_S)
        yield engine, links[0], launchers[0]
    finally:
        links[0].close()


def _gauge(text: str, name: str) -> float:
    line = next(row for row in text.splitlines() if row.startswith(name + " "))
    return float(line.split()[1])


def test_metrics_follow_a_real_worker_s_draft_through_its_loss_and_return(paired, tmp_path):
    engine, link, launcher = paired
    # ttl 0: every scrape asks the worker (a cached answer would hide the change)
    app = LocalApp(local_args(tmp_path, KEYS, worker_probe_ttl_s=0), engine)
    connected, restarts = 'dlite_draft_connected{replica="local"}', 'dlite_draft_restarts{replica="local"}'

    async def scrape() -> tuple[float, float]:
        reply = await app.http.get("/metrics", headers=AUTH)
        assert reply.status == 200
        text = (await reply.read()).decode()
        return _gauge(text, connected), _gauge(text, restarts)

    def wait_for(condition, what: str) -> None:
        pause = threading.Event()  # never set: a pause between looks
        for _ in range(int(WAIT_S / 0.05)):
            if condition():
                return
            pause.wait(0.05)
        raise AssertionError(f"not {what} within {WAIT_S} s")

    try:
        assert asyncio.run(scrape()) == (1, 0)
        launcher.gate.clear()  # a lost draft stays lost until the gate opens
        launcher.kill()
        # the restart is counted as the link drops the draft (under one lock)
        wait_for(lambda: link.restarts == 1, "seen lost")
        assert asyncio.run(scrape()) == (0, 1)
        launcher.gate.set()
        assert link.wait_connected(WAIT_S)
        assert asyncio.run(scrape()) == (1, 1)
    finally:
        app.close()


def _stats(connected: bool, restarts: int) -> WorkerStats:
    return WorkerStats(replica="r", running=1, waiting=0, kv_blocks_used=3, kv_blocks_total=8, held_leases=0,
                       draft_connected=connected, draft_restarts=restarts)


def test_draft_state_and_restarts_are_rendered():
    m = Metrics()
    m.set_worker_stats(_stats(True, 0))
    text = m.render().decode()
    assert _gauge(text, CONNECTED) == 1 and _gauge(text, RESTARTS) == 0
    m.set_worker_stats(_stats(False, 3))
    text = m.render().decode()
    assert _gauge(text, CONNECTED) == 0 and _gauge(text, RESTARTS) == 3
    assert _gauge(text, "dlite_kv_blocks_used") == 3 and _gauge(text, "dlite_kv_blocks_total") == 8


def test_reply_cache_and_corpus_sizes_are_rendered():
    m = Metrics()
    m.set_worker_stats(WorkerStats(replica="r", running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=8,
                                   held_leases=0, draft_connected=True, reply_cache_tokens=300, reply_cache_replies=4,
                                   reply_corpus_tokens=4096))
    text = m.render().decode()
    assert _gauge(text, "dlite_reply_cache_tokens") == 300 and _gauge(text, "dlite_reply_cache_replies") == 4
    assert _gauge(text, "dlite_reply_corpus_tokens") == 4096

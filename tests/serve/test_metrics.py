"""/metrics carries the draft's real state: connected only while its last round or heartbeat
answered, and how often the link brought it back."""

from __future__ import annotations

from dlite_ray.serve.metrics import Metrics
from dlite_ray.serve.worker_messages import WorkerStats

# the draft's figures carry the replica they are of (issue 53 item 8)
CONNECTED, RESTARTS = 'dlite_draft_connected{replica="r"}', 'dlite_draft_restarts{replica="r"}'


def _stats(connected: bool, restarts: int) -> WorkerStats:
    return WorkerStats(replica="r", running=1, waiting=0, kv_blocks_used=3, kv_blocks_total=8, held_leases=0,
                       draft_connected=connected, draft_restarts=restarts)


def _gauge(text: str, name: str) -> float:
    line = next(row for row in text.splitlines() if row.startswith(name + " "))
    return float(line.split()[1])


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

"""/metrics carries the draft's real state: connected only while its last round or heartbeat
answered, and how often the link brought it back."""

from __future__ import annotations

from dlite_ray.serve.metrics import Metrics


def _gauge(text: str, name: str) -> float:
    line = next(l for l in text.splitlines() if l.startswith(name + " "))
    return float(line.split()[1])


def test_draft_state_and_restarts_are_rendered():
    m = Metrics()
    m.set_worker_stats({"draft_connected": True, "draft_restarts": 0})
    text = m.render().decode()
    assert _gauge(text, "dlite_draft_connected") == 1 and _gauge(text, "dlite_draft_restarts") == 0
    m.set_worker_stats({"draft_connected": False, "draft_restarts": 3})
    text = m.render().decode()
    assert _gauge(text, "dlite_draft_connected") == 0 and _gauge(text, "dlite_draft_restarts") == 3

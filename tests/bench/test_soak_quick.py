"""`dlite-ray soak --quick` in the suite, so the soak cannot rot unnoticed again (issue 53,
item 12): the real served app on loopback (as `dlite-ray soak` starts it), tenant B's
clients, an abusive tenant A, every fault kind injected once, and the verdict's checks
(0 lost, 0 stuck, 0 mismatched T = 0 replies, 0 unexplained B errors, 0 cross-tenant
breaches, every fault recovered). No latency verdict: the quick soak's 20 s solo phase is
no baseline. ~4-8 minutes on 2 cores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dlite_ray.bench.soak_faults import FAULT_KINDS

REPO = Path(__file__).resolve().parents[2]
HANG_GUARD_S = 1500  # the subprocess must not hang; not a figure under test


@pytest.mark.slow  # serves the default SmolLM2 model
def test_the_quick_soak_injects_every_fault_and_passes(tmp_path, default_model_dir):
    done = subprocess.run([sys.executable, "-m", "dlite_ray.cli", "soak", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=HANG_GUARD_S, cwd=REPO)
    report_file = tmp_path / "soak.json"
    assert report_file.exists(), done.stderr[-4000:]
    report = json.loads(report_file.read_text())
    injected = [f for f in report["faults"] if f["injected_at_s"] is not None]
    assert sorted(f["kind"] for f in injected) == sorted(FAULT_KINDS), report["faults"]
    failed = {name: check for name, check in report["verdict"]["checks"].items() if not check["ok"]}
    assert report["verdict"]["pass"], failed
    assert report["tenant_a"]["requests"] > 0  # the abusive tenant ran
    assert done.returncode == 0, done.stdout[-2000:]


class _Call:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        return self.value


class _Method:
    def __init__(self, value):
        self.value = value

    def remote(self):
        return _Call(self.value)


def test_the_draft_fault_reads_the_typed_worker_stats():
    """At HEAD before the fix, inject("draft") read stats['replica'] from a WorkerStats
    dataclass and every draft fault failed to inject (TypeError)."""
    from types import SimpleNamespace

    from dlite_ray.bench.soak_faults import RayFaults
    from dlite_ray.serve.worker_messages import WorkerStats

    stats = WorkerStats(replica="r1", running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=8, held_leases=0,
                        draft_connected=True, draft_restarts=2)
    faults = RayFaults.__new__(RayFaults)  # its Serve handles stood in for
    faults.timeout_s, faults.draft = 1.0, True
    faults.worker = SimpleNamespace(stats=_Method(stats), kill_draft=_Method(True))
    assert faults.inject("draft") == "draft of TargetWorker r1 (restarts so far: 2)"
    stats.draft_restarts = 3
    assert faults.recovered("draft", "r1")

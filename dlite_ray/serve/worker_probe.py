"""What the ingress knows of the TargetWorkers for /healthz, /metrics and GetStats.

A handle call to a dead worker waits until Serve has a replica again (seconds to minutes),
so every probe has a deadline, and a worker that misses it reads as unavailable. An answer
serves every probe for `ttl_s`, and concurrent probes share one call: a burst of health
checks costs the workers one `stats` call, and a dead worker costs each probe at most
`timeout_s`. A worker saturated up to its `max_ongoing_requests` queues the probe too, and
reads as unavailable while it cannot take a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Gauge

from dlite_ray.serve.worker_messages import WorkerStats

log = logging.getLogger(__name__)


def health(stats: WorkerStats | None) -> dict:
    """What /healthz and a keyless GetStats say: unavailable (no worker answered), degraded
    (it serves but cannot speculate: which replica and why), or ok."""
    if stats is None:
        return {"status": "unavailable"}
    if stats.degraded is not None:
        return {"status": "degraded", "replica": stats.replica, "reason": stats.degraded}
    return {"status": "ok"}


class WorkerProbe:
    def __init__(self, ask: Callable[[], Awaitable[WorkerStats]], timeout_s: float, ttl_s: float,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic):
        self._ask, self.timeout_s, self.ttl_s, self._clock = ask, timeout_s, ttl_s, clock
        self._answer: tuple[float, WorkerStats | None] | None = None  # (when, stats or None)
        self._pending: asyncio.Future | None = None
        self.up = Gauge("dlite_worker_up", "1 when a TargetWorker answered the last probe in time", registry=registry)

    async def stats(self) -> WorkerStats | None:
        """A worker's stats (`TargetWorker.stats`), or None when none answered within `timeout_s`."""
        if self._answer is not None and self._clock() - self._answer[0] < self.ttl_s:
            return self._answer[1]
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._probe())
        # shielded: a caller that goes away does not cancel the call others wait on
        return await asyncio.shield(self._pending)

    async def _probe(self) -> WorkerStats | None:
        try:
            stats = await asyncio.wait_for(self._ask(), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - timed out, replica gone, call failed: all read as unavailable
            log.warning("no TargetWorker answered a probe within %.1f s: %s", self.timeout_s, type(exc).__name__)
            stats = None
        self._answer, self._pending = (self._clock(), stats), None
        self.up.set(0 if stats is None else 1)
        return stats

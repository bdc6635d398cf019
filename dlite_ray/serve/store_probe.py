"""What the ingress knows of the conversation store, for /healthz and /metrics: the router's
answer to `store_health` (a trivial query's round trip on the store), with a deadline and a
time to live as for the workers (worker_probe): a burst of health checks costs the store one
query, and a router or store that does not answer costs each probe at most `timeout_s`.

/healthz and a keyless GetStats are open to all, so they say only that the store is
unreachable (status "degraded": completions still serve, conversations do not); the latency is
an operational figure, in /metrics (dlite_store_up, dlite_store_latency_seconds) and a full
GetStats ("store": the StoreHealth).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)


class StoreProbe:
    def __init__(self, ask: Callable[[], Awaitable[dict]], timeout_s: float, ttl_s: float,
                 registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.monotonic):
        self._ask, self.timeout_s, self.ttl_s, self._clock = ask, timeout_s, ttl_s, clock
        self._answer: tuple[float, dict | None] | None = None
        self._pending: asyncio.Future | None = None
        self._backend = "unknown"
        self.up = Gauge("dlite_store_up", "1 when the conversation store answered a trivial query at the last probe",
                        ["backend"], registry=registry)
        self.latency = Gauge("dlite_store_latency_seconds", "round trip of that query (a transaction on the store) "
                             "at the last probe it answered", ["backend"], registry=registry)

    async def health(self) -> dict | None:
        """`store_contract.StoreHealth` as a dict, or None when the router did not answer in time."""
        if self._answer is not None and self._clock() - self._answer[0] < self.ttl_s:
            return self._answer[1]
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self._pending)  # a caller that goes away cancels no one's answer

    async def _probe(self) -> dict | None:
        try:
            health: dict | None = await asyncio.wait_for(self._ask(), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - the router gone, slow or failing: the store reads unreachable
            log.warning("no answer on the conversation store's health within %.1f s: %s", self.timeout_s,
                        type(exc).__name__)
            health = None
        self._answer, self._pending = (self._clock(), health), None
        if health is not None:
            self.up.labels(health["backend"]).set(1 if health["reachable"] else 0)
            if health["reachable"]:
                self.latency.labels(health["backend"]).set(health["latency_s"])
            else:
                log.warning("the conversation store is unreachable: %s", health["error"])
            self._backend = health["backend"]
        else:  # nothing answered: the backend last seen (the router's config does not change under it)
            self.up.labels(self._backend).set(0)
        return health


def reachable(health: dict | None) -> bool:
    return health is not None and bool(health["reachable"])


def with_store(body: dict, store: dict | None) -> dict:
    """What /healthz and a keyless GetStats say, given the workers' `body` (worker_probe.health)
    and the store's health: degraded when the workers serve but the store does not answer
    (completions still serve, conversations do not)."""
    if body["status"] == "ok" and not reachable(store):
        return {"status": "degraded", "reason": "the conversation store is unreachable"}
    return body

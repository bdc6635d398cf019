"""Per-tenant cap on in-flight generation requests, enforced by the ingress.

One agent fleet must not take every slot of a shared server: a tenant past its cap gets
`Overloaded` (HTTP 429 / gRPC RESOURCE_EXHAUSTED) at once, instead of queueing behind
itself. The counts live in the ingress replica's event loop, so no lock is needed:
`acquire` checks and increments without awaiting. With several ingress replicas the cap
holds per replica.
"""

from __future__ import annotations

from collections import Counter

from dlite_ray.serve.errors import Overloaded


class TenantSlot:
    """One admitted request. `release()` is idempotent, so every exit path (normal end,
    error, client disconnect, garbage collection of an unstarted stream) may call it."""

    def __init__(self, limits: TenantLimits, tenant: str):
        self._limits, self.tenant = limits, tenant
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limits._release(self.tenant)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc_info) -> None:
        self.release()


class TenantLimits:
    def __init__(self, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.max_in_flight = max_in_flight
        self._in_flight: Counter[str] = Counter()

    def acquire(self, tenant: str) -> TenantSlot:
        """A slot for one more request of `tenant`, or `Overloaded` if it is at its cap."""
        if self._in_flight[tenant] >= self.max_in_flight:
            raise Overloaded(f"too many concurrent requests: this API key already has {self.max_in_flight} "
                             f"generation requests in flight (the per-tenant limit); retry when one finishes")
        self._in_flight[tenant] += 1
        return TenantSlot(self, tenant)

    def in_flight(self, tenant: str) -> int:
        return self._in_flight[tenant]

    def _release(self, tenant: str) -> None:
        self._in_flight[tenant] -= 1
        if self._in_flight[tenant] <= 0:
            del self._in_flight[tenant]  # idle tenants cost nothing

"""TenantLimits without Ray: concurrent asyncio requests of several tenants."""

from __future__ import annotations

import asyncio

import pytest

from dlite_ray.serve.errors import Overloaded
from dlite_ray.serve.tenant_limits import TenantLimits


def test_over_the_cap_is_overloaded_and_tenants_are_independent():
    limits = TenantLimits(2)
    a1, a2 = limits.acquire("a"), limits.acquire("a")
    with pytest.raises(Overloaded, match="per-tenant limit") as err:
        limits.acquire("a")
    assert err.value.http_status == 429 and err.value.grpc_code.name == "RESOURCE_EXHAUSTED"
    b = limits.acquire("b")  # another tenant is not affected by a's load
    assert limits.in_flight("a") == 2 and limits.in_flight("b") == 1
    a1.release()
    a1.release()  # idempotent: a second release must not free someone else's slot
    assert limits.in_flight("a") == 1
    limits.acquire("a")
    with pytest.raises(Overloaded):
        limits.acquire("a")
    a2.release()
    b.release()
    assert limits.in_flight("b") == 0


async def _request(limits: TenantLimits, tenant: str, peak: dict, outcome: str, started: asyncio.Event):
    """One request holding its slot across awaits, ending as asked: ok, error or cancelled."""
    with limits.acquire(tenant):
        peak[tenant] = max(peak.get(tenant, 0), limits.in_flight(tenant))
        started.set()
        await asyncio.sleep(0.01)
        if outcome == "error":
            raise RuntimeError("engine failed")
        if outcome == "cancelled":
            await asyncio.sleep(3600)  # the client goes away; the task is cancelled here


def test_concurrent_requests_never_exceed_the_cap_and_always_release():
    async def main():
        limits, peak, cap = TenantLimits(3), {}, 3
        outcomes = ["ok", "error", "cancelled"]
        tasks, rejected = [], 0
        for i in range(30):
            tenant = "ab"[i % 2]
            started = asyncio.Event()
            try:
                limits.acquire(tenant).release()  # probe: is there room right now?
            except Overloaded:
                rejected += 1
                await asyncio.sleep(0.005)
                continue
            tasks.append(asyncio.create_task(_request(limits, tenant, peak, outcomes[i % 3], started)))
            await started.wait()
        await asyncio.sleep(0.05)
        for t in tasks:
            t.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return limits, peak, cap, rejected, results

    limits, peak, cap, rejected, results = asyncio.run(main())
    assert max(peak.values()) == cap  # the cap was reached...
    assert rejected > 0  # ...and enforced
    assert any(isinstance(r, RuntimeError) for r in results)
    assert any(isinstance(r, asyncio.CancelledError) for r in results)
    assert limits.in_flight("a") == 0 and limits.in_flight("b") == 0  # every path released its slot


def test_a_closed_stream_releases_its_slot():
    """A streaming generator holding a slot and closed mid-stream (what a client
    disconnect does to the ingress's stream) releases the slot."""

    async def stream(limits: TenantLimits):
        with limits.acquire("a"):
            for i in range(100):
                yield i

    async def main():
        limits = TenantLimits(1)
        gen = stream(limits)
        assert await gen.__anext__() == 0 and limits.in_flight("a") == 1
        await gen.aclose()
        return limits

    assert asyncio.run(main()).in_flight("a") == 0
    with pytest.raises(ValueError):
        TenantLimits(0)

"""ConversationRouter: one replica that owns the durable conversation registry.

The ingress asks it to create, read, claim (begin a turn), complete and delete
conversations; it expires leases in the background and tells the holding TargetWorker
replica to unpin the conversation's KV. Histories live in SQLite, so a restarted router
finds every conversation again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from dlite_ray.serve.config import AppArgs
from dlite_ray.serve.conversation_store import ConversationStore

log = logging.getLogger(__name__)
EXPIRY_PERIOD_S = 5.0


class ConversationRouter:
    def __init__(self, worker: DeploymentHandle | None, args: AppArgs):
        self.worker = worker
        self.args = args.conversations
        self.store = ConversationStore(self.args.store_path)
        self._expiry = None

    def _ensure_expiry_task(self) -> None:
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.get_running_loop().create_task(self._expire_forever())

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_PERIOD_S)
            try:
                for conv in self.store.expire():
                    log.info("lease of %s on %s ended: evicted (history kept)", conv.id, conv.replica)
                    await self._release(conv.id, conv.replica)
                await self._evict_gone_replicas()
            except Exception:  # one bad round must not stop expiry for good
                log.exception("lease expiry round failed; retrying next period")

    async def _evict_gone_replicas(self) -> None:
        """A replica that died, or was drained on scale-down, holds nothing any more: its
        conversations are evicted and re-prefill wherever their next turn lands."""
        live = await asyncio.to_thread(live_replicas, "TargetWorker")  # a GCS call: off the event loop
        if live is None:
            return
        for replica in self.store.holding_replicas() - live:
            n = self.store.evict_replica(replica)
            log.info("replica %s is gone: %d conversations evicted (histories kept)", replica, n)

    async def _release(self, conversation_id: str, replica: str | None) -> None:
        if self.worker is None or replica is None:
            return
        try:
            await self.worker.release_lease.remote(conversation_id, route_to=replica, strict=True)
        except Exception as exc:  # noqa: BLE001 - a dead replica holds nothing any more
            log.warning("could not release %s on %s: %s", conversation_id, replica, exc)

    async def create(self, tenant: str, messages: list[dict]) -> dict:
        self._ensure_expiry_task()
        return asdict(self.store.create(tenant, messages))

    async def get(self, tenant: str, conversation_id: str) -> dict:
        return asdict(self.store.get(tenant, conversation_id))

    async def begin_turn(self, tenant: str, conversation_id: str, messages: list[dict]) -> dict:
        self._ensure_expiry_task()
        return asdict(self.store.begin_turn(tenant, conversation_id, messages))

    async def finish_turn(self, tenant: str, conversation_id: str, version: int, reply: str, replica: str | None,
                          lease_s: float | None) -> dict:
        lease = min(lease_s or self.args.default_lease_s, self.args.max_lease_s)
        previous = self.store.get(tenant, conversation_id).replica
        conv = self.store.finish_turn(tenant, conversation_id, version, reply, replica, lease)
        if previous is not None and previous != replica:  # the turn moved: unpin the old copy
            await self._release(conversation_id, previous)
        return asdict(conv)

    async def abandon_turn(self, tenant: str, conversation_id: str) -> None:
        previous = self.store.get(tenant, conversation_id).replica
        self.store.abandon_turn(tenant, conversation_id)
        await self._release(conversation_id, previous)

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        conv = self.store.delete(tenant, conversation_id)
        await self._release(conv.id, conv.replica)
        return True

    async def mark_evicted(self, conversation_ids: list[str], replica: str) -> int:
        """A replica gave up these conversations' KV under memory pressure."""
        return self.store.mark_evicted(conversation_ids, replica)


def live_replicas(deployment: str) -> set[str] | None:
    """Unique ids of this application's running replicas of `deployment` (None outside Serve)."""
    try:
        app = serve.get_replica_context().app_name
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


ConversationRouterDeployment = serve.deployment(ConversationRouter, name="ConversationRouter", num_replicas=1)

"""ConversationRouter: one replica that owns the durable conversation registry.

The ingress asks it to create, read, claim (begin a turn), renew, complete and delete
conversations; it expires leases and turn claims in the background and tells the holding
TargetWorker replica to unpin the conversation's KV, and deletes conversations idle past the
retention. Histories live in the conversation store (a SQLite file, or a PostgreSQL server
for a cluster: conversation_store.open_store), so a restarted router finds every
conversation again; a turn claim whose holder is gone
(checked against live actors) or whose deadline passed ends, so no conversation stays
"generating" for good.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import cast

from ray import serve
from ray.serve.handle import DeploymentHandle

from dlite_ray.serve.config import AppArgs
from dlite_ray.serve.conversation_store import GENERATING, Conversation, ConversationRegistry, TenantQuota, open_store
from dlite_ray.serve.errors import ConversationBusy
from dlite_ray.serve.store_contract import ConversationView
from dlite_ray.serve.turn_claims import SERVE_REPLICA_PREFIX, UNRENEWED_CLAIM_S, holder_gone, live_actor_names

log = logging.getLogger(__name__)
EXPIRY_PERIOD_S = 5.0
LIVENESS_CACHE_S = 1.0  # busy answers ask the GCS who is alive at most this often
MIN_CLAIM_S = 3.0
RELEASE_TIMEOUT_S = 10.0  # a lease release a replica has not answered by then is given up
DAY_S = 86400.0


class ConversationRouter:
    def __init__(self, worker: DeploymentHandle | None, args: AppArgs,
                 live_actors: Callable[[], set[str] | None] = live_actor_names):
        """`live_actors` names the cluster's live actors (None: unknown); tests inject it."""
        self.worker = worker
        self.args, self.limits = args.conversations, args.limits
        quota = TenantQuota(self.args.max_conversations_per_tenant, self.args.max_stored_bytes_per_tenant)
        self.store: ConversationRegistry = open_store(self.args.store_location(), quota)
        self._live_actors = live_actors
        self._live: tuple[float, set[str] | None] = (-math.inf, None)
        self._expiry: asyncio.Task[None] | None = None
        self._app: str | None
        try:
            self._app = serve.get_replica_context().app_name
        except Exception:  # noqa: BLE001 - not inside a Serve replica (tests)
            self._app = None

    def _ensure_expiry_task(self) -> None:
        if self._expiry is None or self._expiry.done():
            self._expiry = asyncio.get_running_loop().create_task(self._expire_forever())

    async def _expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_PERIOD_S)
            try:
                await self.expire_round()
            except Exception:  # one bad round must not stop expiry for good
                log.exception("lease expiry round failed; retrying next period")

    async def expire_round(self, now: float | None = None) -> None:
        """Ended leases and turn claims, then what replicas that are gone held or claimed.
        The registry changes first; the replicas are told afterwards, all at once and each
        within RELEASE_TIMEOUT_S, so one replica that does not answer (at its
        max_ongoing_requests, or hung) holds up neither this round nor the next."""
        ended = []
        for conv in self.store.expire(now):
            log.info("lease of %s on %s ended: evicted (history kept)", conv.id, conv.replica)
            ended.append(conv)
        for conv in self.store.expire_claims(now):
            log.info("turn claim on %s by %s ended: evicted (history kept)", conv.id, conv.claim_holder)
            ended.append(conv)
        if self.args.retention_days is not None:
            for conv in self.store.delete_idle(self.args.retention_days * DAY_S, now):
                log.info("%s idle past the retention (%g days): deleted", conv.id, self.args.retention_days)
                ended.append(conv)
        holders = self.store.claim_holders()  # before the lookup: a claim made after it is not judged by it
        live = await self._live_names(max_age=0)
        if live is not None:
            for holder in holders:
                if holder_gone(holder, live):
                    ended += self._end_claims_of(holder)
            self._evict_gone_replicas(live)
        await self._release_all(ended)

    async def _live_names(self, max_age: float | None = None) -> set[str] | None:
        at, live = self._live
        if time.monotonic() - at > (LIVENESS_CACHE_S if max_age is None else max_age):
            try:
                live = await asyncio.to_thread(self._live_actors)  # a GCS call: off the event loop
            except Exception as exc:  # noqa: BLE001 - no view of the cluster: only deadlines end claims
                log.warning("could not list live actors: %s", exc)
                live = None
            self._live = (time.monotonic(), live)
        return live

    def _evict_gone_replicas(self, live: set[str]) -> None:
        """A replica that died, or was drained on scale-down, holds nothing any more: its
        conversations are evicted and re-prefill wherever their next turn lands."""
        if self._app is None:
            return
        prefix = f"{SERVE_REPLICA_PREFIX}{self._app}#TargetWorker#"
        running = {name[len(prefix):] for name in live if name.startswith(prefix)}
        for replica in self.store.holding_replicas() - running:
            n = self.store.evict_replica(replica)
            log.info("replica %s is gone: %d conversations evicted (histories kept)", replica, n)

    def _end_claims_of(self, holder: str) -> list[Conversation]:
        ended = self.store.release_holder(holder)
        for conv in ended:
            log.info("%s is gone mid-turn: the claim on %s ended (history kept)", holder, conv.id)
        return ended

    async def _release_all(self, conversations: list[Conversation]) -> None:
        await asyncio.gather(*(self._release(conv.id, conv.replica) for conv in conversations))

    async def _release(self, conversation_id: str, replica: str | None) -> None:
        """Tell `replica` to unpin a conversation's KV, waiting RELEASE_TIMEOUT_S at most: an
        unpin that never lands costs memory on that replica (its KV stays until pressure
        evicts it), never correctness, so nothing waits on it for long."""
        if self.worker is None or replica is None:
            return
        response = self.worker.release_lease.remote(conversation_id, route_to=replica, strict=True)
        try:
            await asyncio.wait_for(_answer(response), RELEASE_TIMEOUT_S)
        except TimeoutError:
            response.cancel()  # out of the replica's queue, where it may still wait
            log.warning("no answer from %s releasing %s within %.0f s; left to its memory pressure", replica,
                        conversation_id, RELEASE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a dead replica holds nothing any more
            log.warning("could not release %s on %s: %s", conversation_id, replica, exc)

    async def create(self, tenant: str, messages: list[dict]) -> ConversationView:
        self._ensure_expiry_task()
        return _public(self.store.create(tenant, messages))

    async def get(self, tenant: str, conversation_id: str) -> ConversationView:
        self._ensure_expiry_task()
        return _public(self.store.get(tenant, conversation_id))

    async def begin_turn(self, tenant: str, conversation_id: str, messages: list[dict], holder: str | None = None,
                         idempotency_key: str | None = None, claim_s: float | None = None,
                         claim_token: str | None = None) -> ConversationView:
        """Append `messages` and claim the conversation for one turn.

        holder: the calling replica (`turn_claims.holder_identity()`); its claim ends as
            soon as the router finds it gone. claim_s: the claim's deadline from now, for a
            holder that renews it (`renew_turn`); default: longer than any turn.
        idempotency_key: a retry with the same key and messages appends nothing; when that
            turn finished, the result's `replayed` holds its reply and finish reason (do not
            generate), else the failed turn is claimed again.
        claim_token: the calling request's; the same call again (its answer lost with a router
            replica) gets the claim it made back instead of ConversationBusy.
        A history that would pass max_prompt_chars is refused (PayloadTooLarge) before
        anything is appended. The result: the conversation, with the whole history to
        generate from, its `version` (the turn's) and the `replica` that holds its KV."""
        self._ensure_expiry_task()
        begin = partial(self.store.begin_turn, tenant, conversation_id, messages, holder=holder,
                        claim_s=_claim_s(claim_s), idempotency_key=idempotency_key, limits=self.limits,
                        claim_token=claim_token)
        try:
            conv = begin()
        except ConversationBusy:
            # the turn's holder may be gone: killed mid-turn, or before a restart
            if not await self._release_if_holder_gone(tenant, conversation_id):
                raise
            conv = begin()
        return _public(conv, turn=True)

    async def _release_if_holder_gone(self, tenant: str, conversation_id: str) -> bool:
        conv = self.store.get(tenant, conversation_id)
        if conv.state != GENERATING or conv.claim_holder is None:
            return False
        if not holder_gone(conv.claim_holder, await self._live_names()):
            return False
        # Gone in a cached view: look again before ending a claim (the holder may be newer).
        if not holder_gone(conv.claim_holder, await self._live_names(max_age=0)):
            return False
        await self._release_all(self._end_claims_of(conv.claim_holder))
        return True

    async def renew_turn(self, tenant: str, conversation_id: str, version: int, claim_s: float | None = None) -> float:
        """Push turn `version`'s claim deadline to `claim_s` from now (the new deadline).
        ConversationBusy: the claim was lost; stop the turn."""
        return self.store.renew_turn(tenant, conversation_id, version, _claim_s(claim_s))

    async def finish_turn(self, tenant: str, conversation_id: str, version: int, reply: str, replica: str | None,
                          lease_s: float | None, finish_reason: str | None = None) -> ConversationView:
        """Store the turn's reply (the conversation pauses, its KV pinned on `replica` for
        the lease). What `replica` evicted while it ran the turn the ingress reported with
        the reply's last chunk (`mark_evicted`), as it does for every reply."""
        lease = min(lease_s or self.args.default_lease_s, self.args.max_lease_s)
        previous = self.store.get(tenant, conversation_id).replica
        conv = self.store.finish_turn(tenant, conversation_id, version, reply, replica, lease, finish_reason)
        if previous is not None and previous != replica:  # the turn moved: unpin the old copy
            await self._release(conversation_id, previous)
        return _public(conv)

    async def abandon_turn(self, tenant: str, conversation_id: str, version: int | None = None,
                           pinned_on: str | None = None) -> None:
        """End a failed turn; with `version`, only if that turn still holds the conversation.
        `pinned_on`: a replica that finished the failed reply (its KV is pinned there under
        the conversation's lease), told to release it too."""
        previous = self.store.get(tenant, conversation_id).replica
        if self.store.abandon_turn(tenant, conversation_id, version):
            await self._release(conversation_id, previous)
        if pinned_on is not None and pinned_on != previous:
            await self._release(conversation_id, pinned_on)

    async def refuse_turn(self, tenant: str, conversation_id: str, version: int, messages: list[dict]) -> None:
        """Turn `version` was refused before generating (an invalid request): its messages
        leave the history and the conversation is as it was before the turn
        (`SqlConversationStore.refuse_turn`)."""
        self.store.refuse_turn(tenant, conversation_id, version, messages)

    async def delete(self, tenant: str, conversation_id: str) -> bool:
        conv = self.store.delete(tenant, conversation_id)
        await self._release(conv.id, conv.replica)
        return True

    async def store_health(self) -> dict:
        """Whether the store answers a trivial query and its latency (`StoreHealth`), asked
        off the event loop: a server that does not answer holds up no turn."""
        return asdict(await asyncio.to_thread(self.store.health))

    async def mark_evicted(self, conversation_ids: list[str], replica: str) -> int:
        """A replica gave up these conversations' KV under memory pressure."""
        return self.store.mark_evicted(conversation_ids, replica)


async def _answer(response) -> object:
    return await response


def _claim_s(claim_s: float | None) -> float:
    return UNRENEWED_CLAIM_S if claim_s is None else min(max(claim_s, MIN_CLAIM_S), UNRENEWED_CLAIM_S)


def _public(conv: Conversation, turn: bool = False) -> ConversationView:
    """What callers see: never the claim's holder (an internal actor name) or token; `replayed`
    only from begin_turn (test_conversation_store ties the view's keys to the record's)."""
    out = asdict(conv)
    del out["claim_holder"], out["claim_token"]
    if not turn:
        del out["replayed"]
    return cast(ConversationView, out)


# replicas: conversations.router_replicas (app.build_app); more than one need a shared store
ConversationRouterDeployment = serve.deployment(name="ConversationRouter", num_replicas=1)(ConversationRouter)

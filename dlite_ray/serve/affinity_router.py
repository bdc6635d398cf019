"""ConversationAffinityRouter: Serve's replica choice for TargetWorker.

A conversation's next turn should land where its KV and boundary features are pinned:
the ingress passes `route_to` (the holding replica from the ConversationRouter's
registry) and `conversation` (its id) as keyword arguments; replicas also publish the
conversations they hold through `record_routing_stats`, which covers a registry that
has not heard yet. Requests without a holder go to a replica chosen by a stable hash of
their prompt prefix (so shared system prompts and tool schemas hit the same prefix
cache), among replicas that still have KV room and are not far busier than the least
busy one; Serve then picks the shortest queue
inside each rank, and falls through the ranks when a replica is full.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# Below this fraction of free KV blocks a replica is only used when nothing roomier is.
MIN_FREE_KV = 0.1
# Prefix affinity yields to load: a replica running this many more requests than the least
# busy one is not preferred (a shared system prompt must not pile a fleet onto one replica).
MAX_EXTRA_RUNNING = 4


def rank_replicas(replicas: Sequence[Any], route_to: str | None = None, conversation: str | None = None,
                  prefix_key: str | None = None, strict: bool = False) -> list[list[Any]]:
    """Ranks of replicas, most preferred first (each replica appears once). `strict`: only
    the `route_to` replica while it exists (a call that means nothing elsewhere, e.g. a
    lease release, waits for it instead of falling through to another replica)."""
    if not replicas:
        return []
    first = [r for r in replicas if r.replica_id.unique_id == route_to]
    if strict and first:
        return [first]
    if not first and conversation is not None:
        first = [r for r in replicas if conversation in _stats(r).get("leases", ())][:1]
    roomy = [r for r in replicas if _stats(r).get("kv_free_fraction", 1.0) >= MIN_FREE_KV]
    if not first and prefix_key is not None and roomy:
        least = min(_stats(r).get("running", 0) for r in roomy)
        fair = [r for r in roomy if _stats(r).get("running", 0) <= least + MAX_EXTRA_RUNNING]
        first = [max(fair, key=lambda r: _affinity(prefix_key, r.replica_id.unique_id))]
    rest = [r for r in roomy if r not in first]
    tight = [r for r in replicas if r not in first and r not in rest]
    return [rank for rank in (first, rest, tight) if rank]


def prefix_key(prompt: Any, chars: int = 2048) -> str:
    """What a request shares with others (the start of its prompt: system prompt, tool
    schemas), as a short stable key. `prompt` is text, chat messages or token ids."""
    return hashlib.blake2b(json.dumps(prompt)[:chars].encode(), digest_size=8).hexdigest()


def _affinity(key: str, replica: str) -> bytes:
    # rendezvous hashing: a stable choice that moves few keys when replicas come and go
    return hashlib.blake2b(f"{key}/{replica}".encode(), digest_size=8).digest()


def _stats(replica: Any) -> dict:
    return getattr(replica, "routing_stats", None) or {}


class ConversationAffinityRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        kwargs = pending_request.kwargs if pending_request is not None else {}
        return rank_replicas(candidate_replicas, kwargs.get("route_to"), kwargs.get("conversation"),
                             kwargs.get("prefix_key"), kwargs.get("strict", False))

"""Turn claims: a conversation generates one turn at a time, and a claim that loses its
holder must end by itself, or the conversation answers "already generating" for good.

A claim records its holder (the Serve replica that runs the turn, by its actor name) and a
deadline. It ends when the holder finishes or abandons the turn, when its deadline passes,
or when the router finds its holder gone (a killed ingress replica, a restarted
application). A holder that renews its claim while the turn streams can ask for a short
deadline; one that does not gets a deadline longer than any turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from dlite_ray.serve.errors import ConversationBusy, ConversationNotFound
from dlite_ray.serve.store_contract import TurnOutcomeView
from dlite_ray.serve.worker_messages import GenerateChunk

log = logging.getLogger(__name__)

UNRENEWED_CLAIM_S = 900.0
"""Deadline of a claim that is not renewed: longer than any turn (max_tokens_cap tokens on a
loaded CPU), so that only a lost turn outlives it."""
RENEWED_CLAIM_S = 30.0
"""Deadline a renewing holder asks for; it renews every third of it."""
MAX_IDEMPOTENCY_KEY_CHARS = 255
SERVE_REPLICA_PREFIX = "SERVE_REPLICA::"  # only holders named so can be judged gone


def holder_identity() -> str | None:
    """The calling Serve replica's actor name (`SERVE_REPLICA::app#deployment#id`): the
    claim holder a router can look up among live actors. None outside Serve."""
    from ray import serve

    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # noqa: BLE001 - not inside a Serve replica
        return None


def live_actor_names() -> set[str] | None:
    """Names of the cluster's live named actors (Serve replicas among them); None without Ray."""
    import ray

    if not ray.is_initialized():
        return None
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def holder_gone(holder: str | None, live: set[str] | None) -> bool:
    """Whether a claim's holder is known to be gone (unknown holders never are)."""
    return live is not None and holder is not None and holder.startswith(SERVE_REPLICA_PREFIX) and holder not in live


async def renewed(chunks: AsyncIterator[GenerateChunk], renew: Callable[[], Awaitable[object]],
                  claim_s: float = RENEWED_CLAIM_S) -> AsyncGenerator[GenerateChunk, None]:
    """`chunks`, with the turn's claim renewed every `claim_s / 3` seconds while they stream
    (also while one chunk is slow: a long prefill). A claim found lost (another turn took
    over after its deadline) ends the stream with ConversationBusy; a renewal that fails
    otherwise (the router restarting) is retried at the next period."""
    lost: list[BaseException] = []

    async def renew_forever() -> None:
        while True:
            await asyncio.sleep(claim_s / 3)
            try:
                await renew()
            except Exception as exc:  # noqa: BLE001 - a typed loss ends the turn, anything else is retried
                if _claim_lost(exc):
                    lost.append(exc)
                    return
                log.warning("could not renew a turn claim (retrying): %s", exc)

    task = asyncio.get_running_loop().create_task(renew_forever())
    try:
        async for chunk in chunks:
            if lost:
                raise ConversationBusy(f"the turn lost its claim: {lost[0]}")
            yield chunk
    finally:
        task.cancel()


def _claim_lost(exc: BaseException) -> bool:
    lost = (ConversationBusy, ConversationNotFound)
    return isinstance(exc, lost) or isinstance(getattr(exc, "cause", None), lost)


def replay_chunk(replayed: TurnOutcomeView) -> GenerateChunk:
    """The one, last chunk of a turn replayed from its idempotency key, shaped like a
    TargetWorker's (`replayed` as returned in `begin_turn`'s result)."""
    return GenerateChunk([], replayed["reply"], finished=True, finish_reason=replayed["finish_reason"] or "stop",
                         replayed=True)

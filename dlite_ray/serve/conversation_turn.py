"""A conversation turn: claim the conversation, generate from its history, store the reply
(or give the turn up), in three calls: the router's `begin_turn`, the worker's `generate`,
the router's `finish_turn` / `abandon_turn` / `refuse_turn` (and `renew_turn` every few
seconds while the reply streams).

With several router replicas, one may die with a call in flight, after or before it reached
the store; a store restart fails a call mid-transaction. The calls that are safe to repeat
are repeated (`_through_router`): a claim by its token, a finish by its reply, an abandon by
its version. A refusal is not (a new turn may take the refused version again in between)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.serve.errors import BadRequest, OutputFailed, ReplicaUnavailable, StoreUnavailable, unwrap
from dlite_ray.serve.held_reply import held_for_tool_calls
from dlite_ray.serve.request_types import ConversationTurn
from dlite_ray.serve.store_contract import ConversationView
from dlite_ray.serve.tool_prompt import forced_call_params, functions_in, tools_in
from dlite_ray.serve.turn_claims import RENEWED_CLAIM_S, renewed, replay_chunk
from dlite_ray.serve.worker_messages import GenerateChunk

# DLiteIngress._start: a request sent to a worker, once accepted -> (its chunks, cancel)
Start = Callable[..., Awaitable[tuple[AsyncIterator[GenerateChunk], Callable[[], None]]]]
ROUTER_ATTEMPTS = 7
ROUTER_RETRY_S = 0.1  # doubled after each lost call: 12.7 s in all, past a database restart or failover
_LOST = (ActorDiedError, ActorUnavailableError, RayActorError, ReplicaUnavailable, StoreUnavailable)


class ConversationTurns:
    """Runs conversation turns for an ingress replica (`holder`, the claims' holder)."""

    def __init__(self, router: DeploymentHandle, holder: str | None, start: Start):
        self.router, self.holder, self.start = router, holder, start

    async def run(self, tenant: str, conversation_id: str, turn: ConversationTurn,
                  idempotency_key: str | None = None) -> AsyncIterator[GenerateChunk]:
        """Claim the conversation, generate from its whole history, store the reply, pause.
        The history's KV and boundary features stay cached on the replica that made them;
        a miss re-prefills from the durable history (slower, never wrong). The claim names
        this replica and is renewed while the reply streams, so a turn whose ingress dies
        frees the conversation (turn_claims.py); a retry with the same idempotency key
        replays the stored reply instead of appending the turn twice.

        A history over max_prompt_chars is refused by begin_turn before anything is
        appended; one the engine refuses (over the context) is refused before its first
        token, and `refuse_turn` takes the turn's messages back out: a client's retry does
        not pile up copies of the same messages."""
        token = uuid.uuid4().hex  # this request's claim: a repeated begin_turn gets it back
        conv: ConversationView = await _through_router(lambda: self.router.begin_turn.remote(
            tenant, conversation_id, turn.new_messages, holder=self.holder, idempotency_key=idempotency_key,
            claim_s=RENEWED_CLAIM_S, claim_token=token))
        tools = () if turn.tool_choice == "none" else tools_in(conv["messages"])
        replayed = conv.get("replayed")
        if replayed is not None:  # finished before: the stored reply, nothing generated
            async for chunk in held_for_tool_calls(_one(replay_chunk(replayed)), tools):
                yield chunk
            return
        version = conv["version"]
        accepted = False

        async def reply() -> AsyncIterator[GenerateChunk]:
            nonlocal accepted
            params = _under_tool_choice(turn, conv["messages"])
            # to the replica that holds this conversation's KV (the affinity router falls back
            # to load when it is gone); the reply's KV stays pinned there (the lease)
            chunks, _ = await self.start(conv["messages"], params, route_to=conv["replica"],
                                         conversation=conversation_id, tenant=tenant)
            accepted = True
            async for chunk in chunks:
                yield chunk

        text, last, refused, failed_on = "", None, False, None
        chunks = renewed(reply(), lambda: self.router.renew_turn.remote(tenant, conversation_id, version,
                                                                        RENEWED_CLAIM_S))
        try:
            async for chunk in held_for_tool_calls(chunks, tools):
                # the history keeps calls as the model wrote them (raw_text: held_for_tool_calls sets it)
                text += chunk.raw_text if chunk.raw_text is not None else chunk.text
                last = chunk if chunk.finished else last
                yield chunk
        except OutputFailed as exc:
            failed_on = exc.replica  # the engine finished that reply: its KV stays pinned there
            raise
        except Exception as exc:
            refused = not accepted and isinstance(unwrap(exc), InvalidRequest)
            raise
        finally:
            await chunks.aclose()  # no renewal may land after the turn ends (it would claim it again)
            if last is not None:
                await _through_router(lambda: self.router.finish_turn.remote(
                    tenant, conversation_id, version, text, last.replica, turn.lease_s,
                    finish_reason=last.finish_reason))
            elif refused:
                await self.router.refuse_turn.remote(tenant, conversation_id, version, turn.new_messages)
            else:
                await _through_router(lambda: self.router.abandon_turn.remote(
                    tenant, conversation_id, version=version, pinned_on=failed_on))


def _under_tool_choice(turn: ConversationTurn, history: list[dict[str, str]]) -> SamplingParams:
    """The turn's sampling under the grammar of a call its tool_choice forces. A choice the
    conversation's tools cannot meet is refused as the engine refuses a request, before any
    token, so `refuse_turn` takes the turn's messages back out."""
    try:
        return forced_call_params(turn.params, turn.tool_choice, functions_in(history))
    except BadRequest as exc:
        raise InvalidRequest(str(exc)) from exc


async def _through_router(call: Callable[[], Awaitable[Any]]) -> Any:
    """`call()` (a router call that is safe to repeat), again while it is lost: its router
    replica died (Serve sends the next call to a live one) or the store did not answer."""
    delay = ROUTER_RETRY_S
    for _ in range(ROUTER_ATTEMPTS - 1):
        try:
            return await call()
        except Exception as exc:  # noqa: BLE001 - only a lost call is repeated
            if not isinstance(unwrap(exc), _LOST):
                raise
        await asyncio.sleep(delay)
        delay *= 2
    return await call()


async def _one(chunk: GenerateChunk) -> AsyncIterator[GenerateChunk]:
    yield chunk

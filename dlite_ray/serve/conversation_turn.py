"""A conversation turn: claim the conversation, generate from its history, store the reply,
release the claim (or abandon the turn when it fails)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from ray.serve.handle import DeploymentHandle

from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import OutputFailed
from dlite_ray.serve.held_reply import held_for_tool_calls
from dlite_ray.serve.request_limits import check_prompt_chars
from dlite_ray.serve.request_types import ConversationTurn, ParsedRequest
from dlite_ray.serve.tool_prompt import tools_in
from dlite_ray.serve.turn_claims import RENEWED_CLAIM_S, renewed, replay_chunk


class ConversationTurns:
    """Runs conversation turns for an ingress replica (`holder`, the claims' holder)."""

    def __init__(self, router: DeploymentHandle, worker: DeploymentHandle, holder: str | None, limits: LimitArgs,
                 generate: Callable[..., AsyncIterator[dict]]):
        self.router, self.worker, self.holder, self.limits, self.generate = router, worker, holder, limits, generate

    async def run(self, tenant: str, conversation_id: str, turn: ConversationTurn,
                  idempotency_key: str | None = None) -> AsyncIterator[dict]:
        """Claim the conversation, generate from its whole history, store the reply, pause.
        The history's KV and boundary features stay cached on the replica that made them;
        a miss re-prefills from the durable history (slower, never wrong). The claim names
        this replica and is renewed while the reply streams, so a turn whose ingress dies
        frees the conversation (turn_claims.py); a retry with the same idempotency key
        replays the stored reply instead of appending the turn twice."""
        # A history that could never be served (over the context) is refused before anything
        # is appended, so a client's retry does not pile up copies of the same messages.
        current = await self.router.get.remote(tenant, conversation_id)
        pending = turn.new_messages
        if idempotency_key and current["messages"][-len(pending):] == pending:
            pending = []  # a retry: its messages are in the history already
        check_prompt_chars(current["messages"] + pending, self.limits,
                           "the conversation's history and this turn's messages")
        await self.worker.encode.remote(current["messages"] + pending)
        conv = await self.router.begin_turn.remote(tenant, conversation_id, turn.new_messages, holder=self.holder,
                                                   idempotency_key=idempotency_key, claim_s=RENEWED_CLAIM_S)
        if conv.get("replayed") is not None:  # finished before: the stored reply, nothing generated
            async for chunk in held_for_tool_calls(_one(replay_chunk(conv["replayed"])), tools_in(conv["messages"])):
                yield chunk
            return
        version = conv["version"]
        text, replica, evicted, done, finish, failed_on = "", None, [], False, None, None
        # to the replica that holds this conversation's KV (the affinity router falls back
        # to load when it is gone); the reply's KV stays pinned there (the lease)
        chunks = renewed(self.generate(ParsedRequest(conv["messages"], turn.params), route_to=conv["replica"],
                                        conversation=conversation_id),
                         lambda: self.router.renew_turn.remote(tenant, conversation_id, version, RENEWED_CLAIM_S))
        try:
            async for chunk in held_for_tool_calls(chunks, tools_in(conv["messages"])):
                text += chunk["raw_text"]  # the history keeps calls as the model wrote them
                replica = chunk.get("replica") or replica
                evicted = chunk.get("evicted") or evicted
                finish = chunk["finish_reason"] or finish
                done = done or chunk["finished"]
                yield chunk
        except OutputFailed as exc:
            failed_on = exc.replica  # the engine finished that reply: its KV stays pinned there
            raise
        finally:
            await chunks.aclose()  # no renewal may land after the turn ends (it would claim it again)
            if failed_on is not None:
                await self.worker.release_lease.remote(conversation_id, route_to=failed_on, strict=False)
            if done:
                await self.router.finish_turn.remote(tenant, conversation_id, version, text, replica, turn.lease_s,
                                                     finish_reason=finish)
                evicted = [c for c in evicted if c != conversation_id]  # this reply pinned it again
                if evicted:
                    await self.router.mark_evicted.remote(evicted, replica)
            else:
                await self.router.abandon_turn.remote(tenant, conversation_id, version=version)


async def _one(chunk: dict) -> AsyncIterator[dict]:
    yield chunk

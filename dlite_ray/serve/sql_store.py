"""The conversation store over SQL: one implementation of the contract (store_contract),
shared by the SQLite and PostgreSQL backends, which differ only in how they connect and
open a transaction (and PostgreSQL's per-tenant lock, below).

Every write of a conversation row is a compare-and-set on its `revision` (sql_rows): a
write that finds the row changed since it read it (another router replica claimed the turn
first) changes nothing, and its operation runs again from the read, which now sees the
other's write (a claim then answers ConversationBusy). The turn `version` alone could not
serve: a refused turn takes it back, and renewals, expiry and a finished turn's reply keep it.

A turn's claim, its idempotency key and the history it appends change in one transaction,
and a tenant's quota is checked in the transaction of the write it guards: a write that
would pass the tenant's caps is refused (QuotaExceeded, naming the limit); a turn's reply
is stored whatever its size (it was generated already), so a tenant passes its byte cap by
at most the replies of the turns it has running.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest, ConversationBusy, QuotaExceeded
from dlite_ray.serve.request_limits import check_prompt_chars
from dlite_ray.serve.sql_rows import (
    COLUMNS,
    Query,
    WriteConflict,
    delete_row,
    history_size,
    parse_row,
    read_row,
    release_row,
    set_columns,
    try_release_row,
    turn_key,
    write_row,
)
from dlite_ray.serve.store_contract import (
    CLOSED,
    EVICTED,
    GENERATING,
    PAUSED,
    Conversation,
    StoreHealth,
    TenantQuota,
    TurnOutcome,
)
from dlite_ray.serve.turn_claims import UNRENEWED_CLAIM_S

T = TypeVar("T")
CAS_ATTEMPTS = 16  # reads-then-writes of one operation before it gives up (ConversationBusy)
class SqlConversationStore(ABC):
    """The contract (`store_contract.ConversationRegistry`) over SQL; subclasses connect."""

    backend = "sql"

    def __init__(self, quota: TenantQuota | None = None):
        self.quota = quota or TenantQuota()

    @abstractmethod
    def _transaction(self, write: bool = True) -> AbstractContextManager[Query]:
        """BEGIN ... COMMIT around the block (ROLLBACK when it raises); `write=False`: reads
        that need no transaction of their own."""

    @abstractmethod
    def _lock_tenant(self, q: Query, tenant: str) -> None:
        """Hold writes that check `tenant`'s quota one at a time until this transaction ends,
        so that no two both fit under a cap."""

    @abstractmethod
    def close(self) -> None:
        """Let go of the connections; the store answers nothing after."""

    # -- the contract ------------------------------------------------------------------------

    def create(self, tenant: str, messages: list[dict[str, str]]) -> Conversation:
        """A new conversation of `tenant`; QuotaExceeded where it would pass the tenant's caps."""
        conv = Conversation(secrets.token_urlsafe(18), tenant, 0, PAUSED, None, None, list(messages))
        history = json.dumps(conv.messages)
        size, now = history_size(history), time.time()
        with self._transaction() as q:
            self._check_quota(q, tenant, size, new_conversation=True)
            q("INSERT INTO conversations (id, tenant, version, state, messages, bytes, created, updated, revision) "
              "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)", (conv.id, tenant, 0, PAUSED, history, size, now, now))
        return conv

    def get(self, tenant: str, conversation_id: str) -> Conversation:
        with self._transaction(write=False) as q:
            return read_row(q, tenant, conversation_id)[0]

    def begin_turn(self, tenant: str, conversation_id: str, messages: list[dict[str, str]], *,
                   holder: str | None = None, claim_s: float = UNRENEWED_CLAIM_S,
                   idempotency_key: str | None = None, limits: LimitArgs | None = None,
                   now: float | None = None, claim_token: str | None = None) -> Conversation:
        """Append the new messages and claim the conversation for one generation, for
        `holder` until `claim_s` from now (a claim whose deadline passed is taken over).

        With an `idempotency_key` seen before on this conversation: a finished turn is not
        run again (the result carries `replayed`, the messages are not appended); a turn
        that failed is claimed again without appending its messages a second time.
        `limits`: a history that would pass `max_prompt_chars` is refused (PayloadTooLarge)
        before anything is appended. `claim_token`: the calling request's; called again with
        it while its claim holds the conversation, the claim is returned as it is (the first
        answer was lost: a router replica died after the claim was stored)."""
        now = time.time() if now is None else now
        digest = _digest(messages)

        def attempt(q: Query) -> Conversation:
            conv, revision = self._load_for_write(q, tenant, conversation_id)
            if claim_token is not None and conv.state == GENERATING and conv.claim_token == claim_token:
                return conv
            key = turn_key(q, conv.id, idempotency_key)
            if key is not None:
                version, key_digest, reply_index, finish_reason = key
                if key_digest != digest:
                    raise BadRequest("this idempotency key was used with other messages")
                if reply_index is not None:
                    conv.replayed = TurnOutcome(conv.messages[reply_index]["content"], finish_reason)
                    return conv
                _check_claimable(conv, now)
                if version != conv.version:
                    raise ConversationBusy(f"the turn of this idempotency key on {conversation_id} was superseded")
                _check_history(conv.messages, limits)
            else:
                _check_claimable(conv, now)
                _check_history(conv.messages + messages, limits)
                grown = history_size(json.dumps(conv.messages + messages)) - history_size(json.dumps(conv.messages))
                self._check_quota(q, tenant, grown)
                conv.messages += messages
            conv.version += 1
            conv.state, conv.claim_holder, conv.claim_deadline = GENERATING, holder, now + claim_s
            conv.claim_token = claim_token
            write_row(q, conv, revision, now)
            if idempotency_key is not None:
                q("INSERT INTO turn_keys (conversation_id, key, version, digest, reply_index, finish_reason, created) "
                  "VALUES (?, ?, ?, ?, NULL, NULL, ?) ON CONFLICT (conversation_id, key) DO UPDATE SET "
                  "version = excluded.version, digest = excluded.digest, reply_index = NULL, finish_reason = NULL, "
                  "created = excluded.created", (conv.id, idempotency_key, conv.version, digest, now))
            return conv

        return self._retrying(attempt)

    def renew_turn(self, tenant: str, conversation_id: str, version: int, claim_s: float,
                   now: float | None = None) -> float:
        """Push the claim of turn `version` to `claim_s` from now; its new deadline. A claim
        that ended (deadline passed, holder judged gone) while nobody took over is claimed
        again (its holder is evidently alive). ConversationBusy when another turn took over,
        or this one finished, was abandoned or refused: a renewal that arrives after its
        turn gave up must not claim the conversation back (retries would get 409)."""
        now = time.time() if now is None else now

        def attempt(q: Query) -> float:
            conv, revision = read_row(q, tenant, conversation_id)
            ended_claim = conv.state == EVICTED and conv.claim_deadline is not None
            if conv.version != version or not (conv.state == GENERATING or ended_claim):
                raise ConversationBusy(f"turn {version} of {conversation_id} no longer holds it")
            set_columns(q, conv.id, revision, state=GENERATING, claim_deadline=now + claim_s, updated=now)
            return now + claim_s

        return self._retrying(attempt)

    def finish_turn(self, tenant: str, conversation_id: str, version: int, reply: str, replica: str | None,
                    lease_s: float, finish_reason: str | None = None) -> Conversation:
        """Store the reply; the conversation pauses with its KV held on `replica` until the
        lease ends. A turn whose claim ended stores its reply still, unless another turn
        took over (a new version). A turn already finished with this reply (the first
        call's answer was lost with a router replica) is returned as it is: a retried
        finish never appends the reply twice."""
        def attempt(q: Query) -> Conversation:
            conv, revision = self._load_for_write(q, tenant, conversation_id)
            if conv.version != version:
                raise ConversationBusy(f"conversation {conversation_id} moved on (version {conv.version})")
            finished = conv.state != GENERATING and conv.claim_deadline is None  # no claim open or ended
            if finished and conv.messages[-1:] == [{"role": "assistant", "content": reply}]:
                return conv
            now = time.time()
            conv.messages.append({"role": "assistant", "content": reply})
            conv.state, conv.replica, conv.lease_deadline = PAUSED, replica, now + lease_s
            conv.claim_holder = conv.claim_deadline = conv.claim_token = None
            write_row(q, conv, revision, now)
            q("UPDATE turn_keys SET reply_index = ?, finish_reason = ? WHERE conversation_id = ? AND version = ?",
              (len(conv.messages) - 1, finish_reason, conv.id, version))
            return conv

        return self._retrying(attempt)

    def abandon_turn(self, tenant: str, conversation_id: str, version: int | None = None) -> bool:
        """A failed generation: the appended messages stay (nothing is lost), the KV hold
        does not. With `version`, only that turn is abandoned (a turn that lost its claim
        leaves its successor alone). Whether anything changed."""
        def attempt(q: Query) -> bool:
            conv, revision = read_row(q, tenant, conversation_id)
            if version is not None and (conv.version != version or conv.state != GENERATING):
                return False
            release_row(q, conv, revision, claim_ended=False, now=time.time())
            return True

        return self._retrying(attempt)

    def refuse_turn(self, tenant: str, conversation_id: str, version: int, messages: list[dict[str, str]]) -> bool:
        """Turn `version` was refused before it generated (the engine found the request
        invalid, e.g. the history over the context): the conversation returns to where it
        was, as if the turn had never begun. Its `messages` leave the history, its version
        and idempotency key are forgotten (a retry appends again), and a KV hold it had
        stays. Whether anything changed (not when another turn took over)."""
        def attempt(q: Query) -> bool:
            conv, revision = self._load_for_write(q, tenant, conversation_id)
            if conv.version != version or conv.state != GENERATING:
                return False
            if messages and conv.messages[-len(messages):] == messages:
                del conv.messages[-len(messages):]
            q("DELETE FROM turn_keys WHERE conversation_id = ? AND version = ?", (conv.id, version))
            conv.version -= 1
            # paused where a replica holds it (or as created, before any turn), else evicted
            conv.state = PAUSED if conv.replica is not None or conv.version == 0 else EVICTED
            conv.claim_holder = conv.claim_deadline = conv.claim_token = None
            write_row(q, conv, revision, time.time())
            return True

        return self._retrying(attempt)

    def delete(self, tenant: str, conversation_id: str) -> Conversation:
        def attempt(q: Query) -> Conversation:
            conv, revision = read_row(q, tenant, conversation_id)
            if not delete_row(q, conv, revision):
                raise WriteConflict(conv.id)
            conv.state = CLOSED
            return conv

        return self._retrying(attempt)

    def delete_idle(self, idle_s: float, now: float | None = None) -> list[Conversation]:
        """Retention: conversations that no turn touched for `idle_s` seconds (none of
        them generating) are deleted with their idempotency keys, and returned as they
        were (the caller tells a replica that still pins one to let go)."""
        now = time.time() if now is None else now
        return self._each_where("state != ? AND updated < ?", (GENERATING, now - idle_s), delete_row)

    def expire(self, now: float | None = None) -> list[Conversation]:
        """Paused conversations whose lease ended: marked evicted (their history stays).
        Returned as they were, so the caller can tell each holding replica to release."""
        now = time.time() if now is None else now
        return self._each_where("state = ? AND lease_deadline < ?", (PAUSED, now), try_release_row)

    def expire_claims(self, now: float | None = None) -> list[Conversation]:
        """Turns whose claim deadline passed: their conversations return to use (evicted,
        history kept). Returned as they were, so the caller can release their KV holds."""
        now = time.time() if now is None else now
        return self._each_where("state = ? AND claim_deadline < ?", (GENERATING, now), try_release_row)

    def claim_holders(self) -> set[str]:
        """Holders of the turns being generated."""
        with self._transaction(write=False) as q:
            rows = q("SELECT DISTINCT claim_holder FROM conversations WHERE state = ? AND claim_holder IS NOT NULL",
                     (GENERATING,)).fetchall()
        return {h for (h,) in rows}

    def release_holder(self, holder: str) -> list[Conversation]:
        """`holder` is gone: its turns end now (evicted, history kept), returned as they were."""
        return self._each_where("state = ? AND claim_holder = ?", (GENERATING, holder), try_release_row)

    def evict_replica(self, replica: str) -> int:
        """A replica drained or died: what it held must be re-prefilled elsewhere."""
        def attempt(q: Query) -> int:
            return q("UPDATE conversations SET state = ?, replica = NULL, lease_deadline = NULL, "
                     "revision = revision + 1 WHERE replica = ? AND state = ?", (EVICTED, replica, PAUSED)).rowcount

        return self._retrying(attempt)

    def holding_replicas(self) -> set[str]:
        """Replicas that paused conversations are pinned on."""
        with self._transaction(write=False) as q:
            rows = q("SELECT DISTINCT replica FROM conversations WHERE state = ? AND replica IS NOT NULL",
                     (PAUSED,)).fetchall()
        return {r for (r,) in rows}

    def mark_evicted(self, conversation_ids: list[str], replica: str) -> int:
        """`replica` gave up these paused conversations' KV (memory pressure)."""
        def attempt(q: Query) -> int:
            return sum(q("UPDATE conversations SET state = ?, replica = NULL, lease_deadline = NULL, "
                         "revision = revision + 1 WHERE id = ? AND replica = ? AND state = ?",
                         (EVICTED, cid, replica, PAUSED)).rowcount for cid in conversation_ids)

        return self._retrying(attempt)

    def health(self) -> StoreHealth:
        """Whether a trivial query answers, and its round trip (a transaction's, as a turn sees it)."""
        started = time.perf_counter()
        try:
            with self._transaction() as q:
                q("SELECT 1").fetchone()
        except Exception as exc:  # noqa: BLE001 - whatever stops the query, the store is unreachable
            return StoreHealth(self.backend, False, None, f"{type(exc).__name__}: {exc}")
        return StoreHealth(self.backend, True, time.perf_counter() - started)

    # -- the machinery -------------------------------------------------------------------------

    def _retrying(self, attempt: Callable[[Query], T]) -> T:
        """`attempt` in a transaction, again from its read while a compare-and-set loses."""
        for _ in range(CAS_ATTEMPTS):
            try:
                with self._transaction() as q:
                    return attempt(q)
            except WriteConflict:
                continue
        raise ConversationBusy(f"the conversation changed under each of {CAS_ATTEMPTS} attempts; retry")

    def _load_for_write(self, q: Query, tenant: str, conversation_id: str) -> tuple[Conversation, int]:
        """The row and its revision, read to be written back by a compare-and-set (a test's hook)."""
        return read_row(q, tenant, conversation_id)

    def _each_where(self, where: str, params: tuple, write: Callable[[Query, Conversation, int], bool],
                    ) -> list[Conversation]:
        """`write` each row matching `where`, by compare-and-set: a row another writer changed
        since the read is left to the next round. The rows written, as they were."""
        def attempt(q: Query) -> list[Conversation]:
            rows = q(f"SELECT {COLUMNS} FROM conversations WHERE {where}", params).fetchall()
            done = []
            for row in rows:
                conv, revision = parse_row(row)
                if write(q, conv, revision):
                    done.append(parse_row(row)[0])
            return done

        return self._retrying(attempt)

    def _check_quota(self, q: Query, tenant: str, added_bytes: int, new_conversation: bool = False) -> None:
        """QuotaExceeded where `added_bytes` more (and a conversation more) would pass the
        tenant's caps. Called inside the write's transaction: no two writes both fit."""
        quota = self.quota
        if quota.max_conversations is None and quota.max_stored_bytes is None:
            return
        self._lock_tenant(q, tenant)
        count, stored = q("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM conversations WHERE tenant = ?",
                          (tenant,)).fetchone()
        count, stored = int(count), int(stored)  # PostgreSQL sums a BIGINT as NUMERIC
        if new_conversation and quota.max_conversations is not None and count >= quota.max_conversations:
            raise QuotaExceeded(f"this API key already has {count} conversations, its limit "
                                f"(max_conversations_per_tenant = {quota.max_conversations}); delete some to "
                                f"create more")
        if quota.max_stored_bytes is not None and added_bytes > 0 and stored + added_bytes > quota.max_stored_bytes:
            raise QuotaExceeded(f"this API key's conversations would hold {stored + added_bytes} bytes of history, "
                                f"over its limit (max_stored_bytes_per_tenant = {quota.max_stored_bytes}); delete "
                                f"some to add more")


def _check_claimable(conv: Conversation, now: float) -> None:
    if conv.state == GENERATING and (conv.claim_deadline is None or conv.claim_deadline > now):
        raise ConversationBusy(f"conversation {conv.id} is already generating")


def _check_history(messages: list[dict[str, str]], limits: LimitArgs | None) -> None:
    if limits is not None:
        check_prompt_chars(messages, limits, "the conversation's history and this turn's messages")


def _digest(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()

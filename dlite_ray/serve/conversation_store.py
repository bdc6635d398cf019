"""Durable conversation registry for the ConversationRouter (SQLite, plain Python).

Per conversation: an unguessable id, its tenant, the message history, a version bumped on
every claimed turn, the state (generating / paused / closed / evicted), the TargetWorker
replica holding its KV and boundary features, the lease deadline of that hold, and while
it generates, the turn's claim (holder and deadline, see turn_claims). History is never
deleted by expiry; only DeleteConversation removes it, and its text is overwritten in the
file (secure_delete). A conversation of another tenant does not exist for the caller (same
error as an unknown id). A turn may carry an idempotency key: its retry replays the stored
reply, or re-runs a turn that failed, instead of appending the messages again.

Each tenant's stored state is capped (`TenantQuota`): its live conversations, and the
bytes of their histories. The store enforces it, in the same transaction as the write it
guards, so the cap holds whatever backend keeps the histories: `create` and `begin_turn`
refuse (QuotaExceeded, naming the limit) what would pass it. A turn's reply is stored
whatever its size (it was generated already): a tenant passes its byte cap by at most the
replies of the turns it has running.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.conversation_db import CLOSED, EVICTED, GENERATING, PAUSED, open_db
from dlite_ray.serve.errors import BadRequest, ConversationBusy, ConversationNotFound, QuotaExceeded
from dlite_ray.serve.request_limits import check_prompt_chars
from dlite_ray.serve.turn_claims import MAX_IDEMPOTENCY_KEY_CHARS, UNRENEWED_CLAIM_S

__all__ = ["CLOSED", "EVICTED", "GENERATING", "PAUSED", "Conversation", "ConversationStore", "TenantQuota",
           "TurnOutcome"]

_COLUMNS = "id, tenant, version, state, replica, lease_deadline, messages, claim_holder, claim_deadline"


@dataclass(slots=True)
class TenantQuota:
    """What one tenant may keep in the store (None: no cap)."""

    max_conversations: int | None = None
    max_stored_bytes: int | None = None  # of its histories, as stored (UTF-8 JSON)

    def __post_init__(self):
        for name in ("max_conversations", "max_stored_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


@dataclass(slots=True)
class TurnOutcome:
    """What a finished turn answered: its retry under the same idempotency key gets this."""

    reply: str
    finish_reason: str | None


@dataclass(slots=True)
class Conversation:
    id: str
    tenant: str
    version: int
    state: str
    replica: str | None
    lease_deadline: float | None
    messages: list[dict[str, str]] = field(default_factory=list)
    claim_holder: str | None = None
    claim_deadline: float | None = None
    replayed: TurnOutcome | None = None  # set by begin_turn when its key names a finished turn


class ConversationStore:
    def __init__(self, path: str | Path = ":memory:", quota: TenantQuota | None = None):
        self._db = open_db(path)
        self._lock = threading.Lock()
        self.quota = quota or TenantQuota()

    def create(self, tenant: str, messages: list[dict[str, str]]) -> Conversation:
        """A new conversation of `tenant`; QuotaExceeded where it would pass the tenant's caps."""
        conv = Conversation(secrets.token_urlsafe(18), tenant, 0, PAUSED, None, None, list(messages))
        history = json.dumps(conv.messages)
        with self._lock, self._transaction():
            self._check_quota(tenant, _size(history), new_conversation=True)
            self._db.execute("INSERT INTO conversations (id, tenant, version, state, messages, bytes, created) "
                             "VALUES (?, ?, ?, ?, ?, ?, ?)", (conv.id, tenant, 0, PAUSED, history, _size(history),
                                                              time.time()))
        return conv

    def get(self, tenant: str, conversation_id: str) -> Conversation:
        with self._lock:
            return self._load(tenant, conversation_id)

    def begin_turn(self, tenant: str, conversation_id: str, messages: list[dict[str, str]], *,
                   holder: str | None = None, claim_s: float = UNRENEWED_CLAIM_S,
                   idempotency_key: str | None = None, limits: LimitArgs | None = None,
                   now: float | None = None) -> Conversation:
        """Append the new messages and claim the conversation for one generation, for
        `holder` until `claim_s` from now (a claim whose deadline passed is taken over).

        With an `idempotency_key` seen before on this conversation: a finished turn is not
        run again (the result carries `replayed`, the messages are not appended); a turn
        that failed is claimed again without appending its messages a second time.
        `limits`: a history that would pass `max_prompt_chars` is refused (PayloadTooLarge)
        before anything is appended."""
        now = time.time() if now is None else now
        digest = _digest(messages)
        with self._lock, self._transaction():
            conv = self._load(tenant, conversation_id)
            key = self._turn_key(conv.id, idempotency_key)
            if key is not None:
                version, key_digest, reply_index, finish_reason = key
                if key_digest != digest:
                    raise BadRequest("this idempotency key was used with other messages")
                if reply_index is not None:
                    conv.replayed = TurnOutcome(conv.messages[reply_index]["content"], finish_reason)
                    return conv
                self._check_claimable(conv, now)
                if version != conv.version:
                    raise ConversationBusy(f"the turn of this idempotency key on {conversation_id} was superseded")
                _check_history(conv.messages, limits)
            else:
                self._check_claimable(conv, now)
                _check_history(conv.messages + messages, limits)
                grown = _size(json.dumps(conv.messages + messages)) - _size(json.dumps(conv.messages))
                self._check_quota(tenant, grown)
                conv.messages += messages
            conv.version += 1
            conv.state, conv.claim_holder, conv.claim_deadline = GENERATING, holder, now + claim_s
            self._save(conv)
            if idempotency_key is not None:
                self._db.execute("INSERT OR REPLACE INTO turn_keys (conversation_id, key, version, digest, created) "
                                 "VALUES (?, ?, ?, ?, ?)", (conv.id, idempotency_key, conv.version, digest, now))
            return conv

    def renew_turn(self, tenant: str, conversation_id: str, version: int, claim_s: float,
                   now: float | None = None) -> float:
        """Push the claim of turn `version` to `claim_s` from now; its new deadline. A claim
        that ended (deadline passed, holder judged gone) while nobody took over is claimed
        again (its holder is evidently alive). ConversationBusy when another turn took over,
        or this one finished, was abandoned or refused: a renewal that arrives after its
        turn gave up must not claim the conversation back (retries would get 409)."""
        now = time.time() if now is None else now
        with self._lock:
            conv = self._load(tenant, conversation_id)
            ended_claim = conv.state == EVICTED and conv.claim_deadline is not None
            if conv.version != version or not (conv.state == GENERATING or ended_claim):
                raise ConversationBusy(f"turn {version} of {conversation_id} no longer holds it")
            self._db.execute("UPDATE conversations SET state = ?, claim_deadline = ? WHERE id = ?",
                             (GENERATING, now + claim_s, conv.id))
            return now + claim_s

    def finish_turn(self, tenant: str, conversation_id: str, version: int, reply: str, replica: str | None,
                    lease_s: float, finish_reason: str | None = None) -> Conversation:
        """Store the reply; the conversation pauses with its KV held on `replica` until the
        lease ends. A turn whose claim ended stores its reply still, unless another turn
        took over (a new version)."""
        with self._lock, self._transaction():
            conv = self._load(tenant, conversation_id)
            if conv.version != version:
                raise ConversationBusy(f"conversation {conversation_id} moved on (version {conv.version})")
            conv.messages.append({"role": "assistant", "content": reply})
            conv.state, conv.replica, conv.lease_deadline = PAUSED, replica, time.time() + lease_s
            conv.claim_holder = conv.claim_deadline = None
            self._save(conv)
            self._db.execute("UPDATE turn_keys SET reply_index = ?, finish_reason = ? "
                             "WHERE conversation_id = ? AND version = ?",
                             (len(conv.messages) - 1, finish_reason, conv.id, version))
            return conv

    def abandon_turn(self, tenant: str, conversation_id: str, version: int | None = None) -> bool:
        """A failed generation: the appended messages stay (nothing is lost), the KV hold
        does not. With `version`, only that turn is abandoned (a turn that lost its claim
        leaves its successor alone). Whether anything changed."""
        with self._lock:
            conv = self._load(tenant, conversation_id)
            if version is not None and (conv.version != version or conv.state != GENERATING):
                return False
            self._release(conv, claim_ended=False)
            return True

    def refuse_turn(self, tenant: str, conversation_id: str, version: int, messages: list[dict[str, str]]) -> bool:
        """Turn `version` was refused before it generated (the engine found the request
        invalid, e.g. the history over the context): the conversation returns to where it
        was, as if the turn had never begun. Its `messages` leave the history, its version
        and idempotency key are forgotten (a retry appends again), and a KV hold it had
        stays. Whether anything changed (not when another turn took over)."""
        with self._lock, self._transaction():
            conv = self._load(tenant, conversation_id)
            if conv.version != version or conv.state != GENERATING:
                return False
            if messages and conv.messages[-len(messages):] == messages:
                del conv.messages[-len(messages):]
            self._db.execute("DELETE FROM turn_keys WHERE conversation_id = ? AND version = ?", (conv.id, version))
            conv.version -= 1
            # paused where a replica holds it (or as created, before any turn), else evicted
            conv.state = PAUSED if conv.replica is not None or conv.version == 0 else EVICTED
            conv.claim_holder = conv.claim_deadline = None
            self._save(conv)
            return True

    def delete(self, tenant: str, conversation_id: str) -> Conversation:
        with self._lock, self._transaction():
            conv = self._load(tenant, conversation_id)
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            self._db.execute("DELETE FROM turn_keys WHERE conversation_id = ?", (conversation_id,))
            conv.state = CLOSED
            return conv

    def expire(self, now: float | None = None) -> list[Conversation]:
        """Paused conversations whose lease ended: marked evicted (their history stays).
        Returned as they were, so the caller can tell each holding replica to release."""
        now = time.time() if now is None else now
        return self._release_where("state = ? AND lease_deadline < ?", (PAUSED, now))

    def expire_claims(self, now: float | None = None) -> list[Conversation]:
        """Turns whose claim deadline passed: their conversations return to use (evicted,
        history kept). Returned as they were, so the caller can release their KV holds."""
        now = time.time() if now is None else now
        return self._release_where("state = ? AND claim_deadline < ?", (GENERATING, now))

    def claim_holders(self) -> set[str]:
        """Holders of the turns being generated."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT claim_holder FROM conversations "
                                    "WHERE state = ? AND claim_holder IS NOT NULL", (GENERATING,)).fetchall()
        return {h for (h,) in rows}

    def release_holder(self, holder: str) -> list[Conversation]:
        """`holder` is gone: its turns end now (evicted, history kept), returned as they were."""
        return self._release_where("state = ? AND claim_holder = ?", (GENERATING, holder))

    def evict_replica(self, replica: str) -> int:
        """A replica drained or died: what it held must be re-prefilled elsewhere."""
        with self._lock:
            cur = self._db.execute("UPDATE conversations SET state = ?, replica = NULL, lease_deadline = NULL "
                                   "WHERE replica = ? AND state = ?", (EVICTED, replica, PAUSED))
            return cur.rowcount

    def holding_replicas(self) -> set[str]:
        """Replicas that paused conversations are pinned on."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT replica FROM conversations "
                                    "WHERE state = ? AND replica IS NOT NULL", (PAUSED,)).fetchall()
        return {r for (r,) in rows}

    def mark_evicted(self, conversation_ids: list[str], replica: str) -> int:
        """`replica` gave up these paused conversations' KV (memory pressure)."""
        with self._lock:
            n = 0
            for cid in conversation_ids:
                cur = self._db.execute("UPDATE conversations SET state = ?, replica = NULL, lease_deadline = NULL "
                                       "WHERE id = ? AND replica = ? AND state = ?", (EVICTED, cid, replica, PAUSED))
                n += cur.rowcount
            return n

    def _check_quota(self, tenant: str, added_bytes: int, new_conversation: bool = False) -> None:
        """QuotaExceeded where `added_bytes` more (and a conversation more) would pass the
        tenant's caps. Called inside the write's transaction: no two writes both fit."""
        quota = self.quota
        if quota.max_conversations is None and quota.max_stored_bytes is None:
            return
        count, stored = self._db.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM conversations "
                                         "WHERE tenant = ?", (tenant,)).fetchone()
        if new_conversation and quota.max_conversations is not None and count >= quota.max_conversations:
            raise QuotaExceeded(f"this API key already has {count} conversations, its limit "
                                f"(max_conversations_per_tenant = {quota.max_conversations}); delete some to "
                                f"create more")
        if quota.max_stored_bytes is not None and added_bytes > 0 and stored + added_bytes > quota.max_stored_bytes:
            raise QuotaExceeded(f"this API key's conversations would hold {stored + added_bytes} bytes of history, "
                                f"over its limit (max_stored_bytes_per_tenant = {quota.max_stored_bytes}); delete "
                                f"some to add more")

    def _check_claimable(self, conv: Conversation, now: float) -> None:
        if conv.state == GENERATING and (conv.claim_deadline is None or conv.claim_deadline > now):
            raise ConversationBusy(f"conversation {conv.id} is already generating")

    def _release_where(self, where: str, params: tuple) -> list[Conversation]:
        with self._lock, self._transaction():
            rows = self._db.execute(f"SELECT {_COLUMNS} FROM conversations WHERE {where}", params).fetchall()
            for row in rows:
                self._release(_row(row))
            return [_row(r) for r in rows]

    def _release(self, conv: Conversation, claim_ended: bool = True) -> None:
        """Evicted, history kept. A turn claim that ended by its deadline or its holder's
        loss (`claim_ended`) keeps its passed deadline: the mark that its holder's late
        renewal may take it back (`renew_turn`); an abandoned turn's claim is cleared."""
        conv.state, conv.replica, conv.lease_deadline = EVICTED, None, None
        conv.claim_holder = None
        if not claim_ended:
            conv.claim_deadline = None
        self._save(conv)

    def _turn_key(self, conversation_id: str, key: str | None) -> tuple | None:
        if key is None:
            return None
        if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS:
            raise BadRequest(f"an idempotency key has 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters")
        return self._db.execute("SELECT version, digest, reply_index, finish_reason FROM turn_keys "
                                "WHERE conversation_id = ? AND key = ?", (conversation_id, key)).fetchone()

    @contextmanager
    def _transaction(self) -> Iterator[None]:
        """Several statements as one: a process killed between them leaves neither."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _load(self, tenant: str, conversation_id: str) -> Conversation:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None or row[1] != tenant:  # another tenant's conversation does not exist for you
            raise ConversationNotFound(f"no conversation {conversation_id!r}")
        return _row(row)

    def _save(self, conv: Conversation) -> None:
        history = json.dumps(conv.messages)
        self._db.execute("UPDATE conversations SET version = ?, state = ?, replica = ?, lease_deadline = ?, "
                         "messages = ?, bytes = ?, claim_holder = ?, claim_deadline = ? WHERE id = ?",
                         (conv.version, conv.state, conv.replica, conv.lease_deadline, history, _size(history),
                          conv.claim_holder, conv.claim_deadline, conv.id))


def _row(row: tuple) -> Conversation:
    return Conversation(row[0], row[1], row[2], row[3], row[4], row[5], json.loads(row[6]), row[7], row[8])


def _check_history(messages: list[dict[str, str]], limits: LimitArgs | None) -> None:
    if limits is not None:
        check_prompt_chars(messages, limits, "the conversation's history and this turn's messages")


def _size(history: str) -> int:
    """A stored history's bytes, as the quota counts them (SQLite's length(CAST(messages AS BLOB)))."""
    return len(history.encode())


def _digest(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()

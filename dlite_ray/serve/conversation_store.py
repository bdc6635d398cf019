"""Durable conversation registry for the ConversationRouter (SQLite, plain Python).

Per conversation: an unguessable id, its tenant, the message history, a version bumped on
every append, the state (generating / paused / closed / evicted), the TargetWorker replica
holding its KV and boundary features, and the lease deadline of that hold. History is
never deleted by expiry; only DeleteConversation removes it. A conversation of another
tenant does not exist for the caller (same error as an unknown id).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dlite_ray.serve.errors import ConversationBusy, ConversationNotFound

GENERATING, PAUSED, CLOSED, EVICTED = "generating", "paused", "closed", "evicted"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL,
    replica TEXT, lease_deadline REAL, messages TEXT NOT NULL, created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS by_lease ON conversations (state, lease_deadline);
"""


@dataclass(slots=True)
class Conversation:
    id: str
    tenant: str
    version: int
    state: str
    replica: str | None
    lease_deadline: float | None
    messages: list[dict[str, str]] = field(default_factory=list)


class ConversationStore:
    def __init__(self, path: str | Path = ":memory:"):
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def create(self, tenant: str, messages: list[dict[str, str]]) -> Conversation:
        conv = Conversation(secrets.token_urlsafe(18), tenant, 0, PAUSED, None, None, list(messages))
        with self._lock:
            self._db.execute("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                             (conv.id, tenant, 0, PAUSED, None, None, json.dumps(conv.messages), time.time()))
        return conv

    def get(self, tenant: str, conversation_id: str) -> Conversation:
        with self._lock:
            return self._load(tenant, conversation_id)

    def begin_turn(self, tenant: str, conversation_id: str, messages: list[dict[str, str]]) -> Conversation:
        """Append the new messages and claim the conversation for one generation."""
        with self._lock:
            conv = self._load(tenant, conversation_id)
            if conv.state == GENERATING:
                raise ConversationBusy(f"conversation {conversation_id} is already generating")
            conv.messages += messages
            conv.version += 1
            conv.state = GENERATING
            self._save(conv)
            return conv

    def finish_turn(self, tenant: str, conversation_id: str, version: int, reply: str, replica: str | None,
                    lease_s: float) -> Conversation:
        """Store the reply; the conversation pauses with its KV held on `replica` until the lease ends."""
        with self._lock:
            conv = self._load(tenant, conversation_id)
            if conv.version != version:
                raise ConversationBusy(f"conversation {conversation_id} moved on (version {conv.version})")
            conv.messages.append({"role": "assistant", "content": reply})
            conv.state, conv.replica, conv.lease_deadline = PAUSED, replica, time.time() + lease_s
            self._save(conv)
            return conv

    def abandon_turn(self, tenant: str, conversation_id: str) -> None:
        """A failed generation: the appended messages stay (nothing is lost), the KV hold does not."""
        with self._lock:
            conv = self._load(tenant, conversation_id)
            conv.state, conv.replica, conv.lease_deadline = EVICTED, None, None
            self._save(conv)

    def delete(self, tenant: str, conversation_id: str) -> Conversation:
        with self._lock:
            conv = self._load(tenant, conversation_id)
            self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
            conv.state = CLOSED
            return conv

    def expire(self, now: float | None = None) -> list[Conversation]:
        """Paused conversations whose lease ended: marked evicted (their history stays).
        Returned as they were, so the caller can tell each holding replica to release."""
        now = time.time() if now is None else now
        with self._lock:
            rows = self._db.execute("SELECT id, tenant FROM conversations WHERE state = ? AND lease_deadline < ?",
                                    (PAUSED, now)).fetchall()
            out = []
            for cid, tenant in rows:
                conv = self._load(tenant, cid)
                out.append(conv)
                self._save(Conversation(conv.id, tenant, conv.version, EVICTED, None, None, conv.messages))
            return out

    def evict_replica(self, replica: str) -> int:
        """A replica drained or died: what it held must be re-prefilled elsewhere."""
        with self._lock:
            cur = self._db.execute("UPDATE conversations SET state = ?, replica = NULL, lease_deadline = NULL "
                                   "WHERE replica = ? AND state = ?", (EVICTED, replica, PAUSED))
            return cur.rowcount

    def holding_replicas(self) -> set[str]:
        """Replicas that paused conversations are pinned on."""
        with self._lock:
            rows = self._db.execute("SELECT DISTINCT replica FROM conversations WHERE state = ? AND replica IS NOT NULL",
                                    (PAUSED,)).fetchall()
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

    def _load(self, tenant: str, conversation_id: str) -> Conversation:
        row = self._db.execute("SELECT id, tenant, version, state, replica, lease_deadline, messages "
                               "FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
        if row is None or row[1] != tenant:  # another tenant's conversation does not exist for you
            raise ConversationNotFound(f"no conversation {conversation_id!r}")
        return Conversation(row[0], row[1], row[2], row[3], row[4], row[5], json.loads(row[6]))

    def _save(self, conv: Conversation) -> None:
        self._db.execute("UPDATE conversations SET version = ?, state = ?, replica = ?, lease_deadline = ?, "
                         "messages = ? WHERE id = ?", (conv.version, conv.state, conv.replica, conv.lease_deadline,
                                                       json.dumps(conv.messages), conv.id))

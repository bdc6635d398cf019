"""The rows behind the conversation store (sql_store): reading one, and writing it back by a
compare-and-set on its `revision`, a counter that every write bumps
(`UPDATE ... WHERE id = ? AND revision = ?`). A write that finds the row changed since it was
read changes nothing and raises WriteConflict; the store then runs its operation again from
the read. The same statements run on SQLite and on PostgreSQL (`?` placeholders; the
PostgreSQL backend turns them into psycopg's)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from dlite_ray.serve.errors import BadRequest, ConversationNotFound
from dlite_ray.serve.store_contract import EVICTED, Conversation
from dlite_ray.serve.turn_claims import MAX_IDEMPOTENCY_KEY_CHARS

COLUMNS = ("id, tenant, version, state, replica, lease_deadline, messages, claim_holder, claim_deadline, revision, "
            "claim_token")


class Rows(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


Query = Callable[..., Rows]
"""`q(sql, params=())`: one statement inside the open transaction; `?` placeholders."""


class WriteConflict(Exception):
    """A compare-and-set found the row changed since it was read (or the database aborted the
    transaction for a conflict): the operation runs again from its read."""


def read_row(q: Query, tenant: str, conversation_id: str) -> tuple[Conversation, int]:
    row = q(f"SELECT {COLUMNS} FROM conversations WHERE id = ?", (conversation_id,)).fetchone()
    if row is None or row[1] != tenant:  # another tenant's conversation does not exist for you
        raise ConversationNotFound(f"no conversation {conversation_id!r}")
    return parse_row(row)


def parse_row(row: Sequence) -> tuple[Conversation, int]:
    conv = Conversation(row[0], row[1], row[2], row[3], row[4], row[5], json.loads(row[6]), row[7], row[8], row[10])
    return conv, row[9]


def set_columns(q: Query, conversation_id: str, revision: int, **columns: object) -> None:
    """Set `columns` of the row if it is still at `revision` (bumping it), else WriteConflict."""
    assigned = ", ".join(f"{name} = ?" for name in columns)
    cur = q(f"UPDATE conversations SET {assigned}, revision = revision + 1 WHERE id = ? AND revision = ?",
            (*columns.values(), conversation_id, revision))
    if cur.rowcount != 1:
        raise WriteConflict(conversation_id)


def write_row(q: Query, conv: Conversation, revision: int, now: float) -> None:
    history = json.dumps(conv.messages)
    set_columns(q, conv.id, revision, version=conv.version, state=conv.state, replica=conv.replica,
                lease_deadline=conv.lease_deadline, messages=history, bytes=history_size(history),
                claim_holder=conv.claim_holder, claim_deadline=conv.claim_deadline, claim_token=conv.claim_token,
                updated=now)


def release_row(q: Query, conv: Conversation, revision: int, claim_ended: bool = True,
                now: float | None = None) -> None:
    """Evicted, history kept. A turn claim that ended by its deadline or its holder's loss
    (`claim_ended`) keeps its passed deadline: the mark that its holder's late renewal may
    take it back (`renew_turn`); an abandoned turn's claim is cleared. Expiry (no `now`)
    is not a use: it leaves the conversation's idle time running."""
    columns: dict[str, object] = {"state": EVICTED, "replica": None, "lease_deadline": None, "claim_holder": None,
                                  "claim_token": None}
    if not claim_ended:
        columns["claim_deadline"] = None
    if now is not None:
        columns["updated"] = now
    set_columns(q, conv.id, revision, **columns)


def try_release_row(q: Query, conv: Conversation, revision: int) -> bool:
    try:
        release_row(q, conv, revision)
    except WriteConflict:
        return False
    return True


def delete_row(q: Query, conv: Conversation, revision: int) -> bool:
    if q("DELETE FROM conversations WHERE id = ? AND revision = ?", (conv.id, revision)).rowcount != 1:
        return False
    q("DELETE FROM turn_keys WHERE conversation_id = ?", (conv.id,))
    return True


def turn_key(q: Query, conversation_id: str, key: str | None) -> tuple | None:
    if key is None:
        return None
    if not 0 < len(key) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise BadRequest(f"an idempotency key has 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters")
    return q("SELECT version, digest, reply_index, finish_reason FROM turn_keys WHERE conversation_id = ? AND key = ?",
             (conversation_id, key)).fetchone()


def history_size(history: str) -> int:
    """A stored history's bytes, as the quota counts them (SQLite's length(CAST(messages AS BLOB)))."""
    return len(history.encode())

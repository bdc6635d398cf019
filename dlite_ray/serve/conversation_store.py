"""The durable conversation registry of the ConversationRouter: `open_store(url)` picks its
backend behind one contract (store_contract.ConversationRegistry; the logic, shared, in
sql_store):

- `sqlite:///PATH` (a plain path too): a SQLite file on the router's node, the default. A
  deleted conversation's text is overwritten in the file (secure_delete, conversation_db).
- `postgresql://USER@HOST:PORT/DB`: a PostgreSQL server that every router replica of a
  cluster shares, so histories outlive the node that wrote them (conversation_pg).

History is never deleted by lease or claim expiry; only DeleteConversation removes it, or
the retention (`delete_idle`) once it has been idle for longer than the operator allows. A
conversation of another tenant does not exist for the caller (same error as an unknown
id). A turn may carry an idempotency key: its retry replays the stored reply, or re-runs a
turn that failed, instead of appending the messages again. Each tenant's stored state is
capped (`TenantQuota`: live conversations, history bytes), enforced by the store in the
transaction of the write it guards, so the caps hold on either backend.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dlite_ray.serve.conversation_db import open_db
from dlite_ray.serve.sql_rows import Query
from dlite_ray.serve.sql_store import SqlConversationStore
from dlite_ray.serve.store_contract import (
    CLOSED,
    EVICTED,
    GENERATING,
    PAUSED,
    Conversation,
    ConversationRegistry,
    StoreHealth,
    TenantQuota,
    TurnOutcome,
)
from dlite_ray.serve.store_url import parse_store_url

__all__ = ["CLOSED", "EVICTED", "GENERATING", "PAUSED", "Conversation", "ConversationRegistry", "ConversationStore",
           "SqliteConversationStore", "StoreHealth", "TenantQuota", "TurnOutcome", "open_store"]


class SqliteConversationStore(SqlConversationStore):
    """The registry in one SQLite file. One connection, used by one thread at a time (the
    lock guards the connection object); between processes on the same file, BEGIN
    IMMEDIATE makes each write transaction wait for the other's."""

    backend = "sqlite"

    def __init__(self, path: str | Path = ":memory:", quota: TenantQuota | None = None):
        super().__init__(quota)
        self._db = open_db(path)
        self._lock = threading.Lock()

    @contextmanager
    def _transaction(self, write: bool = True) -> Iterator[Query]:
        """Several statements as one: a process killed between them leaves neither."""
        with self._lock:
            if not write:
                yield self._db.execute
                return
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db.execute
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _lock_tenant(self, q: Query, tenant: str) -> None:
        """BEGIN IMMEDIATE took the file's write lock already: quota checks run one at a time."""

    def close(self) -> None:
        with self._lock:
            self._db.close()


ConversationStore = SqliteConversationStore
"""The default backend under the name every caller used before there were two."""


def open_store(url: str, quota: TenantQuota | None = None) -> ConversationRegistry:
    """The store at `url` (`store_url.parse_store_url`: sqlite:///PATH, a plain path, or
    postgresql://...). PostgreSQL's client (psycopg) is imported only when asked for."""
    backend, where = parse_store_url(url)
    if backend == "postgresql":
        from dlite_ray.serve.conversation_pg import PostgresConversationStore

        return PostgresConversationStore(where, quota)
    return SqliteConversationStore(where, quota)

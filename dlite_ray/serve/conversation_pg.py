"""The conversation store on a PostgreSQL server that every router replica of a cluster
shares (psycopg 3): the same SQL as the SQLite file (sql_store), its own layout and
connections.

Why PostgreSQL (and not the Redis that KubeRay runs for the GCS): a turn's claim, its lease,
its idempotency key and the history it appends must change together or not at all, and a
tenant's byte quota is an aggregate over its conversations. SQL transactions with a
compare-and-set (`UPDATE ... WHERE id = %s AND revision = %s`) give both directly, and the
SQLite backend runs the very same statements, so one contract reads the same on both.

Connections: one per thread (the router's event loop, the threads its health checks run
on), in autocommit mode with explicit BEGIN / COMMIT, as on SQLite. A connection the server
dropped (a restart, a failover) is replaced at the next transaction's BEGIN, before anything
was sent, so that retry is safe; a connection lost later in a transaction fails it with
StoreUnavailable (HTTP 503 / gRPC UNAVAILABLE): a write whose COMMIT got no answer may or
may not have landed, which a client's retry under the same idempotency key resolves. Quota
checks of one tenant take a transaction-scoped advisory lock, so two router replicas never
both fit a write under a cap (READ COMMITTED would let them).

Deleted rows: PostgreSQL has no secure_delete. A deleted history's text stays in the table's
pages (and in its TOAST table, WAL and backups) until VACUUM frees the space and later
rows overwrite it; VACUUM FULL writes the table anew but only unlinks the old file.
Deployments that must erase text run on encrypted volumes with WAL and backup retention
shorter than their obligation (cluster/README.md).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import errors as pg_errors

from dlite_ray.serve.errors import StoreUnavailable
from dlite_ray.serve.sql_rows import Query, Rows, WriteConflict
from dlite_ray.serve.sql_store import SqlConversationStore
from dlite_ray.serve.store_contract import TenantQuota
from dlite_ray.serve.store_url import redacted

log = logging.getLogger(__name__)
LAYOUT = 1
CONNECT_TIMEOUT_S = 3  # a server that does not answer: the turn fails fast (503), the router does not hang
MIGRATION_LOCK = 0x646C697465  # "dlite": replicas starting together make the tables one at a time

_TABLES = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, version BIGINT NOT NULL, state TEXT NOT NULL,
    replica TEXT, lease_deadline DOUBLE PRECISION, messages TEXT NOT NULL, created DOUBLE PRECISION NOT NULL,
    claim_holder TEXT, claim_deadline DOUBLE PRECISION, bytes BIGINT NOT NULL DEFAULT 0,
    updated DOUBLE PRECISION, revision BIGINT NOT NULL DEFAULT 0, claim_token TEXT
);
ALTER TABLE conversations ADD COLUMN IF NOT EXISTS claim_token TEXT;
CREATE INDEX IF NOT EXISTS by_lease ON conversations (state, lease_deadline);
CREATE INDEX IF NOT EXISTS by_tenant ON conversations (tenant);
CREATE INDEX IF NOT EXISTS by_updated ON conversations (updated);
CREATE TABLE IF NOT EXISTS turn_keys (
    conversation_id TEXT NOT NULL, key TEXT NOT NULL, version BIGINT NOT NULL, digest TEXT NOT NULL,
    reply_index INTEGER, finish_reason TEXT, created DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (conversation_id, key)
);
CREATE INDEX IF NOT EXISTS turn_keys_by_version ON turn_keys (conversation_id, version);
CREATE TABLE IF NOT EXISTS dlite_store_layout (layout INTEGER NOT NULL);
"""


class PostgresConversationStore(SqlConversationStore):
    backend = "postgresql"

    def __init__(self, url: str, quota: TenantQuota | None = None):
        super().__init__(quota)
        self.url = url
        self._local = threading.local()
        self._all: list[psycopg.Connection] = []
        self._all_lock = threading.Lock()  # guards the list of connections, never a row
        self._closed = False
        with self._transaction() as q:
            _migrate(q)

    @contextmanager
    def _transaction(self, write: bool = True) -> Iterator[Query]:
        """BEGIN ... COMMIT on this thread's connection (reads too: a dropped connection is
        found at BEGIN and replaced). A conflict the server aborts (deadlock, serialization)
        runs the operation again (WriteConflict); a lost server is StoreUnavailable."""
        conn = self._begin()
        try:
            yield _query(conn)
            conn.execute("COMMIT")
        except pg_errors.TransactionRollback as exc:
            _rollback(conn)
            raise WriteConflict(str(exc)) from exc
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            self._drop(conn)
            raise StoreUnavailable(f"the conversation store ({redacted(self.url)}) is unreachable: "
                                   f"{type(exc).__name__}; retry") from exc
        except BaseException:
            _rollback(conn)
            raise

    def _begin(self) -> psycopg.Connection:
        """This thread's connection with a transaction open; a kept connection that the server
        dropped is replaced once (BEGIN sent nothing else, so trying again is safe)."""
        for attempt in range(2):
            conn = self._connection()
            try:
                conn.execute("BEGIN")
                return conn
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                self._drop(conn)
                if attempt:
                    raise StoreUnavailable(f"the conversation store ({redacted(self.url)}) is unreachable: "
                                           f"{type(exc).__name__}; retry") from exc
        raise AssertionError("unreachable")

    def _lock_tenant(self, q: Query, tenant: str) -> None:
        q("SELECT pg_advisory_xact_lock(hashtextextended(?, 0))", (tenant,))

    def _connection(self) -> psycopg.Connection:
        if self._closed:
            raise StoreUnavailable("the conversation store was closed")
        conn = getattr(self._local, "conn", None)
        if conn is not None and not conn.closed:
            return conn
        try:
            conn = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                                   application_name="dlite-ray-router")
        except psycopg.Error as exc:
            raise StoreUnavailable(f"cannot connect to the conversation store ({redacted(self.url)}): "
                                   f"{type(exc).__name__}; retry") from exc
        self._local.conn = conn
        with self._all_lock:
            self._all.append(conn)
        return conn

    def _drop(self, conn: psycopg.Connection) -> None:
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None
        with self._all_lock:
            if conn in self._all:
                self._all.remove(conn)
        conn.close()

    def close(self) -> None:
        self._closed = True
        with self._all_lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


def _query(conn: psycopg.Connection) -> Query:
    def q(sql: str, params: tuple = ()) -> Rows:
        return conn.execute(sql.replace("?", "%s"), params)  # type: ignore[arg-type]  # sql_store's own SQL

    return q


def _rollback(conn: psycopg.Connection) -> None:
    try:
        conn.execute("ROLLBACK")
    except psycopg.Error:  # the connection is gone: so is its transaction
        log.debug("rollback on a lost connection", exc_info=True)


def _migrate(q: Query) -> None:
    q("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
    for statement in filter(str.strip, _TABLES.split(";")):
        q(statement)
    row = q("SELECT layout FROM dlite_store_layout").fetchone()
    if row is None:
        q("INSERT INTO dlite_store_layout (layout) VALUES (?)", (LAYOUT,))
    elif row[0] > LAYOUT:
        raise RuntimeError(f"conversation store layout {row[0]} is newer than this code ({LAYOUT})")

"""The SQLite file behind the ConversationStore: its layout, its pragmas, and the
migrations that bring a file written by an older router up to date in place.

Layouts (`PRAGMA user_version`):
  0  conversations (id, tenant, version, state, replica, lease_deadline, messages, created)
  1  + conversations.claim_holder / claim_deadline: who holds a turn, and until when
     + turn_keys: a turn's idempotency key, the messages it appended, where its reply is
  2  + conversations.bytes: the stored history's size (UTF-8 JSON), summed per tenant for
       its quota; indexed by tenant
  3  + conversations.updated: when a turn last touched it (the retention's idle time; an
       older file's conversations count from the migration)
     + conversations.revision: bumped by every write, the compare-and-set's (sql_rows)
     + conversations.claim_token: the request that holds the turn (its retried claim gets it back)
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path

from dlite_ray.serve.store_contract import CLOSED, EVICTED, GENERATING, PAUSED

__all__ = ["CLOSED", "EVICTED", "GENERATING", "LAYOUT", "PAUSED", "open_db"]
log = logging.getLogger(__name__)
LAYOUT = 3

_TABLES = """
CREATE TABLE IF NOT EXISTS conversations (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, version INTEGER NOT NULL, state TEXT NOT NULL,
    replica TEXT, lease_deadline REAL, messages TEXT NOT NULL, created REAL NOT NULL,
    claim_holder TEXT, claim_deadline REAL, bytes INTEGER NOT NULL DEFAULT 0, updated REAL,
    revision INTEGER NOT NULL DEFAULT 0, claim_token TEXT
);
CREATE INDEX IF NOT EXISTS by_lease ON conversations (state, lease_deadline);
CREATE INDEX IF NOT EXISTS by_tenant ON conversations (tenant);
CREATE TABLE IF NOT EXISTS turn_keys (
    conversation_id TEXT NOT NULL, key TEXT NOT NULL, version INTEGER NOT NULL, digest TEXT NOT NULL,
    reply_index INTEGER, finish_reason TEXT, created REAL NOT NULL,
    PRIMARY KEY (conversation_id, key)
);
CREATE INDEX IF NOT EXISTS turn_keys_by_version ON turn_keys (conversation_id, version);
"""

# columns added to a table after layout 0; ALTER TABLE adds them to an older file
_ADDED_COLUMNS = {"conversations": {"claim_holder": "TEXT", "claim_deadline": "REAL",
                                     "bytes": "INTEGER NOT NULL DEFAULT 0", "updated": "REAL",
                                     "revision": "INTEGER NOT NULL DEFAULT 0", "claim_token": "TEXT"}}
# indexes over added columns: made once the columns are there
_ADDED_INDEXES = "CREATE INDEX IF NOT EXISTS by_updated ON conversations (updated);"


def open_db(path: str | Path) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), with deleted text
    overwritten on disk, on the current layout."""
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    # Freed cells and pages are zeroed as they are freed, so a deleted conversation's text
    # does not linger in the file (no VACUUM needed). Per connection; many builds default off.
    db.execute("PRAGMA secure_delete = ON")
    _migrate(db)
    return db


def _migrate(db: sqlite3.Connection) -> None:
    (layout,) = db.execute("PRAGMA user_version").fetchone()
    if layout > LAYOUT:
        raise RuntimeError(f"conversation store layout {layout} is newer than this code ({LAYOUT})")
    fresh = not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'conversations'").fetchone()
    db.executescript(_TABLES)  # new tables (and the whole layout of a fresh file)
    for table, columns in _ADDED_COLUMNS.items():
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for name, kind in columns.items():
            if name not in have:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
    db.executescript(_ADDED_INDEXES)
    if layout < 1 and not fresh:
        # A layout-0 turn claim has no holder and no deadline, and the process that made it
        # ran older code, so it is gone: its claim ends now (the router releases it).
        n = db.execute("UPDATE conversations SET claim_deadline = 0 WHERE state = ? AND claim_deadline IS NULL",
                       (GENERATING,)).rowcount
        if n:
            log.info("conversation store: %d turn claims of a previous router released", n)
        # Text deleted before secure_delete was on may sit in free space: scrub it once.
        db.execute("VACUUM")
    if layout < 2 and not fresh:  # histories stored before their size was: measured once
        db.execute("UPDATE conversations SET bytes = length(CAST(messages AS BLOB))")
    if layout < 3 and not fresh:  # idle from now: retention never deletes sooner than it says
        db.execute("UPDATE conversations SET updated = ? WHERE updated IS NULL", (time.time(),))
    db.execute(f"PRAGMA user_version = {LAYOUT}")

"""The conversation store's contract: what the ConversationRouter asks of whatever keeps the
durable histories, and the records it gets back.

Two backends satisfy it (tests/serve/test_store_contract.py runs the same tests on both):
SQLite (`conversation_store.SqliteConversationStore`, a file on the router's node, the
default) and PostgreSQL (`conversation_pg.PostgresConversationStore`, a server that every
router replica of a cluster shares). `conversation_store.open_store(url)` picks one.

Every write that can race another (a turn's claim above all) is a compare-and-set in the
database, so two router replicas, or two processes on one file, never both win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, TypedDict

from dlite_ray.serve.config import LimitArgs

GENERATING, PAUSED, CLOSED, EVICTED = "generating", "paused", "closed", "evicted"  # conversations.state


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
    claim_token: str | None = None  # the request that made the claim: its retried begin_turn gets it back
    replayed: TurnOutcome | None = None  # set by begin_turn when its key names a finished turn


class TurnOutcomeView(TypedDict):
    reply: str
    finish_reason: str | None


class _ConversationFields(TypedDict):
    id: str
    tenant: str
    version: int
    state: str
    replica: str | None
    lease_deadline: float | None
    messages: list[dict[str, str]]
    claim_deadline: float | None


class ConversationView(_ConversationFields, total=False):
    """A conversation as the router's callers see it across Serve handles (`router._public`):
    never its claim's holder (an internal actor name) or token; `replayed` (the one key that
    may be absent) only in begin_turn's answer. JSON as it stands (the HTTP API returns it)."""

    replayed: TurnOutcomeView | None


@dataclass(slots=True)
class StoreHealth:
    """Whether the store answered a trivial query, and how long that took."""

    backend: str  # "sqlite" | "postgresql"
    reachable: bool
    latency_s: float | None  # None when unreachable
    error: str | None = None  # why not (the exception's type and message), for the log


class ConversationRegistry(Protocol):
    """The durable conversation registry. Per conversation: an unguessable id, its tenant, the
    message history, a version bumped on every claimed turn, the state (generating / paused /
    closed / evicted), the TargetWorker replica holding its KV and the lease deadline of that
    hold, and while it generates, the turn's claim (holder and deadline, see turn_claims).

    A conversation of another tenant does not exist for the caller (ConversationNotFound, as
    for an unknown id). Each tenant's stored state is capped (`quota`: live conversations,
    history bytes), checked in the same transaction as the write it guards (QuotaExceeded,
    naming the limit). Histories are removed by `delete` and, past the retention, by
    `delete_idle`; never by lease or claim expiry."""

    quota: TenantQuota
    backend: str

    def create(self, tenant: str, messages: list[dict[str, str]]) -> Conversation: ...

    def get(self, tenant: str, conversation_id: str) -> Conversation: ...

    def begin_turn(self, tenant: str, conversation_id: str, messages: list[dict[str, str]], *,
                   holder: str | None = None, claim_s: float = ..., idempotency_key: str | None = None,
                   limits: LimitArgs | None = None, now: float | None = None,
                   claim_token: str | None = None) -> Conversation:
        """Append the messages and claim the conversation for one turn (compare-and-set: of
        two concurrent claims one wins, the other gets ConversationBusy). A call again with
        the `claim_token` of the claim that holds the conversation gets that claim back
        (its first answer was lost with a router replica), appending nothing."""
        ...

    def renew_turn(self, tenant: str, conversation_id: str, version: int, claim_s: float,
                   now: float | None = None) -> float: ...

    def finish_turn(self, tenant: str, conversation_id: str, version: int, reply: str, replica: str | None,
                    lease_s: float, finish_reason: str | None = None) -> Conversation:
        """Store the turn's reply; the same call again (its first answer was lost) stores nothing."""
        ...

    def abandon_turn(self, tenant: str, conversation_id: str, version: int | None = None) -> bool: ...

    def refuse_turn(self, tenant: str, conversation_id: str, version: int, messages: list[dict[str, str]]) -> bool:
        ...

    def delete(self, tenant: str, conversation_id: str) -> Conversation: ...

    def delete_idle(self, idle_s: float, now: float | None = None) -> list[Conversation]:
        """Retention: conversations untouched for `idle_s` (not generating) are deleted,
        returned as they were (the caller releases their KV holds)."""
        ...

    def expire(self, now: float | None = None) -> list[Conversation]: ...

    def expire_claims(self, now: float | None = None) -> list[Conversation]: ...

    def claim_holders(self) -> set[str]: ...

    def release_holder(self, holder: str) -> list[Conversation]: ...

    def evict_replica(self, replica: str) -> int: ...

    def holding_replicas(self) -> set[str]: ...

    def mark_evicted(self, conversation_ids: list[str], replica: str) -> int: ...

    def health(self) -> StoreHealth: ...

    def close(self) -> None: ...

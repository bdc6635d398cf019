"""What crosses the TargetWorker's handle: the chunks of a reply and the replica's figures.

Slots dataclasses, not dicts: they pickle as well, and a field cannot be dropped or
misspelt on one side only. Callers read them by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.serve.logprobs import LogprobEntry
from dlite_ray.serve.tool_calls import ToolCall


@dataclass(slots=True)
class GenerateChunk:
    """A piece of one reply, as `TargetWorker.generate` streams it.

    text: what a stream may send now (held back while a character or a stop string is
    incomplete, `stream_text.TextStream`). logprobs: OpenAI chat entries of the chunk's
    tokens, when the request asked. On the last chunk (finished): finish_reason, stats,
    replica (where it ran) and evicted (conversations whose KV that replica gave up); error
    says why a reply with finish_reason "error" could not go on.

    Set by `held_reply.held_for_tool_calls` for a reply offered tools: tool_calls (the calls,
    on the last chunk, when the reply is calls) and raw_text (the chunk's text as generated,
    what a conversation's history keeps)."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] | None = None
    error: str | None = None
    stats: RequestStats | None = None
    replica: str | None = None
    evicted: list[str] = field(default_factory=list)
    tool_calls: list[ToolCall] | None = None
    raw_text: str | None = None  # None: not through held_for_tool_calls, the text is `text`
    replayed: bool = False  # a conversation turn's stored reply, sent again for its idempotency key


@dataclass(slots=True)
class WorkerStats:
    """A TargetWorker replica's figures (`TargetWorker.stats`): its engine's load and its draft's link."""

    replica: str
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    held_leases: int
    draft_connected: bool
    draft_restarts: int = 0
    draft_comm_time_s: float = 0.0
    cpu_threads: int = 0
    draft_cpu_threads: int | None = None  # a draft in its own actor
    reply_cache_tokens: int = 0  # tokens of earlier replies the engine holds for copying
    reply_cache_replies: int = 0
    reply_corpus_tokens: int = 0  # tokens of the draft's reply corpus (fixed; 0: none or off)
    draft_join_failures: int = 0  # failed attempts to join a draft (draft_process.PairLink)
    rounds_without_draft: int = 0  # rounds decoded plainly because the draft could not serve them
    degraded: str | None = None  # why this replica cannot speculate; None: it can (or runs no draft)

"""AsyncEngine: the engine's step loop on a background thread, streams for asyncio callers.

One thread owns the DLiteEngine (every tensor, the scheduler); callers on an event loop
submit requests and await their tokens. A request that fails validation raises in the
caller and never reaches the loop, so a bad request cannot disturb the batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dlite_ray.engine.engine import DLiteEngine, Prompt
from dlite_ray.engine.logprobs import TokenLogprob
from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.engine.sequence import SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stats: RequestStats | None = None  # on the last chunk
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the request asked
    error: str | None = None  # on the last chunk of a request that finished with "error": why


@dataclass(slots=True)
class EngineLoad:
    """A snapshot of how busy an engine is (read by attribute across Serve)."""

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    held_leases: int
    reply_cache_tokens: int = 0  # tokens of earlier replies held for copying (reply_cache.py)
    reply_cache_replies: int = 0
    reply_corpus_tokens: int = 0  # tokens of the draft's reply corpus copied from (reply_corpus.py; fixed)


class AsyncEngine:
    def __init__(self, engine: DLiteEngine, before_step: Callable[[int], None] | None = None):
        """before_step: called on the engine thread before each step with the number of
        unfinished requests (a server sizes its CPU threads to its load with it)."""
        self.engine = engine
        self._before_step = before_step
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._held: tuple[str, ...] = ()
        self._evicted: deque[str] = deque()  # filled by the engine thread, drained by callers
        self._thread = threading.Thread(target=self._loop, name="dlite-engine", daemon=True)
        self._thread.start()

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                       lease: str | None = None, namespace: str | None = None) -> AsyncIterator[Chunk]:
        """Stream a request's tokens; cancelling the consumer aborts the request. With
        `lease`, its KV stays pinned afterwards until `release_lease`; `namespace` (a
        tenant) is whose earlier replies it may copy from (`DLiteEngine.add_request`).

        However the consumer leaves before the last chunk (cancelled, closed, collected),
        the request is given up (`_give_up`): also when its "add" still waits in the inbox,
        so no request decodes for nobody, and a reply that finished unread does not keep
        its conversation's KV pinned."""
        # validation errors surface here, in the caller; tokenizing a long prompt happens off
        # the event loop, which streams every other request's tokens
        ids = await asyncio.to_thread(self.engine.encode, prompt)
        # the id is chosen here, not by the engine thread, so the caller can name the request
        # before the engine has admitted it
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        ended = False  # the last chunk was read, or the request failed: nothing left to give up
        self._inbox.put(("add", ids, params, request_id, lease, namespace, loop, out))
        try:
            while True:
                item = await out.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
                if item.finished:
                    ended = True
                    return
        finally:
            if not ended:
                self._inbox.put(("give_up", request_id, lease))

    def stats(self) -> EngineLoad:
        scheduler, replies, corpus = self.engine.scheduler, self.engine.reply_cache, self.engine.corpus
        return EngineLoad(len(scheduler.running), len(scheduler.waiting), scheduler.blocks.num_used_blocks,
                          scheduler.blocks.num_blocks, len(self.held_leases),
                          replies.size_tokens if replies is not None else 0,
                          replies.num_replies if replies is not None else 0,
                          corpus.num_tokens if corpus is not None else 0)

    def is_alive(self) -> bool:
        """Whether the engine loop thread still runs."""
        return self._thread.is_alive()

    @property
    def held_leases(self) -> tuple[str, ...]:
        """Conversations whose KV this engine pins (a snapshot taken by the engine thread)."""
        return self._held

    def take_evicted_leases(self) -> list[str]:
        """Leases given up under memory pressure since the last call."""
        out = []
        while self._evicted:
            out.append(self._evicted.popleft())
        return out

    def release_lease(self, lease: str) -> None:
        """Unpin a conversation's KV (applied by the engine thread, between steps)."""
        self._inbox.put(("release", lease))

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)

    # -- the engine thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox(block=not self.engine.has_unfinished())
            self._snapshot_leases()
            if not self.engine.has_unfinished():
                continue
            try:
                if self._before_step is not None:
                    self._before_step(len(self.engine.scheduler.running) + len(self.engine.scheduler.waiting))
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, not the loop
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            self._snapshot_leases()  # before the final chunks go out: a caller then sees its lease
            for out in outputs:
                seq = out.seq
                new = out.new_token_ids
                stats = RequestStats.of(seq) if seq.is_finished else None
                logprobs = seq.logprobs[len(seq.logprobs) - len(new):] if seq.logprobs is not None else None
                chunk = Chunk(new, seq.is_finished, seq.finish_reason, stats, logprobs, seq.error)
                self._emit(seq.request_id, chunk, final=seq.is_finished)

    def _snapshot_leases(self) -> None:
        self._held = tuple(self.engine.held_leases)
        self._evicted.extend(self.engine.take_evicted_leases())

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if item[0] == "add":
                _, ids, params, request_id, lease, namespace, loop, out = item
                try:
                    self.engine.add_request(ids, params, request_id, lease, namespace)
                except Exception as exc:  # noqa: BLE001 - reported to that caller only
                    loop.call_soon_threadsafe(out.put_nowait, exc)
                    continue
                self._streams[request_id] = (loop, out)
            elif item[0] == "give_up":
                self._give_up(item[1], item[2])
            elif item[0] == "release":
                self.engine.release_lease(item[1])
            elif item[0] == "stop":
                return

    def _give_up(self, request_id: str, lease: str | None) -> None:
        """Its caller left before the last chunk. A request still queued or running is
        aborted (an aborted request pins nothing); one that already finished, unread,
        pinned its KV under `lease` for a reply nobody stored: unpinned."""
        self._streams.pop(request_id, None)
        if not self.engine.abort(request_id) and lease is not None:
            self.engine.release_lease(lease)

    def _emit(self, request_id: str, chunk: Chunk, final: bool) -> None:
        target = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if target is not None:
            loop, out = target
            loop.call_soon_threadsafe(out.put_nowait, chunk)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id, (loop, out) in list(self._streams.items()):
            self.engine.abort(request_id)
            loop.call_soon_threadsafe(out.put_nowait, RuntimeError(f"engine step failed: {exc}"))
        self._streams.clear()

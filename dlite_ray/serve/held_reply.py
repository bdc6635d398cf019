"""Streams of replies offered tools: text is held back while the reply may become calls.

A call must never go out as content first, and a client cannot take text back. So while a
reply may still be calls (`tool_calls.reply_start`: an offered tool's name, or
its beginning, after an optional fence and "["), its text and logprob entries wait; prose
flows from its first characters. Once a reply starts like a call, it is held to its end and
sent as `tool_calls`, or, when it is not calls after all, as text in the last chunk (or
as soon as it is too long to be parsed as calls).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from dlite_ray.serve.logprobs import LogprobEntry
from dlite_ray.serve.tool_calls import CALL, MAX_PARSED_CHARS, TEXT, Tool, ToolCall, reply_calls, reply_start
from dlite_ray.serve.worker_messages import GenerateChunk


class HeldReply:
    def __init__(self, tools: tuple[Tool, ...]):
        self.tools = tools
        self.holding = bool(tools)
        self._call_started = False  # once it starts like a call, it is held to the end: no rescans
        self._text = ""
        self._entries: list[LogprobEntry] = []

    def push(self, text: str, entries: list[LogprobEntry]) -> tuple[str, list[LogprobEntry]]:
        """What to send now of a chunk's text and logprob entries."""
        if not self.holding:
            return text, entries
        self._text += text
        self._entries += entries
        if not self._call_started:
            start = reply_start(self._text, self.tools)
            if start == TEXT:
                return self._stop_holding()
            self._call_started = start == CALL
        if len(self._text) > MAX_PARSED_CHARS:  # too long to be parsed as calls: text after all
            self._call_started = False
            return self._stop_holding()
        return "", []

    def finish(self, failed: bool = False) -> tuple[str, list, list[ToolCall] | None]:
        """At the end: the text still held and its entries, and the calls when that text is
        calls. A reply that `failed` (finish_reason "error") makes no calls: it is text."""
        calls = reply_calls(self._text, self.tools) if self._call_started and not failed else None
        self.holding = False
        text, entries = self._release()
        return ("" if calls else text), entries, calls

    def _stop_holding(self) -> tuple[str, list]:
        self.holding = False
        return self._release()

    def _release(self) -> tuple[str, list]:
        out = self._text, self._entries
        self._text, self._entries = "", []
        return out


async def held_for_tool_calls(chunks: AsyncIterator[GenerateChunk],
                              tools: tuple[Tool, ...]) -> AsyncIterator[GenerateChunk]:
    """A reply's chunks with their text and logprob entries held back while the reply may
    become calls to `tools` (`raw_text` keeps each chunk's text as generated). The last chunk
    carries `tool_calls`: the calls, with finish reason "tool_calls", or None for text (and
    for a reply that failed: its finish reason stays "error")."""
    held = HeldReply(tools)
    async for chunk in chunks:
        text, entries = held.push(chunk.text, chunk.logprobs or [])
        calls = None
        if chunk.finished:
            rest, more, calls = held.finish(failed=chunk.finish_reason == "error")
            text, entries = text + rest, entries + more
        yield replace(chunk, text=text, logprobs=entries, tool_calls=calls, raw_text=chunk.text,
                      finish_reason="tool_calls" if calls else chunk.finish_reason)

"""OpenAI tool calling on a model that writes calls as Python: `get_weather(city="Paris")`.

A request's `tools` are offered in a system message that asks for calls in that form
(`requests.TOOLS_PREAMBLE`, the form BFCL prompts use). A reply that is nothing but calls to
the offered tools, `f(a=1)` or `[f(a=1), g(b="x")]` (optionally in a code fence), comes back
as OpenAI `tool_calls` with JSON arguments; anything else is text. Calls are read with
Python's own parser and `ast.literal_eval`, never evaluated: arguments must be literals.

The other direction: an assistant message's `tool_calls` are written back in the same form,
so the model reads its earlier calls as it would have written them.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

MAX_PARSED_CHARS = 16_384  # a longer reply is text: the parser's time and memory stay bounded
_FENCE = re.compile(r"^```[A-Za-z]*\s*\n?(.*?)\n?\s*```$", re.DOTALL)
# What a reply can look like while it may still become a call: an optional fence, an optional
# "[", a dotted name, then nothing yet or an opening parenthesis (whatever follows it).
_CALL_START = re.compile(r"^\s*(`{1,3}([A-Za-z]*\s*)?)?\[?\s*([A-Za-z_][\w.]*)?\s*(\(.*)?$", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: tuple[str, ...]  # the schema's property names, in order: where positional arguments go


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def openai(self) -> dict:
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def parse_tool_calls(text: str, tools: tuple[Tool, ...]) -> list[ToolCall] | None:
    """The calls `text` consists of, or None when it is text (not only calls to `tools`)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1).strip() if fenced else body
    if not body or len(body) > MAX_PARSED_CHARS:
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    by_name = {t.name: t for t in tools}
    calls = [_call(node, by_name) for node in nodes]
    return calls if calls and all(c is not None for c in calls) else None


def _call(node: ast.expr, tools: dict[str, Tool]) -> ToolCall | None:
    if not isinstance(node, ast.Call):
        return None
    name = _dotted_name(node.func)
    tool = tools.get(name) if name else None
    if tool is None or len(node.args) > len(tool.parameters):
        return None
    try:
        arguments = {p: ast.literal_eval(a) for p, a in zip(tool.parameters, node.args)}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in arguments:  # **kwargs, or a parameter given twice
                return None
            arguments[kw.arg] = ast.literal_eval(kw.value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal
        return None
    if not _json_safe(arguments):
        return None
    return ToolCall(name, arguments)


def _dotted_name(node: ast.expr) -> str | None:
    # BFCL's tools have dotted names ("math.factorial"): f.g parses as an attribute chain
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted_name(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def _json_safe(value: Any) -> bool:
    """Literals JSON can carry: no sets, bytes, complex numbers, tuples as keys, or NaN."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def could_become_tool_calls(text: str) -> bool:
    """Whether a reply that begins with `text` may still turn out to be calls: while it may,
    a stream holds its text back (so a call is never sent as content first)."""
    return len(text) <= MAX_PARSED_CHARS and _CALL_START.match(text) is not None


def render_tool_calls(calls: list[ToolCall]) -> str:
    """Calls as the model is asked to write them: `f(a=1)`, or `[f(a=1), g(b='x')]` for several."""
    written = [f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls]
    return written[0] if len(written) == 1 else f"[{', '.join(written)}]"


class HeldReply:
    """A streamed reply offered tools: its text (and logprob entries) are held back while the
    reply may still become calls, then flow as they come; `finish` gives what is left, as
    text or as calls."""

    def __init__(self, tools: tuple[Tool, ...]):
        self.tools = tools
        self.holding = bool(tools)
        self._text, self._entries = "", []

    def push(self, text: str, entries: list) -> tuple[str, list]:
        """What to send now of a chunk's text and logprob entries."""
        if not self.holding:
            return text, entries
        self._text += text
        self._entries += entries
        if could_become_tool_calls(self._text):
            return "", []
        self.holding = False
        return self._release()

    def finish(self) -> tuple[str, list, list[ToolCall] | None]:
        """At the end: the text still held and its entries, and the calls when that text is calls."""
        calls = parse_tool_calls(self._text, self.tools) if self.holding else None
        self.holding = False
        text, entries = self._release()
        return ("" if calls else text), entries, calls

    def _release(self) -> tuple[str, list]:
        out = self._text, self._entries
        self._text, self._entries = "", []
        return out


async def held_for_tool_calls(chunks: AsyncIterator[dict], tools: tuple[Tool, ...]) -> AsyncIterator[dict]:
    """A reply's chunks with their text and logprob entries held back while the reply may
    become calls to `tools` (`raw_text` keeps each chunk's text as generated). The last chunk
    carries `tool_calls`: the calls, with finish reason "tool_calls", or None for text."""
    held = HeldReply(tools)
    async for chunk in chunks:
        text, entries = held.push(chunk["text"], chunk["logprobs"] or [])
        calls = None
        if chunk["finished"]:
            rest, more, calls = held.finish()
            text, entries = text + rest, entries + more
        out = {**chunk, "text": text, "logprobs": entries, "tool_calls": calls, "raw_text": chunk["text"]}
        if calls:
            out["finish_reason"] = "tool_calls"
        yield out


def chat_message(text: str, finish: str | None, tools: tuple[Tool, ...]) -> tuple[dict, str | None]:
    """A whole reply as OpenAI's assistant message, and its finish reason: "tool_calls" when
    the reply is calls to the offered tools."""
    calls = parse_tool_calls(text, tools) if tools else None
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": [c.openai() for c in calls]}, "tool_calls"
    return {"role": "assistant", "content": text}, finish


def tool_calls_delta(calls: list[ToolCall]) -> dict:
    """A stream's calls, each whole in one delta: a reply is known to be calls only once it is
    complete (OpenAI's clients join argument pieces, and here there is one piece each)."""
    return {"role": "assistant", "content": None,
            "tool_calls": [{"index": i, **c.openai()} for i, c in enumerate(calls)]}

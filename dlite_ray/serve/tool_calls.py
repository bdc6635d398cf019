"""OpenAI tool calling on a model that writes calls as Python: `get_weather(city="Paris")`.

A request's `tools` are offered in a system message that asks for calls in that form
(`requests.TOOLS_PREAMBLE`, the form BFCL prompts use). A reply that is nothing but calls to
the offered tools, `f(a=1)` or `[f(a=1), g(b="x")]` (optionally in a code fence), comes back
as OpenAI `tool_calls` with JSON arguments; anything else is text. Calls are read with
Python's own parser and `ast.literal_eval`, never evaluated: arguments must be literals
(Python's, or JSON's true / false / null).

The other direction: an assistant message's `tool_calls` are written back in the same form,
so the model reads its earlier calls as it would have written them.

Model output is hostile input here: every scan is linear (no backtracking regular
expressions), the parser only sees replies up to MAX_PARSED_CHARS, and nothing recurses
with the reply's nesting except CPython's parser, whose RecursionError is caught.
"""

from __future__ import annotations

import ast
import json
import uuid
from dataclasses import dataclass
from typing import Any

MAX_PARSED_CHARS = 16_384  # a longer reply is text: the parser's time and memory stay bounded
FENCE = "```"


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


# -- replies -> calls ------------------------------------------------------------------------------
def parse_tool_calls(text: str, tools: tuple[Tool, ...]) -> list[ToolCall] | None:
    """The calls `text` consists of, or None when it is text (not only calls to `tools`).
    A reply is calls only if it starts like one (`starts_like_a_call`), so a stream, which
    decides from the start what to hold back, and a whole reply always agree."""
    if len(text) > MAX_PARSED_CHARS or not starts_like_a_call(text, tools):
        return None
    body = _unfenced(text.strip())
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    by_name = {t.name: t for t in tools}
    calls = [_call(node, by_name) for node in nodes]
    parsed = [c for c in calls if c is not None]
    return parsed if parsed and len(parsed) == len(calls) else None


def reply_calls(text: str, tools: tuple[Tool, ...]) -> list[ToolCall] | None:
    """The calls a reply makes, or None (text, or no tools offered)."""
    return parse_tool_calls(text, tools) if tools else None


def _unfenced(body: str) -> str:
    """The code inside a ``` fence (its language word dropped), or `body` as it is."""
    if len(body) < 2 * len(FENCE) or not (body.startswith(FENCE) and body.endswith(FENCE)):
        return body
    inner = body[len(FENCE):-len(FENCE)]
    first_line, _, rest = inner.partition("\n")
    return (rest if first_line.strip().isalpha() else inner).strip()


def _call(node: ast.expr, tools: dict[str, Tool]) -> ToolCall | None:
    if not isinstance(node, ast.Call):
        return None
    tool = tools.get(_dotted_name(node.func) or "")
    if tool is None or len(node.args) > len(tool.parameters):
        return None
    try:
        arguments = {p: _literal(a) for p, a in zip(tool.parameters, node.args, strict=False)}
        for kw in node.keywords:
            if kw.arg is None or kw.arg in arguments:  # **kwargs, or a parameter given twice
                return None
            arguments[kw.arg] = _literal(kw.value)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # not a literal
        return None
    return ToolCall(tool.name, arguments) if _json_safe(arguments) else None


class _JsonNames(ast.NodeTransformer):
    """JSON's true / false / null as Python's True / False / None: forced calls write their
    arguments as JSON (`structured_output.grammar_for_calls`), and models often do too."""

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return ast.Constant(_JSON_NAMES[node.id]) if node.id in _JSON_NAMES else node


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _literal(node: ast.expr) -> Any:
    return ast.literal_eval(_JsonNames().visit(node))


def _dotted_name(node: ast.expr) -> str | None:
    """`f` or `math.factorial` (BFCL's tools have dotted names), walked without recursion."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _json_safe(value: Any) -> bool:
    """Literals JSON can carry: no sets, bytes, complex numbers, tuples as keys, or NaN."""
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


# -- how a call starts (what a stream holds back) --------------------------------------------------
CALL, MAYBE, TEXT = "call", "maybe", "text"  # what a reply's start says it is


def reply_start(text: str, tools: tuple[Tool, ...]) -> str:
    """What a reply that begins with `text` is, judged by its start (after an optional fence
    and "["): CALL once it holds an offered tool's name and "(", MAYBE while it is a
    beginning of such a name, TEXT otherwise. Prose ("Paris (France)...") is TEXT from its
    first characters that leave every tool's name."""
    head = _after_opening(text.lstrip()) if len(text) <= MAX_PARSED_CHARS else None
    if head is None:
        return TEXT
    if any(_opens_call(head, t.name) for t in tools):
        return CALL
    return MAYBE if any(t.name.startswith(head) for t in tools) else TEXT


def could_become_tool_calls(text: str, tools: tuple[Tool, ...]) -> bool:
    """Whether a reply that begins with `text` may still turn out to be calls."""
    return reply_start(text, tools) != TEXT


def starts_like_a_call(text: str, tools: tuple[Tool, ...]) -> bool:
    """Whether `text` starts with an offered tool's name and "(" (after a fence and "[")."""
    return reply_start(text, tools) == CALL


def _opens_call(head: str, name: str) -> bool:
    return head.startswith(name) and head[len(name):].lstrip()[:1] in ("", "(")


def _after_opening(text: str) -> str | None:
    """`text` after an optional ``` fence (with its language word) and "[", None when it
    cannot be the opening of calls (a broken fence)."""
    if text.startswith("`"):
        if not text.startswith(FENCE):
            return "" if FENCE.startswith(text) else None  # "`" or "``": a fence may be coming
        text = text[len(FENCE):]
        word = len(text) - len(text.lstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
        if word and (word == len(text) or text[word].isspace()):
            text = text[word:]  # "```python\n": a language word ends at whitespace
        text = text.lstrip()
    if text.startswith("["):
        text = text[1:].lstrip()
    return text


# -- calls -> text, and OpenAI's shapes -------------------------------------------------------------
def render_tool_calls(calls: list[ToolCall]) -> str:
    """Calls as the model is asked to write them: `f(a=1)`, or `[f(a=1), g(b='x')]` for several."""
    written = [f"{c.name}({', '.join(f'{k}={v!r}' for k, v in c.arguments.items())})" for c in calls]
    return written[0] if len(written) == 1 else f"[{', '.join(written)}]"


def chat_message(text: str, finish: str | None, tools: tuple[Tool, ...]) -> tuple[dict, str | None]:
    """A whole reply as OpenAI's assistant message, and its finish reason: "tool_calls" when
    the reply is calls to the offered tools."""
    calls = reply_calls(text, tools)
    return assistant_message(text, calls), ("tool_calls" if calls else finish)


def assistant_message(text: str, calls: list[ToolCall] | None) -> dict:
    """OpenAI's assistant message: the calls (content null) when there are any, else the text."""
    if calls:
        return {"role": "assistant", "content": None, "tool_calls": [c.openai() for c in calls]}
    return {"role": "assistant", "content": text}


def tool_calls_delta(calls: list[ToolCall]) -> dict:
    """A stream's calls, each whole in one delta: a reply is known to be calls only once it is
    complete (OpenAI's clients join argument pieces, and here there is one piece each)."""
    message = assistant_message("", calls)
    message["tool_calls"] = [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]
    return message

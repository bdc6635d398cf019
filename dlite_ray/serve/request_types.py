"""What parsing a request yields, and the checks of single JSON values every parser shares.

Parsers (openai_requests, grpc_requests, tool_prompt) either return one of these or raise
a `ServeError` subclass (a client error): hostile input must never reach the engine, where
one bad value could fail the whole batch's step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.serve.errors import BadRequest
from dlite_ray.serve.tool_calls import Tool


@dataclass(slots=True)
class ParsedRequest:
    prompt: list[dict[str, str]] | str
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # a stream ends with a chunk of token counts (stream_options)
    tools: tuple[Tool, ...] = ()  # offered to the model: a reply that calls them is tool_calls


@dataclass(slots=True)
class ConversationTurn:
    """One AppendAndGenerate: the new user/tool messages, sampling, the lease asked for, and
    `tool_choice` over the tools the conversation opened with (checked against them once
    the history is read: `tool_prompt.forced_call_params`)."""

    new_messages: list[dict[str, str]]
    params: SamplingParams
    lease_s: float | None = None
    tool_choice: str | dict | None = None


def check_text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string")
    try:
        value.encode("utf-8")  # JSON escapes can carry lone surrogates the tokenizer cannot take
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{name} is not valid Unicode text: {exc.reason}") from exc
    return value


def check_number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError as exc:  # an int too large for a float
        raise BadRequest(f"{name} is out of range") from exc
    if not math.isfinite(number):  # JSON parsers accept NaN and Infinity
        raise BadRequest(f"{name} must be a finite number, got {value!r}")
    return number


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value

"""Bounds a request must keep before anything is tokenized or looked up.

Tokenizing is the one cost of a request that grows with its text before the context
check can refuse it, so characters are counted first: per message (`max_message_chars`)
and per prompt (`max_prompt_chars`: every message, the tools' schemas, a conversation's
stored history). A gRPC message is held to `max_body_bytes` as an HTTP body is. Fields
this server does not implement are refused by name, never silently ignored, and ids are
checked before a lookup, so no error message echoes a huge one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest, PayloadTooLarge
from dlite_ray.serve.grpc_service import MalformedRequest
from dlite_ray.serve.turn_claims import MAX_IDEMPOTENCY_KEY_CHARS

# ids are secrets.token_urlsafe(18): 24 characters of this alphabet
CONVERSATION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
# OpenAI fields with the value that means "not used": any other value is refused by name
NOT_IMPLEMENTED = {"n": 1, "best_of": 1, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0,
                   "repetition_penalty": 1}


# Every field a body may carry, by what it asks for. Anything else is refused by name, as
# OpenAI's API does ("Unrecognized request argument"): a field silently ignored (a `grammar`
# the client believes constrains the reply) is worse than a 400. `model` and `user` are
# OpenAI's bookkeeping and change nothing here.
BOOKKEEPING_FIELDS = frozenset({"model", "user"})
SAMPLING_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                             "stop_token_ids", "verify_mode", "ignore_eos", "response_format", "trace_top_k",
                             "logprobs", "top_logprobs", *NOT_IMPLEMENTED})
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})
STREAM_FIELDS = frozenset({"stream", "stream_options"})
CHAT_FIELDS = BOOKKEEPING_FIELDS | SAMPLING_FIELDS | TOOL_FIELDS | STREAM_FIELDS | {"messages"}
COMPLETION_FIELDS = BOOKKEEPING_FIELDS | SAMPLING_FIELDS | STREAM_FIELDS | {"prompt"}
CREATE_CONVERSATION_FIELDS = BOOKKEEPING_FIELDS | TOOL_FIELDS | {"messages"}
# a turn's reply is not streamed; its tool_choice is over the tools the conversation opened with
APPEND_FIELDS = BOOKKEEPING_FIELDS | SAMPLING_FIELDS | {"messages", "lease_seconds", "tool_choice"}


def refuse_unknown_fields(body: dict, known: frozenset[str]) -> None:
    """A 400 naming the first field (in the body's order) this endpoint does not know."""
    for name in body:
        if name not in known:
            raise BadRequest(f"unrecognized request argument: {_short(name)}")


def check_message_chars(content: str, name: str, limits: LimitArgs) -> None:
    if len(content) > limits.max_message_chars:
        raise PayloadTooLarge(f"{name} holds {len(content)} characters, over this server's max_message_chars "
                              f"of {limits.max_message_chars}")


def check_prompt_chars(messages: list[dict[str, str]], limits: LimitArgs, what: str = "the messages") -> None:
    """`max_prompt_chars` over a prompt's messages (their `content`)."""
    chars = sum(len(m["content"]) for m in messages)
    if chars > limits.max_prompt_chars:
        raise PayloadTooLarge(f"{what} hold {chars} characters, over this server's max_prompt_chars of "
                              f"{limits.max_prompt_chars}")


def refuse_not_implemented(body: dict) -> None:
    """A field this server would ignore is a 400 naming it, unless it is null or holds the
    value that means "not used" (n: 1, penalties 0, repetition_penalty 1, logit_bias {})."""
    for name, unused in NOT_IMPLEMENTED.items():
        value = body.get(name)
        if value is None or (value == unused and not isinstance(value, bool)):  # True == 1 is not n: 1
            continue
        raise BadRequest(f"{name}={_short(value)} is not supported by this server (only {name}: "
                         f"{json.dumps(unused)} or null)")


def conversation_id(raw: Any) -> str:
    """An id as the server makes them, else BadRequest (which never quotes the id)."""
    if not isinstance(raw, str) or not CONVERSATION_ID.fullmatch(raw):
        raise BadRequest("conversation_id must be 1 to 64 characters of A-Z, a-z, 0-9, '_' and '-'")
    return raw


def idempotency_key(raw: str | None) -> str | None:
    """A turn's Idempotency-Key (HTTP header; gRPC metadata `idempotency-key`): printable
    ASCII, at most MAX_IDEMPOTENCY_KEY_CHARS; None when the client sent none."""
    if raw is None or raw == "":
        return None
    if len(raw) > MAX_IDEMPOTENCY_KEY_CHARS or not raw.isascii() or not raw.isprintable():
        raise BadRequest(f"an idempotency key is 1 to {MAX_IDEMPOTENCY_KEY_CHARS} printable ASCII characters")
    return raw


def check_grpc_request(request: Any, limits: LimitArgs) -> None:
    """A message the proxy could decode (`grpc_service`), no larger than `max_body_bytes`:
    Serve's gRPC proxy itself takes up to 2 GB (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE, cluster-wide)."""
    if isinstance(request, MalformedRequest):
        raise BadRequest(request.reason)
    size = request.ByteSize()
    if size > limits.max_body_bytes:
        raise PayloadTooLarge(f"a message of {size} bytes exceeds this server's max_body_bytes of "
                              f"{limits.max_body_bytes}")


def _short(value: Any, chars: int = 40) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= chars else text[:chars] + "..."

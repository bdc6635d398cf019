"""The shapes of OpenAI's responses, and of our conversation replies, built from what a
reply's chunks carried: a whole completion, a streamed chunk and its choice, usage, logprobs,
the stats we add (`dlite_stats`). One place, so that the whole and the streamed answer, chat
and completions, say the same thing the same way; `openai_api.py` only routes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.serve.logprobs import LogprobEntry, completion_logprobs
from dlite_ray.serve.request_types import ConversationTurn, ParsedRequest
from dlite_ray.serve.tool_calls import ToolCall, assistant_message, chat_message, tool_calls_delta
from dlite_ray.serve.worker_messages import GenerateChunk

PUBLIC_STATS = ("mean_accept_length", "accept_lengths", "prefill_time", "decode_wall_time", "draft_time",
                "verify_time", "decode_tokens_per_second", "ttft", "cached_prompt_tokens")


@dataclass(slots=True)
class Reply:
    """What a whole reply's chunks carried, gathered."""

    text: str
    finish: str | None
    stats: RequestStats | None
    tokens: int  # completion tokens
    logprobs: list[LogprobEntry] = field(default_factory=list)  # one entry per token, where asked for


def completion(rid: str, model: str, parsed: ParsedRequest, chat: bool, reply: Reply) -> dict:
    """A whole (not streamed) chat.completion or text_completion."""
    if chat:
        message, finish = chat_message(reply.text, reply.finish, parsed.tools)
        choice = {"index": 0, "message": message, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": reply.text, "finish_reason": reply.finish}
    choice["logprobs"], _ = choice_logprobs(parsed, chat, reply.logprobs)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": [choice], "usage": usage(reply.stats, reply.tokens),
            "dlite_stats": public_stats(reply.stats)}


def stream_choice(chunk: GenerateChunk, parsed: ParsedRequest, chat: bool, first: bool,
                  text_offset: int) -> tuple[dict, int]:
    """A streamed chunk's choice (a chat stream's first delta names the role, as OpenAI's do),
    and the completion text offset after its logprobs."""
    choice: dict[str, Any]
    if chunk.tool_calls:
        choice = {"index": 0, "delta": tool_calls_delta(chunk.tool_calls), "finish_reason": chunk.finish_reason}
    elif chat:
        choice = {"index": 0, "delta": {"content": chunk.text}, "finish_reason": chunk.finish_reason}
    else:
        choice = {"index": 0, "text": chunk.text, "finish_reason": chunk.finish_reason}
    if chat and first:
        choice["delta"] = {"role": "assistant", **choice["delta"]}
    choice["logprobs"], text_offset = choice_logprobs(parsed, chat, chunk.logprobs, text_offset)
    return choice, text_offset


def stream_chunk(rid: str, model: str, chat: bool, choices: list[dict], **extra) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, **extra}


def sse_event(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


def conversation_reply(conversation_id: str, turn: ConversationTurn, reply: Reply, calls: list[ToolCall] | None,
                       replica: str | None) -> dict:
    """The answer to a conversation turn (POST /v1/conversations/{id}/messages)."""
    return {"conversation_id": conversation_id, "message": assistant_message(reply.text, calls),
            "logprobs": None if turn.params.logprobs is None else {"content": reply.logprobs},
            "finish_reason": reply.finish, "replica": replica, "stats": public_stats(reply.stats)}


def usage(stats: RequestStats | None, completion_tokens: int) -> dict:
    prompt_tokens = stats.num_prompt_tokens if stats is not None else 0
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_logprobs(parsed: ParsedRequest, chat: bool, entries: list[LogprobEntry] | None,
                    text_offset: int = 0) -> tuple[dict | None, int]:
    """A choice's `logprobs` (None unless the request asked for them), and the completion
    text offset after them."""
    if parsed.params.logprobs is None:
        return None, text_offset
    entries = entries or []  # a chunk without entries (held_for_tool_calls gives every chunk a list)
    return ({"content": entries}, text_offset) if chat else completion_logprobs(entries, text_offset)


def public_stats(stats: RequestStats | None) -> dict:
    """The speculation figures a reply carries (none of the engine's internals beyond these)."""
    if stats is None:
        return {}
    return {k: getattr(stats, k) for k in PUBLIC_STATS}

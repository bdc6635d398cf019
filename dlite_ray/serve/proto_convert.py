"""Engine chunks and registry records as dlite.v1 messages (the gRPC side of the ingress)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.serve.logprobs import LogprobEntry, TopLogprob
from dlite_ray.serve.proto import dlite_pb2
from dlite_ray.serve.store_contract import ConversationView
from dlite_ray.serve.worker_messages import GenerateChunk


def proto_chunk(chunk: GenerateChunk) -> dlite_pb2.GenerateChunk:
    return dlite_pb2.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids,
                                   finish_reason=chunk.finish_reason or "", stats=_proto_stats(chunk.stats),
                                   logprobs=[_proto_logprob(e) for e in chunk.logprobs or []],
                                   tool_calls=[_proto_tool_call(c.openai()) for c in chunk.tool_calls or []])


def _proto_tool_call(call: dict) -> dlite_pb2.ToolCall:
    return dlite_pb2.ToolCall(id=call["id"], name=call["function"]["name"],
                              arguments_json=call["function"]["arguments"])


def _proto_logprob(entry: LogprobEntry) -> dlite_pb2.TokenLogprob:
    return dlite_pb2.TokenLogprob(token=entry["token"], logprob=entry["logprob"], bytes=bytes(entry["bytes"]),
                                  top_logprobs=[_proto_token(t) for t in entry["top_logprobs"]])


def _proto_token(token: TopLogprob) -> dlite_pb2.TokenLogprob:
    return dlite_pb2.TokenLogprob(token=token["token"], logprob=token["logprob"], bytes=bytes(token["bytes"]))


def proto_conversation(conv: ConversationView) -> dlite_pb2.Conversation:
    return dlite_pb2.Conversation(conversation_id=conv["id"], state=conv["state"], version=conv["version"],
                                  messages=proto_messages(conv["messages"]))  # stored as parse_messages made them


def proto_messages(messages: Iterable[Mapping[str, str]]) -> list[dlite_pb2.Message]:
    """Chat messages ({"role", "content"}) as dlite.v1 Messages."""
    return [dlite_pb2.Message(role=m["role"], content=m["content"]) for m in messages]


def _proto_stats(stats: RequestStats | None) -> dlite_pb2.Stats | None:
    if stats is None:
        return None
    return dlite_pb2.Stats(
        accept_lengths=stats.accept_lengths, mean_accept_length=stats.mean_accept_length,
        prefill_time=stats.prefill_time, decode_wall_time=stats.decode_wall_time,
        draft_time=stats.draft_time, verify_time=stats.verify_time,
        decode_tokens_per_second=stats.decode_tokens_per_second, ttft=stats.ttft or 0.0,
        cached_prompt_tokens=stats.cached_prompt_tokens, num_prompt_tokens=stats.num_prompt_tokens)

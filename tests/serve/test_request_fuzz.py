"""Fuzz the request decoders (HTTP JSON and gRPC messages): whatever arrives, a decoder
returns a request the engine can run or raises a client error (4xx); never anything
else, which the ingress would turn into a 500 or, worse, pass to the engine's batch."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.engine.structured_output import checked
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import ServeError
from dlite_ray.serve.grpc_requests import parse_grpc_append, parse_grpc_create, parse_grpc_generate
from dlite_ray.serve.openai_requests import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    ROLES,
    TOP_K_MAX,
    decode_json_body,
    parse_append,
    parse_chat,
    parse_completion,
    parse_create_conversation,
)
from dlite_ray.serve.proto import dlite_pb2
from dlite_ray.serve.request_types import ConversationTurn, ParsedRequest

LIMITS = LimitArgs(max_tokens_cap=64, default_max_tokens=16, max_body_bytes=4096, max_messages=8)
# database=None: no .hypothesis/ folder in the checkout; a failure prints the seed that replays it
FUZZ = settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# -- strategies ----------------------------------------------------------------------------------
# Text with lone surrogates too: JSON's \ud800 escapes produce them, and tokenizers reject them.
any_text = st.text(st.characters(codec=None), max_size=12)
scalars = st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70) \
    | st.floats(allow_nan=True, allow_infinity=True) | any_text
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(any_text, inner, max_size=3), max_leaves=6)


@st.composite
def one_odd_field(draw, valid: dict, odd: dict, required: tuple[str, ...] = ()) -> dict:
    """A dict of valid fields (the optional ones present or not) where usually one field
    holds an odd value instead: this reaches every check, not just the first one."""
    out = {key: draw(value) for key, value in valid.items() if key in required or draw(st.booleans())}
    if draw(st.integers(0, 3)):
        key = draw(st.sampled_from(sorted(odd)))
        out[key] = draw(odd[key])
    return out


def text_parts(text):
    return st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=3)


# an agent's earlier call, as OpenAI clients send it back (content null, arguments JSON text)
good_call = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.text(min_size=1, max_size=8), "arguments": st.dictionaries(any_text, json_values).map(json.dumps)})})
call_message = st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | any_text,
                                      "tool_calls": st.lists(good_call, min_size=1, max_size=2)})
odd_call = one_odd_field({"type": st.just("function")}, {"function": json_values | st.fixed_dictionaries(
    {"name": json_values, "arguments": json_values | any_text})}) | json_values
good_message = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": any_text | text_parts(any_text)}) \
    | call_message
odd_message = one_odd_field({"role": st.sampled_from(ROLES), "content": any_text},
                            {"role": st.sampled_from(["wizard", ""]) | json_values,
                             "content": json_values | text_parts(json_values),
                             "tool_calls": st.lists(good_call | odd_call, max_size=2) | json_values}) | json_values
# good messages around one odd one
odd_messages = st.tuples(st.lists(good_message, max_size=3), odd_message,
                         st.lists(good_message, max_size=2)).map(lambda t: [*t[0], t[1], *t[2]])
good_tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.text(min_size=1, max_size=8)}, optional={"parameters": st.dictionaries(st.text(max_size=4), scalars)})})
odd_tool = one_odd_field({"type": st.just("function")}, {"function": json_values | st.fixed_dictionaries(
    {"name": json_values}, optional={"parameters": json_values})}) | json_values
not_finite = st.sampled_from([math.nan, math.inf, -math.inf])
small_schema = st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "integer", "array"])},
                                     optional={"properties": st.dictionaries(st.text(max_size=4), st.fixed_dictionaries(
                                         {"type": st.sampled_from(["string", "number", "boolean"])}), max_size=3),
                                               "maxLength": st.integers(0, 9)})
good_format = st.sampled_from([{"type": "text"}, {"type": "json_object"}]) | st.fixed_dictionaries(
    {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries({"name": st.text(max_size=6)},
                                                                          optional={"schema": small_schema})})
# schemas made of anything: the engine's grammar compiler must answer them with a 400, never a crash
odd_format = st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object", "yaml"]) | json_values,
                                    "json_schema": json_values | st.fixed_dictionaries(
                                        {"name": json_values, "schema": json_values | st.dictionaries(
                                            st.sampled_from(["type", "properties", "enum", "$ref", "pattern",
                                                             "minimum", "items", "anyOf"]) | any_text,
                                            json_values, max_size=4)})}) | json_values
valid_fields = {
    "messages": st.lists(good_message, min_size=1, max_size=4),
    "prompt": any_text,
    "tools": st.lists(good_tool, max_size=3),
    "max_tokens": st.integers(min_value=1, max_value=LIMITS.max_tokens_cap),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "top_k": st.integers(min_value=0, max_value=100),
    "seed": st.integers(min_value=0, max_value=1 << 32),
    "stream": st.booleans(),
    "lease_seconds": st.floats(min_value=1, max_value=600),
    "logprobs": st.booleans() | st.integers(min_value=0, max_value=MAX_LOGPROBS),  # chat's flag, completions' count
    "top_logprobs": st.integers(min_value=0, max_value=MAX_LOGPROBS),
    "stop": st.none() | st.text(min_size=1, max_size=8) | st.lists(st.text(min_size=1, max_size=8), max_size=4),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "tool_choice": st.sampled_from(["auto", "none", "required"]),
    "parallel_tool_calls": st.booleans(),
    "response_format": good_format,
}
odd_fields = {
    "messages": odd_messages | st.lists(json_values, max_size=3) | json_values,
    "prompt": json_values,
    "tools": st.lists(good_tool | odd_tool, min_size=1, max_size=3) | json_values,
    "max_tokens": st.integers(min_value=-(1 << 70), max_value=1 << 70) | json_values,
    "max_completion_tokens": st.integers(min_value=-2, max_value=100) | json_values,
    "temperature": not_finite | st.floats() | st.integers(min_value=-(1 << 1100), max_value=1 << 1100) | json_values,
    "top_p": not_finite | st.floats() | json_values,
    "top_k": st.integers(min_value=-(1 << 70), max_value=1 << 70) | json_values,
    "seed": st.integers(min_value=-(1 << 70), max_value=1 << 70) | json_values,
    "stream": json_values,
    "lease_seconds": not_finite | st.floats() | st.integers() | json_values,
    "logprobs": st.integers(min_value=-(1 << 70), max_value=1 << 70) | json_values,
    "top_logprobs": st.integers(min_value=-(1 << 70), max_value=1 << 70) | json_values,
    "stop": st.lists(any_text | json_values, max_size=6) | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
    "tool_choice": st.sampled_from(["required"]) | json_values,
    "parallel_tool_calls": json_values,
    "response_format": odd_format,
}
bodies = one_odd_field(valid_fields, odd_fields, required=("messages",)) \
    | one_odd_field(valid_fields, odd_fields, required=("prompt",)) | json_values


# -- what "valid" means --------------------------------------------------------------------------
def _assert_runnable(params: SamplingParams) -> None:
    assert 1 <= params.max_new_tokens <= LIMITS.max_tokens_cap
    assert math.isfinite(params.temperature) and params.temperature >= 0
    assert 0 < params.top_p <= 1 and 0 <= params.top_k <= TOP_K_MAX
    assert params.seed is None or INT64_MIN <= params.seed <= INT64_MAX
    assert params.logprobs is None or (type(params.logprobs) is int and 0 <= params.logprobs <= MAX_LOGPROBS)
    assert isinstance(params.stop, tuple) and len(params.stop) <= 4
    if params.grammar is not None:
        checked(params.grammar, "grammar")  # the engine compiles it: it must take it
    for stop in params.stop:
        assert type(stop) is str and stop
        stop.encode("utf-8")


def _assert_messages(messages) -> None:
    assert isinstance(messages, list) and 1 <= len(messages) <= LIMITS.max_messages + 1  # + the tools message
    for m in messages:
        assert set(m) == {"role", "content"} and m["role"] in ROLES
        m["content"].encode("utf-8")  # raises on lone surrogates


def _assert_request(parsed: ParsedRequest) -> None:
    if isinstance(parsed.prompt, str):
        assert parsed.prompt
        parsed.prompt.encode("utf-8")
    else:
        _assert_messages(parsed.prompt)
    assert isinstance(parsed.stream, bool) and isinstance(parsed.include_usage, bool)
    assert isinstance(parsed.tools, tuple) and all(type(t.name) is str and t.name for t in parsed.tools)
    assert not parsed.tools or parsed.prompt[0]["role"] == "system"  # offered tools are in the prompt
    assert parsed.stream or not parsed.include_usage
    _assert_runnable(parsed.params)


def _decode_or_client_error(decode, *args):
    """Run a decoder: its result, or None after a client error; anything else fails the test."""
    try:
        return decode(*args, LIMITS)
    except ServeError as err:
        assert 400 <= err.http_status < 500, f"{type(err).__name__} is not a client error"
        assert str(err)
        return None


# -- HTTP ----------------------------------------------------------------------------------------
@FUZZ
@given(bodies)
def test_chat_and_completion_bodies(body):
    for decode in (parse_chat, parse_completion):
        parsed = _decode_or_client_error(decode, body)
        if parsed is not None:
            _assert_request(parsed)


@FUZZ
@given(bodies)
def test_conversation_bodies(body):
    messages = _decode_or_client_error(parse_create_conversation, body)
    if messages is not None:
        _assert_messages(messages)
    turn = _decode_or_client_error(parse_append, body)
    if turn is not None:
        assert isinstance(turn, ConversationTurn)
        if turn.new_messages:
            _assert_messages(turn.new_messages)
        assert turn.lease_s is None or (math.isfinite(turn.lease_s) and turn.lease_s > 0)
        _assert_runnable(turn.params)


@FUZZ
@given(st.binary(max_size=64) | bodies.map(lambda b: json.dumps(b).encode("utf-8", "surrogatepass")))
def test_raw_bodies(raw):
    body = _decode_or_client_error(decode_json_body, raw)
    if body is not None:
        parsed = _decode_or_client_error(parse_chat, body)
        if parsed is not None:
            _assert_request(parsed)


@pytest.mark.parametrize("raw, status", [
    (b"[" * 100_000 + b"]" * 100_000, 413),  # over max_body_bytes
    (b"[" * 2000 + b"]" * 2000, 400),  # deeper than the JSON parser's stack
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),  # a lone surrogate
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "seed": 18446744073709551616}', 400),  # > int64
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_k": 9223372036854775808}', 400),  # fails a batch
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', 400),
])
def test_hostile_bodies_found_by_hand(raw, status):
    limits = LIMITS.model_copy(update={"max_body_bytes": 100_000})
    with pytest.raises(ServeError) as err:
        parse_chat(decode_json_body(raw, limits), limits)
    assert err.value.http_status == status


# -- gRPC ----------------------------------------------------------------------------------------
# Protobuf strings are valid Unicode by construction: no surrogates here.
proto_text = st.text(max_size=12)
json_object_text = st.dictionaries(proto_text, json_values).map(json.dumps)  # escapes: proto strings are UTF-8
proto_json = json_object_text | json_values.map(json.dumps) | proto_text
proto_schema = st.just("") | proto_json | small_schema.map(json.dumps)
proto_calls = st.lists(st.builds(dlite_pb2.ToolCall, id=proto_text, name=proto_text, arguments_json=proto_json),
                       max_size=2)
proto_messages = st.lists(st.builds(dlite_pb2.Message, role=st.sampled_from([*ROLES, "wizard", ""]) | proto_text,
                                    content=proto_text, tool_calls=proto_calls), max_size=10)
proto_tools = st.lists(st.builds(dlite_pb2.Tool, name=proto_text, description=proto_text,
                                 parameters_json=st.just("") | proto_json), max_size=3)
int32 = st.integers(min_value=-(1 << 31), max_value=(1 << 31) - 1)
float32 = st.floats(width=32) | st.floats(min_value=-1, max_value=2, width=32)
sampling_fields = {"max_tokens": int32 | st.integers(min_value=0, max_value=80), "temperature": float32,
                   "top_p": float32, "seed": st.integers(min_value=INT64_MIN, max_value=INT64_MAX)}


@FUZZ
@given(st.builds(dlite_pb2.GenerateRequest, messages=proto_messages, prompt=proto_text, top_k=int32,
                 logprobs=st.booleans(), top_logprobs=int32 | st.integers(min_value=0, max_value=25),
                 stop=st.lists(proto_text, max_size=5), tools=proto_tools,
                 tool_choice=st.sampled_from(["", "auto", "none", "required"]) | proto_text, json_schema=proto_schema,
                 **sampling_fields))
def test_grpc_generate_requests(request):
    parsed = _decode_or_client_error(parse_grpc_generate, request)
    if parsed is not None:
        _assert_request(parsed)


@FUZZ
@given(st.builds(dlite_pb2.AppendRequest, messages=proto_messages, lease_seconds=int32,
                 stop=st.lists(proto_text, max_size=5), logprobs=st.booleans(),
                 top_logprobs=int32 | st.integers(min_value=0, max_value=25), json_schema=proto_schema,
                 **sampling_fields),
       st.builds(dlite_pb2.CreateConversationRequest, messages=proto_messages, tools=proto_tools))
def test_grpc_conversation_requests(append, create):
    turn = _decode_or_client_error(parse_grpc_append, append)
    if turn is not None:
        assert turn.lease_s is None or turn.lease_s > 0
        _assert_runnable(turn.params)
    messages = _decode_or_client_error(parse_grpc_create, create)
    if messages is not None:
        _assert_messages(messages)

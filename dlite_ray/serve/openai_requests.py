"""OpenAI request bodies (chat, completions, conversations) into a prompt + SamplingParams.

Every function here either returns a request the engine can run or raises a `ServeError`
subclass (a client error); gRPC messages are read into the same shapes (grpc_requests) and
go through the same checks.
"""

from __future__ import annotations

import json
from typing import Any

from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.engine.structured_output import ANY_JSON_OBJECT, grammar_for_schema
from dlite_ray.runtime.sampling import VERIFY_MODES
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest, PayloadTooLarge
from dlite_ray.serve.request_limits import (
    APPEND_FIELDS,
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    CREATE_CONVERSATION_FIELDS,
    check_message_chars,
    check_prompt_chars,
    refuse_not_implemented,
    refuse_unknown_fields,
)
from dlite_ray.serve.request_types import ConversationTurn, ParsedRequest, check_bool, check_number, check_text
from dlite_ray.serve.tool_calls import Tool
from dlite_ray.serve.tool_prompt import (
    assistant_tool_calls,
    check_tool_choice,
    forced_call_params,
    forced_tools,
    offered_tools,
    tools_message,
)

ROLES = ("system", "user", "assistant", "tool")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # torch.Generator seeds are 64-bit
TOP_K_MAX = (1 << 31) - 1  # top_k becomes an int64 tensor in the batch; gRPC carries int32
MAX_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's top_logprobs cap)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 4, 256  # OpenAI takes up to 4 stop sequences
MAX_STOP_TOKEN_IDS = 64
TOKEN_ID_MAX = (1 << 31) - 1  # gRPC carries int32


def decode_json_body(raw: bytes, limits: LimitArgs) -> Any:
    """An HTTP body: at most `max_body_bytes` of UTF-8 JSON."""
    if len(raw) > limits.max_body_bytes:
        raise PayloadTooLarge(f"body of {len(raw)} bytes exceeds {limits.max_body_bytes}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"the body is not UTF-8 JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. "[[[[..." nested deeper than the parser's stack
        raise BadRequest("the body's JSON is nested too deeply") from exc


def parse_chat(body: Any, limits: LimitArgs) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    refuse_unknown_fields(body, CHAT_FIELDS)
    messages, tools = messages_and_tools(body, limits)
    params = sampling(body, limits, chat_logprobs(body))
    if tools:
        params = forced_call_params(params, body.get("tool_choice"), [t["function"] for t in body["tools"]])
    else:
        forced_tools(body.get("tool_choice"), tools)  # "required" or a name with nothing offered: refused
    return ParsedRequest(messages, params, *_streaming(body), tools=tools)


def messages_and_tools(body: dict, limits: LimitArgs) -> tuple[list[dict[str, str]], tuple[Tool, ...]]:
    """`messages`, opened by a system message that offers the tools if any are offered."""
    messages = parse_messages(body.get("messages"), limits)
    tools = offered_tools(body)
    messages = [tools_message(body["tools"])] + messages if tools else messages
    check_prompt_chars(messages, limits)
    return messages, tools


def parse_completion(body: Any, limits: LimitArgs) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    refuse_unknown_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string")
    check_prompt_chars([{"content": prompt}], limits, "'prompt'")
    check_text(prompt, "'prompt'")
    return ParsedRequest(prompt, sampling(body, limits, _completion_logprobs(body)), *_streaming(body))


def _streaming(body: dict) -> tuple[bool, bool]:
    """`stream`, and `stream_options.include_usage` (only with a stream, as OpenAI has it)."""
    stream = check_bool(body.get("stream", False), "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("stream_options needs stream: true")
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    return stream, check_bool(options.get("include_usage", False), "stream_options.include_usage")


def chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs` alternatives (0 to 20): the count, or None."""
    raw = body.get("logprobs")
    wanted = raw is not None and check_bool(raw, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs: true")
    return logprob_count(0 if top is None else top, "top_logprobs") if wanted else None


def _completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: how many alternatives per token (0 to 20), or null for none."""
    top = body.get("logprobs")
    return None if top is None else logprob_count(top, "logprobs")


def logprob_count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    return value


def sampling(body: dict, limits: LimitArgs, logprobs: int | None = None) -> SamplingParams:
    """Every SamplingParams field a client may set: OpenAI's names where OpenAI has the field
    (max_tokens / max_completion_tokens, temperature, top_p, seed, stop, logprobs,
    response_format), extensions otherwise (top_k, verify_mode, ignore_eos, stop_token_ids).
    trace_top_k is refused: a trace has nowhere to go in a response."""
    refuse_not_implemented(body)
    if body.get("trace_top_k") not in (None, 0) or isinstance(body.get("trace_top_k"), bool):
        raise BadRequest("trace_top_k is not served: a trace of each output position (tap features, top-k "
                         "distribution) has nowhere to go in a response; use the library's DLiteEngine")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if max_tokens > limits.max_tokens_cap:
        raise BadRequest(f"max_tokens={max_tokens} exceeds this server's cap of {limits.max_tokens_cap}")
    temperature = check_number(body.get("temperature", 0.0), "temperature")
    top_p = check_number(body.get("top_p", 1.0), "top_p")
    top_k = body.get("top_k", 0) or 0
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not INT64_MIN <= seed <= INT64_MAX):
        raise BadRequest(f"seed must be a 64-bit integer, got {seed!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k > TOP_K_MAX:
        raise BadRequest(f"top_k must be an integer in [0, {TOP_K_MAX}], got {top_k!r}")
    verify_mode = body.get("verify_mode")
    if verify_mode is not None and verify_mode not in VERIFY_MODES:
        raise BadRequest(f"verify_mode must be one of {', '.join(VERIFY_MODES)} (or null), got {verify_mode!r}")
    ignore_eos = check_bool(body.get("ignore_eos", False), "ignore_eos")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              verify_mode=verify_mode, stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
                              stop=_stop_strings(body.get("stop")), ignore_eos=ignore_eos, logprobs=logprobs,
                              grammar=_response_format(body.get("response_format")))
    except InvalidRequest as exc:
        raise BadRequest(str(exc)) from exc


def _stop_token_ids(raw: Any) -> tuple[int, ...]:
    """`stop_token_ids` (vLLM's extension): null or a list of up to MAX_STOP_TOKEN_IDS token ids."""
    ids = [] if raw is None else raw
    if not isinstance(ids, list) or len(ids) > MAX_STOP_TOKEN_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= TOKEN_ID_MAX for t in ids):
        raise BadRequest(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids "
                         f"(integers in [0, {TOKEN_ID_MAX}])")
    return tuple(ids)


def _response_format(raw: Any) -> str | None:
    """OpenAI's `response_format` -> the grammar of JSON the reply must be (None: free text).

    "json_object" is any JSON object; "json_schema" carries {name, schema, strict}, and every
    schema is decoded strictly (the reply always matches it). The schema is compiled here,
    so one the engine could not use is a 400 before any worker sees it."""
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar_for_schema(ANY_JSON_OBJECT)
    if kind != "json_schema":
        raise BadRequest("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                         "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
    spec = raw.get("json_schema")
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    if not isinstance(schema, dict) or not isinstance(spec.get("name", ""), str):
        raise BadRequest("response_format.json_schema must be {'name': str, 'schema': {...}}")
    try:
        return grammar_for_schema(json.dumps(schema))
    except RecursionError as exc:
        raise BadRequest("response_format's schema is nested too deeply") from exc
    except InvalidRequest as exc:
        raise BadRequest(f"response_format: {exc}") from exc


def _stop_strings(raw: Any) -> tuple[str, ...]:
    """OpenAI's `stop`: null, a string, or a list of up to 4 non-empty strings."""
    stops = [] if raw is None else [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings")
    for s in stops:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise BadRequest(f"each stop string must be a non-empty string of at most {MAX_STOP_CHARS} characters")
        check_text(s, "stop")
    return tuple(stops)


def parse_messages(raw: Any, limits: LimitArgs) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list")
    if len(raw) > limits.max_messages:
        raise BadRequest(f"too many messages ({len(raw)} > {limits.max_messages})")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}] must be an object")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            content = _text_parts(content, i)
        content = check_text(content, f"messages[{i}].content")
        if role == "assistant" and m.get("tool_calls") is not None:
            content = "\n".join(filter(None, [content, assistant_tool_calls(m["tool_calls"], i)]))
        check_message_chars(content, f"messages[{i}].content", limits)
        out.append({"role": role, "content": content})
    return out


def _text_parts(parts: list, i: int) -> str:
    """OpenAI content parts: the text ones, concatenated (images and audio are not served)."""
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
    strings = [t for t in texts if isinstance(t, str)]
    if len(strings) < len(texts):
        raise BadRequest(f"messages[{i}].content text parts need a string 'text'")
    return "".join(strings)


def parse_create_conversation(body: Any, limits: LimitArgs) -> list[dict[str, str]]:
    """POST /v1/conversations: the opening messages, after a system message offering `tools`
    if given (then every turn offers them, and replies that call them are tool_calls)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    refuse_unknown_fields(body, CREATE_CONVERSATION_FIELDS)
    return messages_and_tools(body, limits)[0]


def parse_append(body: Any, limits: LimitArgs) -> ConversationTurn:
    """POST /v1/conversations/{id}/messages: new messages (optional), sampling, lease."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    refuse_unknown_fields(body, APPEND_FIELDS)
    raw = body.get("messages")
    new = [] if raw is None or raw == [] else parse_messages(raw, limits)  # a turn may add nothing
    check_prompt_chars(new, limits)
    lease = body.get("lease_seconds")
    if lease is not None and (check_number(lease, "lease_seconds") <= 0):
        raise BadRequest("lease_seconds must be > 0")
    return ConversationTurn(new, sampling(body, limits, chat_logprobs(body)), None if lease is None else float(lease),
                            check_tool_choice(body.get("tool_choice")))

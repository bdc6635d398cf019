"""Decode and validate requests (OpenAI JSON, gRPC messages) into a prompt + SamplingParams.

Every function here either returns a request the engine can run or raises a `ServeError`
subclass (a client error): hostile input must never reach the engine, where one bad
value could fail the whole batch's step.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any

from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.engine.structured_output import ANY_JSON_OBJECT, grammar_for_calls, grammar_for_schema
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest, PayloadTooLarge
from dlite_ray.serve.request_limits import (
    check_grpc_request,
    check_message_chars,
    check_prompt_chars,
    refuse_not_implemented,
)
from dlite_ray.serve.tool_calls import Tool, ToolCall, render_tool_calls

ROLES = ("system", "user", "assistant", "tool")
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # torch.Generator seeds are 64-bit
TOP_K_MAX = (1 << 31) - 1  # top_k becomes an int64 tensor in the batch; gRPC carries int32
MAX_LOGPROBS = 20  # alternatives a token's logprobs may list (OpenAI's top_logprobs cap)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 4, 256  # OpenAI takes up to 4 stop sequences
TOOLS_PREAMBLE = ("You are an assistant that can call tools. When a tool is needed, answer with a call like "
                  "func_name(arg=value). Available tools (JSON schemas):\n")


@dataclass(slots=True)
class ParsedRequest:
    prompt: list[dict[str, str]] | str
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # a stream ends with a chunk of token counts (stream_options)
    tools: tuple[Tool, ...] = ()  # offered to the model: a reply that calls them is tool_calls


@dataclass(slots=True)
class ConversationTurn:
    """One AppendAndGenerate: the new user/tool messages, sampling, the lease asked for."""

    new_messages: list[dict[str, str]]
    params: SamplingParams
    lease_s: float | None = None


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
    messages, tools = _messages_and_tools(body, limits)
    params = sampling(body, limits, _chat_logprobs(body))
    forced = _forced_tools(body.get("tool_choice"), tools)
    if forced:
        if params.grammar is not None:
            raise BadRequest("tool_choice forces a call and response_format asks for JSON: ask for one of them")
        functions = [t["function"] for t in body["tools"] if t["function"]["name"] in forced]
        try:
            params = replace(params, grammar=grammar_for_calls(functions))
        except InvalidRequest as exc:
            raise BadRequest(f"tool_choice: {exc}") from exc
    return ParsedRequest(messages, params, *_streaming(body), tools=tools)


def _messages_and_tools(body: dict, limits: LimitArgs) -> tuple[list[dict[str, str]], tuple[Tool, ...]]:
    """`messages`, opened by a system message that offers the tools if any are offered."""
    messages = _messages(body.get("messages"), limits)
    tools = _offered_tools(body)
    messages = [_tools_message(body["tools"])] + messages if tools else messages
    check_prompt_chars(messages, limits)
    return messages, tools


def _offered_tools(body: dict) -> tuple[Tool, ...]:
    """The tools the model is offered: `tools`, unless `tool_choice` is "none"."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if body.get("parallel_tool_calls") is not None:
        _bool(body["parallel_tool_calls"], "parallel_tool_calls")  # accepted; the model is not constrained
    tools = () if raw is None or raw == [] else _tools(raw)
    return () if choice == "none" else tools


def _forced_tools(choice: Any, tools: tuple[Tool, ...]) -> set[str]:
    """The tools one of which `tool_choice` forces a call to: a named function, or every
    offered tool for "required"; none for "auto", "none" or no choice. The reply is then
    decoded under the grammar of such calls (`structured_output.grammar_for_calls`)."""
    if choice in (None, "auto", "none"):
        return set()
    names = {t.name for t in tools}
    if choice == "required":
        if not names:
            raise BadRequest("tool_choice 'required' needs 'tools'")
        return names
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise BadRequest("tool_choice must be 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    if name not in names:
        raise BadRequest("tool_choice names a function that is not in 'tools'")
    return {name}


def parse_completion(body: Any, limits: LimitArgs) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string")
    check_prompt_chars([{"content": prompt}], limits, "'prompt'")
    _text(prompt, "'prompt'")
    return ParsedRequest(prompt, sampling(body, limits, _completion_logprobs(body)), *_streaming(body))


def _streaming(body: dict) -> tuple[bool, bool]:
    """`stream`, and `stream_options.include_usage` (only with a stream, as OpenAI has it)."""
    stream = _bool(body.get("stream", False), "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("stream_options needs stream: true")
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object")
    return stream, _bool(options.get("include_usage", False), "stream_options.include_usage")


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs: true` with `top_logprobs` alternatives (0 to 20): the count, or None."""
    raw = body.get("logprobs")
    wanted = raw is not None and _bool(raw, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs: true")
    return _logprob_count(0 if top is None else top, "top_logprobs") if wanted else None


def _completion_logprobs(body: dict) -> int | None:
    """Completions' `logprobs`: how many alternatives per token (0 to 20), or null for none."""
    top = body.get("logprobs")
    return None if top is None else _logprob_count(top, "logprobs")


def _logprob_count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
    return value


def sampling(body: dict, limits: LimitArgs, logprobs: int | None = None) -> SamplingParams:
    refuse_not_implemented(body)
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise BadRequest(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if max_tokens > limits.max_tokens_cap:
        raise BadRequest(f"max_tokens={max_tokens} exceeds this server's cap of {limits.max_tokens_cap}")
    temperature = _number(body.get("temperature", 0.0), "temperature")
    top_p = _number(body.get("top_p", 1.0), "top_p")
    top_k = body.get("top_k", 0) or 0
    seed = body.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not INT64_MIN <= seed <= INT64_MAX):
        raise BadRequest(f"seed must be a 64-bit integer, got {seed!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k > TOP_K_MAX:
        raise BadRequest(f"top_k must be an integer in [0, {TOP_K_MAX}], got {top_k!r}")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              stop=_stop_strings(body.get("stop")), logprobs=logprobs,
                              grammar=_response_format(body.get("response_format")))
    except InvalidRequest as exc:
        raise BadRequest(str(exc)) from exc


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
        _text(s, "stop")
    return tuple(stops)


def _messages(raw: Any, limits: LimitArgs) -> list[dict[str, str]]:
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
        content = _text(content, f"messages[{i}].content")
        if role == "assistant" and m.get("tool_calls") is not None:
            content = "\n".join(filter(None, [content, _assistant_tool_calls(m["tool_calls"], i)]))
        check_message_chars(content, f"messages[{i}].content", limits)
        out.append({"role": role, "content": content})
    return out


def _text_parts(parts: list, i: int) -> str:
    """OpenAI content parts: the text ones, concatenated (images and audio are not served)."""
    texts = [p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"]
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest(f"messages[{i}].content text parts need a string 'text'")
    return "".join(texts)


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{name} must be a string")
    try:
        value.encode("utf-8")  # JSON escapes can carry lone surrogates the tokenizer cannot take
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{name} is not valid Unicode text: {exc.reason}") from exc
    return value


def _tools(raw: Any) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        raise BadRequest("'tools' must be a list")
    tools = []
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        parameters = fn.get("parameters", {})
        properties = parameters.get("properties", {}) if isinstance(parameters, dict) else None
        if not isinstance(properties, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        tools.append(Tool(_text(fn["name"], f"tools[{i}].function.name"), tuple(properties)))
    return tuple(tools)


def _tools_message(tools: list[dict]) -> dict[str, str]:
    schemas = [json.dumps(t["function"]) for t in tools]  # one line each: JSON escapes newlines
    return {"role": "system", "content": TOOLS_PREAMBLE + "\n".join(schemas)}


def tools_in(messages: list[dict[str, str]]) -> tuple[Tool, ...]:
    """The tools a stored history offers (a conversation's are offered once, when it opens):
    read back from the system message that `_tools_message` wrote."""
    first = messages[0] if messages else {}
    if first.get("role") != "system" or not first.get("content", "").startswith(TOOLS_PREAMBLE):
        return ()
    try:
        return _tools([{"function": json.loads(line)}
                       for line in first["content"][len(TOOLS_PREAMBLE):].split("\n")])
    except (json.JSONDecodeError, BadRequest):  # a system message that only looks like ours
        return ()


def _assistant_tool_calls(raw: Any, i: int) -> str:
    """An assistant message's `tool_calls`, written as the model writes calls."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"{where} must be a non-empty list")
    calls = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise BadRequest(f"{where}[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                             "'arguments': JSON text}}}}")
        try:
            arguments = json.loads(fn["arguments"])
        except (json.JSONDecodeError, RecursionError) as exc:
            raise BadRequest(f"{where}[{j}].function.arguments is not JSON: {exc}") from exc
        if not isinstance(arguments, dict):
            raise BadRequest(f"{where}[{j}].function.arguments must be a JSON object")
        calls.append(ToolCall(_text(fn["name"], f"{where}[{j}].function.name"), arguments))
    return _text(render_tool_calls(calls), where)  # argument names are written as they came


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError as exc:  # an int too large for a float
        raise BadRequest(f"{name} is out of range") from exc
    if not math.isfinite(number):  # JSON parsers accept NaN and Infinity
        raise BadRequest(f"{name} must be a finite number, got {value!r}")
    return number


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value


def parse_create_conversation(body: Any, limits: LimitArgs) -> list[dict[str, str]]:
    """POST /v1/conversations: the opening messages, after a system message offering `tools`
    if given (then every turn offers them, and replies that call them are tool_calls)."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return _messages_and_tools(body, limits)[0]


def parse_append(body: Any, limits: LimitArgs) -> ConversationTurn:
    """POST /v1/conversations/{id}/messages: new messages (optional), sampling, lease."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    raw = body.get("messages")
    new = [] if raw is None or raw == [] else _messages(raw, limits)  # a turn may add nothing
    check_prompt_chars(new, limits)
    lease = body.get("lease_seconds")
    if lease is not None and (_number(lease, "lease_seconds") <= 0):
        raise BadRequest("lease_seconds must be > 0")
    return ConversationTurn(new, sampling(body, limits, _chat_logprobs(body)), None if lease is None else float(lease))


# -- gRPC: proto3 scalars have no "unset", so 0 means "the server default" -----------------------

def parse_grpc_generate(request, limits: LimitArgs) -> ParsedRequest:
    """A dlite.v1.GenerateRequest: chat messages if any, else the raw prompt."""
    check_grpc_request(request, limits)
    body = _grpc_sampling_body(request)
    body["top_k"] = request.top_k
    if request.messages:
        body |= {"messages": _grpc_messages(request.messages), "tools": _grpc_tools(request.tools),
                 "tool_choice": _grpc_tool_choice(request.tool_choice)}
        parsed = parse_chat(body, limits)
    else:
        body["prompt"] = request.prompt
        parsed = parse_completion(body, limits)
    parsed.params = replace(parsed.params, logprobs=_grpc_logprobs(request))  # validated again, as built
    return parsed


def _grpc_logprobs(request) -> int | None:
    """`logprobs` with `top_logprobs` alternatives, as chat has them."""
    if request.top_logprobs and not request.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true")
    return _logprob_count(request.top_logprobs, "top_logprobs") if request.logprobs else None


def parse_grpc_create(request, limits: LimitArgs) -> list[dict[str, str]]:
    """A dlite.v1.CreateConversationRequest: the opening messages (and the tools they offer)."""
    check_grpc_request(request, limits)
    body = {"messages": _grpc_messages(request.messages), "tools": _grpc_tools(request.tools)}
    return _messages_and_tools(body, limits)[0]


def parse_grpc_append(request, limits: LimitArgs) -> ConversationTurn:
    """A dlite.v1.AppendRequest: new messages (optional), sampling, lease."""
    check_grpc_request(request, limits)
    new = _messages(_grpc_messages(request.messages), limits) if request.messages else []
    check_prompt_chars(new, limits)
    if request.lease_seconds < 0:
        raise BadRequest(f"lease_seconds must be >= 0 (0 = the server default), got {request.lease_seconds}")
    params = sampling(_grpc_sampling_body(request), limits, _grpc_logprobs(request))
    return ConversationTurn(new, params, request.lease_seconds or None)


def _grpc_sampling_body(request) -> dict:
    body: dict[str, Any] = {"max_tokens": request.max_tokens or None, "temperature": request.temperature,
                            "top_p": request.top_p or 1.0, "stop": list(request.stop)}
    if request.seed:
        body["seed"] = request.seed
    if request.json_schema:
        body["response_format"] = _grpc_response_format(request.json_schema)
    return body


def _grpc_response_format(schema: str) -> dict:
    """`json_schema` (a schema as JSON text) in OpenAI's shape."""
    try:
        parsed = json.loads(schema)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise BadRequest(f"json_schema is not JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise BadRequest("json_schema must be a JSON object (a schema)")
    return {"type": "json_schema", "json_schema": {"name": "grpc", "schema": parsed}}


def _grpc_messages(messages) -> list[dict]:
    """gRPC messages in OpenAI's shape, for the one validation every request goes through."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_json}}
                                     for c in m.tool_calls]
        out.append(message)
    return out


def _grpc_tool_choice(choice: str) -> str | dict | None:
    """"" (auto), "auto", "none", "required", or the name of the function to call."""
    if choice in ("", "auto", "none", "required"):
        return choice or None
    return {"type": "function", "function": {"name": choice}}


def _grpc_tools(tools) -> list[dict] | None:
    """gRPC tools in OpenAI's shape; parameters_json must be a JSON object (or empty)."""
    out = []
    for i, t in enumerate(tools):
        function: dict[str, Any] = {"name": t.name, "description": t.description}
        if t.parameters_json:
            try:
                function["parameters"] = json.loads(t.parameters_json)
            except (json.JSONDecodeError, RecursionError) as exc:
                raise BadRequest(f"tools[{i}].parameters_json is not JSON: {exc}") from exc
        out.append({"type": "function", "function": function})
    return out or None

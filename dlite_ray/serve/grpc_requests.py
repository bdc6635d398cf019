"""dlite.v1 request messages into the shapes of openai_requests, checked the same way.

proto3 scalars have no "unset", so 0 (or "") means "the server default"; `seed` is declared
`optional`, so seed 0 is a seed and an unset one is none.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest
from dlite_ray.serve.openai_requests import (
    logprob_count,
    messages_and_tools,
    parse_chat,
    parse_completion,
    parse_messages,
    sampling,
)
from dlite_ray.serve.request_limits import check_grpc_request, check_prompt_chars
from dlite_ray.serve.request_types import ConversationTurn, ParsedRequest
from dlite_ray.serve.tool_prompt import check_tool_choice


def parse_grpc_generate(request, limits: LimitArgs) -> ParsedRequest:
    """A dlite.v1.GenerateRequest: chat messages if any, else the raw prompt."""
    check_grpc_request(request, limits)
    body = _grpc_sampling_body(request)
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
    return logprob_count(request.top_logprobs, "top_logprobs") if request.logprobs else None


def parse_grpc_create(request, limits: LimitArgs) -> list[dict[str, str]]:
    """A dlite.v1.CreateConversationRequest: the opening messages (and the tools they offer)."""
    check_grpc_request(request, limits)
    body = {"messages": _grpc_messages(request.messages), "tools": _grpc_tools(request.tools)}
    return messages_and_tools(body, limits)[0]


def parse_grpc_append(request, limits: LimitArgs) -> ConversationTurn:
    """A dlite.v1.AppendRequest: new messages (optional), sampling, lease."""
    check_grpc_request(request, limits)
    new = parse_messages(_grpc_messages(request.messages), limits) if request.messages else []
    check_prompt_chars(new, limits)
    if request.lease_seconds < 0:
        raise BadRequest(f"lease_seconds must be >= 0 (0 = the server default), got {request.lease_seconds}")
    params = sampling(_grpc_sampling_body(request), limits, _grpc_logprobs(request))
    return ConversationTurn(new, params, request.lease_seconds or None,
                            check_tool_choice(_grpc_tool_choice(request.tool_choice)))


def _grpc_sampling_body(request) -> dict:
    """The sampling fields GenerateRequest and AppendRequest share, as OpenAI's body has them."""
    body: dict[str, Any] = {"max_tokens": request.max_tokens or None, "temperature": request.temperature,
                            "top_p": request.top_p or 1.0, "top_k": request.top_k, "stop": list(request.stop),
                            "verify_mode": request.verify_mode or None, "ignore_eos": request.ignore_eos,
                            "stop_token_ids": list(request.stop_token_ids)}
    if request.HasField("seed"):
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

"""Decode and validate requests (OpenAI JSON, gRPC messages) into a prompt + SamplingParams."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest

ROLES = ("system", "user", "assistant", "tool")
TOOLS_PREAMBLE = ("You are an assistant that can call tools. When a tool is needed, answer with a call like "
                  "func_name(arg=value). Available tools (JSON schemas):\n")


@dataclass(slots=True)
class ParsedRequest:
    prompt: list[dict[str, str]] | str
    params: SamplingParams
    stream: bool = False


def parse_chat(body: Any, limits: LimitArgs) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    messages = _messages(body.get("messages"), limits)
    tools = body.get("tools")
    if tools is not None:
        messages = [_tools_message(tools)] + messages
    return ParsedRequest(messages, sampling(body, limits), _bool(body.get("stream", False), "stream"))


def parse_completion(body: Any, limits: LimitArgs) -> ParsedRequest:
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string")
    return ParsedRequest(prompt, sampling(body, limits), _bool(body.get("stream", False), "stream"))


def sampling(body: dict, limits: LimitArgs) -> SamplingParams:
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
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise BadRequest("seed must be an integer")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise BadRequest("top_k must be an integer")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except InvalidRequest as exc:
        raise BadRequest(str(exc)) from exc


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
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string")
        out.append({"role": role, "content": content})
    return out


def _tools_message(tools: Any) -> dict[str, str]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    schemas = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        schemas.append(json.dumps(fn))
    return {"role": "system", "content": TOOLS_PREAMBLE + "\n".join(schemas)}


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false")
    return value

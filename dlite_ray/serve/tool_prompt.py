"""Tools written into a prompt, and read back from a stored one.

Offered tools open the prompt as a system message (TOOLS_PREAMBLE and one JSON schema per
line); an assistant's earlier calls are written back as the model writes calls
(`tool_calls.render_tool_calls`); `tool_choice` that forces a call decodes the reply under
the grammar of such calls. A conversation's history keeps that system message, so its
tools are read back from it (`tools_in`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.engine.structured_output import grammar_for_calls
from dlite_ray.serve.errors import BadRequest
from dlite_ray.serve.request_types import check_bool, check_text
from dlite_ray.serve.tool_calls import Tool, ToolCall, render_tool_calls

TOOLS_PREAMBLE = ("You are an assistant that can call tools. When a tool is needed, answer with a call like "
                  "func_name(arg=value). Available tools (JSON schemas):\n")


def offered_tools(body: dict) -> tuple[Tool, ...]:
    """The tools the model is offered: `tools`, unless `tool_choice` is "none"."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if body.get("parallel_tool_calls") is not None:
        check_bool(body["parallel_tool_calls"], "parallel_tool_calls")  # accepted; the model is not constrained
    tools = () if raw is None or raw == [] else parse_tools(raw)
    return () if choice == "none" else tools


def forced_tools(choice: Any, tools: tuple[Tool, ...]) -> set[str]:
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
    name = _named_function(choice)
    if name not in names:
        raise BadRequest("tool_choice names a function that is not in 'tools'")
    return {name}


def _named_function(choice: Any) -> str:
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise BadRequest("tool_choice must be 'auto', 'none', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")
    return name


def parse_tools(raw: Any) -> tuple[Tool, ...]:
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
        tools.append(Tool(check_text(fn["name"], f"tools[{i}].function.name"), tuple(properties)))
    return tuple(tools)


def tools_message(tools: list[dict]) -> dict[str, str]:
    schemas = [json.dumps(t["function"]) for t in tools]  # one line each: JSON escapes newlines
    return {"role": "system", "content": TOOLS_PREAMBLE + "\n".join(schemas)}


def tools_in(messages: list[dict[str, str]]) -> tuple[Tool, ...]:
    """The tools a stored history offers (a conversation's are offered once, when it opens):
    read back from the system message that `tools_message` wrote."""
    try:
        return parse_tools([{"function": fn} for fn in functions_in(messages)])
    except BadRequest:  # a system message that only looks like ours
        return ()


def functions_in(messages: list[dict[str, str]]) -> list[dict]:
    """The OpenAI function objects (name, description, parameters) of `tools_in`."""
    first = messages[0] if messages else {}
    if first.get("role") != "system" or not first.get("content", "").startswith(TOOLS_PREAMBLE):
        return []
    try:
        functions = [json.loads(line) for line in first["content"][len(TOOLS_PREAMBLE):].split("\n")]
    except json.JSONDecodeError:
        return []
    return functions if all(isinstance(fn, dict) for fn in functions) else []


def check_tool_choice(choice: Any) -> Any:
    """`tool_choice`'s shape, before the tools it may name are known (a conversation turn's
    are in the stored history): "auto", "none", "required" or a named function."""
    if choice not in (None, "auto", "none", "required"):
        _named_function(choice)
    return choice


def forced_call_params(params: SamplingParams, choice: Any, functions: list[dict]) -> SamplingParams:
    """`params` under the grammar of a call to the tools `tool_choice` forces (unchanged when
    it forces none): `functions` are the offered tools' OpenAI function objects."""
    forced = forced_tools(choice, parse_tools([{"function": fn} for fn in functions]))
    if not forced:
        return params
    if params.grammar is not None:
        raise BadRequest("tool_choice forces a call and response_format asks for JSON: ask for one of them")
    try:
        return replace(params, grammar=grammar_for_calls([fn for fn in functions if fn["name"] in forced]))
    except InvalidRequest as exc:
        raise BadRequest(f"tool_choice: {exc}") from exc


def assistant_tool_calls(raw: Any, i: int) -> str:
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
        calls.append(ToolCall(check_text(fn["name"], f"{where}[{j}].function.name"), arguments))
    return check_text(render_tool_calls(calls), where)  # argument names are written as they came

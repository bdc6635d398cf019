"""Workloads whose replies are constrained by a grammar, as the server constrains them.

- structured:   what an agent asks for as JSON (`response_format` json_schema): fields
                extracted from text, a label, a short plan, a tool's arguments, any object;
- forced-tools: an agent's third turn of a weather tool loop (two earlier calls and their
                results in the history) with `tool_choice` forcing the call, parsed by the
                server's own request parser, so the prompt and grammar are the served ones.

Every engine masks the target with the same grammar, so replies must be identical.
"""

from __future__ import annotations

import json

from dlite_ray.engine.prompts import Messages
from dlite_ray.engine.structured_output import ANY_JSON_OBJECT, grammar_for_schema


def _obj(**properties) -> str:
    return json.dumps({"type": "object", "properties": properties, "required": list(properties)})


STRING, INTEGER = {"type": "string"}, {"type": "integer"}
LEVEL = {"enum": ["debug", "info", "warning", "error"]}
STRUCTURED_REQUESTS = [
    ("Extract the person: 'Maria Lopez, 34, moved to Madrid last year.'", _obj(name=STRING, age=INTEGER, city=STRING)),
    ("Extract the person: 'Kenji Sato (51) runs a bakery in Osaka.'", _obj(name=STRING, age=INTEGER, city=STRING)),
    ("Classify this log line: 'WARN disk /dev/sda1 is 91% full'", _obj(level=LEVEL, reason=STRING)),
    ("Classify this log line: 'ERROR connection refused: db:5432'", _obj(level=LEVEL, reason=STRING)),
    ("Give three shell commands that find large files.",
     _obj(steps={"type": "array", "items": STRING, "minItems": 3, "maxItems": 3})),
    ("Call get_weather for Tokyo in celsius.", _obj(city=STRING, unit={"enum": ["celsius", "fahrenheit"]})),
    ("Describe the book 'Dune' as JSON with its title, author and year.", ANY_JSON_OBJECT),
    ("Describe a Python function that adds two numbers: its name, arguments and return type.", ANY_JSON_OBJECT),
]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["Berlin", "Tokyo", "Oslo", "Lisbon", "Cairo", "Lima", "Seoul", "Quebec City"]


def structured_requests(limit: int) -> list[tuple[str, Messages, str]]:
    """(id, messages, grammar) per request."""
    return [(f"json-{i}", [{"role": "user", "content": q}], grammar_for_schema(schema))
            for i, (q, schema) in enumerate(STRUCTURED_REQUESTS[:limit])]


def forced_tool_requests(limit: int) -> list[tuple[str, Messages, str]]:
    """(id, messages, grammar) per request: the prompt and grammar the server builds for
    `tool_choice` naming get_weather."""
    from dlite_ray.serve.config import LimitArgs
    from dlite_ray.serve.openai_requests import parse_chat

    out = []
    for city in CITIES[:limit]:
        body = {"messages": [*weather_history(), {"role": "user", "content": f"Weather in {city}?"}],
                "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        parsed = parse_chat(body, LimitArgs())
        messages, grammar = parsed.prompt, parsed.params.grammar
        assert isinstance(messages, list) and grammar is not None  # a chat whose tool_choice forces a call
        out.append((f"call-{city.lower().replace(' ', '-')}", messages, grammar))
    return out


def weather_history() -> list[dict]:
    """Two earlier turns of the loop: a call, its result and the answer, as OpenAI messages."""
    history: list[dict] = []
    for city, weather in (("Paris", "18 C, sunny"), ("Rome", "24 C, clear")):
        call = {"id": f"call_{city}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        history += [{"role": "user", "content": f"What's the weather in {city}?"},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": weather},
                    {"role": "assistant", "content": f"It is {weather} in {city}."}]
    return history

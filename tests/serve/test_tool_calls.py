"""OpenAI tool calling: replies written as Python calls become `tool_calls`; an agent's
earlier calls are written back the same way; streams hold a reply back while it may still
become calls. The last test runs the default model through a tool loop."""

from __future__ import annotations

import asyncio
import json

import pytest

from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest
from dlite_ray.serve.held_reply import HeldReply, held_for_tool_calls
from dlite_ray.serve.openai_requests import parse_chat, parse_create_conversation
from dlite_ray.serve.tool_calls import (
    MAX_PARSED_CHARS,
    Tool,
    ToolCall,
    chat_message,
    could_become_tool_calls,
    parse_tool_calls,
    render_tool_calls,
    tool_calls_delta,
)
from dlite_ray.serve.tool_prompt import TOOLS_PREAMBLE, tools_in
from dlite_ray.serve.worker_messages import GenerateChunk

TOOLS = (Tool("get_weather", ("city", "unit")), Tool("math.factorial", ("n",)))
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


CALLS = [
    ("get_weather(city='Paris')", [ToolCall("get_weather", {"city": "Paris"})]),
    ('  get_weather("Paris", unit="celsius")\n', [ToolCall("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("[get_weather(city='Oslo'), math.factorial(n=5)]",
     [ToolCall("get_weather", {"city": "Oslo"}), ToolCall("math.factorial", {"n": 5})]),
    ("```python\nmath.factorial(n=12)\n```", [ToolCall("math.factorial", {"n": 12})]),
    ("get_weather(city={'name': 'Rome', 'tags': [1, 2.5, None, True]})",
     [ToolCall("get_weather", {"city": {"name": "Rome", "tags": [1, 2.5, None, True]}})]),
    ("```\n[ get_weather ('Oslo')]\n```", [ToolCall("get_weather", {"city": "Oslo"})]),
    ('get_weather(city={"tags": [true, false, null]})',  # JSON's literals: forced calls are written so
     [ToolCall("get_weather", {"city": {"tags": [True, False, None]}})]),
]


@pytest.mark.parametrize("text, calls", CALLS)
def test_replies_that_are_calls(text, calls):
    assert parse_tool_calls(text, TOOLS) == calls
    # a stream holds every beginning of it back, so none of it goes out as content first
    assert all(could_become_tool_calls(text[:i], TOOLS) for i in range(len(text) + 1))


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.",
    "get_weather(city='Paris') will tell you.",  # a call inside prose
    "get_time(zone='UTC')",  # not an offered tool
    "get_weather(city=paris)",  # a name, not a literal: never evaluated
    "get_weather(city=__import__('os').getcwd())",
    "get_weather(**{'city': 'Paris'})",
    "get_weather('Paris', city='Rome')",  # a parameter given twice
    "get_weather('Paris', 'C', 'extra')",  # more positional arguments than parameters
    "get_weather(city={1, 2})",  # a set: JSON cannot carry it
    "get_weather(city=float('nan'))",
    "[]",
    "[get_weather(city='Paris'), 'and more']",
    "get_weather(city='" + "x" * MAX_PARSED_CHARS + "')",
    "get_weather(city=" + "[" * 5000 + "]" * 5000 + ")",  # deeper than the parser's stack
    "math." * 3000 + "factorial(n=1)",  # a long attribute chain: walked without recursion
    "# the call:\nget_weather(city='Paris')",  # a stream would have sent the comment as content
    "```\n" + " " * MAX_PARSED_CHARS + "x",  # whitespace runs: scans are linear
    "",
])
def test_replies_that_are_text(text):
    assert parse_tool_calls(text, TOOLS) is None


def test_written_calls_parse_back():
    calls = [ToolCall("get_weather", {"city": "São Paulo", "unit": None}),
             ToolCall("math.factorial", {"n": 3})]
    for some in (calls[:1], calls):
        assert parse_tool_calls(render_tool_calls(some), TOOLS) == some
    assert render_tool_calls(calls[:1]) == "get_weather(city='São Paulo', unit=None)"


def test_a_call_may_be_coming_until_its_text_says_otherwise():
    assert could_become_tool_calls("", TOOLS) and could_become_tool_calls("``", TOOLS)
    assert could_become_tool_calls("```python\nget_wea", TOOLS)
    assert could_become_tool_calls("[ math.fac", TOOLS)
    assert could_become_tool_calls("get_weather  ", TOOLS)
    for prose in ("Sure", "The weather", "42", "Paris (France)", "(1) First", "get_weatherman(", "`x"):
        assert not could_become_tool_calls(prose, TOOLS), prose
    assert not could_become_tool_calls(" " * (MAX_PARSED_CHARS + 1), TOOLS)


def _stream(held: HeldReply, pieces: list[str]) -> tuple[list[str], tuple]:
    sent = [held.push(p, [p])[0] for p in pieces]
    return sent, held.finish()


def test_a_held_stream_sends_calls_once_complete():
    sent, (rest, entries, calls) = _stream(HeldReply(TOOLS), ["get_", "weather(city", "='Oslo')"])
    assert sent == ["", "", ""] and rest == "" and calls == [ToolCall("get_weather", {"city": "Oslo"})]
    assert entries == ["get_", "weather(city", "='Oslo')"]  # the tokens' logprobs are not lost


def test_a_held_stream_lets_prose_flow_and_releases_a_false_start():
    sent, (rest, _, calls) = _stream(HeldReply(TOOLS), ["g", "iven", " that"])
    assert sent == ["", "given", " that"] and rest == "" and calls is None
    sent, (rest, _, calls) = _stream(HeldReply(TOOLS), ["Paris", " (France)"])
    assert sent == ["Paris", " (France)"] and rest == "" and calls is None
    sent, (rest, entries, calls) = _stream(HeldReply(TOOLS), ["get_weather(", "is a tool)."])
    assert sent == ["", ""] and rest == "get_weather(is a tool)." and calls is None
    assert entries == ["get_weather(", "is a tool)."]
    long = "x" * MAX_PARSED_CHARS
    sent, (rest, _, calls) = _stream(HeldReply(TOOLS), ["get_weather(city='", long, "')"])
    assert sent == ["", "get_weather(city='" + long, "')"] and calls is None  # past the parser's limit: text
    sent, (rest, _, calls) = _stream(HeldReply(()), ["get_weather(", "city='Oslo')"])
    assert sent == ["get_weather(", "city='Oslo')"] and rest == "" and calls is None  # no tools, no holding


def _held_chunks(pieces: list[str], tools: tuple[Tool, ...]) -> list[GenerateChunk]:
    async def worker():
        for i, p in enumerate(pieces):
            last = i == len(pieces) - 1
            yield GenerateChunk([i], p, last, "stop" if last else None, logprobs=[p])

    async def collect():
        return [c async for c in held_for_tool_calls(worker(), tools)]

    return asyncio.run(collect())


def test_held_chunks_end_with_calls_or_text():
    chunks = _held_chunks(["math.fact", "orial(n=", "4)"], TOOLS)
    assert [c.text for c in chunks] == ["", "", ""] and [c.token_ids for c in chunks] == [[0], [1], [2]]
    assert [c.raw_text for c in chunks] == ["math.fact", "orial(n=", "4)"]  # what a history stores
    assert chunks[-1].tool_calls == [ToolCall("math.factorial", {"n": 4})]
    assert chunks[-1].finish_reason == "tool_calls" and chunks[-1].logprobs == ["math.fact", "orial(n=", "4)"]
    chunks = _held_chunks(["ma", "ny", " ways"], TOOLS)
    assert [c.text for c in chunks] == ["", "many", " ways"]
    assert chunks[-1].tool_calls is None and chunks[-1].finish_reason == "stop"


def test_tools_read_back_from_a_history():
    opened = parse_create_conversation({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]},
                                       LimitArgs())
    assert opened[0]["role"] == "system" and tools_in(opened) == (Tool("get_weather", ("city",)),)
    assert tools_in(opened[1:]) == ()
    look_alike = [{"role": "system", "content": TOOLS_PREAMBLE + "not json"}]
    assert tools_in(look_alike) == () and tools_in([]) == ()


def test_openai_shapes():
    message, finish = chat_message("get_weather(city='Oslo')", "stop", TOOLS)
    assert finish == "tool_calls" and message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Oslo"})}
    assert chat_message("get_weather(city='Oslo')", "stop", ()) == (
        {"role": "assistant", "content": "get_weather(city='Oslo')"}, "stop")  # no tools offered
    assert chat_message("Hello", "length", TOOLS) == ({"role": "assistant", "content": "Hello"}, "length")
    delta = tool_calls_delta([ToolCall("get_weather", {"city": "Oslo"}), ToolCall("math.factorial", {"n": 1})])
    assert [c["index"] for c in delta["tool_calls"]] == [0, 1]
    assert len({c["id"] for c in delta["tool_calls"]}) == 2


def _call_message(city: str) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{city}", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


def test_requests_offer_tools_and_write_back_earlier_calls():
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}, _call_message("Oslo"),
                         {"role": "tool", "tool_call_id": "call_Oslo", "content": "3 C"}], "tools": [WEATHER]}
    parsed = parse_chat(body, LimitArgs())
    system, _user, assistant, tool = parsed.prompt
    assert system["role"] == "system" and system["content"].startswith(TOOLS_PREAMBLE)
    assert assistant == {"role": "assistant", "content": "get_weather(city='Oslo')"}
    assert tool == {"role": "tool", "content": "3 C"}
    assert parsed.tools == (Tool("get_weather", ("city",)),)
    none = parse_chat({**body, "tool_choice": "none"}, LimitArgs())
    assert none.tools == () and none.prompt == parsed.prompt[1:]  # not offered, calls still written back


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}, "short": {"type": "boolean"}}}}}


def _takes(grammar: str, text: str) -> bool:
    """Whether a reply of `text` (in the tiny byte-level tokenizer) matches `grammar` whole."""
    from dlite_ray.engine.structured_output import GrammarTokenizer
    from tests.engine.test_structured_output import char_tokenizer

    tok = char_tokenizer()
    matcher = GrammarTokenizer(tok, 128, (2,)).matcher(grammar).matcher
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return matcher.validate_tokens(ids) == len(ids) and matcher.try_consume_tokens(ids) == len(ids) \
        and matcher.is_accepting()


def test_tool_choice_forces_one_call_by_its_grammar():
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER, TIME]}
    assert parse_chat(body, LimitArgs()).params.grammar is None
    required = parse_chat(body | {"tool_choice": "required"}, LimitArgs()).params.grammar
    named = parse_chat(body | {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
                       LimitArgs()).params.grammar
    for text, by_required, by_named in [
        ('get_weather(city="Oslo")', True, False),
        ('get_time(zone="CET", short=true)', True, True),
        ("get_time()", True, True),
        ("get_time(short=false)", True, True),  # any optional arguments, in the schema's order
        ('get_time(short=true, zone="UTC")', False, False),
        ("get_weather()", False, False),  # city is required
        ('get_time(zone="PST")', False, False),  # not in the enum
        ('get_weather(city="Oslo") and more', False, False),  # the reply is the call, nothing else
        ("It is sunny.", False, False),
    ]:
        assert (_takes(required, text), _takes(named, text)) == (by_required, by_named), text
        if by_required:  # what the grammar lets through comes back as tool_calls
            assert chat_message(text, "stop", parse_chat(body, LimitArgs()).tools)[1] == "tool_calls"


def _tool(name: str, properties: dict, required: object = ()) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


def test_a_forced_call_honours_its_tools_definitions():
    """Pydantic-made tools point their arguments at `$defs`; each argument's grammar carries them."""
    tool = _tool("book", {"guest": {"$ref": "#/$defs/Guest"}}, ["guest"])
    tool["function"]["parameters"]["$defs"] = {"Guest": {
        "type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
        "additionalProperties": False}}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "required"}
    grammar = parse_chat(body, LimitArgs()).params.grammar
    assert _takes(grammar, 'book(guest={"age": 7})')
    assert not _takes(grammar, 'book(guest={"age": "7"})')


@pytest.mark.parametrize("extra, message", [
    ({"tool_choice": "required", "tools": []}, "needs 'tools'"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"max-n": {}}}}}]}, "not a Python name"),
    ({"tool_choice": "required", "tools": [_tool("f", {"from": {}})]}, "not a Python name"),  # f(from=1)
    ({"tool_choice": "required", "tools": [_tool("get-weather", {})]}, "not a Python name"),
    ({"tool_choice": "required", "tools": [_tool("f", {"a": {}}, [5])]}, "'required' must list"),
    ({"tool_choice": "required", "tools": [_tool("f", {"a": {}}, ["b"])]}, "'required' must list"),
    ({"tool_choice": "required", "tools": [_tool("f", {"a": {}}, "a")]}, "'required' must list"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "ask for one of them"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "not in 'tools'"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "any"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": []}}}]}, "parameters"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "f()"}]}, "tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "not JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "JSON object"),
])
def test_bad_tool_fields_are_refused(extra, message):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **extra}
    with pytest.raises(BadRequest, match=message):
        parse_chat(body, LimitArgs())


def test_the_default_model_calls_a_tool_after_seeing_its_earlier_calls():
    """A real agent loop's request: two earlier turns went through get_weather (sent back as
    OpenAI tool_calls messages), and the model, reading them written as calls, calls it again.
    Before calls were written back, they reached the model as empty assistant turns."""
    from dlite_ray.engine.engine import DLiteEngine

    history = []
    for city, weather in (("Paris", "18 C, sunny"), ("Rome", "24 C, clear")):
        history += [{"role": "user", "content": f"What's the weather in {city}?"}, _call_message(city),
                    {"role": "tool", "tool_call_id": f"call_{city}", "content": weather},
                    {"role": "assistant", "content": f"It is {weather} in {city}."}]
    body = {"messages": [*history, {"role": "user", "content": "Weather in Berlin?"}], "tools": [WEATHER]}
    parsed = parse_chat(body, LimitArgs())
    engine = DLiteEngine.from_pretrained(dtype="bfloat16")
    reply = engine.generate(parsed.prompt, max_new_tokens=24)[0]
    message, finish = chat_message(reply.text, reply.finish_reason, parsed.tools)
    assert finish == "tool_calls", reply.text
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "get_weather", "arguments": json.dumps({"city": "Berlin"})}]


def test_the_default_model_makes_a_forced_call():
    """tool_choice names get_weather, then "required" offers two tools: the reply is decoded
    under the grammar of one call, so it is a call, with arguments its schema accepts."""
    from dlite_ray.engine.engine import DLiteEngine

    engine = DLiteEngine.from_pretrained(dtype="bfloat16")
    body = {"messages": [{"role": "user", "content": "What's the weather in Paris?"}], "tools": [WEATHER, TIME]}
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        parsed = parse_chat(body | {"tool_choice": choice, "max_tokens": 24}, LimitArgs())
        seq = engine.add_request(parsed.prompt, parsed.params)
        while engine.has_unfinished():
            engine.step()
        reply = engine.result(seq)
        message, finish = chat_message(reply.text, reply.finish_reason, parsed.tools)
        assert finish == "tool_calls", reply.text
        (call,) = message["tool_calls"]
        if choice != "required":
            assert call["function"]["name"] == "get_weather"
            assert "Paris" in json.loads(call["function"]["arguments"]).values()

"""A grammar that llguidance cannot follow (a parser or lexer limit) never ends a reply as a
normal "stop": one that fails on the reply's first token is refused up front; one that fails
later ends its reply with finish_reason "error" and the reason, through GenerationResult, the
AsyncEngine's chunks and the TargetWorker's stream (the serving contract the ingress maps to
an HTTP / gRPC error)."""

from __future__ import annotations

import asyncio
import json

import llguidance
import pytest

from dlite_ray.engine.async_engine import AsyncEngine
from dlite_ray.engine.sequence import FINISH_ERROR, InvalidRequest, SamplingParams
from dlite_ray.engine.structured_output import checked, grammar_for_calls, grammar_for_schema
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import random_draft
from tests.engine.test_structured_output import CHOICE, PROMPTS, _engine, char_tokenizer

# required recursion: every reply would be infinite, and llguidance's forced-token scan gives up
ENDLESS = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"],
                           "additionalProperties": False}}, "$ref": "#/$defs/n"}
HUGE_PATTERN = {"type": "string", "pattern": "^a{1000000}$"}  # its lexer is too large to build
# fine on its first tokens, then (after "ab" and a letter) the same unbuildable lexeme
LATE_FAILURE = checked(llguidance.LLMatcher.grammar_from_lark(
    f'start: "ab" /[a-z]/ value\nvalue: %json {json.dumps(HUGE_PATTERN)}'), "test")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """As test_structured_output's: a tiny target, its draft, a byte-level one-token-a-character tokenizer."""
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("gf") / "llama", "llama")
    target = load_target(d)
    return target, random_draft(target, read_config(d), seed=5), char_tokenizer()


def _run(engine, params: SamplingParams):
    seq = engine.add_request(PROMPTS[0], params)
    while engine.has_unfinished():
        engine.step()
    return seq


@pytest.mark.parametrize("schema", [ENDLESS, HUGE_PATTERN, {"type": "object", "properties": {"s": HUGE_PATTERN},
                                                             "required": ["s"]}],
                         ids=["recursive-ref", "huge-pattern", "nested-pattern"])
def test_a_schema_that_fails_on_its_first_token_is_refused(tiny, schema):
    engine = _engine(tiny)
    with pytest.raises(InvalidRequest, match="cannot be followed"):
        engine.generate(PROMPTS[0], max_new_tokens=8, json_schema=json.dumps(schema))
    assert not engine.has_unfinished()
    assert len(engine.generate(PROMPTS[0], max_new_tokens=4)[0].token_ids) == 4  # nothing else disturbed


def test_a_forced_tool_call_whose_arguments_fail_is_refused(tiny):
    """tool_choice "required" with a recursive $ref: no reply can be a call."""
    fn = {"name": "get", "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}},
                                        "required": ["x"], "$defs": ENDLESS["$defs"]}}
    with pytest.raises(InvalidRequest, match="cannot be followed"):
        _engine(tiny).add_request(PROMPTS[0], SamplingParams(grammar=grammar_for_calls([fn])))


def test_a_recursive_schema_that_ends_is_served(tiny):
    """Optional recursion has finite replies: not refused."""
    nested = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    out = _engine(tiny).generate(PROMPTS[0], max_new_tokens=12, json_schema=json.dumps(nested))[0]
    assert out.finish_reason in ("stop", "length") and out.error is None


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "draft+forced-copies"])
def test_a_grammar_that_fails_mid_reply_ends_it_with_an_error_not_a_stop(tiny, speculate):
    engine = _engine(tiny, tiny[1], lookup_tokens=15) if speculate else _engine(tiny)
    seq = _run(engine, SamplingParams(max_new_tokens=40, grammar=LATE_FAILURE))
    assert seq.finish_reason == FINISH_ERROR == "error"
    assert "lexer" in seq.error and "too many" in seq.error
    assert "\n" not in seq.error and len(seq.error) < 300  # the reason, not the parser's state
    text = tiny[2].decode([t for t in seq.output_ids if t != 2])
    assert text.startswith("ab") and len(text) <= 4  # "ab", a letter, and at most the failing '"'
    result = engine.result(seq)
    assert (result.finish_reason, result.error) == ("error", seq.error)
    assert not engine.has_unfinished()
    assert _run(engine, _schema_params(CHOICE)).finish_reason == "stop"  # the engine serves on


def _schema_params(schema: dict) -> SamplingParams:
    return SamplingParams(max_new_tokens=24, grammar=grammar_for_schema(json.dumps(schema)))


def test_a_failed_grammar_is_reported_in_the_last_chunk(tiny):
    async_engine = AsyncEngine(_engine(tiny))

    async def chunks():
        return [c async for c in async_engine.generate(PROMPTS[0], SamplingParams(grammar=LATE_FAILURE))]

    try:
        got = asyncio.run(chunks())
    finally:
        async_engine.shutdown()
    assert [c.error for c in got[:-1]] == [None] * (len(got) - 1)
    last = got[-1]
    assert last.finished and last.finish_reason == "error" and "lexer" in last.error


def test_the_target_worker_streams_the_error_in_its_final_chunk(tiny):
    """The worker's chunk contract: every chunk has "error" (None), the last one of a failed
    grammar has finish_reason "error" and "error" = the reason; tool calls are never parsed
    out of a failed reply."""
    from dlite_ray.serve.config import AppArgs
    from dlite_ray.serve.held_reply import held_for_tool_calls
    from dlite_ray.serve.target_worker import TargetWorker
    from dlite_ray.serve.tool_calls import Tool

    worker = TargetWorker(AppArgs(), engine_factory=lambda args: _engine(tiny))
    params = SamplingParams(max_new_tokens=40, grammar=LATE_FAILURE)

    async def stream(tools=()):
        chunks = worker.generate(PROMPTS[0], params)
        if tools:
            chunks = held_for_tool_calls(chunks, tools)
        return [c async for c in chunks]

    try:
        got = asyncio.run(stream())
        held = asyncio.run(stream((Tool("ab", ()),)))
    finally:
        worker.async_engine.shutdown()
    assert all(c.error is None and not c.finished for c in got[:-1])
    last = got[-1]
    assert (last.finished, last.finish_reason) == (True, "error")
    assert isinstance(last.error, str) and "lexer" in last.error
    assert held[-1].finish_reason == "error" and held[-1].tool_calls is None
    assert held[-1].error == last.error
    assert "".join(c.text for c in held) == "".join(c.text for c in got)


def test_sampling_parameters_we_do_not_have_are_named():
    """Refused, never silently ignored (the worker builds a request's SamplingParams so)."""
    with pytest.raises(InvalidRequest, match="n, presence_penalty"):
        SamplingParams.from_dict({"max_new_tokens": 2, "n": 3, "presence_penalty": 1.0})

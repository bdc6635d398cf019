"""Every sampling field a library user can set can be set over HTTP and gRPC (or is refused
by name), the TargetWorker takes SamplingParams itself and streams typed chunks, and only
client errors say what went wrong (anything else is a 500 with an error id)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.serve.config import AppArgs, LimitArgs
from dlite_ray.serve.errors import BadRequest, ConversationNotFound, InternalError, as_serve_error, openai_error_body
from dlite_ray.serve.grpc_requests import parse_grpc_append, parse_grpc_generate
from dlite_ray.serve.openai_requests import parse_append, parse_chat, parse_completion, parse_create_conversation
from dlite_ray.serve.proto import dlite_pb2

LIMITS = LimitArgs()
HI = [{"role": "user", "content": "hi"}]
HI_PB = [dlite_pb2.Message(role="user", content="hi")]
FIELDS = {"verify_mode": "match", "ignore_eos": True, "stop_token_ids": [2, 7], "top_k": 5, "seed": 3,
          "temperature": 0.7, "top_p": 0.9, "max_tokens": 9, "stop": ["END"]}
EXPECTED = {"verify_mode": "match", "ignore_eos": True, "stop_token_ids": (2, 7), "top_k": 5, "seed": 3,
            "max_new_tokens": 9, "stop": ("END",)}


def _has(params: SamplingParams, expected: dict) -> None:
    assert {k: getattr(params, k) for k in expected} == expected
    assert params.temperature == pytest.approx(0.7) and params.top_p == pytest.approx(0.9)


def test_every_field_over_http():
    _has(parse_chat({"messages": HI, **FIELDS}, LIMITS).params, EXPECTED)
    _has(parse_completion({"prompt": "hi", **FIELDS}, LIMITS).params, EXPECTED)
    _has(parse_append({"messages": HI, **FIELDS}, LIMITS).params, EXPECTED)
    chat = parse_chat({"messages": HI, "logprobs": True, "top_logprobs": 2,
                       "response_format": {"type": "json_object"}}, LIMITS).params
    assert chat.logprobs == 2 and chat.grammar is not None


def test_every_field_over_grpc():
    fields = {k: v for k, v in FIELDS.items()}
    for parse, request in ((parse_grpc_generate, dlite_pb2.GenerateRequest(messages=HI_PB, **fields)),
                           (parse_grpc_generate, dlite_pb2.GenerateRequest(prompt="hi", **fields)),
                           (parse_grpc_append, dlite_pb2.AppendRequest(conversation_id="c", messages=HI_PB, **fields))):
        params = parse(request, LIMITS)
        _has(params.params if hasattr(params, "params") else params, EXPECTED)
    default = parse_grpc_generate(dlite_pb2.GenerateRequest(prompt="hi"), LIMITS).params
    assert (default.verify_mode, default.ignore_eos, default.stop_token_ids, default.top_k) == (None, False, (), 0)


@pytest.mark.parametrize(("body", "name"), [
    ({"verify_mode": "speculative"}, "verify_mode"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"top_k": -1}, "top_k"),
    ({"trace_top_k": 5}, "trace_top_k"),
])
def test_bad_values_are_refused_by_name(body, name):
    with pytest.raises(BadRequest, match=name):
        parse_chat({"messages": HI, **body}, LIMITS)
    with pytest.raises(BadRequest, match=name):
        parse_append(body, LIMITS)


def test_bad_values_over_grpc_are_refused_by_name():
    for request, name in ((dlite_pb2.GenerateRequest(prompt="hi", verify_mode="x"), "verify_mode"),
                          (dlite_pb2.GenerateRequest(prompt="hi", stop_token_ids=[-3]), "stop_token_ids"),
                          (dlite_pb2.AppendRequest(conversation_id="c", top_k=-2), "top_k")):
        parse = parse_grpc_generate if isinstance(request, dlite_pb2.GenerateRequest) else parse_grpc_append
        with pytest.raises(BadRequest, match=name):
            parse(request, LIMITS)


def test_only_client_errors_say_what_went_wrong(caplog):
    assert isinstance(as_serve_error(InvalidRequest("prompt of 9 tokens does not fit")), BadRequest)
    assert as_serve_error(ConversationNotFound("no conversation")).http_status == 404
    with caplog.at_level(logging.ERROR, logger="dlite_ray.serve.errors"):
        err = as_serve_error(ValueError("checkpoint /secret/path has a bad shape"))
    assert isinstance(err, InternalError) and err.http_status == 500
    body = openai_error_body(err)["error"]
    assert "secret" not in body["message"] and body["id"] == err.error_id and err.error_id in body["message"]
    assert err.error_id in caplog.text and "secret" in caplog.text  # the log keeps the traceback
    assert caplog.records[-1].exc_info is not None


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    from dlite_ray.runtime.loading import load_target
    from dlite_ray.serve.target_worker import TargetWorker
    from tests.conftest import make_tiny_checkpoint
    from tests.engine.test_structured_output import _engine, char_tokenizer

    target = load_target(make_tiny_checkpoint(tmp_path_factory.mktemp("fields") / "llama", "llama"))
    worker = TargetWorker(AppArgs(), engine_factory=lambda args: _engine((target, None, char_tokenizer())))
    yield worker
    worker.async_engine.shutdown()


def _reply(worker, prompt, params: SamplingParams) -> list:
    async def go():
        return [c async for c in worker.generate(prompt, params)]
    return asyncio.run(go())


def test_ignore_eos_and_stop_token_ids_reach_the_engine(worker):
    """Parsed from an HTTP body, through the worker's stream: this tiny model ends its reply
    with an end-of-sequence token at once, unless ignore_eos; a stop token id ends it too."""
    prompt = "abc"

    def token_ids(body: dict) -> tuple[list[int], str]:
        chunks = _reply(worker, prompt, parse_completion({"prompt": prompt, "max_tokens": 8, **body}, LIMITS).params)
        assert chunks[-1].finished and chunks[-1].replica == "local"
        return [t for c in chunks for t in c.token_ids], chunks[-1].finish_reason

    stopped, reason = token_ids({})
    assert reason == "stop" and len(stopped) < 8 and stopped[-1] in worker.engine.eos_ids
    ignored, reason = token_ids({"ignore_eos": True})
    assert reason == "length" and len(ignored) == 8 and ignored[:len(stopped)] == stopped
    k = next(k for k in range(1, 8) if ignored[k] not in ignored[:k] and ignored[k] not in worker.engine.eos_ids)
    at_stop, reason = token_ids({"ignore_eos": True, "stop_token_ids": [ignored[k]]})
    assert reason == "stop" and at_stop == ignored[:k + 1]


def test_the_worker_validates_before_its_first_chunk(worker):
    async def first():
        async for chunk in worker.generate("x" * 100_000, SamplingParams(max_new_tokens=4)):
            return chunk
    with pytest.raises(InvalidRequest, match="does not fit"):
        asyncio.run(first())


@pytest.mark.parametrize(("parse", "body"), [
    (parse_chat, {"messages": HI}),
    (parse_completion, {"prompt": "hi"}),
    (parse_append, {"messages": HI}),
    (parse_create_conversation, {"messages": HI}),
])
def test_unknown_fields_are_refused_by_name(parse, body):
    parse(body | {"model": "any", "user": "u1"}, LIMITS)  # OpenAI's bookkeeping is accepted
    with pytest.raises(BadRequest, match="unrecognized request argument: \"grammar\""):
        parse(body | {"grammar": "root ::= \"x\""}, LIMITS)


def test_fields_of_another_endpoint_are_refused():
    with pytest.raises(BadRequest, match="stream"):
        parse_append({"messages": HI, "stream": True}, LIMITS)  # a turn's reply is not streamed
    with pytest.raises(BadRequest, match="tools"):
        parse_completion({"prompt": "hi", "tools": []}, LIMITS)
    with pytest.raises(BadRequest, match="max_tokens"):
        parse_create_conversation({"messages": HI, "max_tokens": 3}, LIMITS)


def test_grpc_seed_zero_is_a_seed():
    zero = dlite_pb2.GenerateRequest(prompt="hi", seed=0)
    assert parse_grpc_generate(zero, LIMITS).params.seed == 0
    assert parse_grpc_generate(dlite_pb2.GenerateRequest(prompt="hi"), LIMITS).params.seed is None
    append = dlite_pb2.AppendRequest(conversation_id="c", messages=HI_PB, seed=0)
    assert parse_grpc_append(append, LIMITS).params.seed == 0


def test_a_turns_tool_choice_is_checked_for_shape_when_parsed():
    assert parse_append({"tool_choice": "required"}, LIMITS).tool_choice == "required"
    named = {"type": "function", "function": {"name": "f"}}
    assert parse_append({"tool_choice": named}, LIMITS).tool_choice == named
    with pytest.raises(BadRequest, match="tool_choice"):
        parse_append({"tool_choice": "always"}, LIMITS)
    grpc_turn = parse_grpc_append(dlite_pb2.AppendRequest(conversation_id="c", tool_choice="f"), LIMITS)
    assert grpc_turn.tool_choice == named

"""The ingress's HTTP and gRPC endpoints without Ray: the real DLiteIngress and TargetWorker
(a tiny random model with the default tokenizer and a random in-process draft) and
ConversationRouter, in one process over local handles (local_handles.py). Replies at T = 0
equal the library engine's for the same request."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from dlite_ray.constants import REPLY_CACHE_TOKENS
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.proto import dlite_pb2
from tests.serve.local_handles import GrpcContext, LocalApp, local_args, sse_events, tiny_engine

# tenant-c and tenant-d send one request each in the module: no earlier reply of their own
# to copy from (the served engine's reply cache copies a tenant's replies), whatever the order
KEYS = {"tenant-a": "key-a", "tenant-b": "key-b", "tenant-c": "key-c", "tenant-d": "key-d"}
AUTH_A, AUTH_B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
AUTH_D = {"authorization": "Bearer key-d"}
GRPC_A, GRPC_C = (("authorization", "Bearer key-a"),), (("authorization", "Bearer key-c"),)
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]
NEW = 24


@pytest.fixture(scope="module")
def library(tiny_serving_model):
    """The library engine, for the expected replies."""
    return tiny_engine(tiny_serving_model)


@pytest.fixture(scope="module")
def served_engine(tiny_serving_model):
    """The engine the local TargetWorker serves (one per module: each app's worker drives it
    from its own thread, one app at a time), copying from earlier replies as a server does."""
    return tiny_engine(tiny_serving_model, reply_cache_tokens=REPLY_CACHE_TOKENS)


@pytest.fixture
def make_app(served_engine, tmp_path):
    apps = []

    def make(**overrides) -> LocalApp:
        apps.append(LocalApp(local_args(tmp_path, KEYS, **overrides), served_engine))
        return apps[-1]

    yield make
    for app in apps:
        app.close()


@pytest.fixture
def app(make_app) -> LocalApp:
    return make_app()


@pytest.fixture(scope="module")
def reference(library):
    return library.generate(MESSAGES, max_new_tokens=NEW)[0]


def _chat(app: LocalApp, headers=AUTH_A, **body):
    return app.http.post("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": NEW, **body}, headers=headers)


def _contents(events: list) -> list[str]:
    return [e["choices"][0]["delta"].get("content") for e in events if e != "[DONE]" and e["choices"]]


# -- chat and completions, whole and streamed ----------------------------------------------------
def test_chat_completion_equals_library_engine(app, reference):
    async def go():
        r = await _chat(app, headers=AUTH_D)  # a tenant with no earlier reply: its rounds are drafted
        assert r.status == 200
        return await r.json()

    body = asyncio.run(go())
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": reference.text}
    assert body["choices"][0]["finish_reason"] == reference.finish_reason
    assert body["usage"]["completion_tokens"] == len(reference.token_ids)
    assert body["usage"]["prompt_tokens"] > 0 and body["dlite_stats"]["draft_time"] > 0  # drafted


def test_streaming_chat_completion(app, reference):
    async def go():
        r = await _chat(app, stream=True)
        assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
        return await r.events()

    events = asyncio.run(go())
    assert events[-1] == "[DONE]" and all(e != "[DONE]" for e in events[:-1])
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d["content"] for d in deltas) == reference.text and len(deltas) >= 2
    assert [d.get("role") for d in deltas] == ["assistant"] + [None] * (len(deltas) - 1)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]] == [None] * (len(deltas) - 1) + ["length"]
    assert all("usage" not in e for e in events[:-1])  # only with include_usage


def test_a_stream_can_end_with_its_usage(app, reference):
    async def go():
        r = await _chat(app, stream=True, stream_options={"include_usage": True})
        return await r.events()

    events = asyncio.run(go())
    assert events[-1] == "[DONE]"
    chunks, last = events[:-2], events[-2]
    assert all(e["choices"] and e["usage"] is None for e in chunks) and last["choices"] == []
    usage = last["usage"]
    assert usage["completion_tokens"] == len(reference.token_ids)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0


def test_completions_whole_and_streamed_equal_library_engine(app, library):
    prompt = "def add(a, b):"
    expected = library.generate(prompt, max_new_tokens=12)[0]

    async def go():
        whole = await (await app.http.post("/v1/completions", {"prompt": prompt, "max_tokens": 12},
                                           headers=AUTH_A)).json()
        events = await (await app.http.post("/v1/completions", {"prompt": prompt, "max_tokens": 12, "stream": True},
                                            headers=AUTH_A)).events()
        return whole, events

    whole, events = asyncio.run(go())
    assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == expected.text
    assert whole["usage"]["completion_tokens"] == len(expected.token_ids)
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected.text


# -- errors ----------------------------------------------------------------------------------------
BAD_BODIES = [
    ({"messages": MESSAGES, "temperature": -1}, "temperature"),
    ({"messages": MESSAGES, "max_tokens": 10**6}, "cap"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options needs stream"),
    ({"messages": MESSAGES, "n": 3}, "n="),
    ({"messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 4}, "context"),  # the engine's
]


def test_bad_requests_get_openai_errors_and_others_are_unaffected(app, reference):
    """A request the parser or the engine refuses is a 400 with an OpenAI error body while
    another stream runs; that stream and later requests are served as before."""
    async def go():
        stream = await _chat(app, stream=True)
        pieces = stream.pieces()
        first = await anext(pieces)  # streaming now
        refused = []
        for body, _ in BAD_BODIES:
            r = await app.http.post("/v1/chat/completions", body, headers=AUTH_A)
            refused.append((r.status, await r.json()))
        rest = b"".join([p async for p in pieces])
        after = await (await _chat(app)).json()
        return first + rest, refused, after

    streamed, refused, after = asyncio.run(go())
    for (status, body), (_, words) in zip(refused, BAD_BODIES, strict=True):
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
        assert words in body["error"]["message"], body
    assert "".join(_contents(sse_events(streamed))) == reference.text
    assert after["choices"][0]["message"]["content"] == reference.text


def test_malformed_and_oversized_bodies(app):
    async def go():
        not_utf8 = await app.http.post("/v1/chat/completions", body=b"\xff\xfe{", headers=AUTH_A)
        huge = await app.http.post("/v1/chat/completions", body=b"x" * (5 << 20), headers=AUTH_A)
        return (not_utf8.status, await not_utf8.json()), (huge.status, await huge.json())

    (status, body), (huge_status, huge_body) = asyncio.run(go())
    assert status == 400 and "UTF-8" in body["error"]["message"]
    assert huge_status == 413 and "max_body_bytes" in huge_body["error"]["message"]


# -- credentials and operational endpoints --------------------------------------------------------
def test_credentials_are_required(app):
    async def go():
        statuses = []
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic key-a"}):
            r = await _chat(app, headers=headers)
            statuses.append((r.status, (await r.json())["error"]["type"]))
        _, no_key = await app.grpc.stream("Generate", dlite_pb2.GenerateRequest(prompt="hi", max_tokens=2))
        _, wrong = await app.grpc.unary("GetStats", dlite_pb2.GetStatsRequest(),
                                        (("authorization", "Bearer wrong"),))
        lower = await _chat(app, headers={"authorization": "bearer key-a"}, max_tokens=2)
        return statuses, no_key.code, wrong.code, lower.status

    statuses, no_key, wrong, lower = asyncio.run(go())
    assert statuses == [(401, "authentication_error")] * 3
    assert no_key == wrong == grpc.StatusCode.UNAUTHENTICATED
    assert lower == 200  # the scheme is case-insensitive


def test_models_health_metrics_and_no_docs(app):
    async def go():
        out = {}
        for path, headers in (("/healthz", {}), ("/v1/models", {}), ("/metrics", {}), ("/metrics", AUTH_B),
                              ("/docs", {}), ("/openapi.json", {})):
            r = await app.http.get(path, headers=headers)
            out[path, bool(headers)] = (r.status, (await r.read()).decode())
        bare, _ = await app.grpc.unary("GetStats", dlite_pb2.GetStatsRequest())
        full, _ = await app.grpc.unary("GetStats", dlite_pb2.GetStatsRequest(), GRPC_A)
        return out, bare.json, full.json

    out, bare, full = asyncio.run(go())
    assert out["/healthz", False] == (200, '{"status":"ok"}')
    assert json.loads(out["/v1/models", False][1])["data"][0]["id"] == "dlite-smollm2-135m"
    assert out["/metrics", False][0] == 401
    status, metrics = out["/metrics", True]
    assert status == 200 and "dlite_kv_blocks_total" in metrics and "dlite_worker_up 1.0" in metrics
    assert out["/docs", False][0] == out["/openapi.json", False][0] == 404
    assert json.loads(bare) == {"status": "ok"}
    assert json.loads(full)["worker"]["replica"] == "local" and json.loads(full)["status"] == "ok"


def test_a_tenant_s_replies_are_copied_for_that_tenant_only(app, served_engine, library):
    """The worker keeps each reply under its tenant (the engine's reply cache namespace):
    a later request of that tenant may copy from it, another tenant's never."""
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]  # asked by tenant-a only

    async def go():
        chat = await app.http.post("/v1/chat/completions", {"messages": messages, "max_tokens": NEW}, headers=AUTH_A)
        metrics = await app.http.get("/metrics", headers=AUTH_A)
        return chat.status, (await metrics.read()).decode()

    status, metrics = asyncio.run(go())
    assert status == 200
    prompt, reply = library.encode(messages), library.generate(messages, max_new_tokens=NEW)[0].token_ids
    cache = served_engine.reply_cache
    assert cache.propose("tenant-a", prompt, 4) == reply[:4]  # the reply starts after its prompt's tail
    # another tenant's namespace never holds it (one that sent nothing: every prompt ends in the
    # chat template's tail, so a tenant with replies of its own may well propose those)
    assert cache.propose("tenant-silent", prompt, 4) == [] and cache.propose(None, prompt, 4) == []
    gauge = next(row for row in metrics.splitlines() if row.startswith("dlite_reply_cache_tokens "))
    assert float(gauge.split()[1]) >= len(reply)


# -- gRPC ----------------------------------------------------------------------------------------
def test_grpc_generate_streams_the_same_tokens_and_refuses_bad_values(app, reference):
    request = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in MESSAGES], max_tokens=NEW)

    async def go():
        good = await app.grpc.stream("Generate", request, GRPC_C)
        bad = await app.grpc.stream("Generate", dlite_pb2.GenerateRequest(prompt="hi", temperature=-2, max_tokens=4),
                                    GRPC_A)
        return good, bad

    (chunks, ok), (refused, bad) = asyncio.run(go())
    assert ok.code is None
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    assert "".join(c.text for c in chunks) == reference.text
    stats = chunks[-1].stats
    # the served rounds are the library's, drafted (was: mean_accept_length >= 1, true with no draft)
    assert chunks[-1].finish_reason == "length" and list(stats.accept_lengths) == reference.stats.accept_lengths
    assert stats.draft_time > 0  # the rounds went through the draft (its proposals rejected: a random draft)
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in bad.details
    assert [c.finish_reason for c in refused] == ["error"]


# -- tools: held back while the reply may be calls ------------------------------------------------
TOOL = {"type": "function", "function": {"name": "run_tests", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "maxLength": 4}}, "required": ["path"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}
TOOL_BODY = {"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "2 failed"}],
             "tools": [TOOL], "max_tokens": NEW}


def _library_chat(library, body: dict) -> tuple[dict, str]:
    """The library engine's reply to a chat body, as the ingress words it (message, finish)."""
    from dlite_ray.serve.openai_requests import parse_chat
    from dlite_ray.serve.tool_calls import chat_message

    parsed = parse_chat(body, LimitArgs())
    seq = library.add_request(parsed.prompt, parsed.params)
    while library.has_unfinished():
        library.step()
    reply = library.result(seq)
    return chat_message(reply.text, reply.finish_reason, parsed.tools)


def test_a_forced_tool_call_streams_no_text_before_its_calls(app, library):
    forced = TOOL_BODY | {"tool_choice": "required"}
    expected, finish = _library_chat(library, forced)
    assert finish == "tool_calls"  # decoded under the call's grammar: even this model calls

    async def go():
        whole = await (await app.http.post("/v1/chat/completions", forced, headers=AUTH_A)).json()
        events = await (await app.http.post("/v1/chat/completions", forced | {"stream": True},
                                            headers=AUTH_A)).events()
        return whole, events

    whole, events = asyncio.run(go())
    got = whole["choices"][0]
    assert got["finish_reason"] == "tool_calls" and got["message"]["content"] is None
    assert [c["function"] for c in got["message"]["tool_calls"]] == [c["function"] for c in expected["tool_calls"]]
    choices = [e["choices"][0] for e in events[:-1]]
    assert not any(c["delta"].get("content") for c in choices)  # not one character of the call as text
    assert choices[-1]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in choices[-1]["delta"]["tool_calls"]] == [c["function"]
                                                                        for c in expected["tool_calls"]]


def test_prose_with_tools_offered_streams_as_it_comes(app, library):
    expected, finish = _library_chat(library, TOOL_BODY)
    assert finish != "tool_calls" and expected["content"]  # the tiny model writes prose here

    async def go():
        whole = await (await app.http.post("/v1/chat/completions", TOOL_BODY, headers=AUTH_A)).json()
        events = await (await app.http.post("/v1/chat/completions", TOOL_BODY | {"stream": True},
                                            headers=AUTH_A)).events()
        return whole, events

    whole, events = asyncio.run(go())
    assert whole["choices"][0]["message"] == expected and whole["choices"][0]["finish_reason"] == finish
    pieces = [p for p in _contents(events) if p]
    assert "".join(pieces) == expected["content"]
    assert len(pieces) >= 3  # prose is not held to the end of the reply


# -- per-tenant limits ------------------------------------------------------------------------------
# An unread stream stays open (local_handles.AsgiClient: the app waits for its reader), so
# a short one holds its slot as long as the test needs.
LONG = {"messages": [{"role": "user", "content": "Count from one to one hundred."}], "max_tokens": 32,
        "stream": True}


def test_a_tenant_over_its_limit_is_refused_at_once_while_another_proceeds(make_app):
    app = make_app(limits={"max_in_flight_per_tenant": 1})

    async def go():
        first = await app.http.post("/v1/chat/completions", LONG, headers=AUTH_A)
        pieces = first.pieces()
        await anext(pieces)  # tenant a's one stream is open (it waits for this reader)
        over = await app.http.post("/v1/chat/completions", LONG, headers=AUTH_A)
        over_body = await over.json()
        refused, grpc_over = await app.grpc.stream("Generate", dlite_pb2.GenerateRequest(prompt="hi", max_tokens=2),
                                                   GRPC_A)
        assert [c.finish_reason for c in refused] == ["error"]
        other = await app.http.post("/v1/chat/completions", {**LONG, "stream": False, "max_tokens": 4},
                                    headers=AUTH_B)
        other_body = await other.json()
        assert app.ingress.tenant_limits.in_flight("tenant-a") == 1  # a's stream was open all along
        rest = [p async for p in pieces]
        again = await app.http.post("/v1/chat/completions", {**LONG, "stream": False, "max_tokens": 4},
                                    headers=AUTH_A)
        return over.status, over_body, grpc_over.code, other.status, other_body, rest, again.status

    over, over_body, grpc_over, other, other_body, rest, again = asyncio.run(go())
    assert over == 429 and over_body["error"]["type"] == "rate_limit_error"
    assert "per-tenant limit" in over_body["error"]["message"]
    assert grpc_over == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert other == 200 and other_body["choices"][0]["finish_reason"]
    assert rest[-1].endswith(b"data: [DONE]\n\n")  # a's stream ran to its end
    assert again == 200  # and gave its slot back


def test_failed_and_disconnected_requests_release_their_slot(make_app):
    app = make_app(limits={"max_in_flight_per_tenant": 1})
    short = {**LONG, "stream": False, "max_tokens": 4}

    async def go():
        statuses = []
        too_long = await app.http.post("/v1/chat/completions", {**short, "messages": [
            {"role": "user", "content": "word " * 2000}]}, headers=AUTH_A)
        statuses.append(too_long.status)
        statuses.append((await app.http.post("/v1/chat/completions", short, headers=AUTH_A)).status)

        stream = await app.http.post("/v1/chat/completions", LONG, headers=AUTH_A)
        await anext(stream.pieces())
        await stream.close()  # the client goes away mid-stream
        statuses.append((await app.http.post("/v1/chat/completions", short, headers=AUTH_A)).status)

        rpc = app.ingress.Generate(dlite_pb2.GenerateRequest(prompt="Count to a hundred.", max_tokens=32),
                                   GrpcContext(GRPC_A))
        await anext(rpc)
        await rpc.aclose()  # a gRPC client gone mid-stream
        statuses.append((await app.http.post("/v1/chat/completions", short, headers=AUTH_A)).status)
        return statuses

    assert asyncio.run(go()) == [400, 200, 200, 200]
    assert app.ingress.tenant_limits.in_flight("tenant-a") == 0


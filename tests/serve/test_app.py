"""The Serve application end to end on CPU: target and draft in two processes over gloo,
OpenAI HTTP (streaming and not), gRPC Generate, typed errors, a killed draft actor. What
the ingress does with a request (validation, credentials, endpoints, conversations) is
tested in one process, without Ray: test_ingress_local.py, test_conversations_local.py."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import requests

from dlite_ray.serve.proto import dlite_pb2, dlite_pb2_grpc
from tests.serve.conftest import AUTH_A, GRPC_A, GRPC_PORT, HTTP_PORT

URL = f"http://127.0.0.1:{HTTP_PORT}"
MESSAGES = [{"role": "user", "content": "Write a function that adds two numbers."}]


@pytest.fixture(scope="module")
def reference(tiny_serving_model):
    """The in-process library engine's greedy output for the same request."""
    from dlite_ray.engine.engine import DLiteEngine

    target_dir, draft_dir = tiny_serving_model
    engine = DLiteEngine.from_pretrained(target_dir, draft_dir, dtype="float32", adaptive_draft_length=False)
    return engine.generate(MESSAGES, max_new_tokens=24)[0]


def _worker(serve_app):
    from ray import serve

    return serve.get_deployment_handle("TargetWorker", app_name="dlite")


def _wait_for_draft(serve_app, timeout=60, connected=True):
    """Until the worker reports its draft connected (or, connected=False, lost)."""
    worker = _worker(serve_app)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if worker.stats.remote().result().draft_connected == connected:
            return
        time.sleep(0.5)
    raise AssertionError(f"the draft worker never became {'connected' if connected else 'disconnected'}")


def test_chat_completion_equals_library_engine(serve_app, reference):
    _wait_for_draft(serve_app)
    r = requests.post(f"{URL}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24}, headers=AUTH_A,
                      timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == reference.text
    assert body["usage"]["completion_tokens"] == len(reference.token_ids)
    assert body["dlite_stats"]["draft_time"] > 0  # the round went through the draft process


def test_cpu_workers_run_on_the_threads_configured(serve_app):
    """Ray gives an actor with num_cpus 0 OMP_NUM_THREADS=1 whatever the machine; the target
    and draft workers set the counts their EngineArgs name (the test app: 2 and 1)."""
    _wait_for_draft(serve_app)
    stats = _worker(serve_app).stats.remote().result()
    _, args = serve_app
    assert (stats.cpu_threads, stats.draft_cpu_threads) == (args.engine.cpu_threads, 1) == (2, 1)


@pytest.mark.parametrize(("payload", "share"), [("dist", 1), ("host", 0.5)])
def test_a_gpu_pair_gives_the_target_and_its_draft_their_gpus(serve_app, payload, share):
    """build_app for CUDA: the TargetWorker replica asks for bundle 0's GPU and its DraftWorker
    for bundle 1's, so each sees one GPU and not the same one (on the session's two logical
    GPUs, with probes in place of the models); with draft_payload 'host' each asks for half
    of one, so a one-GPU machine holds the pair."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from dlite_ray.serve.app import build_app

    app = build_app({"engine": {"device": "cuda", "draft_payload": payload}})
    worker = app._bound_deployment.init_args[0]._bound_deployment
    bundles = worker._replica_config.placement_group_bundles
    assert [b["GPU"] for b in bundles] == [share, share]
    assert worker._replica_config.placement_group_strategy == "STRICT_PACK"
    assert worker.ray_actor_options["num_gpus"] == share

    @ray.remote
    class Replica:
        def gpus_of_pair(self) -> tuple[list, list]:
            from dlite_ray.serve.draft_link import draft_actor_options

            draft = ray.remote(lambda: ray.get_gpu_ids()).options(**draft_actor_options("cuda", share))
            return ray.get_gpu_ids(), ray.get(draft.remote(), timeout=60)

    pg = placement_group(bundles, strategy="STRICT_PACK")
    try:
        ray.get(pg.ready(), timeout=60)
        replica = Replica.options(**worker.ray_actor_options, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0)).remote()
        target_gpus, draft_gpus = ray.get(replica.gpus_of_pair.remote(), timeout=120)
        ray.kill(replica)
    finally:
        remove_placement_group(pg)
    assert len(target_gpus) == 1 and len(draft_gpus) == 1
    assert (target_gpus != draft_gpus) == (payload == "dist")


def test_streaming_chat_completion(serve_app, reference):
    r = requests.post(f"{URL}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24, "stream": True},
                      headers=AUTH_A, stream=True, timeout=120)
    assert r.status_code == 200
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
              if line.startswith(b"data: ") and line != b"data: [DONE]"]
    assert "".join(d["content"] for d in deltas) == reference.text and len(deltas) >= 2
    assert [d.get("role") for d in deltas] == ["assistant"] + [None] * (len(deltas) - 1)  # the first names it


def test_a_stream_can_end_with_its_usage(serve_app, reference):
    body = {"messages": MESSAGES, "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}
    r = requests.post(f"{URL}/v1/chat/completions", json=body, headers=AUTH_A, stream=True, timeout=120)
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: {")]
    assert all(e["choices"] and e["usage"] is None for e in events[:-1]) and events[-1]["choices"] == []
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == len(reference.token_ids) > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] and usage["prompt_tokens"] > 0


def test_grpc_generate_streams_the_same_tokens(serve_app, reference):
    _wait_for_draft(serve_app)
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        req = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in MESSAGES], max_tokens=24)
        chunks = list(stub.Generate(req, metadata=GRPC_A, timeout=120))
    assert [t for c in chunks for t in c.token_ids] == reference.token_ids
    stats = chunks[-1].stats
    assert chunks[-1].finish_reason and list(stats.accept_lengths) == reference.stats.accept_lengths
    assert stats.draft_time > 0  # the rounds went through the draft process (0 with a dead or no draft)


@pytest.fixture(scope="module")
def reference_logprobs(tiny_serving_model):
    """The library engine's reply with 3 alternatives per token, as chat entries."""
    from transformers import AutoTokenizer

    from dlite_ray.engine.engine import DLiteEngine
    from dlite_ray.serve.logprobs import TokenRenderer

    target_dir, draft_dir = tiny_serving_model
    engine = DLiteEngine.from_pretrained(target_dir, draft_dir, dtype="float32", adaptive_draft_length=False)
    result = engine.generate(MESSAGES, max_new_tokens=24, logprobs=3)[0]
    visible = [lp for lp in result.logprobs if lp.token_id not in engine.eos_ids]
    return result.text, TokenRenderer(AutoTokenizer.from_pretrained(target_dir)).chat_entries(visible)


def _assert_same_entries(got: list[dict], expected: list[dict]) -> None:
    assert [e["bytes"] for e in got] == [e["bytes"] for e in expected]
    assert [[t["bytes"] for t in e["top_logprobs"]] for e in got] == [[t["bytes"] for t in e["top_logprobs"]]
                                                                      for e in expected]
    assert [e["logprob"] for e in got] == pytest.approx([e["logprob"] for e in expected], abs=1e-5)


def test_chat_logprobs_whole_and_streamed_match_the_library(serve_app, reference_logprobs):
    text, expected = reference_logprobs
    body = {"messages": MESSAGES, "max_tokens": 24, "logprobs": True, "top_logprobs": 3}
    r = requests.post(f"{URL}/v1/chat/completions", json=body, headers=AUTH_A, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    _assert_same_entries(content, expected)
    assert bytes(b for e in content for b in e["bytes"]).decode("utf-8") == text
    streamed = requests.post(f"{URL}/v1/chat/completions", json=body | {"stream": True}, headers=AUTH_A, stream=True,
                             timeout=120)
    entries = [e for line in streamed.iter_lines() if line.startswith(b"data: {")
               for e in json.loads(line[6:])["choices"][0]["logprobs"]["content"]]
    _assert_same_entries(entries, expected)
    plain = requests.post(f"{URL}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4}, headers=AUTH_A,
                          timeout=120)
    assert plain.json()["choices"][0]["logprobs"] is None


def test_grpc_generate_streams_logprobs(serve_app, reference_logprobs):
    text, expected = reference_logprobs
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        req = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in MESSAGES], max_tokens=24,
                                        logprobs=True, top_logprobs=3)
        entries = [e for c in stub.Generate(req, metadata=GRPC_A, timeout=120) for e in c.logprobs]
    _assert_same_entries([{"bytes": list(e.bytes), "logprob": e.logprob,
                           "top_logprobs": [{"bytes": list(t.bytes)} for t in e.top_logprobs]} for e in entries],
                         expected)
    assert b"".join(e.bytes for e in entries).decode("utf-8") == text


def test_completion_logprobs_in_the_legacy_shape(serve_app):
    body = {"prompt": "def add(a, b):", "max_tokens": 12, "logprobs": 2}
    choice = requests.post(f"{URL}/v1/completions", json=body, headers=AUTH_A, timeout=120).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 0
    assert all(len(top) <= 3 and top[token] == chosen
               for top, token, chosen in zip(lp["top_logprobs"], lp["tokens"], lp["token_logprobs"], strict=True))
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    whole = next((i for i, t in enumerate(lp["tokens"]) if "\ufffd" in t), len(lp["tokens"]))
    for token, offset in zip(lp["tokens"][:whole], lp["text_offset"][:whole], strict=True):  # up to a split character
        assert choice["text"][offset:offset + len(token)] == token
    streamed = requests.post(f"{URL}/v1/completions", json=body | {"stream": True}, headers=AUTH_A, stream=True,
                             timeout=120)
    chunks = [json.loads(line[6:])["choices"][0]["logprobs"] for line in streamed.iter_lines()
              if line.startswith(b"data: {")]
    assert [t for c in chunks for t in c["tokens"]] == lp["tokens"]
    assert [o for c in chunks for o in c["text_offset"]] == lp["text_offset"]  # offsets run on across chunks


def _stream_events(body: dict) -> list[dict]:
    """A chat stream's choices, one per event."""
    r = requests.post(f"{URL}/v1/chat/completions", json=body | {"stream": True}, headers=AUTH_A, stream=True,
                      timeout=120)
    return [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith(b"data: {")]


def _stream_pieces(body: dict) -> list[str]:
    return [choice["delta"]["content"] for choice in _stream_events(body)]


def _stop_across_two_chunks(pieces: list[str], text: str) -> str:
    """Two streamed chunks' text, found nowhere earlier in the reply: asked as a stop, the
    first chunk's part must not be sent before the second shows the stop complete."""
    for i in range(1, len(pieces) - 2):  # the reply goes on after the stop
        stop = pieces[i] + pieces[i + 1]
        if pieces[i] and pieces[i + 1] and text.find(stop) == len("".join(pieces[:i])):
            return stop
    raise AssertionError(f"no two-chunk stop string in {pieces}")


def test_stop_strings_end_replies_whole_and_streamed(serve_app, reference):
    from dlite_ray.engine.stop_strings import text_before_stop

    pieces = _stream_pieces({"messages": MESSAGES, "max_tokens": 24})
    stop = _stop_across_two_chunks(pieces, reference.text)
    expected = text_before_stop(reference.text, (stop,))
    body = {"messages": MESSAGES, "max_tokens": 24, "stop": [stop, "#never#"]}
    r = requests.post(f"{URL}/v1/chat/completions", json=body, headers=AUTH_A, timeout=120).json()
    assert r["choices"][0]["message"]["content"] == expected and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] < len(reference.token_ids)
    assert "".join(_stream_pieces(body)) == expected  # the stop's first characters never went out
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        req = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in MESSAGES], max_tokens=24,
                                        stop=[stop])
        assert "".join(c.text for c in stub.Generate(req, metadata=GRPC_A, timeout=120)) == expected


def test_tool_requests_whole_and_streamed(serve_app, tiny_serving_model):
    """Tools offered and an earlier call written back: the served reply is the library
    engine's for the same prompt, as tool_calls if it is calls, else as text, and a stream
    (held back while the reply may become calls) delivers the same."""
    from dlite_ray.engine.engine import DLiteEngine
    from dlite_ray.serve.config import LimitArgs
    from dlite_ray.serve.openai_requests import parse_chat
    from dlite_ray.serve.tool_calls import chat_message

    tool = {"type": "function", "function": {"name": "run_tests", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 4}}, "required": ["path"]}}}
    call = {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "2 failed"}],
            "tools": [tool], "max_tokens": 24}
    parsed = parse_chat(body, LimitArgs())
    engine = DLiteEngine.from_pretrained(*tiny_serving_model, dtype="float32", adaptive_draft_length=False)
    reply = engine.generate(parsed.prompt, max_new_tokens=24)[0]
    expected, finish = chat_message(reply.text, reply.finish_reason, parsed.tools)

    r = requests.post(f"{URL}/v1/chat/completions", json=body, headers=AUTH_A, timeout=120).json()
    got = r["choices"][0]
    assert got["finish_reason"] == finish and got["message"]["content"] == expected["content"]
    names = [c["function"] for c in expected.get("tool_calls", [])]
    assert [c["function"] for c in got["message"].get("tool_calls", [])] == names
    if expected["content"] is not None:
        assert "".join(_stream_pieces(body)) == expected["content"]

    # a forced call: decoded under the grammar of a run_tests call, so even this model makes one
    forced = body | {"tool_choice": "required"}
    seq = engine.add_request(parsed.prompt, parse_chat(forced, LimitArgs()).params)
    while engine.has_unfinished():
        engine.step()
    reply = engine.result(seq)
    expected, finish = chat_message(reply.text, reply.finish_reason, parsed.tools)
    assert finish == "tool_calls", reply.text
    got = requests.post(f"{URL}/v1/chat/completions", json=forced, headers=AUTH_A, timeout=120).json()["choices"][0]
    assert got["finish_reason"] == finish and got["message"] == expected | {"tool_calls": got["message"]["tool_calls"]}
    assert [c["function"] for c in got["message"]["tool_calls"]] == [c["function"] for c in expected["tool_calls"]]
    streamed = _stream_events(forced)
    assert [c["function"] for c in streamed[-1]["delta"]["tool_calls"]] == [c["function"]
                                                                         for c in expected["tool_calls"]]
    unknown = {"type": "function", "function": {"name": "deploy"}}
    refused = requests.post(f"{URL}/v1/chat/completions", json=body | {"tool_choice": unknown}, headers=AUTH_A,
                            timeout=30)
    assert refused.status_code == 400 and "tool_choice" in refused.json()["error"]["message"]


def test_tools_over_grpc_and_in_conversations(serve_app, tiny_serving_model):
    """gRPC Generate takes tools and earlier calls as HTTP chat does; a conversation opened
    with tools offers them in every turn and keeps the model's own text in its history."""
    from dlite_ray.engine.engine import DLiteEngine
    from dlite_ray.serve.config import LimitArgs
    from dlite_ray.serve.openai_requests import parse_chat
    from dlite_ray.serve.tool_calls import chat_message

    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "run_tests", "description": "", "parameters": schema}}
    call = {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [call]}]
    engine = DLiteEngine.from_pretrained(*tiny_serving_model, dtype="float32", adaptive_draft_length=False)
    parsed = parse_chat({"messages": messages, "tools": [tool]}, LimitArgs())
    reply = engine.generate(parsed.prompt, max_new_tokens=16)[0]
    expected, finish = chat_message(reply.text, reply.finish_reason, parsed.tools)

    grpc_messages = [dlite_pb2.Message(**MESSAGES[0]), dlite_pb2.Message(role="assistant", tool_calls=[
        dlite_pb2.ToolCall(id="call_1", name="run_tests", arguments_json='{"path": "tests/"}')])]
    req = dlite_pb2.GenerateRequest(messages=grpc_messages, max_tokens=16, tools=[dlite_pb2.Tool(
        name="run_tests", parameters_json=json.dumps(schema))])
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        chunks = list(dlite_pb2_grpc.DLiteServiceStub(channel).Generate(req, metadata=GRPC_A, timeout=120))
    assert chunks[-1].finish_reason == finish
    assert "".join(c.text for c in chunks) == (expected["content"] or "")
    assert [(c.name, c.arguments_json) for c in chunks[-1].tool_calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected.get("tool_calls", [])]

    opened = requests.post(f"{URL}/v1/conversations", json={"messages": MESSAGES, "tools": [tool]}, headers=AUTH_A,
                           timeout=60).json()
    cid = opened["id"]
    turn = requests.post(f"{URL}/v1/conversations/{cid}/messages", json={"messages": messages[1:], "max_tokens": 16},
                         headers=AUTH_A, timeout=120).json()
    assert turn["message"]["content"] == expected["content"] and turn["finish_reason"] == finish
    stored = requests.get(f"{URL}/v1/conversations/{cid}", headers=AUTH_A, timeout=60).json()["messages"]
    assert stored[:-1] == parsed.prompt and stored[-1] == {"role": "assistant", "content": reply.text}


def test_structured_output_over_http_grpc_and_conversations(serve_app, tiny_serving_model):
    """response_format (HTTP) and json_schema (gRPC) give the library engine's reply under
    the same schema; even the tiny random model's reply is then JSON the schema accepts."""
    from dlite_ray.engine.engine import DLiteEngine

    schema = {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 4},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["tag", "n"], "additionalProperties": False}
    engine = DLiteEngine.from_pretrained(*tiny_serving_model, dtype="float32", adaptive_draft_length=False)
    reply = engine.generate(MESSAGES, max_new_tokens=40, json_schema=json.dumps(schema))[0]
    assert reply.finish_reason == "stop" and set(json.loads(reply.text)) == {"tag", "n"}

    body = {"messages": MESSAGES, "max_tokens": 40,
            "response_format": {"type": "json_schema", "json_schema": {"name": "tagged", "schema": schema}}}
    got = requests.post(f"{URL}/v1/chat/completions", json=body, headers=AUTH_A, timeout=120).json()["choices"][0]
    assert (got["message"]["content"], got["finish_reason"]) == (reply.text, "stop")
    assert "".join(_stream_pieces(body)) == reply.text

    req = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**MESSAGES[0])], max_tokens=40,
                                    json_schema=json.dumps(schema))
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        chunks = list(dlite_pb2_grpc.DLiteServiceStub(channel).Generate(req, metadata=GRPC_A, timeout=120))
    assert "".join(c.text for c in chunks) == reply.text

    opening = {"messages": [{"role": "system", "content": "Answer in JSON."}]}
    cid = requests.post(f"{URL}/v1/conversations", json=opening, headers=AUTH_A, timeout=60).json()["id"]
    turn_body = {"messages": MESSAGES, "max_tokens": 40, "response_format": body["response_format"]}
    turn = requests.post(f"{URL}/v1/conversations/{cid}/messages", json=turn_body, headers=AUTH_A,
                         timeout=120).json()
    assert set(json.loads(turn["message"]["content"])) == {"tag", "n"}


def test_grpc_invalid_argument(serve_app):
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        req = dlite_pb2.GenerateRequest(prompt="hi", temperature=-2, max_tokens=4)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, metadata=GRPC_A, timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_killing_the_draft_actor_mid_stream_still_completes(serve_app, reference):
    """The worker's engine is held after the reply's first two steps (its step gate): the draft
    is killed and seen lost while the reply is unfinished, and the rest decodes without it."""
    _wait_for_draft(serve_app)
    worker = _worker(serve_app)
    restarts = worker.stats.remote().result().draft_restarts
    worker.allow_steps.remote(2).result()
    try:
        r = requests.post(f"{URL}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24, "stream": True},
                          headers=AUTH_A, stream=True, timeout=120)
        lines = r.iter_lines()
        text = ""
        for line in lines:
            if line.startswith(b"data: {"):
                text += json.loads(line[6:])["choices"][0]["delta"]["content"]
                break
        held = worker.stats.remote().result()
        assert held.running + held.waiting == 1  # the reply is still in the engine
        assert worker.kill_draft.remote().result()
        _wait_for_draft(serve_app, connected=False)  # the worker's link saw the draft go
    finally:
        worker.allow_steps.remote(None).result()
    for line in lines:
        if line.startswith(b"data: {"):
            text += json.loads(line[6:])["choices"][0]["delta"]["content"]
    assert text == reference.text
    assert worker.stats.remote().result().draft_restarts > restarts
    _wait_for_draft(serve_app, timeout=120)  # restarted and reconnected
    again = requests.post(f"{URL}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 24}, headers=AUTH_A,
                          timeout=120)
    assert again.json()["choices"][0]["message"]["content"] == reference.text
    assert again.json()["dlite_stats"]["draft_time"] > 0  # the restarted draft drafts again


def test_conversations_over_http_and_malformed_bodies(serve_app):
    created = requests.post(f"{URL}/v1/conversations", json={"messages": MESSAGES}, headers=AUTH_A, timeout=60)
    assert created.status_code == 200, created.text
    cid = created.json()["id"]
    turn = requests.post(f"{URL}/v1/conversations/{cid}/messages", headers=AUTH_A, timeout=120,
                         json={"max_tokens": 4, "lease_seconds": 30, "logprobs": True, "top_logprobs": 2})
    assert turn.status_code == 200 and turn.json()["finish_reason"], turn.text
    entries = turn.json()["logprobs"]["content"]
    assert 1 <= len(entries) <= 4 and all(len(e["top_logprobs"]) == 2 for e in entries)
    assert bytes(b for e in entries for b in e["bytes"]).decode("utf-8", errors="replace") == \
        turn.json()["message"]["content"]
    stored = requests.get(f"{URL}/v1/conversations/{cid}", headers=AUTH_A, timeout=60).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant"]
    # bodies that are JSON but not objects, or carry odd fields, are client errors, never 500s
    for path, body in (("/v1/conversations", [1, 2]), (f"/v1/conversations/{cid}/messages", "hi"),
                       (f"/v1/conversations/{cid}/messages", {"lease_seconds": "soon"}),
                       ("/v1/chat/completions", {"messages": MESSAGES, "seed": 1 << 64})):
        r = requests.post(f"{URL}{path}", json=body, headers=AUTH_A, timeout=60)
        assert r.status_code == 400, (path, body, r.text)
    assert requests.get(f"{URL}/v1/conversations/{cid}", headers=AUTH_A, timeout=60).json()["version"] == 1


def test_a_prompt_over_the_context_is_refused_before_any_response(serve_app):
    """The worker tokenizes and validates (no separate encode call); the ingress waits for the
    stream's first chunk, so a refused request is a 400 / INVALID_ARGUMENT, never a 200 stream
    that then fails, and a refused conversation turn leaves its history as it was."""
    long = [{"role": "user", "content": "word " * 2000}]  # past the tiny model's 512 positions
    for stream in (False, True):
        r = requests.post(f"{URL}/v1/chat/completions", json={"messages": long, "max_tokens": 4, "stream": stream},
                          headers=AUTH_A, timeout=120)
        assert r.status_code == 400 and "does not fit" in r.json()["error"]["message"], (stream, r.text)
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        req = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in long], max_tokens=4)
        with pytest.raises(grpc.RpcError) as err:
            list(dlite_pb2_grpc.DLiteServiceStub(channel).Generate(req, metadata=GRPC_A, timeout=120))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    cid = requests.post(f"{URL}/v1/conversations", json={"messages": MESSAGES}, headers=AUTH_A, timeout=60).json()["id"]
    for _ in range(2):  # a retry piles up nothing
        turn = requests.post(f"{URL}/v1/conversations/{cid}/messages", json={"messages": long, "max_tokens": 4},
                             headers={**AUTH_A, "idempotency-key": "k1"}, timeout=120)
        assert turn.status_code == 400, turn.text
    stored = requests.get(f"{URL}/v1/conversations/{cid}", headers=AUTH_A, timeout=60).json()
    assert (stored["messages"], stored["version"], stored["state"]) == (MESSAGES, 0, "paused")
    ok = requests.post(f"{URL}/v1/conversations/{cid}/messages", json={"max_tokens": 4}, headers=AUTH_A, timeout=120)
    assert ok.status_code == 200 and ok.json()["finish_reason"], ok.text

"""The per-tenant concurrency cap through the running app: a second application on the
session's Serve instance with a cap of 1 (plain decoding, so it starts fast). A stream that
must still hold its slot is held in the engine by the worker's step gate (`allow_steps`),
not assumed slow."""

from __future__ import annotations

import json
import time

import grpc
import pytest
import requests

from dlite_ray.serve.proto import dlite_pb2, dlite_pb2_grpc
from tests.serve.conftest import GRPC_PORT, HTTP_PORT

URL = f"http://127.0.0.1:{HTTP_PORT}/limited"
AUTH_A, AUTH_B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
GRPC_A = (("application", "limited"), ("authorization", "Bearer key-a"))
MESSAGES = [{"role": "user", "content": "Count from one to one hundred."}]
LONG = {"messages": MESSAGES, "max_tokens": 400, "stream": True}  # clipped to the tiny model's context
SHORT = {"messages": MESSAGES, "max_tokens": 4}


@pytest.fixture(scope="module")
def limited_app(serve_app, tmp_path_factory):
    from ray import serve

    from dlite_ray.serve.app import build_app

    _, args = serve_app
    limited = args.model_copy(deep=True)
    limited.engine.draft, limited.engine.disaggregated_draft = "none", False
    limited.limits.max_in_flight_per_tenant = 1
    limited.conversations.store_path = str(tmp_path_factory.mktemp("limited") / "conv.sqlite3")
    serve.run(build_app(limited), name="limited", route_prefix="/limited")
    yield
    serve.delete("limited")


def _first_event(lines) -> dict:
    """The first SSE event. Keep `lines` alive to read on: dropping a half-read iterator
    makes urllib3 close the connection, which the server sees as a client disconnect."""
    for line in lines:
        if line.startswith(b"data: {"):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without an event")


def _until_admitted(body: dict, headers: dict, timeout: float = 60) -> requests.Response:
    """Retry while 429: a released slot shows up within `timeout`."""
    deadline = time.time() + timeout
    while True:
        r = requests.post(f"{URL}/v1/chat/completions", json=body, headers=headers, timeout=120)
        if r.status_code != 429 or time.time() > deadline:
            return r
        time.sleep(0.2)


def test_second_concurrent_request_of_a_tenant_gets_429_and_the_first_completes(limited_app):
    from ray import serve

    worker = serve.get_deployment_handle("TargetWorker", app_name="limited")
    worker.allow_steps.remote(2).result()  # the engine holds after the first stream's first steps
    try:
        first = requests.post(f"{URL}/v1/chat/completions", json=LONG, headers=AUTH_A, stream=True, timeout=120)
        assert first.status_code == 200
        lines = first.iter_lines()
        _first_event(lines)  # the first request is now streaming and holds tenant a's only slot
        held = worker.stats.remote().result()
        assert held.running + held.waiting == 1  # and stays unfinished until the gate opens
        second = requests.post(f"{URL}/v1/chat/completions", json={**LONG, "stream": True}, headers=AUTH_A,
                               timeout=60)
        assert second.status_code == 429
        error = second.json()["error"]
        assert error["type"] == "rate_limit_error" and "per-tenant limit" in error["message"]
        with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
            stub = dlite_pb2_grpc.DLiteServiceStub(channel)
            req = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in MESSAGES], max_tokens=4)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(req, metadata=GRPC_A, timeout=60))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            conv = stub.CreateConversation(dlite_pb2.CreateConversationRequest(
                messages=[dlite_pb2.Message(**m) for m in MESSAGES]), metadata=GRPC_A, timeout=60)
            with pytest.raises(grpc.RpcError) as err:
                list(stub.AppendAndGenerate(dlite_pb2.AppendRequest(conversation_id=conv.conversation_id,
                                                                    max_tokens=4), metadata=GRPC_A, timeout=60))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # refused before the turn was claimed: the conversation is untouched
            stored = stub.GetConversation(dlite_pb2.GetConversationRequest(conversation_id=conv.conversation_id),
                                          metadata=GRPC_A, timeout=60)
            assert stored.version == 0 and len(stored.messages) == 1
    finally:
        worker.allow_steps.remote(None).result()
    other_tenant = requests.post(f"{URL}/v1/chat/completions", json=SHORT, headers=AUTH_B, timeout=120)
    assert other_tenant.status_code == 200
    finish = None
    for line in lines:
        if line.startswith(b"data: {"):
            finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    assert finish in ("length", "stop")  # the admitted stream ran to its end
    assert _until_admitted(SHORT, AUTH_A).status_code == 200  # and gave its slot back


def test_failed_and_disconnected_requests_release_their_slot(limited_app):
    too_long = {"messages": [{"role": "user", "content": "word " * 2000}], "max_tokens": 4}
    r = requests.post(f"{URL}/v1/chat/completions", json=too_long, headers=AUTH_A, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    # with a cap of 1, a slot leaked by the failure above would make this a 429
    assert requests.post(f"{URL}/v1/chat/completions", json=SHORT, headers=AUTH_A, timeout=120).status_code == 200

    stream = requests.post(f"{URL}/v1/chat/completions", json=LONG, headers=AUTH_A, stream=True, timeout=120)
    _first_event(stream.iter_lines())
    stream.close()  # the client goes away mid-stream
    assert _until_admitted(SHORT, AUTH_A).status_code == 200

    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        req = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in MESSAGES], max_tokens=400)
        call = stub.Generate(req, metadata=GRPC_A, timeout=120)
        next(call)
        call.cancel()  # a gRPC client gone mid-stream
    assert _until_admitted(SHORT, AUTH_A).status_code == 200

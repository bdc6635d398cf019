"""The ingress against hostile and careless clients, through Serve's proxies: a second
application on the session's Serve instance whose TargetWorker is a fake, so a test can hold
streams open for as long as it likes, count what was tokenized, and make the worker go
silent as a dead one does. No timing thresholds: what must not wait is checked to complete
while the streams that could block it are still open (a timeout only stops a hang)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import replace

import grpc
import pytest
import requests

from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.proto import dlite_pb2, dlite_pb2_grpc
from dlite_ray.serve.worker_messages import GenerateChunk, WorkerStats
from tests.serve.conftest import GRPC_PORT, HTTP_PORT

APP = "hostile"
URL = f"http://127.0.0.1:{HTTP_PORT}/{APP}"
AUTH_A, AUTH_B = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
GRPC_A = (("application", APP), ("authorization", "Bearer key-a"))
GRPC_NO_KEY = (("application", APP),)
HOLD = [{"role": "user", "content": "hold"}]  # the fake worker streams one chunk, then waits for release()
QUICK = [{"role": "user", "content": "hi"}]
LIMITS = LimitArgs()
HANG_GUARD_S = 30  # only so that a hang fails the test instead of stalling the run


class FakeWorker:
    """TargetWorker's methods as the ingress calls them, without a model."""

    def __init__(self):
        self.released = asyncio.Event()
        self.silent = False
        self.generated = 0  # requests that reached the worker (where they would be tokenized)
        self.holding = 0
        self.released_leases: list[str] = []

    async def generate(self, prompt, params: SamplingParams, route_to=None, conversation=None, prefix_key=None,
                       tenant=None):
        assert isinstance(params, SamplingParams)
        self.generated += 1
        yield _chunk("x", finished=False)
        if isinstance(prompt, list) and prompt[-1].get("content") == "grammar fails":  # as the worker ends a
            # reply whose grammar failed
            yield replace(_chunk('"', finished=True), finish_reason="error",
                          error="the output grammar failed: lexer error: too many expressions constructed")
            return
        if "hold" in json.dumps(prompt):
            self.holding += 1
            try:
                await self.released.wait()
            finally:
                self.holding -= 1
        yield _chunk("y", finished=True)

    async def stats(self, route_to=None) -> WorkerStats:
        if self.silent:
            await asyncio.Event().wait()  # as a dead replica: the call never returns
        return WorkerStats(replica="fake-replica", running=self.holding, waiting=0, kv_blocks_used=0,
                           kv_blocks_total=8, held_leases=0, draft_connected=True)

    async def release_lease(self, conversation, route_to=None, strict=True) -> str:
        self.released_leases.append(conversation)
        return "fake-replica"

    async def leases_released(self) -> list[str]:
        return self.released_leases

    async def counts(self) -> dict:
        return {"generated": self.generated, "holding": self.holding}

    async def release(self) -> None:
        self.released.set()

    async def set_silent(self, silent: bool) -> None:
        self.silent = silent


def _chunk(text: str, finished: bool) -> GenerateChunk:
    stats = RequestStats(num_prompt_tokens=3, num_output_tokens=2, accept_lengths=[1])
    return GenerateChunk([7], text, finished, "stop" if finished else None, stats=stats if finished else None,
                         replica="fake-replica" if finished else None)


@pytest.fixture(scope="module")
def fake_worker(serve_app, tmp_path_factory):
    from ray import cloudpickle, serve

    from dlite_ray.serve.app import ingress_options
    from dlite_ray.serve.ingress import DLiteIngressDeployment
    from dlite_ray.serve.router import ConversationRouterDeployment

    _, args = serve_app
    args = args.model_copy(deep=True)
    args.conversations.store_path = str(tmp_path_factory.mktemp(APP) / "conv.sqlite3")
    args.worker_probe_timeout_s = 1.0
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # replicas cannot import tests/
    worker = serve.deployment(FakeWorker, name="FakeWorker", max_ongoing_requests=1000,
                              ray_actor_options={"num_cpus": 0}).bind()
    router = ConversationRouterDeployment.options(ray_actor_options={"num_cpus": 0}).bind(worker, args)
    serve.run(DLiteIngressDeployment.options(**ingress_options(args)).bind(worker, router, args),
              name=APP, route_prefix=f"/{APP}")
    handle = serve.get_deployment_handle("FakeWorker", app_name=APP)
    _until(lambda: requests.get(f"{URL}/healthz", timeout=HANG_GUARD_S).status_code == 200)
    yield handle
    handle.release.remote().result()
    serve.delete(APP)


def _until(ok, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.time() + timeout
    while not ok():
        assert time.time() < deadline, "the condition never held"
        time.sleep(0.2)


def _chat(messages, headers, **extra) -> requests.Response:
    return requests.post(f"{URL}/v1/chat/completions", json={"messages": messages, "max_tokens": 4, **extra},
                         headers=headers, timeout=HANG_GUARD_S)


def _events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]


def _first_event(lines) -> dict:
    for line in lines:
        if line.startswith(b"data: {"):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without an event")


def _stub(channel):
    return dlite_pb2_grpc.DLiteServiceStub(channel)


# -- 1: one tenant at its limit stalls no one --------------------------------------------------
def test_a_tenant_over_its_limit_is_refused_at_once_and_others_are_served_meanwhile(fake_worker):
    limit = LIMITS.max_in_flight_per_tenant
    assert limit > 5  # more than Serve's default max_ongoing_requests, which the ingress once had
    streams = []
    try:
        for _ in range(limit):  # tenant a holds every slot it has, each stream open at the worker
            r = requests.post(f"{URL}/v1/chat/completions", json={"messages": HOLD, "stream": True}, headers=AUTH_A,
                              stream=True, timeout=HANG_GUARD_S)
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the connection
            _first_event(lines)
            streams.append((r, lines))
        assert fake_worker.counts.remote().result()["holding"] == limit
        for _ in range(3):  # one more of a's: refused, not queued behind a's own streams
            over = _chat(QUICK, AUTH_A, stream=True)
            assert over.status_code == 429 and over.json()["error"]["type"] == "rate_limit_error"
        with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(_stub(channel).Generate(dlite_pb2.GenerateRequest(prompt="hi", max_tokens=2), metadata=GRPC_A,
                                             timeout=HANG_GUARD_S))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other = _chat(QUICK, AUTH_B)  # tenant b, health checks and scrapes are served as before
        assert other.status_code == 200 and other.json()["choices"][0]["message"]["content"] == "xy"
        assert requests.get(f"{URL}/healthz", timeout=HANG_GUARD_S).json() == {"status": "ok"}
        assert "dlite_worker_up 1.0" in requests.get(f"{URL}/metrics", headers=AUTH_B, timeout=HANG_GUARD_S).text
        assert fake_worker.counts.remote().result()["holding"] == limit  # all of a's streams were open meanwhile
    finally:
        fake_worker.release.remote().result()
    for r, lines in streams:  # and each ran to its end
        assert [e["choices"][0]["finish_reason"] for e in _events(lines)][-1] == "stop"
        r.close()


# -- 2: sizes before any tokenizing ------------------------------------------------------------
def test_oversized_prompts_and_histories_are_refused_before_anything_is_tokenized(fake_worker):
    generated = fake_worker.counts.remote().result()["generated"]
    big = [{"role": "user", "content": "x" * (LIMITS.max_message_chars + 1)}]
    many = [{"role": "user", "content": "x" * LIMITS.max_message_chars}] * 3  # each fits, not all of them
    for messages, limit in ((big, "max_message_chars"), (many, "max_prompt_chars")):
        for path in ("/v1/chat/completions", "/v1/conversations"):
            r = requests.post(f"{URL}{path}", json={"messages": messages}, headers=AUTH_A, timeout=HANG_GUARD_S)
            assert r.status_code == 413 and limit in r.json()["error"]["message"], (path, r.text)
    r = requests.post(f"{URL}/v1/completions", json={"prompt": "x" * (LIMITS.max_prompt_chars + 1)}, headers=AUTH_A,
                      timeout=HANG_GUARD_S)
    assert r.status_code == 413 and "max_prompt_chars" in r.json()["error"]["message"]
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}", options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = _stub(ch)
        pb = [dlite_pb2.Message(**m) for m in big]
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(dlite_pb2.GenerateRequest(messages=pb), metadata=GRPC_A, timeout=HANG_GUARD_S))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_message_chars" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            stub.CreateConversation(dlite_pb2.CreateConversationRequest(messages=pb), metadata=GRPC_A,
                                    timeout=HANG_GUARD_S)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_message_chars" in err.value.details()
        n = LIMITS.max_body_bytes // LIMITS.max_message_chars + 1  # a message over max_body_bytes
        full = dlite_pb2.Message(role="user", content="x" * LIMITS.max_message_chars)
        flood = dlite_pb2.GenerateRequest(messages=[full] * n)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(flood, metadata=GRPC_A, timeout=HANG_GUARD_S))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_body_bytes" in err.value.details()
    assert fake_worker.counts.remote().result()["generated"] == generated  # none of it reached a worker

    # a history that fits, and a turn that would take it over the limit: refused, history untouched
    near = [{"role": "user", "content": "x" * LIMITS.max_message_chars}] * 2
    cid = requests.post(f"{URL}/v1/conversations", json={"messages": near}, headers=AUTH_A,
                        timeout=HANG_GUARD_S).json()["id"]
    turn = requests.post(f"{URL}/v1/conversations/{cid}/messages", json={"messages": [
        {"role": "tool", "content": "y" * (LIMITS.max_prompt_chars - 2 * LIMITS.max_message_chars + 1)}]},
        headers=AUTH_A, timeout=HANG_GUARD_S)
    assert turn.status_code == 413 and "max_prompt_chars" in turn.json()["error"]["message"], turn.text
    stored = requests.get(f"{URL}/v1/conversations/{cid}", headers=AUTH_A, timeout=HANG_GUARD_S).json()
    assert stored["version"] == 0 and len(stored["messages"]) == 2
    assert fake_worker.counts.remote().result()["generated"] == generated


# -- 3: ids -----------------------------------------------------------------------------------------
def test_a_huge_or_odd_conversation_id_is_invalid_argument_and_never_echoed(fake_worker):
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = _stub(channel)
        calls = (lambda cid: stub.GetConversation(dlite_pb2.GetConversationRequest(conversation_id=cid),
                                                  metadata=GRPC_A, timeout=HANG_GUARD_S),
                 lambda cid: stub.DeleteConversation(dlite_pb2.DeleteConversationRequest(conversation_id=cid),
                                                     metadata=GRPC_A, timeout=HANG_GUARD_S),
                 lambda cid: list(stub.AppendAndGenerate(dlite_pb2.AppendRequest(conversation_id=cid),
                                                         metadata=GRPC_A, timeout=HANG_GUARD_S)))
        for call in calls:
            for cid in ("x" * 20_000, "../../etc/passwd"):
                with pytest.raises(grpc.RpcError) as err:
                    call(cid)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (cid[:20], err.value.code())
                assert len(err.value.details()) < 200
            with pytest.raises(grpc.RpcError) as err:
                call("well-formed-but-unknown")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
    r = requests.get(f"{URL}/v1/conversations/{'x' * 2000}", headers=AUTH_A, timeout=HANG_GUARD_S)
    assert r.status_code == 400 and len(r.text) < 300


# -- 4: operational endpoints ------------------------------------------------------------------
def test_operational_figures_need_a_key_and_liveness_says_nothing_more(fake_worker):
    for headers in ({}, {"authorization": "Bearer wrong"}):
        assert requests.get(f"{URL}/metrics", headers=headers, timeout=HANG_GUARD_S).status_code == 401
    metrics = requests.get(f"{URL}/metrics", headers=AUTH_A, timeout=HANG_GUARD_S)
    assert metrics.status_code == 200 and "dlite_kv_blocks_total" in metrics.text
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert requests.get(f"{URL}{path}", timeout=HANG_GUARD_S).status_code == 404, path
    assert requests.get(f"{URL}/healthz", timeout=HANG_GUARD_S).json() == {"status": "ok"}
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = _stub(channel)
        bare = json.loads(stub.GetStats(dlite_pb2.GetStatsRequest(), metadata=GRPC_NO_KEY, timeout=HANG_GUARD_S).json)
        assert bare == {"status": "ok"}
        full = json.loads(stub.GetStats(dlite_pb2.GetStatsRequest(), metadata=GRPC_A, timeout=HANG_GUARD_S).json)
        assert full["status"] == "ok" and full["worker"]["replica"] == "fake-replica"
        with pytest.raises(grpc.RpcError) as err:
            stub.GetStats(dlite_pb2.GetStatsRequest(), metadata=(*GRPC_NO_KEY, ("authorization", "Bearer wrong")),
                          timeout=HANG_GUARD_S)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


# -- 5: a dead worker -----------------------------------------------------------------------------
def test_healthz_and_metrics_tell_a_silent_worker_and_never_hang_on_it(fake_worker):
    assert requests.get(f"{URL}/healthz", timeout=HANG_GUARD_S).json() == {"status": "ok"}
    fake_worker.set_silent.remote(True).result()
    try:
        _until(lambda: requests.get(f"{URL}/healthz", timeout=HANG_GUARD_S).status_code == 503)
        assert requests.get(f"{URL}/healthz", timeout=HANG_GUARD_S).json() == {"status": "unavailable"}
        metrics = requests.get(f"{URL}/metrics", headers=AUTH_A, timeout=HANG_GUARD_S)
        assert metrics.status_code == 200 and "dlite_worker_up 0.0" in metrics.text
        with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
            stats = _stub(channel).GetStats(dlite_pb2.GetStatsRequest(), metadata=GRPC_A, timeout=HANG_GUARD_S)
        assert json.loads(stats.json)["status"] == "unavailable"
    finally:
        fake_worker.set_silent.remote(False).result()
    _until(lambda: requests.get(f"{URL}/healthz", timeout=HANG_GUARD_S).status_code == 200)


# -- 6: smaller ---------------------------------------------------------------------------------
def test_unimplemented_fields_are_refused_and_the_bearer_scheme_is_case_insensitive(fake_worker):
    for extra, field in (({"n": 3}, "n"), ({"logit_bias": {"42": -100}}, "logit_bias"),
                         ({"presence_penalty": 0.5}, "presence_penalty"),
                         ({"frequency_penalty": 0.5}, "frequency_penalty"),
                         ({"repetition_penalty": 1.3}, "repetition_penalty")):
        r = _chat(QUICK, AUTH_A, **extra)
        assert r.status_code == 400 and f"{field}=" in r.json()["error"]["message"], r.text
    assert _chat(QUICK, AUTH_A, n=1, presence_penalty=0, frequency_penalty=0).status_code == 200
    assert _chat(QUICK, {"authorization": "bearer key-a"}).status_code == 200


GRAMMAR_FAILS = [{"role": "user", "content": "grammar fails"}]


def test_a_grammar_that_fails_mid_reply_is_an_error_never_a_stop(fake_worker):
    whole = _chat(GRAMMAR_FAILS, AUTH_A)
    assert whole.status_code == 422 and "grammar failed" in whole.json()["error"]["message"]
    stream = requests.post(f"{URL}/v1/chat/completions", json={"messages": GRAMMAR_FAILS, "stream": True},
                           headers=AUTH_A, stream=True, timeout=HANG_GUARD_S)
    events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith(b"data: {")]
    assert "grammar failed" in events[-1]["error"]["message"]
    assert all(c["finish_reason"] in (None, "error") for e in events[:-1] for c in e["choices"])
    assert not any(c["finish_reason"] == "stop" for e in events[:-1] for c in e["choices"])
    stub = dlite_pb2_grpc.DLiteServiceStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
    request = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(**m) for m in GRAMMAR_FAILS], max_tokens=4)
    with pytest.raises(grpc.RpcError) as failed:
        list(stub.Generate(request, metadata=GRPC_A, timeout=HANG_GUARD_S))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "grammar failed" in failed.value.details()


def test_a_turn_retried_with_its_idempotency_key_is_stored_once(fake_worker):
    created = requests.post(f"{URL}/v1/conversations", json={"messages": [{"role": "system", "content": "s"}]},
                            headers=AUTH_A, timeout=HANG_GUARD_S).json()
    turn_url = f"{URL}/v1/conversations/{created['id']}/messages"
    body = {"messages": QUICK, "max_tokens": 4}
    keyed = {**AUTH_A, "idempotency-key": "turn-1"}
    first = requests.post(turn_url, json=body, headers=keyed, timeout=HANG_GUARD_S)
    again = requests.post(turn_url, json=body, headers=keyed, timeout=HANG_GUARD_S)
    assert first.status_code == again.status_code == 200
    assert again.json()["message"]["content"] == first.json()["message"]["content"] == "xy"
    history = requests.get(f"{URL}/v1/conversations/{created['id']}", headers=AUTH_A,
                           timeout=HANG_GUARD_S).json()["messages"]
    assert [m["role"] for m in history] == ["system", "user", "assistant"]
    other = requests.post(turn_url, json={"messages": [{"role": "user", "content": "else"}]},
                          headers=keyed, timeout=HANG_GUARD_S)
    assert other.status_code == 400  # the same key for other messages
    bad = requests.post(turn_url, json=body, headers={**AUTH_A, "idempotency-key": "k" * 300}, timeout=HANG_GUARD_S)
    assert bad.status_code == 400


def test_a_turn_whose_grammar_failed_frees_its_kv_and_its_conversation(fake_worker):
    """The engine finished that reply, so its KV sits pinned under the conversation's lease
    on the replica that ran it: the ingress releases it, and the conversation takes turns."""
    created = requests.post(f"{URL}/v1/conversations", json={"messages": [{"role": "system", "content": "s"}]},
                            headers=AUTH_A, timeout=HANG_GUARD_S).json()
    turn_url = f"{URL}/v1/conversations/{created['id']}/messages"
    failed = requests.post(turn_url, json={"messages": GRAMMAR_FAILS, "max_tokens": 4}, headers=AUTH_A,
                           timeout=HANG_GUARD_S)
    assert failed.status_code == 422
    assert created["id"] in fake_worker.leases_released.remote().result()
    again = requests.post(turn_url, json={"messages": QUICK, "max_tokens": 4}, headers=AUTH_A, timeout=HANG_GUARD_S)
    assert again.status_code == 200

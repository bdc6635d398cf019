"""Bounds and refusals of the ingress without Ray: sizes checked before tokenizing, fields we
do not implement refused by name, ids checked before a lookup, credentials, the worker
probe, and undecodable gRPC messages (a real gRPC server in front of the ingress class)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from dlite_ray.serve.auth import KeyRing
from dlite_ray.serve.config import AppArgs, LimitArgs
from dlite_ray.serve.errors import MAX_ERROR_CHARS, ConversationNotFound, ServeError, openai_error_body
from dlite_ray.serve.grpc_requests import parse_grpc_create, parse_grpc_generate
from dlite_ray.serve.openai_requests import parse_append, parse_chat, parse_completion, parse_create_conversation
from dlite_ray.serve.proto import dlite_pb2, dlite_pb2_grpc
from dlite_ray.serve.request_limits import conversation_id
from dlite_ray.serve.worker_messages import WorkerStats
from dlite_ray.serve.worker_probe import WorkerProbe

LIMITS = LimitArgs(max_message_chars=100, max_prompt_chars=250)
HI = [{"role": "user", "content": "hi"}]
HI_PB = [dlite_pb2.Message(**m) for m in HI]


def _refused(decode, body, status: int, *words: str) -> None:
    with pytest.raises(ServeError) as err:
        decode(body, LIMITS)
    assert err.value.http_status == status, err.value
    assert all(w in str(err.value) for w in words), str(err.value)


# -- sizes, before anything is tokenized ----------------------------------------------------
def test_messages_and_prompts_over_their_character_limits_are_413_naming_the_limit():
    one_big = [{"role": "user", "content": "x" * 101}]
    for decode in (parse_chat, parse_create_conversation, parse_append):
        _refused(decode, {"messages": one_big}, 413, "messages[0].content", "max_message_chars")
    three = [{"role": "user", "content": "x" * 100}] * 3  # each fits, together they do not
    for decode in (parse_chat, parse_create_conversation, parse_append):
        _refused(decode, {"messages": three}, 413, "max_prompt_chars")
    _refused(parse_completion, {"prompt": "x" * 251}, 413, "max_prompt_chars")
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 300}}]
    _refused(parse_chat, {"messages": HI, "tools": tools}, 413, "max_prompt_chars")  # the tools' schemas count
    assert parse_chat({"messages": [{"role": "user", "content": "x" * 100}] * 2}, LIMITS).prompt


def test_grpc_messages_are_held_to_the_same_limits_and_to_max_body_bytes():
    big = dlite_pb2.Message(role="user", content="x" * 101)
    for decode, request in ((parse_grpc_generate, dlite_pb2.GenerateRequest(messages=[big])),
                            (parse_grpc_create, dlite_pb2.CreateConversationRequest(messages=[big]))):
        _refused(decode, request, 413, "max_message_chars")
    huge = dlite_pb2.GenerateRequest(messages=HI_PB, json_schema=json.dumps({"description": "d" * 5000}))
    with pytest.raises(ServeError) as err:
        parse_grpc_generate(huge, LimitArgs(max_body_bytes=4096))
    assert err.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT and "max_body_bytes" in str(err.value)


# -- what we do not implement is refused, not ignored --------------------------------------
@pytest.mark.parametrize("field, value", [
    ("n", 3), ("n", True), ("best_of", 2), ("logit_bias", {"42": -100}), ("presence_penalty", 0.5),
    ("frequency_penalty", -1), ("repetition_penalty", 1.2),
])
def test_unimplemented_sampling_fields_are_400_naming_the_field(field, value):
    for decode, body in ((parse_chat, {"messages": HI}), (parse_completion, {"prompt": "hi"}),
                         (parse_append, {})):
        _refused(decode, {**body, field: value}, 400, f"{field}=", "not supported")


def test_their_neutral_values_stay_accepted():
    neutral = {"n": 1, "best_of": None, "logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0,
               "repetition_penalty": 1.0}
    assert parse_chat({"messages": HI, **neutral}, LIMITS).prompt == HI


# -- ids and error messages ----------------------------------------------------------------------
def test_conversation_ids_are_checked_and_errors_never_quote_a_huge_one():
    assert conversation_id("Ab-_09" * 4) == "Ab-_09" * 4
    for bad in ("", "x" * 65, "x" * 20_000, "a b", "../etc", "é", None, 5):
        with pytest.raises(ServeError) as err:
            conversation_id(bad)
        assert err.value.http_status == 400 and len(str(err.value)) < 100
    body = openai_error_body(ConversationNotFound(f"no conversation {'x' * 20_000!r}"))
    assert len(body["error"]["message"]) == MAX_ERROR_CHARS


# -- credentials -------------------------------------------------------------------------------
def test_the_bearer_scheme_is_case_insensitive_and_odd_keys_are_401():
    keys = KeyRing({"key-a": "tenant-a"})
    for header in ("Bearer key-a", "bearer key-a", "BEARER  key-a ", " bearer key-a"):
        assert keys.tenant(header) == "tenant-a"
    for header in (None, "", "key-a", "Basic key-a", "Bearer", "Bearer ÿ", "Bearer key-b"):
        with pytest.raises(ServeError) as err:
            keys.tenant(header)
        assert err.value.http_status == 401


def test_operational_figures_need_a_key_and_may_be_kept_to_some_tenants():
    anyone = KeyRing({"key-a": "tenant-a", "key-b": "ops"})
    assert anyone.ops_tenant("Bearer key-a") == "tenant-a"
    with pytest.raises(ServeError) as err:
        anyone.ops_tenant(None)
    assert err.value.http_status == 401
    ops_only = KeyRing({"key-a": "tenant-a", "key-b": "ops"}, ops_tenants=["ops"])
    assert ops_only.ops_tenant("Bearer key-b") == "ops"
    with pytest.raises(ServeError) as err:
        ops_only.ops_tenant("Bearer key-a")
    assert err.value.http_status == 403 and err.value.grpc_code == grpc.StatusCode.PERMISSION_DENIED
    assert KeyRing({}).ops_tenant(None) == "local"  # local mode: open, as everything else is
    assert (anyone.num_tenants, KeyRing({}).num_tenants) == (2, 1)


def test_the_ingress_takes_what_its_tenants_may_have_in_flight(tmp_path):
    from dlite_ray.serve.app import ROUTER_MAX_ONGOING, build_app, ingress_options

    keys = tmp_path / "keys"
    keys.write_text("k1 t1\nk2 t2\nk3 t2\nk4 t3\n")
    args = AppArgs(api_keys_file=str(keys), api_keys_env=None)
    assert ingress_options(args)["max_ongoing_requests"] == 3 * 8 + 32  # three tenants, four keys
    args.limits.ingress_max_ongoing_requests = 7
    assert ingress_options(args)["max_ongoing_requests"] == 7
    app = build_app(AppArgs(api_keys_env=None, limits={"max_in_flight_per_tenant": 4}))
    assert app._bound_deployment._deployment_config.max_ongoing_requests == 4 + 32  # local mode: one tenant
    router = app._bound_deployment.init_args[1]._bound_deployment  # (worker, router, args)
    assert router._deployment_config.max_ongoing_requests == ROUTER_MAX_ONGOING  # not Serve's 5


# -- the worker probe ----------------------------------------------------------------------------
class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_probe_shares_one_call_keeps_it_a_moment_and_gives_up_on_a_silent_worker():
    from prometheus_client import CollectorRegistry

    calls, hang = [], asyncio.Event()

    async def ask():
        calls.append(1)
        if hang.is_set():
            await asyncio.Event().wait()  # a dead worker: the call never returns
        return {"running": 0}

    async def scenario():
        clock, registry = Clock(), CollectorRegistry()
        probe = WorkerProbe(ask, timeout_s=0.05, ttl_s=1.0, registry=registry, clock=clock)
        answers = await asyncio.gather(*(probe.stats() for _ in range(5)))
        assert answers == [{"running": 0}] * 5 and len(calls) == 1  # concurrent probes: one call
        assert await probe.stats() == {"running": 0} and len(calls) == 1  # fresh: no call
        assert registry.get_sample_value("dlite_worker_up") == 1
        hang.set()
        clock.now += 1.5
        assert await probe.stats() is None and len(calls) == 2  # the deadline, not a hang
        assert registry.get_sample_value("dlite_worker_up") == 0
        assert await probe.stats() is None and len(calls) == 2  # a dead worker costs one call per ttl
        hang.clear()
        clock.now += 1.5
        assert await probe.stats() == {"running": 0}

    asyncio.run(scenario())


# -- undecodable gRPC messages -------------------------------------------------------------------
class FakeHandle:
    """A DeploymentHandle's shape: `handle.method.remote(...)` is awaitable."""

    def __init__(self, **methods):
        self._methods = methods

    def __getattr__(self, name):
        method = self._methods[name]

        class Call:
            @staticmethod
            def remote(*args, **kwargs):
                return method(*args, **kwargs)
        return Call


@pytest.fixture
def ingress_server():
    """The ingress class behind a plain gRPC server, registered as Serve's proxy registers it."""
    from dlite_ray.serve.grpc_service import add_DLiteServiceServicer_to_server
    from dlite_ray.serve.ingress import DLiteIngress

    async def not_found(tenant, cid):
        raise ConversationNotFound(f"no conversation {cid!r}")

    async def stats(route_to=None):
        return WorkerStats(replica="r", running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=8, held_leases=0,
                           draft_connected=True)

    ingress = DLiteIngress(FakeHandle(stats=stats), FakeHandle(get=not_found), AppArgs(api_keys_env=None))

    async def serve(body):
        server = grpc.aio.server()
        add_DLiteServiceServicer_to_server(ingress, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await body(channel)
        finally:
            await server.stop(None)

    return lambda body: asyncio.run(serve(body))


def _raw_call(channel, method: str, streaming: bool):
    kind = channel.unary_stream if streaming else channel.unary_unary
    return kind(f"/dlite.v1.DLiteService/{method}", request_serializer=None, response_deserializer=None)


def test_a_string_that_is_not_utf8_is_invalid_argument(ingress_server):
    good = dlite_pb2.GenerateRequest(messages=[dlite_pb2.Message(role="user", content="hi-XX")], max_tokens=2)
    bad = good.SerializeToString().replace(b"hi-XX", b"hi-\xff\xfe")

    async def body(channel):
        codes = {}
        for method, streaming, raw in (("Generate", True, bad), ("CreateConversation", False, bad),
                                       ("GetConversation", False, b"\x0a\x02\xff\xfe"),
                                       ("AppendAndGenerate", True, b"\x0a\x02\xff\xfe")):
            call = _raw_call(channel, method, streaming)(raw)
            try:
                if streaming:
                    async for _ in call:
                        pass
                else:
                    await call
            except grpc.aio.AioRpcError as err:
                codes[method] = (err.code(), err.details())
        return codes

    codes = ingress_server(body)
    assert set(codes) == {"Generate", "CreateConversation", "GetConversation", "AppendAndGenerate"}, codes
    for code, details in codes.values():
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in details


def test_a_huge_conversation_id_is_invalid_argument_with_short_details(ingress_server):
    async def body(channel):
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        out = []
        for cid in ("x" * 20_000, "short-but-unknown"):
            try:
                await stub.GetConversation(dlite_pb2.GetConversationRequest(conversation_id=cid))
            except grpc.aio.AioRpcError as err:
                out.append((err.code(), err.details()))
        return out

    (long_code, long_details), (unknown_code, _) = ingress_server(body)
    assert long_code == grpc.StatusCode.INVALID_ARGUMENT and len(long_details) < 200
    assert unknown_code == grpc.StatusCode.NOT_FOUND

"""The soak's abusive tenant: threads that, until their deadline, cycle through what a
hostile or careless client sends, and record every answer by kind.

- flood: `flood_width` generation requests at once (HTTP and gRPC), past the tenant's
  in-flight limit, each asking for `max_tokens`: the limit answers 429 /
  RESOURCE_EXHAUSTED at once, the rest are served;
- oversized: a message over max_message_chars, a body over max_body_bytes, a prompt and a
  conversation history over max_prompt_chars (413 / INVALID_ARGUMENT, before tokenizing);
- disconnect: a stream (HTTP SSE, gRPC Generate, a conversation turn) dropped after its
  first chunk; the conversations are kept, to be probed for stuck claims later;
- garbage: bodies that are not JSON, not UTF-8, of the wrong types, unsupported fields,
  no or a wrong key, a 20,000-character conversation id (400 / 401 / INVALID_ARGUMENT /
  UNAUTHENTICATED);
- cross_tenant: reading, appending to and deleting the other tenant's conversations by id
  (404 / NOT_FOUND; anything that succeeds is a breach).
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from dlite_ray.bench.loadtest_client import _error_kind
from dlite_ray.bench.workloads import HELD_OUT_CHAT

ACTIONS = ("flood", "oversized", "disconnect", "garbage", "cross_tenant")
OK = "ok"
EXPECTED = {
    "flood": {OK, "http:429", "grpc:RESOURCE_EXHAUSTED"},
    "oversized": {"http:413", "grpc:INVALID_ARGUMENT"},
    "disconnect": {OK, "http:429", "grpc:RESOURCE_EXHAUSTED"},
    "garbage": {"http:400", "http:401", "grpc:INVALID_ARGUMENT", "grpc:UNAUTHENTICATED"},
    # an append is a generation request: over the limit, 429 comes before the lookup
    "cross_tenant": {"http:404", "grpc:NOT_FOUND", "http:429", "grpc:RESOURCE_EXHAUSTED"},
}
MAX_KEPT_CONVERSATIONS = 40  # per thread: the conversations dropped mid-turn, probed after the soak


@dataclass(slots=True)
class AbuseConfig:
    threads: int = 2
    flood_width: int = 12
    max_tokens: int = 64
    pause_s: float = 0.2  # between two actions of one thread
    http_url: str = ""
    grpc_address: str = ""
    application: str = "dlite"
    api_key: str = ""
    max_message_chars: int = 128 << 10  # the app's LimitArgs, to go just past them
    max_prompt_chars: int = 256 << 10
    max_body_bytes: int = 4 << 20
    request_timeout_s: float = 60.0
    seed: int = 0


@dataclass(slots=True)
class AbuseOutcome:
    action: str
    variant: str
    kind: str  # "ok" or an error kind as the load test names them (http:413, grpc:NOT_FOUND, ...)
    started_s: float  # since the soak's origin
    ended_s: float

    @property
    def expected(self) -> bool:
        return self.kind in EXPECTED[self.action]


class _Status(Exception):
    def __init__(self, status: int):
        super().__init__(f"HTTP {status}")
        self.status = status


class Abuser:
    """One abusive thread of tenant A (its own HTTP session, gRPC channel and flood pool)."""

    def __init__(self, index: int, cfg: AbuseConfig, origin: float, victim_ids: list[str]):
        import grpc
        import requests

        from dlite_ray.serve.proto import dlite_pb2_grpc

        self.cfg, self.origin, self.victim_ids = cfg, origin, victim_ids
        self.rng = random.Random(cfg.seed * 7919 + index)
        self.auth = {"authorization": f"Bearer {cfg.api_key}"}
        self.metadata = (("application", cfg.application), ("authorization", f"Bearer {cfg.api_key}"))
        self.http = requests.Session()
        self.channel = grpc.insecure_channel(cfg.grpc_address)
        self.stub = dlite_pb2_grpc.DLiteServiceStub(self.channel)
        self.pool = ThreadPoolExecutor(cfg.flood_width, thread_name_prefix=f"soak-flood-{index}")
        self.conversations: list[str] = []  # its own, dropped mid-turn
        self._variant = dict.fromkeys(ACTIONS, 0)

    def run_until(self, deadline: float, out: list[AbuseOutcome]) -> None:
        step = 0
        while time.monotonic() < deadline:
            action = ACTIONS[step % len(ACTIONS)]
            step += 1
            if action == "cross_tenant" and not self.victim_ids:
                continue
            if action == "flood":
                out.extend(self.pool.map(lambda i: self._timed("flood", self._flood_one, i),
                                         range(self.cfg.flood_width)))
            else:
                variants = VARIANTS[action]
                n = self._variant[action]
                self._variant[action] += 1
                out.append(self._timed(action, variants[n % len(variants)], self))
            time.sleep(self.cfg.pause_s)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.channel.close()
        self.http.close()

    def _timed(self, action: str, send, arg) -> AbuseOutcome:
        started = time.monotonic() - self.origin
        variant = getattr(send, "__name__", "request").lstrip("_")
        try:
            send(arg)
            kind = OK
        except _Status as exc:
            kind = f"http:{exc.status}"
        except Exception as exc:  # noqa: BLE001 - every answer is counted by kind
            kind = _error_kind(exc)
        return AbuseOutcome(action, variant, kind, started, time.monotonic() - self.origin)

    # -- the requests ---------------------------------------------------------------------------
    def _flood_one(self, i: int) -> None:
        messages = [{"role": "user", "content": self.rng.choice(HELD_OUT_CHAT)}]
        if i % 2:
            self._post({"messages": messages, "max_tokens": self.cfg.max_tokens})
            return
        for _ in self.stub.Generate(self._generate_request(messages, self.cfg.max_tokens), metadata=self.metadata,
                                    timeout=self.cfg.request_timeout_s):
            pass

    def _post(self, body: dict | bytes, headers: dict | None = None, stream: bool = False):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = self.http.post(f"{self.cfg.http_url}/v1/chat/completions", data=data, stream=stream,
                           headers={"content-type": "application/json", **(self.auth if headers is None else headers)},
                           timeout=self.cfg.request_timeout_s)
        if r.status_code != 200:
            r.close()
            raise _Status(r.status_code)
        return r

    def _generate_request(self, messages: list[dict], max_tokens: int = 16):
        from dlite_ray.serve.proto import dlite_pb2
        from dlite_ray.serve.proto_convert import proto_messages

        return dlite_pb2.GenerateRequest(messages=proto_messages(messages), max_tokens=max_tokens)

    def _long_messages(self) -> list[dict]:
        """Every message under max_message_chars, together over max_prompt_chars."""
        per = self.cfg.max_message_chars // 2
        n = self.cfg.max_prompt_chars // per + 1
        return [{"role": "user", "content": "y" * per} for _ in range(n)]

    def _call(self, rpc, request) -> None:
        rpc(request, metadata=self.metadata, timeout=self.cfg.request_timeout_s)

    def _victim(self) -> str:
        return self.rng.choice(self.victim_ids)


def _message_over_limit(a: Abuser) -> None:
    a._post({"messages": [{"role": "user", "content": "x" * (a.cfg.max_message_chars + 1)}], "max_tokens": 8})


def _body_over_limit(a: Abuser) -> None:
    filler = "x" * (a.cfg.max_message_chars - 16)
    n = a.cfg.max_body_bytes // len(filler) + 1
    a._post({"messages": [{"role": "user", "content": filler}] * n, "max_tokens": 8})


def _grpc_prompt_over_limit(a: Abuser) -> None:
    for _ in a.stub.Generate(a._generate_request(a._long_messages()), metadata=a.metadata,
                             timeout=a.cfg.request_timeout_s):
        pass


def _grpc_history_over_limit(a: Abuser) -> None:
    from dlite_ray.serve.proto import dlite_pb2
    from dlite_ray.serve.proto_convert import proto_messages

    a._call(a.stub.CreateConversation, dlite_pb2.CreateConversationRequest(
        messages=proto_messages(a._long_messages())))


def _http_stream_dropped(a: Abuser) -> None:
    r = a._post({"messages": [{"role": "user", "content": a.rng.choice(HELD_OUT_CHAT)}],
                 "max_tokens": a.cfg.max_tokens, "stream": True}, stream=True)
    try:
        next(line for line in r.iter_lines() if line)  # the first event, then hang up
    finally:
        r.close()


def _grpc_stream_cancelled(a: Abuser) -> None:
    call = a.stub.Generate(a._generate_request([{"role": "user", "content": a.rng.choice(HELD_OUT_CHAT)}],
                                               a.cfg.max_tokens), metadata=a.metadata, timeout=a.cfg.request_timeout_s)
    try:
        next(call)
    finally:
        call.cancel()


def _grpc_turn_cancelled(a: Abuser) -> None:
    from dlite_ray.serve.proto import dlite_pb2

    conv = a.stub.CreateConversation(dlite_pb2.CreateConversationRequest(
        messages=[dlite_pb2.Message(role="user", content=a.rng.choice(HELD_OUT_CHAT))]),
        metadata=a.metadata, timeout=a.cfg.request_timeout_s)
    if len(a.conversations) < MAX_KEPT_CONVERSATIONS:
        a.conversations.append(conv.conversation_id)
    call = a.stub.AppendAndGenerate(dlite_pb2.AppendRequest(conversation_id=conv.conversation_id,
                                                            max_tokens=a.cfg.max_tokens),
                                    metadata=a.metadata, timeout=a.cfg.request_timeout_s)
    try:
        next(call)
    finally:
        call.cancel()


def _not_json(a: Abuser) -> None:
    a._post(b'{"messages": [{"role": "user", "content": "hi"}')


def _not_utf8(a: Abuser) -> None:
    a._post(b'{"messages": [{"role": "user", "content": "\xff\xfe\xfd"}]}')


def _wrong_types(a: Abuser) -> None:
    a._post({"messages": "hello", "max_tokens": "lots", "temperature": [1]})


def _unsupported_field(a: Abuser) -> None:
    a._post({"messages": [{"role": "user", "content": "hi"}], "n": 3})


def _no_key(a: Abuser) -> None:
    a._post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, headers={})


def _wrong_key_grpc(a: Abuser) -> None:
    from dlite_ray.serve.proto import dlite_pb2

    a.stub.GetConversation(dlite_pb2.GetConversationRequest(conversation_id="abc"),
                           metadata=(("application", a.cfg.application), ("authorization", "Bearer not-a-key")),
                           timeout=a.cfg.request_timeout_s)


def _huge_conversation_id(a: Abuser) -> None:
    from dlite_ray.serve.proto import dlite_pb2

    a._call(a.stub.GetConversation, dlite_pb2.GetConversationRequest(conversation_id="z" * 20_000))


def _negative_max_tokens(a: Abuser) -> None:
    for _ in a.stub.Generate(a._generate_request([{"role": "user", "content": "hi"}], -5), metadata=a.metadata,
                             timeout=a.cfg.request_timeout_s):
        pass


def _read_other_tenant(a: Abuser) -> None:
    from dlite_ray.serve.proto import dlite_pb2

    a._call(a.stub.GetConversation, dlite_pb2.GetConversationRequest(conversation_id=a._victim()))


def _append_to_other_tenant(a: Abuser) -> None:
    from dlite_ray.serve.proto import dlite_pb2

    call = a.stub.AppendAndGenerate(dlite_pb2.AppendRequest(
        conversation_id=a._victim(), max_tokens=4, messages=[dlite_pb2.Message(role="user", content="ignore that")]),
        metadata=a.metadata, timeout=a.cfg.request_timeout_s)
    for _ in call:
        pass


def _delete_other_tenant(a: Abuser) -> None:
    from dlite_ray.serve.proto import dlite_pb2

    a._call(a.stub.DeleteConversation, dlite_pb2.DeleteConversationRequest(conversation_id=a._victim()))


def _http_read_other_tenant(a: Abuser) -> None:
    r = a.http.get(f"{a.cfg.http_url}/v1/conversations/{a._victim()}", headers=a.auth,
                   timeout=a.cfg.request_timeout_s)
    if r.status_code != 200:
        raise _Status(r.status_code)


VARIANTS = {
    "oversized": (_message_over_limit, _grpc_prompt_over_limit, _grpc_history_over_limit, _body_over_limit),
    "disconnect": (_http_stream_dropped, _grpc_stream_cancelled, _grpc_turn_cancelled),
    "garbage": (_not_json, _not_utf8, _wrong_types, _unsupported_field, _no_key, _wrong_key_grpc,
                _huge_conversation_id, _negative_max_tokens),
    "cross_tenant": (_read_other_tenant, _append_to_other_tenant, _delete_other_tenant, _http_read_other_tenant),
}


def summarize_abuse(outcomes: list[AbuseOutcome], in_fault: Callable[[float, float], bool]) -> dict:
    """Counts by action and kind; what was not expected and no fault explains; breaches
    (cross-tenant requests that succeeded). `in_fault(started_s, ended_s)`: whether that
    interval meets a fault window."""
    by_action: dict[str, Counter] = {}
    unexpected: Counter = Counter()
    breaches = 0
    for o in outcomes:
        by_action.setdefault(o.action, Counter())[o.kind] += 1
        if o.action == "cross_tenant" and o.kind == OK:
            breaches += 1
        elif not o.expected and not in_fault(o.started_s, o.ended_s):
            unexpected[f"{o.action}/{o.variant}/{o.kind}"] += 1
    return {"requests": len(outcomes), "by_action": {a: dict(c) for a, c in by_action.items()},
            "unexpected": dict(unexpected), "cross_tenant_breaches": breaches}

"""One load-test client: a simulated user of a dlite-ray app that, until its deadline (or
for a fixed number of actions), sends one-shot chats (HTTP chat/completions or gRPC Generate) or runs multi-turn tool
loops through the conversation API, recording every request and checking that each
conversation's stored history is what it sent and received."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from dlite_ray.bench.workloads import HELD_OUT_CHAT
from dlite_ray.training.prompts import TOOL_RESULT

HTTP_PORT, GRPC_PORT = 18300, 19300  # the app `dlite-ray loadtest` starts; --connect uses yours
TOOLS_SYSTEM = ('You can call tools. Answer with a call like get_weather(city="Paris") when one is needed. '
                'Tools: get_weather(city: str), search(query: str), run_python(code: str).')
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # the unverified share of one-shot requests


@dataclass(slots=True)
class LoadTestConfig:
    clients: int = 4
    duration_s: float = 30.0
    # fixed work instead of a duration: each client makes this many actions (a one-shot
    # request or a whole tool loop), however long they take; None: until duration_s
    actions_per_client: int | None = None
    max_tokens: int = 32
    turns: int = 3  # assistant replies per tool loop
    one_shot_fraction: float = 0.5
    sampled_fraction: float = 0.2  # one-shot requests sent at T > 0 (counted, not verified)
    http_url: str = f"http://127.0.0.1:{HTTP_PORT}"
    grpc_address: str = f"127.0.0.1:{GRPC_PORT}"
    application: str = "dlite"  # the Serve app name, for gRPC routing
    api_keys: list[str] = field(default_factory=list)  # clients take them round-robin; none = no credentials
    seed: int = 0
    request_timeout_s: float = 300.0


@dataclass(slots=True)
class Record:
    """One request: a one-shot chat or one conversation turn."""

    kind: str  # chat-http | chat-grpc | turn
    messages: list[dict[str, str]]  # the model's input (the whole history for a turn)
    greedy: bool
    latency_s: float = 0.0
    ttft_s: float | None = None
    token_ids: list[int] | None = None  # gRPC only
    text: str = ""
    num_tokens: int = 0
    error: str | None = None
    error_detail: str = ""


@dataclass(slots=True)
class LoopOutcome:
    turns_done: int
    lost: bool
    detail: str = ""


class _HttpStatus(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


def _error_kind(exc: Exception) -> str:
    import grpc
    import requests

    if isinstance(exc, grpc.RpcError):
        return f"grpc:{exc.code().name}"
    if isinstance(exc, _HttpStatus):
        return f"http:{exc.status}"
    if isinstance(exc, requests.Timeout):
        return "timeout"
    if isinstance(exc, requests.ConnectionError):
        return "connection"
    return type(exc).__name__


def _detail(exc: Exception) -> str:
    details = getattr(exc, "details", None)  # grpc.RpcError carries the server's message here
    return (details() if callable(details) else str(exc))[:300]


class Client:
    """One simulated user: its own HTTP session, gRPC channel and API key."""

    def __init__(self, index: int, cfg: LoadTestConfig):
        import grpc
        import requests

        from dlite_ray.serve.proto import dlite_pb2_grpc

        self.cfg, self.rng = cfg, random.Random(cfg.seed * 1000 + index)
        key = cfg.api_keys[index % len(cfg.api_keys)] if cfg.api_keys else None
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.metadata = (("application", cfg.application),) + ((("authorization", f"Bearer {key}"),) if key else ())
        self.http = requests.Session()
        self.channel = grpc.insecure_channel(cfg.grpc_address)
        self.stub = dlite_pb2_grpc.DLiteServiceStub(self.channel)

    def run_until(self, deadline: float, records: list[Record], loops: list[LoopOutcome]) -> None:
        actions = 0
        try:
            while time.monotonic() < deadline and actions != self.cfg.actions_per_client:
                actions += 1
                if self.rng.random() < self.cfg.one_shot_fraction:
                    records.append(self.one_shot())
                else:
                    loops.append(self.tool_loop(deadline, records))
        finally:
            self.channel.close()
            self.http.close()

    def one_shot(self) -> Record:
        messages = [{"role": "user", "content": self.rng.choice(HELD_OUT_CHAT)}]
        greedy = self.rng.random() >= self.cfg.sampled_fraction
        sampling = {} if greedy else {**SAMPLED, "seed": self.rng.randrange(1 << 31)}
        if self.rng.random() < 0.5:
            return self._timed(Record("chat-http", messages, greedy), lambda r: self._http_chat(r, sampling))
        return self._timed(Record("chat-grpc", messages, greedy), lambda r: self._grpc_generate(r, sampling))

    def tool_loop(self, deadline: float, records: list[Record]) -> LoopOutcome:
        from dlite_ray.serve.proto import dlite_pb2
        from dlite_ray.serve.proto_convert import proto_messages

        expected = [{"role": "system", "content": TOOLS_SYSTEM},
                    {"role": "user", "content": self.rng.choice(HELD_OUT_CHAT)}]
        try:
            conv = self.stub.CreateConversation(dlite_pb2.CreateConversationRequest(
                messages=proto_messages(expected)), metadata=self.metadata,
                timeout=self.cfg.request_timeout_s)
        except Exception as exc:  # noqa: BLE001 - counted like any failed request
            records.append(Record("create", expected, False, error=_error_kind(exc), error_detail=_detail(exc)))
            return LoopOutcome(0, False, "not created")
        accepted = [expected]  # the histories the store may rightly hold
        turns = 0
        for turn in range(self.cfg.turns):
            if turn and time.monotonic() >= deadline:
                break
            new = [{"role": "tool", "content": TOOL_RESULT}] if turn else []
            record = self._timed(Record("turn", expected + new, True),
                                 lambda r, new=new: self._grpc_turn(r, conv.conversation_id, new))
            records.append(record)
            if record.error:  # the new messages may or may not have been stored; either is no loss
                accepted = [expected, expected + new]
                break
            expected = expected + new + [{"role": "assistant", "content": record.text}]
            accepted, turns = [expected], turns + 1
        return self._check_history(conv.conversation_id, accepted, turns)

    def _check_history(self, conversation_id: str, accepted: list[list[dict]], turns: int) -> LoopOutcome:
        from dlite_ray.serve.proto import dlite_pb2

        timeout = self.cfg.request_timeout_s
        try:
            stored = self.stub.GetConversation(dlite_pb2.GetConversationRequest(conversation_id=conversation_id),
                                               metadata=self.metadata, timeout=timeout)
            history = [{"role": m.role, "content": m.content} for m in stored.messages]
            self.stub.DeleteConversation(dlite_pb2.DeleteConversationRequest(conversation_id=conversation_id),
                                         metadata=self.metadata, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - a conversation we cannot read back is lost
            return LoopOutcome(turns, True, f"unreadable: {_error_kind(exc)}")
        lost = history not in accepted
        return LoopOutcome(turns, lost, f"stored {len(history)} messages, expected {len(accepted[-1])}" if lost else "")

    def _timed(self, record: Record, send) -> Record:
        started = time.perf_counter()
        try:
            send(record)
        except Exception as exc:  # noqa: BLE001 - every failure is classified and counted
            record.error, record.error_detail = _error_kind(exc), _detail(exc)
        record.latency_s = time.perf_counter() - started
        if record.ttft_s is not None:
            record.ttft_s -= started
        return record

    def _http_chat(self, record: Record, sampling: dict) -> None:
        body = {"messages": record.messages, "max_tokens": self.cfg.max_tokens, **sampling}
        r = self.http.post(f"{self.cfg.http_url}/v1/chat/completions", json=body, headers=self.headers,
                           timeout=self.cfg.request_timeout_s)
        if r.status_code != 200:
            raise _HttpStatus(r.status_code, r.text)
        out = r.json()
        record.text = out["choices"][0]["message"]["content"]
        record.num_tokens = out["usage"]["completion_tokens"]

    def _grpc_generate(self, record: Record, sampling: dict) -> None:
        from dlite_ray.serve.proto import dlite_pb2
        from dlite_ray.serve.proto_convert import proto_messages

        req = dlite_pb2.GenerateRequest(messages=proto_messages(record.messages),
                                        max_tokens=self.cfg.max_tokens, **sampling)
        self._collect(record, self.stub.Generate(req, metadata=self.metadata, timeout=self.cfg.request_timeout_s))

    def _grpc_turn(self, record: Record, conversation_id: str, new: list[dict]) -> None:
        from dlite_ray.serve.proto import dlite_pb2
        from dlite_ray.serve.proto_convert import proto_messages

        req = dlite_pb2.AppendRequest(conversation_id=conversation_id, max_tokens=self.cfg.max_tokens,
                                      messages=proto_messages(new))
        self._collect(record, self.stub.AppendAndGenerate(req, metadata=self.metadata,
                                                          timeout=self.cfg.request_timeout_s))

    @staticmethod
    def _collect(record: Record, stream) -> None:
        record.token_ids = []
        for chunk in stream:
            if record.ttft_s is None and chunk.token_ids:
                record.ttft_s = time.perf_counter()
            record.token_ids += chunk.token_ids
            record.text += chunk.text
            if chunk.finish_reason == "error":
                raise RuntimeError("the stream ended with an error chunk")
        record.num_tokens = len(record.token_ids)


def wait_until_ready(cfg: LoadTestConfig, timeout_s: float = 120.0) -> None:
    """Both protocols answer: Serve's proxies learn a new app's routes a moment after
    `serve.run` returns, and requests in that moment fail as UNAVAILABLE / 404."""
    import grpc
    import requests

    from dlite_ray.serve.proto import dlite_pb2, dlite_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(cfg.grpc_address) as channel:
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        while True:
            try:
                requests.get(f"{cfg.http_url}/healthz", timeout=10).raise_for_status()
                stub.GetStats(dlite_pb2.GetStatsRequest(), metadata=(("application", cfg.application),), timeout=10)
                return
            except (requests.RequestException, grpc.RpcError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

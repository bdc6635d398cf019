"""The soak's tenant B: the load test's client, retrying (turns under an idempotency key),
keeping its conversations until the settle phase, and logging every attempt; what counts
as a conversation's history kept, lost or stuck."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from dlite_ray.bench.loadtest_client import TOOLS_SYSTEM, Client, LoadTestConfig, Record
from dlite_ray.bench.workloads import HELD_OUT_CHAT
from dlite_ray.training.prompts import TOOL_RESULT

SOLO, SOAK, SETTLE = "solo", "soak", "settle"
LATENCY_KINDS = ("chat-http", "chat-grpc", "turn")  # what a user waits for (not creates, reads, probes)
# answers a retry cannot change: the request itself is wrong (or the conversation is gone)
FINAL_ERRORS = frozenset({"http:400", "http:401", "http:403", "http:404", "http:413", "http:422",
                          "grpc:INVALID_ARGUMENT", "grpc:UNAUTHENTICATED", "grpc:PERMISSION_DENIED",
                          "grpc:NOT_FOUND"})
NOT_FOUND = frozenset({"http:404", "grpc:NOT_FOUND"})
BUSY = frozenset({"http:409", "grpc:ABORTED"})
# what a client of a replica that died or restarted is told (explained inside a fault's window)
FAULT_ERRORS = frozenset({"http:503", "grpc:UNAVAILABLE", *BUSY, "connection"})
# Serve's proxies answer a request whose ingress replica died under it with 500 / INTERNAL
# (the replica cannot map its own death): explained by an ingress fault only
INGRESS_FAULT_ERRORS = frozenset({"http:500", "grpc:INTERNAL"})
DISRUPTION_AFTER_S = 5.0  # after a recovery: the first requests re-prefill, queues drain
PROBE = {"role": "user", "content": "Thanks. Answer in one word: done?"}

def claim_bound_s() -> float:
    """How long a conversation may rightly answer busy after its turn's holder died: the
    claim's deadline plus one expiry round of the router."""
    from dlite_ray.serve.router import EXPIRY_PERIOD_S
    from dlite_ray.serve.turn_claims import RENEWED_CLAIM_S

    return RENEWED_CLAIM_S + EXPIRY_PERIOD_S

@dataclass(slots=True)
class Attempt:
    """One try of one of B's requests; times in seconds since the soak's origin."""

    record: Record
    phase: str
    started_s: float
    ended_s: float
    retry: int  # 0: the first try
    request: str  # retries of one request share it


@dataclass(slots=True)
class PendingTurn:
    key: str  # its idempotency key
    new: list[dict[str, str]]


@dataclass(slots=True)
class ConversationLog:
    id: str
    expected: list[dict[str, str]]  # the history as the client sent and received it
    turns_done: int = 0
    pending: PendingTurn | None = None  # a turn whose retries ran out
    lost: bool = False
    detail: str = ""
    probe: str = ""  # after the soak: ok | stuck | lost | failed:<kind> (all but ok and lost are stuck)


def history_matches(history: list[dict], expected: list[dict], pending: PendingTurn | None = None) -> bool:
    """The stored history is what the client sent and received; with a turn that failed,
    its new messages may be stored too, and its reply (the client lost the answer)."""
    if history == expected:
        return True
    if pending is None:
        return False
    base = expected + pending.new
    return history == base or (len(history) == len(base) + 1 and history[:-1] == base
                               and history[-1]["role"] == "assistant")


def probe_outcome(kinds: list[str | None]) -> str:
    """A conversation's last turn, from its attempts' error kinds in order (None: it
    succeeded): ok; lost (not found); stuck (still busy when the bound ran out); failed."""
    if None in kinds:
        return "ok"
    if any(k in NOT_FOUND for k in kinds):
        return "lost"
    if kinds and kinds[-1] in BUSY:
        return "stuck"
    return f"failed:{kinds[-1] if kinds else 'none'}"


@dataclass(slots=True)
class RetryPolicy:
    window_s: float = 120.0
    backoff_s: float = 0.5
    backoff_max_s: float = 4.0


class SoakClient(Client):
    """A load-test client that retries (turns under an idempotency key), keeps its
    conversations until the settle phase, and logs every attempt."""

    def __init__(self, index: int, cfg: LoadTestConfig, policy: RetryPolicy, origin: float,
                 shared_ids: list[str] | None = None, probe_max_tokens: int = 4):
        super().__init__(index, cfg)
        self.index, self.policy, self.origin = index, policy, origin
        self.probe_max_tokens = probe_max_tokens
        self.shared_ids = shared_ids if shared_ids is not None else []  # B's ids, for A's cross-tenant tries
        self.phase = SOLO
        self.attempts: list[Attempt] = []
        self.conversations: list[ConversationLog] = []
        self._requests = itertools.count()

    def run_phase(self, phase: str, deadline: float) -> None:
        self.phase = phase
        while time.monotonic() < deadline:
            if self.rng.random() < self.cfg.one_shot_fraction:
                self.one_shot_retried()
            elif (conv := self.tool_loop_kept(deadline)) is not None:
                self.conversations.append(conv)

    def close(self) -> None:
        self.channel.close()
        self.http.close()

    def one_shot_retried(self) -> list[Record]:
        messages = [{"role": "user", "content": self.rng.choice(HELD_OUT_CHAT)}]
        greedy = self.rng.random() >= self.cfg.sampled_fraction
        sampling = {} if greedy else {"temperature": 0.8, "top_p": 0.95, "seed": self.rng.randrange(1 << 31)}
        if self.rng.random() < 0.5:
            return self._retried(lambda: Record("chat-http", messages, greedy), lambda r: self._http_chat(r, sampling))
        return self._retried(lambda: Record("chat-grpc", messages, greedy), lambda r: self._grpc_generate(r, sampling))

    def tool_loop_kept(self, deadline: float) -> ConversationLog | None:
        """A tool loop whose conversation is kept (and checked) instead of deleted."""
        from dlite_ray.serve.proto import dlite_pb2
        from dlite_ray.serve.proto_convert import proto_messages

        expected = [{"role": "system", "content": TOOLS_SYSTEM},
                    {"role": "user", "content": self.rng.choice(HELD_OUT_CHAT)}]
        created: list[str] = []

        def create(_record: Record) -> None:
            created.append(self.stub.CreateConversation(dlite_pb2.CreateConversationRequest(
                messages=proto_messages(expected)), metadata=self.metadata,
                timeout=self.cfg.request_timeout_s).conversation_id)

        if self._retried(lambda: Record("create", expected, False), create)[-1].error:
            return None
        conv = ConversationLog(created[-1], expected)
        self.shared_ids.append(conv.id)
        for turn in range(self.cfg.turns):
            if turn and time.monotonic() >= deadline:
                break
            new = [{"role": "tool", "content": TOOL_RESULT}] if turn else []
            if self.turn(conv, new, f"{conv.id}-t{turn}", self.cfg.max_tokens, "turn")[-1].error is not None:
                break
        history = self.read_history(conv.id)
        if history is not None and not history_matches(history, conv.expected, conv.pending):
            conv.lost = True
            conv.detail = f"after its loop: stored {len(history)} messages, expected {len(conv.expected)}"
        return conv

    def turn(self, conv: ConversationLog, new: list[dict], key: str, max_tokens: int, kind: str,
             window_s: float | None = None) -> list[Record]:
        """One turn under `key`, retried; on success the history moves on, else the turn is pending."""
        records = self._retried(lambda: Record(kind, conv.expected + new, True),
                                lambda r: self._keyed_turn(r, conv.id, new, key, max_tokens), window_s)
        if records[-1].error is None:
            conv.expected = conv.expected + new + [{"role": "assistant", "content": records[-1].text}]
            if kind == "turn":
                conv.turns_done += 1
            conv.pending = None
        else:
            conv.pending = PendingTurn(key, new)
        return records

    def settle(self, conv: ConversationLog, bound_s: float) -> None:
        """After the soak: the failed turn again (same key), then one more turn, each within
        `bound_s`; then the stored history must be exactly what the client saw."""
        self.phase = SETTLE
        records: list[Record] = []
        if conv.pending is not None:
            pending = conv.pending
            records = self.turn(conv, pending.new, pending.key, self.cfg.max_tokens, "turn", bound_s)
        if conv.pending is None:
            records = self.turn(conv, [PROBE], f"{conv.id}-probe", self.probe_max_tokens, "probe", bound_s)
        conv.probe = probe_outcome([r.error for r in records])
        history = self.read_history(conv.id)
        if conv.probe == "lost" or history is None or not history_matches(history, conv.expected, conv.pending):
            conv.lost = True
            found = "unreadable" if history is None else f"stored {len(history)} messages"
            conv.detail = conv.detail or f"at the end: {found}, expected {len(conv.expected)}"
        self._retried(lambda: Record("delete", [], False), lambda r: self._delete(conv.id), bound_s)

    def read_history(self, conversation_id: str) -> list[dict] | None:
        from dlite_ray.serve.proto import dlite_pb2

        got: list[list[dict]] = []

        def read(_record: Record) -> None:
            stored = self.stub.GetConversation(dlite_pb2.GetConversationRequest(conversation_id=conversation_id),
                                               metadata=self.metadata, timeout=self.cfg.request_timeout_s)
            got.append([{"role": m.role, "content": m.content} for m in stored.messages])

        self._retried(lambda: Record("read", [], False), read)
        return got[-1] if got else None

    def _delete(self, conversation_id: str) -> None:
        from dlite_ray.serve.proto import dlite_pb2

        self.stub.DeleteConversation(dlite_pb2.DeleteConversationRequest(conversation_id=conversation_id),
                                     metadata=self.metadata, timeout=self.cfg.request_timeout_s)

    def _keyed_turn(self, record: Record, conversation_id: str, new: list[dict], key: str, max_tokens: int) -> None:
        from dlite_ray.serve.proto import dlite_pb2
        from dlite_ray.serve.proto_convert import proto_messages

        req = dlite_pb2.AppendRequest(conversation_id=conversation_id, max_tokens=max_tokens,
                                      messages=proto_messages(new))
        self._collect(record, self.stub.AppendAndGenerate(req, metadata=self.metadata + (("idempotency-key", key),),
                                                          timeout=self.cfg.request_timeout_s))
        if not record.token_ids:  # a replayed reply carries its text only: checked by text
            record.token_ids = None

    @staticmethod
    def _collect(record: Record, stream) -> None:
        """The stream's chunks into `record`. A failed stream sends one error chunk, then its
        status: read on to raise that status (its code is the error's kind)."""
        record.token_ids = []
        failed = False
        for chunk in stream:
            if chunk.finish_reason == "error":
                failed = True
                continue
            if record.ttft_s is None and chunk.token_ids:
                record.ttft_s = time.perf_counter()
            record.token_ids += chunk.token_ids
            record.text += chunk.text
        if failed:
            raise RuntimeError("the stream ended with an error chunk and status OK")
        record.num_tokens = len(record.token_ids)

    def _retried(self, make, send, window_s: float | None = None) -> list[Record]:
        """`send` until it succeeds, fails for good, or the window ends; every try logged."""
        request = f"{self.index}-{next(self._requests)}"
        give_up = time.monotonic() + (self.policy.window_s if window_s is None else window_s)
        records = []
        for retry in itertools.count():
            started = time.monotonic()
            record = self._timed(make(), send)
            records.append(record)
            self.attempts.append(Attempt(record, self.phase, started - self.origin, time.monotonic() - self.origin,
                                         retry, request))
            if record.error is None or record.error in FINAL_ERRORS or time.monotonic() >= give_up:
                return records
            time.sleep(min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** min(retry, 10)))
        raise AssertionError("unreachable")

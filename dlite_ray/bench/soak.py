"""`dlite-ray soak`: the load test for a long while, with an abusive tenant and faults.

One app on loopback (as `dlite-ray loadtest` starts it) with two tenants' keys:

1. solo: tenant B's clients (the load test's mix of one-shot chats and tool loops) alone,
   for B's baseline latency;
2. soak: B's clients again, tenant A's abusers (soak_abuser: floods past its limit,
   oversized prompts, dropped streams, garbage, requests for B's conversations), and a
   fault every `fault_period_s` (soak_faults: the draft, the TargetWorker, the ingress, the
   router killed in turn, one at a time, each waited out);
3. settle: every conversation is asked for one more turn (a turn left failed is first
   retried with its idempotency key); then the T = 0 replies are checked against the
   library engine, once the app is gone.

B's clients retry a failed request (turns with the same idempotency key, so a retry
never appends twice) until it succeeds, fails for good (4xx) or `retry_window_s` passes;
every attempt is logged with its times. The report (JSON + a table) holds B's latency
solo and under the soak (outside the faults' windows, and all of it), B's errors
explained by a fault or not, lost and stuck conversations, mismatched T = 0 replies, A's
answers by kind, and every fault with its wall time and recovery time.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dlite_ray.bench.loadtest import _percentile, check_greedy_replies, local_app
from dlite_ray.bench.loadtest_client import TOOLS_SYSTEM, Client, LoadTestConfig, Record, wait_until_ready
from dlite_ray.bench.machine import machine_info
from dlite_ray.bench.soak_abuser import AbuseConfig, AbuseOutcome, Abuser, summarize_abuse
from dlite_ray.bench.soak_faults import (
    FAULT_KINDS,
    FaultEvent,
    FaultInjector,
    RayFaults,
    fault_windows,
    overlaps,
    plan_faults,
)
from dlite_ray.bench.workloads import HELD_OUT_CHAT, TOOL_RESULT

log = logging.getLogger(__name__)

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
class SoakConfig:
    solo_s: float = 120.0
    duration_s: float = 600.0
    fault_period_s: float = 100.0
    faults: tuple[str, ...] = FAULT_KINDS
    clients: int = 3  # tenant B
    abusers: int = 2  # tenant A's threads
    flood_width: int = 12
    abuse_max_tokens: int = 64
    max_tokens: int = 16
    turns: int = 3
    one_shot_fraction: float = 0.5
    sampled_fraction: float = 0.2
    tenant_limit: int = 4  # the app's max_in_flight_per_tenant
    retry_window_s: float = 120.0
    request_timeout_s: float = 120.0
    stuck_bound_s: float | None = None  # default: claim_bound_s() + 15 s
    probe_max_tokens: int = 4
    max_p99_ratio: float = 2.0
    seed: int = 0


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

        expected = [{"role": "system", "content": TOOLS_SYSTEM},
                    {"role": "user", "content": self.rng.choice(HELD_OUT_CHAT)}]
        created: list[str] = []

        def create(_record: Record) -> None:
            created.append(self.stub.CreateConversation(dlite_pb2.CreateConversationRequest(
                messages=[dlite_pb2.Message(**m) for m in expected]), metadata=self.metadata,
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

        req = dlite_pb2.AppendRequest(conversation_id=conversation_id, max_tokens=max_tokens,
                                      messages=[dlite_pb2.Message(**m) for m in new])
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


# -- the report ---------------------------------------------------------------------------------
def latency_figures(values: list[float]) -> dict:
    values = sorted(values)
    return {"n": len(values), "p50": _percentile(values, 50), "p99": _percentile(values, 99),
            "max": values[-1] if values else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize_soak(cfg: SoakConfig, attempts: list[Attempt], conversations: list[ConversationLog],
                   abuse: list[AbuseOutcome], abuser_probes: list[str], faults: list[FaultEvent], greedy: dict,
                   horizon_s: float, thread_errors: list[str] | None = None) -> dict:
    """The report, verdict included, from what the run logged (no Ray, no clock)."""
    disrupted = fault_windows(faults, DISRUPTION_AFTER_S, horizon_s)
    explaining = fault_windows(faults, claim_bound_s() + DISRUPTION_AFTER_S, horizon_s)
    ingress_windows = fault_windows([f for f in faults if f.kind == "ingress"], claim_bound_s() + DISRUPTION_AFTER_S,
                                    horizon_s)
    ok = [a for a in attempts if a.record.error is None and a.record.kind in LATENCY_KINDS]
    solo = [a.record.latency_s for a in ok if a.phase == SOLO]
    soak = [a for a in ok if a.phase == SOAK]
    quiet = [a.record.latency_s for a in soak if not overlaps(a.started_s, a.ended_s, disrupted)]
    by_request: dict[str, list[Attempt]] = defaultdict(list)
    for a in attempts:
        by_request[a.request].append(a)
    end_to_end = [rs[-1].ended_s - rs[0].started_s for rs in by_request.values()
                  if rs[-1].phase == SOAK and rs[-1].record.error is None and rs[-1].record.kind in LATENCY_KINDS]
    explained, unexplained, settling = Counter(), Counter(), Counter()
    examples: dict[str, str] = {}
    for a in attempts:
        kind = a.record.error
        if kind is None:
            continue
        examples.setdefault(kind, a.record.error_detail)
        if a.phase == SETTLE:
            settling[kind] += 1  # judged by the probe's outcome (stuck / lost), not one by one
        elif (kind in FAULT_ERRORS and overlaps(a.started_s, a.ended_s, explaining)) or \
                (kind in INGRESS_FAULT_ERRORS and overlaps(a.started_s, a.ended_s, ingress_windows)):
            explained[kind] += 1
        else:
            unexplained[kind] += 1
    failed_for_good = [rs for rs in by_request.values() if rs[-1].record.error and rs[-1].phase != SETTLE]
    lat_solo, lat_quiet = latency_figures(solo), latency_figures(quiet)
    b = {
        "requests": len(by_request), "attempts": len(attempts),
        "requests_by_kind": dict(Counter(rs[0].record.kind for rs in by_request.values())),
        "retried_requests": sum(len(rs) > 1 for rs in by_request.values()),
        "retried_by_kind": dict(Counter(rs[0].record.kind for rs in by_request.values() if len(rs) > 1)),
        "failed_after_retries": len(failed_for_good),
        "failed_after_retries_kinds": dict(Counter(rs[-1].record.error for rs in failed_for_good)),
        "latency_s": {"solo": lat_solo, "soak_quiet": lat_quiet,
                      "soak_all": latency_figures([a.record.latency_s for a in soak]),
                      "soak_end_to_end": latency_figures(end_to_end)},
        "p50_ratio": _ratio(lat_quiet["p50"], lat_solo["p50"]), "p99_ratio": _ratio(lat_quiet["p99"], lat_solo["p99"]),
        "p99_ratio_all": _ratio(latency_figures([a.record.latency_s for a in soak])["p99"], lat_solo["p99"]),
        "errors_explained": dict(explained), "errors_unexplained": dict(unexplained),
        "errors_while_settling": dict(settling), "error_examples": examples,
        "conversations": len(conversations), "conversation_turns": sum(c.turns_done for c in conversations),
        "lost_conversations": sum(c.lost for c in conversations),
        "lost_details": [f"{c.id}: {c.detail}" for c in conversations if c.lost][:5],
        "stuck_conversations": sum(_stuck(c.probe) for c in conversations),
        "probes": dict(Counter(c.probe for c in conversations)),
    }
    a = summarize_abuse(abuse, lambda s, e: overlaps(s, e, explaining))
    a["conversations_probed"] = len(abuser_probes)
    a["probes"] = dict(Counter(abuser_probes))
    a["stuck_conversations"] = sum(_stuck(p) for p in abuser_probes)
    report = {"config": asdict(cfg) | {"stuck_bound_s": _stuck_bound(cfg)}, "tenant_b": b, "tenant_a": a,
              "faults": [asdict(f) | {"recovery_s": f.recovery_s} for f in faults], "greedy": greedy,
              "thread_errors": thread_errors or []}
    report["verdict"] = verdict(report, cfg.max_p99_ratio)
    return report


def _stuck(probe: str) -> bool:
    """A conversation whose new turn did not go through within the bound, for any reason
    but being gone (that is a lost one); one never probed counts too."""
    return probe not in ("ok", "lost")


def verdict(report: dict, max_p99_ratio: float) -> dict:
    """Each check as {value, limit, ok}, and whether all passed."""
    b, a = report["tenant_b"], report["tenant_a"]
    ratio = b["p99_ratio"]
    checks = {
        "b_p99_ratio_quiet": (ratio, f"<= {max_p99_ratio}", ratio is not None and ratio <= max_p99_ratio),
        "lost_conversations": (b["lost_conversations"], "0", b["lost_conversations"] == 0),
        "stuck_conversations": (b["stuck_conversations"] + a["stuck_conversations"], "0",
                                b["stuck_conversations"] + a["stuck_conversations"] == 0),
        "mismatched_t0_replies": (report["greedy"]["mismatches"], "0", report["greedy"]["mismatches"] == 0),
        "b_unexplained_errors": (sum(b["errors_unexplained"].values()), "0", not b["errors_unexplained"]),
        "b_failed_after_retries": (b["failed_after_retries"], "0", b["failed_after_retries"] == 0),
        "cross_tenant_breaches": (a["cross_tenant_breaches"], "0", a["cross_tenant_breaches"] == 0),
        "faults_unrecovered": (sum(f["error"] is not None for f in report["faults"]), "0",
                               all(f["error"] is None for f in report["faults"])),
        "client_crashes": (len(report["thread_errors"]), "0", not report["thread_errors"]),
    }
    out = {name: {"value": v, "limit": lim, "ok": ok} for name, (v, lim, ok) in checks.items()}
    return {"checks": out, "pass": all(c["ok"] for c in out.values())}


def _stuck_bound(cfg: SoakConfig) -> float:
    return cfg.stuck_bound_s if cfg.stuck_bound_s is not None else claim_bound_s() + 15.0


# -- the run ------------------------------------------------------------------------------------
@dataclass(slots=True)
class SoakRun:
    attempts: list[Attempt] = field(default_factory=list)
    conversations: list[ConversationLog] = field(default_factory=list)
    abuse: list[AbuseOutcome] = field(default_factory=list)
    abuser_probes: list[str] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)
    faults_planned: int = 0
    horizon_s: float = 0.0
    thread_errors: list[str] = field(default_factory=list)


def _run_threads(targets: list, errors: list[str]) -> None:
    """Run the callables on threads and wait; a crash is recorded, never silent."""
    def guarded(fn):
        try:
            fn()
        except Exception as exc:
            log.exception("soak thread crashed")
            errors.append(f"{type(exc).__name__}: {exc}"[:300])

    threads = [threading.Thread(target=guarded, args=(fn,), name=f"soak-{i}") for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run_soak(cfg: SoakConfig, lt: LoadTestConfig, abuse_cfg: AbuseConfig, draft: bool) -> SoakRun:
    """The three phases against the app at `lt`'s addresses (B's key in `lt`, A's in `abuse_cfg`)."""
    out = SoakRun()
    wait_until_ready(lt)
    origin = time.monotonic()
    shared_ids: list[str] = []
    policy = RetryPolicy(window_s=cfg.retry_window_s)
    clients = [SoakClient(i, lt, policy, origin, shared_ids, cfg.probe_max_tokens) for i in range(cfg.clients)]
    log.info("soak: solo phase, %d clients of tenant B for %.0f s", cfg.clients, cfg.solo_s)
    _run_threads([lambda c=c: c.run_phase(SOLO, origin + cfg.solo_s) for c in clients], out.thread_errors)

    soak_start = time.monotonic()
    plan = plan_faults(cfg.duration_s, cfg.fault_period_s, cfg.faults)
    out.faults_planned = len(plan)  # one whose time comes after the soak ended (a long recovery before) is skipped
    injector = FaultInjector(plan, RayFaults(lt.application, lt.http_url, draft), origin, soak_start - origin)
    abusers = [Abuser(i, abuse_cfg, origin, shared_ids) for i in range(cfg.abusers)]
    log.info("soak: B + A + %d faults for %.0f s", len(plan), cfg.duration_s)
    injector.start()
    deadline = soak_start + cfg.duration_s
    _run_threads([lambda c=c: c.run_phase(SOAK, deadline) for c in clients]
                 + [lambda a=a: a.run_until(deadline, out.abuse) for a in abusers], out.thread_errors)
    injector.stop()  # no new fault; the last one recovered (or timed out)
    out.faults = injector.events

    bound = _stuck_bound(cfg)
    log.info("soak: settling %d conversations of B and %d of A (bound %.0f s each)",
             sum(len(c.conversations) for c in clients), sum(len(a.conversations) for a in abusers), bound)
    _run_threads([lambda c=c: [c.settle(conv, bound) for conv in c.conversations] for c in clients],
                 out.thread_errors)
    prober = SoakClient(cfg.clients, LoadTestConfig(**{**asdict(lt), "api_keys": [abuse_cfg.api_key]}),
                        policy, origin)
    prober.phase = SETTLE
    for abuser in abusers:
        for cid in abuser.conversations:  # dropped mid-turn: a new turn must go through
            records = prober.turn(ConversationLog(cid, []), [PROBE], f"{cid}-probe", cfg.probe_max_tokens, "probe",
                                  bound)
            out.abuser_probes.append(probe_outcome([r.error for r in records]))
        abuser.close()
    prober.close()
    out.horizon_s = time.monotonic() - origin
    for c in clients:
        c.close()
        out.attempts += c.attempts
        out.conversations += c.conversations
    return out


def run(args) -> dict:
    """The CLI: start the app, run the soak, check T = 0 replies, print and write the report."""
    from dlite_ray.engine.engine import DLiteEngine
    from dlite_ray.serve.config import EngineArgs, LimitArgs

    cfg = SoakConfig(solo_s=args.solo_s, duration_s=args.duration_s, fault_period_s=args.fault_period_s,
                     faults=tuple(k for k in args.faults.split(",") if k), clients=args.clients,
                     abusers=args.abusers, flood_width=args.flood_width, abuse_max_tokens=args.abuse_max_tokens,
                     max_tokens=args.max_tokens, turns=args.turns, one_shot_fraction=args.one_shot_fraction,
                     sampled_fraction=args.sampled_fraction, tenant_limit=args.tenant_limit,
                     retry_window_s=args.retry_window_s, request_timeout_s=args.request_timeout_s,
                     max_p99_ratio=args.max_p99_ratio, seed=args.seed)
    plan_faults(cfg.duration_s, cfg.fault_period_s, cfg.faults)  # bad kinds fail before anything starts
    limits = LimitArgs(max_in_flight_per_tenant=cfg.tenant_limit)
    engine_args = EngineArgs(target=args.target, draft=args.draft, dtype=args.dtype, adaptive_draft_length=False)
    lt = LoadTestConfig(clients=cfg.clients, duration_s=cfg.duration_s, max_tokens=cfg.max_tokens, turns=cfg.turns,
                        one_shot_fraction=cfg.one_shot_fraction, sampled_fraction=cfg.sampled_fraction,
                        seed=cfg.seed, request_timeout_s=cfg.request_timeout_s)
    with local_app(engine_args, tenants=2, limits=limits.model_dump()) as (key_a, key_b):
        lt.api_keys = [key_b]
        abuse_cfg = AbuseConfig(threads=cfg.abusers, flood_width=cfg.flood_width, max_tokens=cfg.abuse_max_tokens,
                                http_url=lt.http_url, grpc_address=lt.grpc_address, application=lt.application,
                                api_key=key_a, max_message_chars=limits.max_message_chars,
                                max_prompt_chars=limits.max_prompt_chars, max_body_bytes=limits.max_body_bytes,
                                seed=cfg.seed)
        result = run_soak(cfg, lt, abuse_cfg, draft=args.draft != "none")
    draft = None if args.draft == "none" else args.draft  # the reference, once the app's CPUs are free
    engine = DLiteEngine.from_pretrained(args.target, draft, dtype=args.dtype, adaptive_draft_length=False)
    checked = [a.record for a in result.attempts if a.record.kind in LATENCY_KINDS]
    greedy = check_greedy_replies(checked, engine, cfg.max_tokens)
    report = summarize_soak(cfg, result.attempts, result.conversations, result.abuse, result.abuser_probes,
                            result.faults, greedy, result.horizon_s, result.thread_errors)
    report["faults_planned"] = result.faults_planned
    report["machine"] = machine_info()
    out = Path(args.out) / "soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(format_summary(report))
    print(f"report: {out}")
    return report


def format_summary(report: dict) -> str:
    cfg, b, a, greedy = report["config"], report["tenant_b"], report["tenant_a"], report["greedy"]
    fmt = (lambda v: "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
    lines = [(f"soak: solo {cfg['solo_s']:.0f} s, soak {cfg['duration_s']:.0f} s; tenant B {cfg['clients']} "
              f"clients, tenant A {cfg['abusers']} abusers; a fault every {cfg['fault_period_s']:.0f} s"),
             "", f"{'B latency (s)':<26}{'n':>6}{'p50':>9}{'p99':>9}{'max':>9}"]
    for name, row in b["latency_s"].items():
        lines.append(f"  {name:<24}{row['n']:>6}{fmt(row['p50']):>9}{fmt(row['p99']):>9}{fmt(row['max']):>9}")
    lines += ["", f"faults ({len(report['faults'])} of {report.get('faults_planned', '?')} planned):"]
    for f in report["faults"]:
        lines.append(f"  {f['wall_time']}  t={fmt(f['injected_at_s'])} s  {f['kind']:<14} recovered in "
                     f"{fmt(f['recovery_s'])} s  {f['error'] or ''}  [{f['target']}]")
    lines += [
        "",
        (f"B: {b['requests']} requests {b['requests_by_kind']} in {b['attempts']} attempts; retried "
         f"{b['retried_by_kind'] or 'none'}; {b['conversations']} conversations ({b['conversation_turns']} turns), "
         f"their last turns {b['probes']}"),
        (f"B errors explained by a fault: {b['errors_explained'] or 'none'}; unexplained: "
         f"{b['errors_unexplained'] or 'none'}; while settling: {b['errors_while_settling'] or 'none'}"),
        (f"A: {a['requests']} requests {a['by_action']}; unexpected: {a['unexpected'] or 'none'}; "
         f"its conversations probed {a['conversations_probed']} {a['probes']}"),
        f"T=0 replies checked {greedy['checked']} ({greedy['distinct_inputs']} distinct inputs)",
        "",
        f"{'check':<26}{'value':>10}  {'limit':<8}ok",
    ]
    for name, c in report["verdict"]["checks"].items():
        lines.append(f"  {name:<24}{fmt(c['value']):>10}  {c['limit']:<8}{'yes' if c['ok'] else 'NO'}")
    lines.append(f"verdict: {'PASS' if report['verdict']['pass'] else 'FAIL'}")
    return "\n".join(lines)

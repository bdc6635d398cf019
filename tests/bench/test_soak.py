"""`dlite-ray soak`'s pieces that need no Ray: the fault schedule and its injector's order,
the retrying client's bookkeeping, and the verdict on fabricated runs (lost, stuck,
unexplained errors, the latency ratio). The soak itself runs by hand (see the issue note)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from dlite_ray.bench.loadtest_client import LoadTestConfig, Record, _HttpStatus
from dlite_ray.bench.soak import SoakConfig
from dlite_ray.bench.soak_abuser import AbuseOutcome, summarize_abuse
from dlite_ray.bench.soak_client import (
    SETTLE,
    SOAK,
    SOLO,
    Attempt,
    ConversationLog,
    PendingTurn,
    RetryPolicy,
    SoakClient,
    claim_bound_s,
    history_matches,
    probe_outcome,
)
from dlite_ray.bench.soak_faults import FAULT_KINDS, FaultEvent, FaultInjector, fault_windows, overlaps, plan_faults
from dlite_ray.bench.soak_report import format_summary, summarize_soak

SYS = {"role": "system", "content": "tools"}
USER = {"role": "user", "content": "hi"}
TOOL = {"role": "tool", "content": "{}"}
REPLY = {"role": "assistant", "content": "ok"}
CLEAN_GREEDY = {"checked": 10, "distinct_inputs": 4, "mismatches": 0, "mismatch_examples": []}


def test_the_plan_cycles_through_every_kind_from_half_a_period():
    plan = plan_faults(duration_s=600, period_s=100)
    assert [p.at_s for p in plan] == [50, 150, 250, 350, 450, 550]
    assert [p.kind for p in plan] == [*FAULT_KINDS, *FAULT_KINDS[:2]]
    assert [p.kind for p in plan_faults(100, 30, ("router", "draft"), first_at_s=0)] == ["router", "draft"] * 2
    assert plan_faults(10, 100) == []
    with pytest.raises(ValueError, match="kinds"):
        plan_faults(100, 10, ("draft", "gpu"))
    with pytest.raises(ValueError, match="period"):
        plan_faults(100, 0)


class FakeActions:
    """Records calls; a fault recovers after `recover_after` looks; 'router' cannot be injected;
    `injected` is set once a fault has been."""

    def __init__(self, recover_after: int = 3):
        self.calls: list[tuple[str, str]] = []
        self.injected = threading.Event()
        self.looks: dict[str, int] = {}
        self.recover_after = recover_after

    def inject(self, kind: str) -> str:
        if kind == "router":
            raise RuntimeError("no live router")
        self.calls.append(("inject", kind))
        self.injected.set()
        return f"{kind}-replica"

    def recovered(self, kind: str, target: str) -> bool:
        self.looks[kind] = self.looks.get(kind, 0) + 1
        if self.looks[kind] == 1:
            raise ConnectionError("still restarting")  # a failing look is a "not yet"
        done = self.looks[kind] >= self.recover_after
        if done:
            self.calls.append(("recovered", kind))
        return done


def test_the_injector_runs_the_plan_in_order_one_fault_at_a_time():
    actions = FakeActions()
    origin = time.monotonic()
    plan = plan_faults(duration_s=0.16, period_s=0.04, kinds=("draft", "target_worker", "router", "ingress"))
    injector = FaultInjector(plan, actions, origin, phase_start_s=0.0, poll_s=0.01)
    injector.start()
    injector._thread.join(timeout=10)  # the whole plan
    injector.stop()
    assert actions.calls == [("inject", "draft"), ("recovered", "draft"), ("inject", "target_worker"),
                             ("recovered", "target_worker"), ("inject", "ingress"), ("recovered", "ingress")]
    events = injector.events
    assert [e.kind for e in events] == ["draft", "target_worker", "router", "ingress"]
    assert events[2].error.startswith("inject failed: RuntimeError") and events[2].recovered_at_s is None
    for e in (events[0], events[1], events[3]):
        assert e.error is None and e.target == f"{e.kind}-replica" and e.wall_time
        assert e.injected_at_s >= e.planned_at_s and e.recovery_s >= 0
    # the next fault never starts before the previous one recovered
    assert events[1].injected_at_s >= events[0].recovered_at_s


def test_a_stopped_injector_schedules_nothing_more_and_a_fault_that_never_recovers_says_so():
    actions = FakeActions(recover_after=10**9)
    injector = FaultInjector(plan_faults(100, 10, ("draft",), first_at_s=0), actions, time.monotonic(), 0.0,
                             recovery_timeout_s=0.05, poll_s=0.01)
    injector.start()
    assert actions.injected.wait(30)  # the first fault is in progress (a guard, not a figure under test)
    injector.stop()
    assert len(injector.events) == 1 and injector.events[0].error == "not recovered within 0 s"
    assert fault_windows(injector.events, after_s=1.0, horizon_s=50.0) == [(injector.events[0].injected_at_s, 51.0)]


def test_windows_and_overlaps():
    events = [FaultEvent("draft", 10, injected_at_s=10, recovered_at_s=12),
              FaultEvent("router", 40, injected_at_s=None, error="inject failed")]
    windows = fault_windows(events, after_s=5, horizon_s=100)
    assert windows == [(10, 17)]
    assert overlaps(9, 10, windows) and overlaps(16, 30, windows) and overlaps(11, 12, windows)
    assert not overlaps(0, 9.9, windows) and not overlaps(17.1, 20, windows)


def test_a_history_is_lost_unless_it_is_what_the_client_sent_and_received():
    expected = [SYS, USER, REPLY]
    assert history_matches(expected, expected)
    assert not history_matches([SYS, USER], expected)  # a reply the client received is gone
    assert not history_matches(expected + [TOOL], expected)  # something it never sent
    assert not history_matches([SYS, USER, REPLY, TOOL, TOOL], expected, PendingTurn("k", [TOOL]))  # appended twice
    pending = PendingTurn("k", [TOOL])  # a failed turn: its messages, and its reply, may be stored
    assert history_matches(expected, expected, pending)
    assert history_matches(expected + [TOOL], expected, pending)
    assert history_matches(expected + [TOOL, REPLY], expected, pending)
    assert not history_matches(expected + [TOOL, USER], expected, pending)


def test_a_conversation_is_stuck_when_it_still_answers_busy_at_the_bound():
    assert probe_outcome(["http:503", "grpc:ABORTED", None]) == "ok"
    assert probe_outcome(["grpc:ABORTED"] * 20) == "stuck"
    assert probe_outcome(["grpc:UNAVAILABLE", "grpc:ABORTED"]) == "stuck"
    assert probe_outcome(["grpc:ABORTED", "grpc:NOT_FOUND"]) == "lost"
    assert probe_outcome(["grpc:ABORTED", "grpc:UNAVAILABLE"]) == "failed:grpc:UNAVAILABLE"


@pytest.fixture
def client():
    # no server: a gRPC channel connects lazily, and these tests send through fakes
    c = SoakClient(0, LoadTestConfig(api_keys=["k"]), RetryPolicy(window_s=5, backoff_s=0.001), time.monotonic())
    yield c
    c.close()


def test_the_client_retries_until_success_and_logs_every_try(client):
    answers = iter([_HttpStatus(503, "down"), _HttpStatus(409, "busy"), None])

    def send(record: Record) -> None:
        exc = next(answers)
        if exc is not None:
            raise exc
        record.text = "done"

    records = client._retried(lambda: Record("turn", [USER], True), send)
    assert [r.error for r in records] == ["http:503", "http:409", None] and records[-1].text == "done"
    assert [a.retry for a in client.attempts] == [0, 1, 2] and len({a.request for a in client.attempts}) == 1
    assert all(a.phase == SOLO and a.ended_s >= a.started_s for a in client.attempts)


def test_the_client_does_not_retry_a_request_that_is_wrong_and_gives_up_after_its_window(client):
    def refused(record: Record) -> None:
        raise _HttpStatus(413, "too large")

    assert [r.error for r in client._retried(lambda: Record("chat-http", [USER], True), refused)] == ["http:413"]

    def down(record: Record) -> None:
        raise _HttpStatus(503, "down")

    records = client._retried(lambda: Record("chat-http", [USER], True), down, window_s=0.02)
    assert len(records) >= 2 and all(r.error == "http:503" for r in records)


def test_a_failed_stream_is_known_by_its_status_not_by_its_error_chunk(client):
    class Unavailable(Exception):
        pass

    def stream():
        yield SimpleNamespace(finish_reason="", token_ids=[5], text="a")
        yield SimpleNamespace(finish_reason="error", token_ids=[], text="")
        raise Unavailable("the status that follows the error chunk")

    with pytest.raises(Unavailable):
        client._collect(Record("turn", [USER], True), stream())
    record = Record("turn", [USER], True)
    client._collect(record, iter([SimpleNamespace(finish_reason="stop", token_ids=[1, 2], text="ok")]))
    assert record.token_ids == [1, 2] and record.num_tokens == 2 and record.text == "ok"


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class FakeServer:
    """The conversation RPCs over a dict, with idempotency keys as the server keeps them.
    `fail` holds (when, code) for the next AppendAndGenerate calls: "before" the turn is
    stored, or "after" (the reply is stored, the client told an error)."""

    def __init__(self):
        self.histories: dict[str, list[dict]] = {}
        self.replies: dict[tuple[str, str], str] = {}
        self.fail: list[tuple[str, grpc.StatusCode]] = []
        self.busy = False

    def CreateConversation(self, req, metadata, timeout):
        cid = f"c{len(self.histories)}"
        self.histories[cid] = [{"role": m.role, "content": m.content} for m in req.messages]
        return SimpleNamespace(conversation_id=cid)

    def AppendAndGenerate(self, req, metadata, timeout):
        key = (req.conversation_id, dict(metadata)["idempotency-key"])
        if self.busy:
            raise FakeRpcError(grpc.StatusCode.ABORTED)
        when, code = self.fail.pop(0) if self.fail else (None, None)
        if when == "before":
            raise FakeRpcError(code)
        if key in self.replies:  # a retry: the stored reply, text only
            return iter([SimpleNamespace(finish_reason="stop", token_ids=[], text=self.replies[key])])
        history = self.histories[req.conversation_id]
        reply = f"reply {len(history)}"
        history += [{"role": m.role, "content": m.content} for m in req.messages] + [
            {"role": "assistant", "content": reply}]
        self.replies[key] = reply
        if when == "after":
            raise FakeRpcError(code)
        return iter([SimpleNamespace(finish_reason="stop", token_ids=[7, 8], text=reply)])

    def GetConversation(self, req, metadata, timeout):
        if req.conversation_id not in self.histories:
            raise FakeRpcError(grpc.StatusCode.NOT_FOUND)
        return SimpleNamespace(messages=[SimpleNamespace(**m) for m in self.histories[req.conversation_id]])

    def DeleteConversation(self, req, metadata, timeout):
        del self.histories[req.conversation_id]


@pytest.fixture
def served(client):
    client.stub = FakeServer()
    client.cfg.turns = 3
    return client


def test_a_tool_loop_retries_each_turn_under_its_key_and_keeps_the_history_exact(served):
    server = served.stub
    server.fail = [("before", grpc.StatusCode.UNAVAILABLE), ("after", grpc.StatusCode.INTERNAL)]
    conv = served.tool_loop_kept(deadline=float("inf"))
    assert conv.turns_done == 3 and conv.pending is None and not conv.lost
    assert server.histories[conv.id] == conv.expected and len(conv.expected) == 2 + 1 + 2 + 2  # never twice
    turns = [a.record for a in served.attempts if a.record.kind == "turn"]
    assert [r.error for r in turns] == ["grpc:UNAVAILABLE", "grpc:INTERNAL", None, None, None]
    assert turns[2].token_ids is None and turns[3].token_ids == [7, 8]  # a replay is checked by its text
    served.settle(conv, bound_s=1.0)
    assert conv.probe == "ok" and not conv.lost and conv.id not in server.histories  # probed, checked, deleted
    assert [a.phase for a in served.attempts][-3:] == [SETTLE] * 3


def test_a_turn_left_failed_is_retried_with_its_key_before_the_probe(served):
    served.policy.window_s = 0.01
    # stored, the client told an error; then every retry fails until the loop gives up
    served.stub.fail = [("after", grpc.StatusCode.UNAVAILABLE)] + [("before", grpc.StatusCode.UNAVAILABLE)] * 100
    conv = served.tool_loop_kept(deadline=float("inf"))
    assert conv.turns_done == 0 and conv.pending is not None and not conv.lost
    served.stub.fail = []
    served.settle(conv, bound_s=1.0)
    assert conv.probe == "ok" and not conv.lost
    assert [m["role"] for m in conv.expected] == ["system", "user", "assistant", "user", "assistant"]


def test_settling_finds_a_stuck_and_a_lost_conversation(served):
    stuck = served.tool_loop_kept(deadline=float("inf"))
    lost = served.tool_loop_kept(deadline=float("inf"))
    served.stub.histories[lost.id].pop(2)  # a stored reply vanished
    served.settle(lost, bound_s=1.0)
    assert lost.lost and "expected" in lost.detail
    served.stub.busy = True
    served.settle(stuck, bound_s=0.05)
    assert stuck.probe == "stuck" and not stuck.lost


def _attempt(phase, latency, kind="turn", error=None, at=0.0, retry=0, request=None):
    record = Record(kind, [USER], True, latency_s=latency, error=error, error_detail=error or "")
    return Attempt(record, phase, at, at + latency, retry, request or f"r{at}-{phase}-{latency}-{kind}")


def _clean_run() -> dict:
    solo = [_attempt(SOLO, 1.0 + i / 100, at=i) for i in range(100)]
    soak = [_attempt(SOAK, 1.2 + i / 100, at=200 + i * 3) for i in range(100)]
    return {"attempts": solo + soak, "conversations": [ConversationLog("c1", [SYS, USER, REPLY], 1, probe="ok")],
            "abuse": [AbuseOutcome("flood", "flood_one", "http:429", 210, 211),
                      AbuseOutcome("cross_tenant", "read_other_tenant", "grpc:NOT_FOUND", 212, 213)],
            "abuser_probes": ["ok"], "faults": [FaultEvent("ingress", 300, injected_at_s=300, recovered_at_s=310)],
            "greedy": dict(CLEAN_GREEDY), "horizon_s": 600}


def _report(run: dict) -> dict:
    return summarize_soak(SoakConfig(), **run)


def test_a_clean_run_passes_and_reads_well():
    report = _report(_clean_run())
    assert report["verdict"]["pass"], report["verdict"]
    b = report["tenant_b"]
    assert b["latency_s"]["solo"]["n"] == 100 and b["latency_s"]["soak_all"]["n"] == 100
    assert b["latency_s"]["soak_quiet"]["n"] < 100  # the requests during the ingress' fault are left out
    assert 1.0 < b["p99_ratio"] < 2.0 and report["faults"][0]["recovery_s"] == 10
    text = format_summary(report)
    assert "verdict: PASS" in text and "ingress" in text


def test_a_fault_explains_what_its_clients_are_told_during_its_window_and_nothing_else():
    run = _clean_run()
    during = 305  # inside [300, 310 + the claim bound]
    after = 310 + claim_bound_s() + 20
    run["attempts"] += [_attempt(SOAK, 0.1, error="grpc:UNAVAILABLE", at=during, request="x"),
                        _attempt(SOAK, 1.0, at=during + 1, retry=1, request="x"),
                        _attempt(SOAK, 0.1, error="http:409", at=during + 20, request="y"),
                        _attempt(SOAK, 1.0, at=during + 21, retry=1, request="y")]
    report = _report(run)
    b = report["tenant_b"]
    assert b["errors_explained"] == {"grpc:UNAVAILABLE": 1, "http:409": 1} and b["errors_unexplained"] == {}
    assert b["retried_requests"] == 2 and b["failed_after_retries"] == 0 and report["verdict"]["pass"]

    internal = _clean_run()  # the proxy's answer for a request whose ingress died under it
    internal["attempts"] += [_attempt(SOAK, 0.1, error="grpc:INTERNAL", at=during, request="x"),
                             _attempt(SOAK, 1.0, at=during + 1, retry=1, request="x")]
    assert _report(internal)["tenant_b"]["errors_explained"] == {"grpc:INTERNAL": 1}

    for error, at, fault in (("http:503", after, "ingress"), ("http:429", during, "ingress"),
                             ("grpc:INTERNAL", during, "target_worker")):
        bad = _clean_run()
        bad["faults"][0].kind = fault
        bad["attempts"].append(_attempt(SOAK, 0.1, error=error, at=at, request="z"))
        bad["attempts"].append(_attempt(SOAK, 1.0, at=at + 1, retry=1, request="z"))
        report = _report(bad)
        assert report["tenant_b"]["errors_unexplained"] == {error: 1}, error
        assert not report["verdict"]["checks"]["b_unexplained_errors"]["ok"] and not report["verdict"]["pass"]


@pytest.mark.parametrize("spoil, check", [
    (lambda r: r["conversations"].append(
        ConversationLog("c2", [], lost=True, detail="stored 2, expected 3", probe="ok")),
     "lost_conversations"),
    (lambda r: r["conversations"].append(ConversationLog("c3", [], probe="stuck")), "stuck_conversations"),
    (lambda r: r["abuser_probes"].append("stuck"), "stuck_conversations"),
    (lambda r: r["conversations"].append(ConversationLog("c4", [], probe="failed:grpc:UNAVAILABLE")),
     "stuck_conversations"),
    (lambda r: r["conversations"].append(ConversationLog("c5", [])), "stuck_conversations"),  # never probed
    (lambda r: r["greedy"].update(mismatches=1), "mismatched_t0_replies"),
    (lambda r: r["abuse"].append(AbuseOutcome("cross_tenant", "delete_other_tenant", "ok", 220, 221)),
     "cross_tenant_breaches"),
    (lambda r: r["faults"].append(FaultEvent("router", 400, injected_at_s=400, error="not recovered within 300 s")),
     "faults_unrecovered"),
    (lambda r: r["attempts"].extend(_attempt(SOAK, 9.0, at=500 + i) for i in range(5)), "b_p99_ratio_quiet"),
    (lambda r: r["attempts"].append(_attempt(SOAK, 0.1, error="http:503", at=305, request="gave-up")),
     "b_failed_after_retries"),
])
def test_each_failure_fails_its_check_and_the_verdict(spoil, check):
    run = _clean_run()
    spoil(run)
    report = _report(run)
    failed = [name for name, c in report["verdict"]["checks"].items() if not c["ok"]]
    assert failed == [check] and not report["verdict"]["pass"]


def test_errors_while_settling_are_judged_by_the_probe_not_one_by_one():
    run = _clean_run()
    run["attempts"].append(_attempt(SETTLE, 0.1, error="grpc:ABORTED", at=590, request="p"))
    run["attempts"].append(_attempt(SETTLE, 0.1, kind="probe", at=592, retry=1, request="p"))
    report = _report(run)
    assert report["tenant_b"]["errors_while_settling"] == {"grpc:ABORTED": 1} and report["verdict"]["pass"]


def test_the_abusers_answers_are_counted_by_kind_and_judged():
    outcomes = [AbuseOutcome("oversized", "message_over_limit", "http:413", 1, 2),
                AbuseOutcome("oversized", "grpc_prompt_over_limit", "grpc:INVALID_ARGUMENT", 1, 2),
                AbuseOutcome("garbage", "not_json", "http:500", 1, 2),  # unexpected, no fault
                AbuseOutcome("flood", "flood_one", "grpc:UNAVAILABLE", 50, 51),  # during a fault
                AbuseOutcome("cross_tenant", "read_other_tenant", "ok", 1, 2)]  # a breach
    summary = summarize_abuse(outcomes, lambda s, e: overlaps(s, e, [(45, 60)]))
    assert summary["by_action"]["oversized"] == {"http:413": 1, "grpc:INVALID_ARGUMENT": 1}
    assert summary["unexpected"] == {"garbage/not_json/http:500": 1}
    assert summary["cross_tenant_breaches"] == 1 and summary["requests"] == 5


def test_the_cli_refuses_an_unknown_fault_before_starting_anything():
    from dlite_ray.cli import main

    with pytest.raises(ValueError, match="fault kinds"):
        main(["soak", "--faults", "draft,meteor", "--out", "/nonexistent"])

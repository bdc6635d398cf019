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

import json
import logging
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dlite_ray.bench.loadtest import check_greedy_replies, local_app
from dlite_ray.bench.loadtest_client import LoadTestConfig, wait_until_ready
from dlite_ray.bench.machine import machine_info
from dlite_ray.bench.soak_abuser import AbuseConfig, AbuseOutcome, Abuser
from dlite_ray.bench.soak_client import (
    LATENCY_KINDS,
    PROBE,
    SETTLE,
    SOAK,
    SOLO,
    Attempt,
    ConversationLog,
    RetryPolicy,
    SoakClient,
    probe_outcome,
)
from dlite_ray.bench.soak_faults import FAULT_KINDS, FaultEvent, FaultInjector, RayFaults, plan_faults
from dlite_ray.bench.soak_report import format_summary, stuck_bound, summarize_soak

log = logging.getLogger(__name__)


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
    every_fault: bool = False  # the soak goes on past duration_s until every planned fault has run


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
    while True:
        _run_threads([lambda c=c, d=deadline: c.run_phase(SOAK, d) for c in clients]
                     + [lambda a=a, d=deadline: a.run_until(d, out.abuse) for a in abusers], out.thread_errors)
        if not (cfg.every_fault and injector.running):
            break
        # slow recoveries (a loaded machine) pushed faults past the end: the load goes on under them
        deadline = time.monotonic() + EVERY_FAULT_EXTENSION_S
        log.info("soak: extended by %.0f s, faults of the plan still to run", EVERY_FAULT_EXTENSION_S)
    injector.stop()  # no new fault; the last one recovered (or timed out)
    out.faults = injector.events

    bound = stuck_bound(cfg)
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


# `dlite-ray soak --quick`: every fault kind once (a fault every 30 s of a 120 s soak, longer
# where recoveries are slow) and one abuser; what make test runs so that the soak cannot rot
# unnoticed.
QUICK = {"solo_s": 20.0, "duration_s": 120.0, "fault_period_s": 30.0, "faults": ",".join(FAULT_KINDS), "clients": 2,
         "abusers": 1, "flood_width": 8, "max_p99_ratio": math.inf, "every_fault": True}
EVERY_FAULT_EXTENSION_S = 15.0


def quick_args(args) -> None:
    """Turn the CLI's arguments into the quick soak's."""
    for name, value in QUICK.items():
        setattr(args, name, value)


def run(args) -> dict:
    """The CLI: start the app, run the soak, check T = 0 replies, print and write the report."""
    from dlite_ray.engine.engine import DLiteEngine
    from dlite_ray.serve.config import EngineArgs, LimitArgs
    from dlite_ray.serve.engine_factory import engine_config

    cfg = SoakConfig(solo_s=args.solo_s, duration_s=args.duration_s, fault_period_s=args.fault_period_s,
                     faults=tuple(k for k in args.faults.split(",") if k), clients=args.clients,
                     abusers=args.abusers, flood_width=args.flood_width, abuse_max_tokens=args.abuse_max_tokens,
                     max_tokens=args.max_tokens, turns=args.turns, one_shot_fraction=args.one_shot_fraction,
                     sampled_fraction=args.sampled_fraction, tenant_limit=args.tenant_limit,
                     retry_window_s=args.retry_window_s, request_timeout_s=args.request_timeout_s,
                     max_p99_ratio=args.max_p99_ratio, seed=args.seed, every_fault=args.every_fault)
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
    engine = DLiteEngine.from_config(engine_config(engine_args))  # the reference, once the app's CPUs are free
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

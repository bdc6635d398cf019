"""The soak's report from what the run logged (no Ray, no clock): B's latency solo and under
the soak, errors explained by a fault or not, lost and stuck conversations, A's answers,
the faults, and the verdict."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import asdict

from dlite_ray.bench.soak_abuser import AbuseOutcome, summarize_abuse
from dlite_ray.bench.soak_client import (
    DISRUPTION_AFTER_S,
    FAULT_ERRORS,
    INGRESS_FAULT_ERRORS,
    LATENCY_KINDS,
    SETTLE,
    SOAK,
    SOLO,
    Attempt,
    ConversationLog,
    claim_bound_s,
)
from dlite_ray.bench.soak_faults import FaultEvent, fault_windows, overlaps
from dlite_ray.bench.stats import percentile


def latency_figures(values: list[float]) -> dict:
    values = sorted(values)
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": values[-1] if values else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize_soak(cfg, attempts: list[Attempt], conversations: list[ConversationLog],
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
    explained: Counter[str] = Counter()
    unexplained: Counter[str] = Counter()
    settling: Counter[str] = Counter()
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
    tenant_a = summarize_abuse(abuse, lambda s, e: overlaps(s, e, explaining))
    tenant_a["conversations_probed"] = len(abuser_probes)
    tenant_a["probes"] = dict(Counter(abuser_probes))
    tenant_a["stuck_conversations"] = sum(_stuck(p) for p in abuser_probes)
    report = {"config": asdict(cfg) | {"stuck_bound_s": stuck_bound(cfg)}, "tenant_b": b, "tenant_a": tenant_a,
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
        # an infinite bound (the quick soak): no latency verdict
        "b_p99_ratio_quiet": (ratio, f"<= {max_p99_ratio}",
                              math.isinf(max_p99_ratio) or (ratio is not None and ratio <= max_p99_ratio)),
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


def stuck_bound(cfg) -> float:
    """How long a conversation's last turn may take to go through before it counts as stuck."""
    return cfg.stuck_bound_s if cfg.stuck_bound_s is not None else claim_bound_s() + 15.0


def format_summary(report: dict) -> str:
    cfg, b, a, greedy = report["config"], report["tenant_b"], report["tenant_a"], report["greedy"]

    def fmt(v):
        return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

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

"""The soak's faults: a schedule that cycles through the kinds of failure a deployment
meets (the draft actor dies, the TargetWorker replica dies, the ingress replica dies, the
ConversationRouter restarts), and an injector that runs it against a live app.

One fault at a time: the injector waits until the app has recovered from one (a new
replica answers, the draft is connected again) before it injects the next, so each
window of disruption is measured on its own. Every fault is logged with its wall time.
The schedule and the injector's order are plain Python; `RayFaults` is the part that
touches Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from dlite_ray.serve.worker_messages import WorkerStats

log = logging.getLogger(__name__)

FAULT_KINDS = ("draft", "target_worker", "ingress", "router")
DEPLOYMENTS = {"target_worker": "TargetWorker", "ingress": "DLiteIngress", "router": "ConversationRouter"}
RECOVERY_TIMEOUT_S = 300.0  # a TargetWorker reloads its model and reconnects its draft on restart
RECOVERY_POLL_S = 1.0


@dataclass(frozen=True, slots=True)
class PlannedFault:
    at_s: float  # seconds after the soak phase starts
    kind: str


def plan_faults(duration_s: float, period_s: float, kinds: tuple[str, ...] = FAULT_KINDS,
                first_at_s: float | None = None) -> list[PlannedFault]:
    """One fault every `period_s` (the first at `first_at_s`, default half a period, so the
    soak starts quiet), cycling through `kinds`, none at or after `duration_s`."""
    if period_s <= 0:
        raise ValueError(f"the fault period must be > 0, got {period_s}")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if not kinds or unknown:
        raise ValueError(f"fault kinds must be a non-empty list of {', '.join(FAULT_KINDS)}; got {list(kinds)}")
    at = period_s / 2 if first_at_s is None else first_at_s
    plan: list[PlannedFault] = []
    while at < duration_s:
        plan.append(PlannedFault(at, kinds[len(plan) % len(kinds)]))
        at += period_s
    return plan


@dataclass(slots=True)
class FaultEvent:
    """One injected fault. Times are seconds since the soak's origin (its solo phase start)."""

    kind: str
    planned_at_s: float
    injected_at_s: float | None = None
    recovered_at_s: float | None = None  # None: not recovered within the injector's timeout
    wall_time: str = ""  # ISO 8601 (UTC) of the injection, for the note and the server logs
    target: str = ""  # what was killed
    error: str | None = None  # the injection itself failed, or recovery timed out

    @property
    def recovery_s(self) -> float | None:
        if self.injected_at_s is None or self.recovered_at_s is None:
            return None
        return self.recovered_at_s - self.injected_at_s


def fault_windows(events: list[FaultEvent], after_s: float, horizon_s: float) -> list[tuple[float, float]]:
    """[injected, recovered + after_s] of every injected fault; a fault never seen to
    recover reaches `horizon_s` (the end of the run)."""
    return [(e.injected_at_s, (e.recovered_at_s if e.recovered_at_s is not None else horizon_s) + after_s)
            for e in events if e.injected_at_s is not None]


def overlaps(started_s: float, ended_s: float, windows: list[tuple[float, float]]) -> bool:
    """Whether [started_s, ended_s] meets any window."""
    return any(started_s <= end and ended_s >= start for start, end in windows)


class FaultActions(Protocol):
    def inject(self, kind: str) -> str:
        """Cause the fault; a description of what was hit."""

    def recovered(self, kind: str, target: str) -> bool:
        """One look: has the app recovered from `kind` injected on `target`?"""


class FaultInjector:
    """Runs a plan on its own thread: each fault at its time (or once the previous one has
    recovered, if later), then polls for recovery. `stop()` schedules nothing more and
    waits for the fault in progress to recover."""

    def __init__(self, plan: list[PlannedFault], actions: FaultActions, origin: float, phase_start_s: float,
                 recovery_timeout_s: float = RECOVERY_TIMEOUT_S, poll_s: float = RECOVERY_POLL_S,
                 clock: Callable[[], float] = time.monotonic):
        """origin: the clock reading that times count from; phase_start_s: when (since
        origin) the plan's zero is."""
        self.plan, self.actions = plan, actions
        self.origin, self.phase_start_s = origin, phase_start_s
        self.recovery_timeout_s, self.poll_s = recovery_timeout_s, poll_s
        self.clock = clock
        self.events: list[FaultEvent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def now_s(self) -> float:
        return self.clock() - self.origin

    @property
    def running(self) -> bool:
        """Whether faults of the plan are still to inject or to recover."""
        return self._thread.is_alive()

    def run(self) -> None:
        for planned in self.plan:
            delay = self.phase_start_s + planned.at_s - self.now_s()
            if self._stop.wait(max(0.0, delay)):
                return
            self.events.append(self._inject(planned))

    def _inject(self, planned: PlannedFault) -> FaultEvent:
        event = FaultEvent(planned.kind, self.phase_start_s + planned.at_s)
        event.wall_time = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        event.injected_at_s = self.now_s()
        try:
            event.target = self.actions.inject(planned.kind)
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is reported, not fatal
            event.error = f"inject failed: {type(exc).__name__}: {exc}"[:300]
            log.warning("fault %s at %s: %s", planned.kind, event.wall_time, event.error)
            return event
        log.info("fault %s injected at %s (t=%.1f s): %s", planned.kind, event.wall_time, event.injected_at_s,
                 event.target)
        give_up = self.clock() + self.recovery_timeout_s
        while self.clock() < give_up:
            try:
                if self.actions.recovered(planned.kind, event.target):
                    event.recovered_at_s = self.now_s()
                    log.info("fault %s recovered after %.1f s", planned.kind, event.recovery_s)
                    return event
            except Exception as exc:  # noqa: BLE001 - the app is still coming back
                log.debug("recovery check of %s: %s", planned.kind, exc)
            time.sleep(self.poll_s)
        event.error = f"not recovered within {self.recovery_timeout_s:.0f} s"
        log.warning("fault %s: %s", planned.kind, event.error)
        return event


class RayFaults:
    """FaultActions against a Serve app in this process's Ray cluster."""

    def __init__(self, app_name: str, http_url: str, draft: bool, probe_timeout_s: float = 10.0):
        from ray import serve

        self.app, self.http_url, self.draft = app_name, http_url, draft
        self.worker = serve.get_deployment_handle("TargetWorker", app_name=app_name)
        self.router = serve.get_deployment_handle("ConversationRouter", app_name=app_name)
        self.timeout_s = probe_timeout_s
        self._draft_restarts = 0

    def replicas(self, deployment: str) -> list[str]:
        """Actor names of the deployment's live replicas."""
        import ray

        prefix = f"SERVE_REPLICA::{self.app}#{deployment}#"
        return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["name"].startswith(prefix))

    def inject(self, kind: str) -> str:
        import ray

        if kind == "draft":
            stats = self._worker_stats()
            self._draft_restarts = stats.draft_restarts
            if not self.worker.kill_draft.remote().result(timeout_s=self.timeout_s):
                raise RuntimeError("the TargetWorker has no draft actor to kill")
            return f"draft of TargetWorker {stats.replica} (restarts so far: {self._draft_restarts})"
        names = self.replicas(DEPLOYMENTS[kind])
        if not names:
            raise RuntimeError(f"no live {DEPLOYMENTS[kind]} replica")
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)  # Serve starts another
        return names[0]

    def recovered(self, kind: str, target: str) -> bool:
        if kind == "draft":
            stats = self._worker_stats()
            return stats.draft_connected and stats.draft_restarts > self._draft_restarts
        if not [n for n in self.replicas(DEPLOYMENTS[kind]) if n != target]:
            return False
        if kind == "target_worker":
            stats = self._worker_stats()
            return not self.draft or stats.draft_connected
        if kind == "ingress":
            import requests

            return requests.get(f"{self.http_url}/healthz", timeout=self.timeout_s).status_code == 200
        return self._router_answers()

    def _worker_stats(self) -> WorkerStats:
        return self.worker.stats.remote().result(timeout_s=self.timeout_s)

    def _router_answers(self) -> bool:
        from dlite_ray.serve.errors import ConversationNotFound

        try:
            self.router.get.remote("soak-probe", "no-such-conversation").result(timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - NotFound is the answer of a live router
            return isinstance(exc, ConversationNotFound) or isinstance(getattr(exc, "cause", None),
                                                                       ConversationNotFound)
        return True

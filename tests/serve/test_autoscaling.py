"""Serve autoscaling on TargetWorker, watched on the real application (min 1, max 2
replicas, short delays, logical resources, the tiny model): load raises the replica count
to 2; a new conversation can land on the new replica while a paused one keeps its KV
where it is; when the load ends the count falls back to 1, and a conversation whose
replica went away takes its next turn on the one left, re-prefilled from its history,
with the reply an uninterrupted run gives (T = 0); every stored history equals what its
client saw. The replica count over time is logged (the timeline)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import requests

from tests.serve.conftest import AUTH_A, HTTP_PORT, KEYS

log = logging.getLogger(__name__)

APP, PREFIX = "dlite-autoscale", "/autoscale"
BASE = f"http://127.0.0.1:{HTTP_PORT}{PREFIX}"
AUTH_B = {"authorization": f"Bearer {KEYS['tenant-b']}"}  # the load's tenant: its own in-flight cap
TOOL = {"role": "tool", "content": '{"status": "ok", "result": 42}'}
NEW = 12  # tokens per conversation turn
LOAD_CLIENTS = 4  # at most 4 more running on one replica than on the other: both stay "fair" for new prefixes
LOAD_TOKENS = 48
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2,
               # one request in flight per replica is the target: the load's 4 ask for 4 replicas (capped
               # at 2), a lone conversation turn for 1
               "target_ongoing_requests": 1,
               "metrics_interval_s": 0.5, "look_back_period_s": 2,
               "upscale_delay_s": 1, "downscale_delay_s": 3}
DEADLINE_S = 180  # for Serve to start or stop a replica on a loaded 2-core machine (a failure bound only)


@dataclass
class Timeline:
    """TargetWorker's replica states, sampled from the Serve controller, with the test's events."""

    t0: float = field(default_factory=time.monotonic)
    rows: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    events: list[tuple[float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample_forever(self, period_s: float = 0.25) -> None:
        from ray import serve

        while not self.stop.is_set():
            app = serve.status().applications.get(APP)
            if app is not None and "TargetWorker" in app.deployments:
                states = {str(k): v for k, v in app.deployments["TargetWorker"].replica_states.items() if v}
                if not self.rows or self.rows[-1][1] != states:
                    self.rows.append((self.now(), states))
            self.stop.wait(period_s)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, what: str) -> None:
        self.events.append((self.now(), what))
        log.info("t=%6.1fs  %s", self.now(), what)

    def first_time(self, running: int) -> float | None:
        return next((t for t, s in self.rows if s.get("RUNNING", 0) == running), None)

    def text(self) -> str:
        lines = [f"t={t:6.1f}s  replicas {s}" for t, s in self.rows] + [f"t={t:6.1f}s  -- {e}" for t, e in self.events]
        return "\n".join(sorted(lines, key=lambda line: float(line[2:8])))


class Load:
    """LOAD_CLIENTS clients sending chat completions back to back until stopped; every reply
    must be a 200 with exactly LOAD_TOKENS tokens."""

    def __init__(self):
        self.stop = threading.Event()
        self.done = [0] * LOAD_CLIENTS
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(LOAD_CLIENTS)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=300)

    def _client(self, i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Client {i}: count from one to a hundred."}],
                "max_tokens": LOAD_TOKENS, "ignore_eos": True}
        while not self.stop.is_set():
            try:
                r = requests.post(f"{BASE}/v1/chat/completions", json=body, headers=AUTH_B, timeout=120)
            except requests.RequestException as exc:
                self.failures.append(repr(exc))
                continue
            if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != LOAD_TOKENS:
                self.failures.append(f"{r.status_code} {r.text[:200]}")
            else:
                self.done[i] += 1


@dataclass
class Conv:
    """One conversation as its client saw it: the history and the replica of each reply."""

    id: str
    history: list[dict]
    replicas: list[str] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # cached_prompt_tokens of each turn


@pytest.fixture(scope="module")
def autoscaling_args(ray_serve, tiny_serving_model, tmp_path_factory):
    from ray import serve

    from dlite_ray.serve.config import AppArgs, EngineArgs

    target_dir, draft_dir = tiny_serving_model
    root = tmp_path_factory.mktemp("autoscaling")
    (root / "keys").write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    yield AppArgs(engine=EngineArgs(target=str(target_dir), draft=str(draft_dir), disaggregated_draft=False,
                                    dtype="float32", max_kv_tokens=8192),
                  autoscaling=AUTOSCALING, routing_stats_period_s=0.5, api_keys_file=str(root / "keys"),
                  conversations={"store_path": str(root / "conv.sqlite3")})
    serve.delete(APP)


@pytest.fixture(scope="module")
def library(tiny_serving_model):
    from dlite_ray.engine.engine import DLiteEngine

    target_dir, draft_dir = tiny_serving_model
    return DLiteEngine.from_pretrained(target_dir, draft_dir, dtype="float32")


def _replica_ids() -> set[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#TargetWorker#"
    return {a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)}


def _wait_for_replicas(n: int, timeline: Timeline, what: str) -> set[str]:
    """Poll the controller until exactly `n` TargetWorker replicas exist, all RUNNING (none
    starting or stopping), and their actors are the only ones left; their ids."""
    from ray import serve

    deadline = time.monotonic() + DEADLINE_S
    while True:
        states = {k: v for k, v in serve.status().applications[APP].deployments["TargetWorker"].replica_states.items()
                  if v}
        if states == {"RUNNING": n} and len(ids := _replica_ids()) == n:
            timeline.event(f"{what}: {n} replica(s) running")
            return ids
        assert time.monotonic() < deadline, f"{what}: never {n} replicas; timeline:\n{timeline.text()}"
        time.sleep(0.25)


def _wait_for_route(timeout: float = 60) -> None:
    """The HTTP proxy learns a new application's route a moment after it is ready."""
    deadline = time.monotonic() + timeout
    while requests.get(f"{BASE}/healthz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "the proxy never routed the application"
        time.sleep(0.25)


def _create(first: str) -> Conv:
    messages = [{"role": "user", "content": first}]
    r = requests.post(f"{BASE}/v1/conversations", json={"messages": messages}, headers=AUTH_A, timeout=60)
    assert r.status_code == 200, r.text
    return Conv(r.json()["id"], messages)


def _turn(conv: Conv, new: list[dict]) -> dict:
    r = requests.post(f"{BASE}/v1/conversations/{conv.id}/messages", json={"messages": new, "max_tokens": NEW},
                      headers=AUTH_A, timeout=120)
    assert r.status_code == 200, r.text
    reply = r.json()
    conv.history += new + [reply["message"]]
    conv.replicas.append(reply["replica"])
    conv.cached.append(reply["stats"]["cached_prompt_tokens"])
    return reply


def _turn_noting_holder(conv: Conv) -> str | None:
    """A turn with a tool result; the holder the registry named just before it."""
    holder = requests.get(f"{BASE}/v1/conversations/{conv.id}", headers=AUTH_A, timeout=30).json()["replica"]
    _turn(conv, [TOOL])
    return holder


def _check_reply(library, conv: Conv) -> None:
    """The last reply is what the library answers to the history before it (T = 0)."""
    expected = library.generate(conv.history[:-1], max_new_tokens=NEW)[0].text
    assert conv.history[-1]["content"] == expected, conv.id


def test_load_scales_target_workers_up_and_back_down_and_no_conversation_is_lost(autoscaling_args, library):
    timeline = Timeline()
    sampler = threading.Thread(target=timeline.sample_forever, daemon=True)
    sampler.start()
    try:
        _scenario(autoscaling_args, library, timeline)
    finally:
        timeline.stop.set()
        sampler.join(timeout=10)
        log.info("TargetWorker replicas over time (autoscaling %s):\n%s", AUTOSCALING, timeline.text())


def _scenario(args, library, timeline: Timeline) -> None:
    from ray import serve

    from dlite_ray.serve.app import build_app

    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    _wait_for_route()
    (first_replica,) = _wait_for_replicas(1, timeline, "deployed")

    # Before any load: two agent conversations take their first turn on the only replica and
    # pause there (a tool runs), their KV pinned.
    paused = [_create(f"Agent {i}: plan the steps to rename a function across a repository.") for i in range(2)]
    for conv in paused:
        _turn(conv, [])
        assert conv.replicas[-1] == first_replica
        _check_reply(library, conv)
    assert timeline.first_time(2) is None  # one conversation at a time does not scale

    with Load() as load:
        timeline.event(f"load starts: {LOAD_CLIENTS} clients")
        replicas = _wait_for_replicas(2, timeline, "load")
        (new_replica,) = replicas - {first_replica}

        # New conversations go where their prefix hashes among replicas that are not far busier
        # than the least busy: the new replica takes its share. Open them until it holds two.
        placed: list[Conv] = []
        for i in range(16):
            conv = _create(f"Task {i}: list three prime numbers above {10 * i}.")
            _turn(conv, [])
            _check_reply(library, conv)
            placed.append(conv)
            if sum(c.replicas[-1] == new_replica for c in placed) == 2:
                break
        on_new = [c for c in placed if c.replicas[-1] == new_replica]
        assert len(on_new) == 2, [c.replicas for c in placed]
        timeline.event(f"{len(placed)} new conversations placed, {len(on_new)} on the new replica")

        # The paused conversations' tools return: each next turn goes back to its KV, on the
        # first replica or the new one.
        for conv in paused + on_new:
            where = conv.replicas[-1]
            _turn(conv, [TOOL])
            assert conv.replicas[-1] == where
            assert conv.cached[-1] > 0  # its history's KV was still there
            _check_reply(library, conv)
        assert _held(first_replica) >= len(paused) and _held(new_replica) >= len(on_new)
        timeline.event("paused conversations resumed on their replica")
    timeline.event(f"load ends: {sum(load.done)} requests served")
    assert not load.failures, load.failures[:3]
    assert all(load.done), load.done

    (left,) = _wait_for_replicas(1, timeline, "idle")
    gone = ({first_replica, new_replica} - {left}).pop()
    conversations = paused + placed
    moved = [c for c in conversations if c.replicas[-1] == gone]
    stayed = [c for c in conversations if c.replicas[-1] != gone]
    assert moved and stayed  # both replicas held paused conversations
    # Every conversation takes one more turn on the replica left. Those whose replica went away
    # go first, at once: sent before the ConversationRouter's sweep (every 5 s) has seen the
    # replica gone (most runs; the log says), their registry still names it as the holder
    # (route_to), and the affinity router must pass them to the replica left. They re-prefill
    # their history there (nothing of it can be cached: no request that replica served began
    # with their first message) and answer as an uninterrupted run would.
    with ThreadPoolExecutor(len(moved)) as pool:
        holders = list(pool.map(_turn_noting_holder, moved))
    timeline.event(f"{len(moved)} conversations of the replica scaled away took their next turn; the "
                   f"registry named the gone replica as holder for {holders.count(gone)}, none for "
                   f"{holders.count(None)}")
    for conv in moved:
        assert conv.replicas[-1] == left
        _check_reply(library, conv)
        assert conv.cached[-1] < len(library.encode(conv.history[:1])), conv.cached
    for conv in stayed:
        _turn(conv, [TOOL])
        assert conv.replicas[-1] == left
        assert conv.cached[-1] > 0
        _check_reply(library, conv)
    timeline.event("every conversation took its next turn on the replica left")
    names = {first_replica: "first", new_replica: "new"}
    for conv in conversations:
        log.info("conversation %s: replicas %s, cached prompt tokens %s", conv.id[:6],
                 [names[r] for r in conv.replicas], conv.cached)

    # Nothing stuck or lost: each stored history is what its client saw, paused on the replica
    # that gave its last reply.
    for conv in conversations:
        stored = requests.get(f"{BASE}/v1/conversations/{conv.id}", headers=AUTH_A, timeout=30).json()
        assert stored["messages"] == conv.history
        assert stored["state"] == "paused" and stored["replica"] == left
    assert _held(left) >= len(conversations)


def _held(replica: str) -> int:
    from ray import serve

    worker = serve.get_deployment_handle("TargetWorker", app_name=APP)
    return worker.stats.remote(route_to=replica).result().held_leases

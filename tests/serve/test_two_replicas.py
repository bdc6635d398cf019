"""Two TargetWorker replicas behind the ConversationAffinityRouter: every turn of a tool
loop lands where its KV is pinned and reuses it; an expired lease frees the KV and the
next turn re-prefills exactly; killing the holding replica or the ConversationRouter
loses no history and the next turn answers as an uninterrupted run would (T = 0)."""

from __future__ import annotations

import time

import pytest
import requests

from tests.serve.conftest import AUTH_A, HTTP_PORT, KEYS

APP, PREFIX = "dlite-two", "/two"
URL = f"http://127.0.0.1:{HTTP_PORT}{PREFIX}/v1/conversations"
TOOL = {"role": "tool", "content": '{"status": "ok", "result": 42}'}
NEW = 12


@pytest.fixture(scope="module")
def two_replicas_args(serve_app, tiny_serving_model, tmp_path_factory):
    from ray import serve

    from dlite_ray.serve.config import AppArgs, EngineArgs

    target_dir, draft_dir = tiny_serving_model
    root = tmp_path_factory.mktemp("two-replicas")
    (root / "keys").write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    yield AppArgs(engine=EngineArgs(target=str(target_dir), draft=str(draft_dir), disaggregated_draft=False,
                                    dtype="float32", max_kv_tokens=8192),
                  num_replicas=2, routing_stats_period_s=0.5, api_keys_file=str(root / "keys"),
                  conversations={"store_path": str(root / "conv.sqlite3")})
    serve.delete(APP)


@pytest.fixture
def two_replicas(two_replicas_args):
    """The application with both replicas running, whatever a test before this one (in any
    order) killed or deleted: each test starts from the same state."""
    from ray import serve

    from dlite_ray.serve.app import build_app

    deadline = time.time() + 120
    while (app := serve.status().applications.get(APP)) is not None and app.status == "DELETING":
        assert time.time() < deadline, "the application was never deleted"
        time.sleep(0.5)
    if app is None:  # the drain test deletes it
        serve.run(build_app(two_replicas_args), name=APP, route_prefix=PREFIX)
        _wait_for_route()
    _replica_ids()
    return serve.get_deployment_handle("TargetWorker", app_name=APP)


def _wait_for_route(timeout: float = 60) -> None:
    """The HTTP proxy learns a new application's route a moment after it is ready."""
    deadline = time.time() + timeout
    while requests.get(f"http://127.0.0.1:{HTTP_PORT}{PREFIX}/healthz", timeout=10).status_code != 200:
        assert time.time() < deadline, "the proxy never routed the second application"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def library(tiny_serving_model):
    from dlite_ray.engine.engine import DLiteEngine

    target_dir, draft_dir = tiny_serving_model
    return DLiteEngine.from_pretrained(target_dir, draft_dir, dtype="float32")


def _create(first_message: str) -> tuple[str, list[dict]]:
    messages = [{"role": "user", "content": first_message}]
    r = requests.post(URL, json={"messages": messages}, headers=AUTH_A, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"], messages


def _turn(conv: str, new: list[dict], **extra) -> dict:
    r = requests.post(f"{URL}/{conv}/messages", json={"messages": new, "max_tokens": NEW, **extra},
                      headers=AUTH_A, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _expected(library, history: list[dict]) -> str:
    return library.generate(history, max_new_tokens=NEW)[0].text


def _held_by(worker, replica: str) -> int:
    return worker.stats.remote(route_to=replica).result().held_leases


def test_a_tool_loop_stays_on_its_replica_and_reuses_its_kv(two_replicas, library):
    looped = set()  # replicas that ran a tool loop
    # A new conversation goes where a rendezvous hash of its prefix and the replicas' ids
    # (new each run) points: either replica, so open conversations until both have one.
    for i in range(16):
        conv, history = _create(f"Task {i}: list three prime numbers above {10 * i}.")
        first = _turn(conv, [])
        if first["replica"] in looped:
            continue
        looped.add(first["replica"])
        history.append(first["message"])
        for new in ([TOOL], [{"role": "user", "content": "And one more?"}]):
            reply = _turn(conv, new)
            history += new
            assert reply["replica"] == first["replica"]
            assert reply["stats"]["cached_prompt_tokens"] > 0  # the history's KV was still there
            assert reply["message"]["content"] == _expected(library, history)
            history.append(reply["message"])
        if len(looped) == 2:
            break
    assert len(looped) == 2


def test_lease_expiry_unpins_and_the_next_turn_reprefills_exactly(two_replicas, library):
    conv, history = _create("Name a colour.")
    first = _turn(conv, [], lease_seconds=1)
    history.append(first["message"])
    held_before = _held_by(two_replicas, first["replica"])
    deadline = time.time() + 30
    while requests.get(f"{URL}/{conv}", headers=AUTH_A, timeout=30).json()["state"] != "evicted":
        assert time.time() < deadline, "the lease never expired"
        time.sleep(0.5)
    while _held_by(two_replicas, first["replica"]) != held_before - 1:  # applied between engine steps
        assert time.time() < deadline, "the holding replica never released the conversation"
        time.sleep(0.5)
    reply = _turn(conv, [TOOL])
    assert reply["message"]["content"] == _expected(library, history + [TOOL])


def test_an_unservable_turn_is_refused_before_anything_is_appended(two_replicas):
    conv, _ = _create("Hello.")
    too_long = {"role": "user", "content": "word " * 2000}  # beyond the tiny model's 512 positions
    for _ in range(2):  # a client retrying does not pile up copies
        r = requests.post(f"{URL}/{conv}/messages", json={"messages": [too_long], "max_tokens": NEW},
                          headers=AUTH_A, timeout=120)
        assert r.status_code == 400, r.text
    stored = requests.get(f"{URL}/{conv}", headers=AUTH_A, timeout=30).json()
    assert [m["role"] for m in stored["messages"]] == ["user"] and stored["state"] != "generating"


def _retry_turn(conv: str, new: list[dict], attempts: int = 5) -> dict:
    """A turn right after a fault may meet the dying process once; the client retries."""
    for _ in range(attempts):
        r = requests.post(f"{URL}/{conv}/messages", json={"messages": new, "max_tokens": NEW},
                          headers=AUTH_A, timeout=120)
        if r.status_code == 200:
            return r.json()
        assert r.status_code in (500, 503), r.text
        new = []  # the appended messages were kept by the failed attempt: nothing to resend
        time.sleep(2)
    raise AssertionError("the turn never succeeded after the fault")


def test_killing_the_holding_replica_loses_nothing(two_replicas, library):
    import ray

    conv, history = _create("Explain what a tool call is, briefly.")
    first = _turn(conv, [])
    history.append(first["message"])
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#TargetWorker#{first['replica']}", namespace="serve"))
    deadline = time.time() + 30  # the router notices the replica is gone and evicts what it held
    while requests.get(f"{URL}/{conv}", headers=AUTH_A, timeout=30).json()["state"] != "evicted":
        assert time.time() < deadline, "the router never noticed the dead replica"
        time.sleep(0.5)
    reply = _retry_turn(conv, [TOOL])
    assert reply["replica"] != first["replica"]
    assert reply["message"]["content"] == _expected(library, history + [TOOL])
    stored = requests.get(f"{URL}/{conv}", headers=AUTH_A, timeout=30).json()
    assert [m["role"] for m in stored["messages"]] == ["user", "assistant", "tool", "assistant"]


def test_restarting_the_router_keeps_every_conversation(two_replicas, library):
    import ray

    conv, history = _create("Say something about rivers.")
    history.append(_turn(conv, [])["message"])
    router = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith(f"SERVE_REPLICA::{APP}#ConversationRouter#")]
    assert len(router) == 1
    ray.kill(ray.get_actor(router[0]["name"], namespace=router[0]["namespace"]))
    reply = _retry_turn(conv, [TOOL])
    assert reply["message"]["content"] == _expected(library, history + [TOOL])
    stored = requests.get(f"{URL}/{conv}", headers=AUTH_A, timeout=30).json()
    assert stored["version"] == 2 and len(stored["messages"]) == 4


def test_a_replica_killed_mid_stream_gives_a_clean_error_and_the_next_turn_recovers(two_replicas, library):
    import grpc
    import ray

    from dlite_ray.serve.proto import dlite_pb2, dlite_pb2_grpc
    from tests.serve.conftest import GRPC_PORT

    replicas = _replica_ids()  # both running: the fixture waited for them
    conv, history = _create("Write a long story about a lighthouse keeper.")
    metadata = (("application", APP), ("authorization", f"Bearer {KEYS['tenant-a']}"))
    with grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}") as channel:
        stub = dlite_pb2_grpc.DLiteServiceStub(channel)
        stream = stub.AppendAndGenerate(dlite_pb2.AppendRequest(conversation_id=conv, max_tokens=1000),
                                        metadata=metadata, timeout=120)
        next(stream)  # generating on some replica
        stats = [two_replicas.stats.remote(route_to=r).result() for r in replicas]
        busy = [s.replica for s in stats if s.running > 0]
        assert len(busy) == 1
        ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP}#TargetWorker#{busy[0]}", namespace="serve"))
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.value.details()
    stored = requests.get(f"{URL}/{conv}", headers=AUTH_A, timeout=30).json()
    assert stored["state"] == "evicted" and [m["role"] for m in stored["messages"]] == ["user"]
    reply = _retry_turn(conv, [])
    assert reply["replica"] != busy[0]
    assert reply["message"]["content"] == _expected(library, history)


def _replica_ids(timeout: float = 180) -> list[str]:
    """Both replicas' ids, once Serve has replaced any replica an earlier test killed."""
    import ray
    from ray import serve

    deadline = time.time() + timeout
    while serve.status().applications[APP].deployments["TargetWorker"].replica_states.get("RUNNING", 0) != 2:
        assert time.time() < deadline, "Serve never restored two replicas"
        time.sleep(1)
    prefix = f"SERVE_REPLICA::{APP}#TargetWorker#"
    return [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]


def test_shutdown_drains_requests_in_flight(two_replicas, library):
    """Deleting the application lets running streams finish (the next test deploys it again)."""
    import json
    import threading

    from ray import serve

    messages = [{"role": "user", "content": "Count slowly from one to fifty."}]
    body = {"messages": messages, "max_tokens": 200, "stream": True}
    with requests.post(f"http://127.0.0.1:{HTTP_PORT}{PREFIX}/v1/chat/completions", json=body, headers=AUTH_A,
                       stream=True, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        deleting = threading.Thread(target=serve.delete, args=(APP,))
        deleting.start()
        text = json.loads(first.decode()[len("data: "):])["choices"][0]["delta"].get("content", "")
        finish = None
        for line in lines:
            if not line or line == b"data: [DONE]":
                continue
            choice = json.loads(line.decode()[len("data: "):])["choices"][0]
            text += choice["delta"].get("content", "")
            finish = choice.get("finish_reason") or finish
        deleting.join(timeout=120)
    expected = library.generate(messages, max_new_tokens=200)[0]
    assert finish == expected.finish_reason and text == expected.text

"""`dlite-ray loadtest` with a fixed amount of work against the session's app (tiny model),
and its checks shown able to fail. It lives here, not in tests/bench, because it needs the one
Ray + Serve instance this folder's conftest starts per session."""

from __future__ import annotations

import json

import pytest

from dlite_ray.bench.loadtest import check_greedy_replies, run_loadtest
from dlite_ray.bench.loadtest_client import Client, LoadTestConfig, Record
from tests.serve.conftest import GRPC_PORT, HTTP_PORT, KEYS

CONFIG = {"http_url": f"http://127.0.0.1:{HTTP_PORT}", "grpc_address": f"127.0.0.1:{GRPC_PORT}",
          "api_keys": sorted(KEYS.values()), "max_tokens": 8, "turns": 2}


@pytest.fixture(scope="module")
def library(tiny_serving_model):
    from dlite_ray.engine.engine import DLiteEngine

    target_dir, draft_dir = tiny_serving_model
    return DLiteEngine.from_pretrained(target_dir, draft_dir, dtype="float32", adaptive_draft_length=False)


def test_a_short_loadtest_loses_nothing_and_matches_the_library(serve_app, library, tmp_path):
    """Fixed work, not a duration: 3 clients x 4 actions, every one of them accounted for
    however fast the machine (the clients' choices follow their seeds, not the clock)."""
    cfg = LoadTestConfig(clients=3, actions_per_client=4, **CONFIG)
    report = run_loadtest(cfg, library, tmp_path / "loadtest.json")
    assert report["errors"] == {}, report["error_examples"]
    kinds = report["requests_by_kind"]
    one_shots, loops = kinds.get("chat-http", 0) + kinds.get("chat-grpc", 0), report["conversations"]
    assert one_shots + loops == 3 * 4 and one_shots > 0 and loops > 0, kinds
    assert report["conversation_turns"] == kinds["turn"] == loops * CONFIG["turns"]  # every loop ran every turn
    assert report["requests_ok"] == report["requests"] == one_shots + kinds["turn"]
    assert report["lost_conversations"] == 0, report["lost_details"]
    # every turn is greedy and checked; a one-shot is unless sent sampled (sampled_fraction)
    assert kinds["turn"] <= report["greedy"]["checked"] <= report["requests_ok"], report["greedy"]
    assert report["greedy"]["mismatches"] == 0, report["greedy"]
    assert report["latency_s"]["p50"] > 0 and report["tokens_per_second"] > 0
    assert json.loads((tmp_path / "loadtest.json").read_text())["requests"] == report["requests"]
    assert "key-a" not in (tmp_path / "loadtest.json").read_text()  # keys never written out


def test_the_checks_catch_a_wrong_reply_and_a_wrong_history(serve_app, library):
    messages = [{"role": "user", "content": "Explain what a closure is with an example."}]
    right = library.generate(messages, max_new_tokens=8)[0]
    records = [Record("chat-grpc", messages, True, token_ids=list(right.token_ids)),
               Record("chat-grpc", messages, True, token_ids=[*right.token_ids[:-1], right.token_ids[-1] + 1]),
               Record("chat-http", messages, True, text=right.text + "!")]
    assert check_greedy_replies(records, library, max_tokens=8)["mismatches"] == 2

    client = Client(0, LoadTestConfig(**CONFIG))
    outcome = client.tool_loop(deadline=float("inf"), records=[])
    assert outcome.turns_done == 2 and not outcome.lost
    from dlite_ray.serve.proto import dlite_pb2

    conv = client.stub.CreateConversation(dlite_pb2.CreateConversationRequest(
        messages=[dlite_pb2.Message(**m) for m in messages]), metadata=client.metadata, timeout=60)
    assert client._check_history(conv.conversation_id, [messages + messages], 0).lost
    assert client._check_history(conv.conversation_id, [messages], 0).lost  # deleted by the call above

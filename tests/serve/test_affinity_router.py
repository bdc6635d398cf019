"""Replica ranking of the ConversationAffinityRouter (a pure function; the deployed
router is exercised end to end in test_two_replicas.py)."""

from __future__ import annotations

from types import SimpleNamespace

from dlite_ray.serve.affinity_router import rank_replicas


def _replica(name: str, free: float = 1.0, leases=()):
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name),
                           routing_stats={"kv_free_fraction": free, "leases": list(leases)})


def test_the_holder_comes_first():
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    assert rank_replicas([a, b, c], route_to="b") == [[b], [a, c]]


def test_published_leases_find_the_holder_when_the_registry_has_none():
    a, b = _replica("a"), _replica("b", leases=["conv-1"])
    assert rank_replicas([a, b], conversation="conv-1") == [[b], [a]]


def test_a_gone_holder_falls_back_to_load():
    a, b = _replica("a"), _replica("b")
    assert rank_replicas([a, b], route_to="dead") == [[a, b]]


def test_prefix_affinity_is_stable_and_spreads_keys():
    replicas = [_replica(n) for n in "abcd"]
    chosen = {rank_replicas(replicas, prefix_key=f"k{i}")[0][0].replica_id.unique_id for i in range(40)}
    assert len(chosen) >= 3  # different prefixes spread over replicas
    first = rank_replicas(replicas, prefix_key="same")[0]
    assert rank_replicas(list(reversed(replicas)), prefix_key="same")[0] == first  # order does not matter


def test_full_replicas_go_last():
    full, roomy = _replica("full", free=0.02), _replica("roomy", free=0.5)
    for key in ("x", "y", "z"):
        assert rank_replicas([full, roomy], prefix_key=key) == [[roomy], [full]]
    # ... but a conversation still goes home, even to a full replica
    assert rank_replicas([full, roomy], route_to="full") == [[full], [roomy]]


def test_strict_calls_wait_for_their_replica_while_it_exists():
    a, b = _replica("a"), _replica("b")
    assert rank_replicas([a, b], route_to="b", strict=True) == [[b]]
    assert rank_replicas([a, b], route_to="gone", strict=True) == [[a, b]]  # nothing to wait for


def test_prefix_affinity_yields_to_load():
    def first(key: str) -> str:
        return rank_replicas([_replica("a"), _replica("b")], prefix_key=key)[0][0].replica_id.unique_id

    busy_key = next(f"k{i}" for i in range(100) if first(f"k{i}") == "a")
    a, b = _replica("a"), _replica("b")
    a.routing_stats["running"], b.routing_stats["running"] = 9, 1
    assert rank_replicas([a, b], prefix_key=busy_key)[0] == [b]  # a is preferred by hash but far busier
    a.routing_stats["running"] = 3
    assert rank_replicas([a, b], prefix_key=busy_key)[0] == [a]

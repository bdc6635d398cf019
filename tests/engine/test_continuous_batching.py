"""Continuous batching through the scheduler: same greedy tokens as each request alone,
with staggered arrivals, aborts, preemption, the prefix cache and stored boundaries."""

from __future__ import annotations

import random

import pytest

from dlite_ray.engine.scheduler import SchedulerConfig
from dlite_ray.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine

PROMPTS = [[random.Random(10 + i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((7, 40, 19, 33, 12, 26))]
NEW = 24


@pytest.fixture(scope="module")
def alone(tiny_target):
    ar = make_engine(tiny_target, enable_prefix_cache=False)
    return [ar.generate(p, max_new_tokens=NEW)[0].token_ids for p in PROMPTS]


def _drive(engine, arrivals: dict[int, list[int]], aborts: dict[int, str] | None = None):
    """arrivals: step -> prompt indices added before that step; returns request -> tokens."""
    seqs, step = {}, 0
    while step in arrivals or engine.has_unfinished() or step <= max(arrivals):
        for i in arrivals.get(step, []):
            seqs[i] = engine.add_request(PROMPTS[i], SamplingParams(max_new_tokens=NEW), request_id=f"r{i}")
        for rid in (aborts or {}).get(step, []):
            assert engine.abort(rid)
        engine.step()
        step += 1
    return seqs


@pytest.mark.parametrize("with_draft", [False, True])
def test_staggered_arrivals_and_aborts(tiny_target, tiny_draft, alone, with_draft):
    engine = make_engine(tiny_target, tiny_draft if with_draft else None,
                         scheduler=SchedulerConfig(max_batch_tokens=32))
    seqs = _drive(engine, {0: [0, 1], 2: [2], 3: [3, 4], 7: [5]}, aborts={4: ["r2"]})
    for i, seq in seqs.items():
        if i == 2:
            assert seq.finish_reason == "abort"
        else:
            assert seq.output_ids == alone[i], i
    stored = engine.scheduler.boundaries._entries.values()
    assert engine.scheduler.blocks.num_used_blocks == sum(len(b.blocks) for b in stored)


def test_preemption_by_recompute_keeps_outputs(tiny_target, tiny_draft, alone):
    # 24 blocks of 4 tokens: each request fits alone, four at once do not
    engine = make_engine(tiny_target, tiny_draft, max_kv_tokens=96, block_size=4, enable_prefix_cache=False)
    preempted = []
    original = engine.scheduler.schedule

    def spy():
        out = original()
        preempted.extend(out.preempted)
        return out

    engine.scheduler.schedule = spy
    out = engine.generate(PROMPTS[:4], max_new_tokens=NEW)
    assert preempted, "the pool was meant to run out"
    assert [r.token_ids for r in out] == alone[:4]


def test_a_request_that_can_never_fit_is_refused(tiny_target):
    from dlite_ray.engine.sequence import InvalidRequest

    engine = make_engine(tiny_target, max_kv_tokens=32, block_size=4)
    with pytest.raises(InvalidRequest, match="needs up to"):
        engine.generate(PROMPTS[1], max_new_tokens=NEW)
    assert engine.generate(PROMPTS[0], max_new_tokens=8)[0].token_ids


def test_prefix_cache_reuses_the_shared_history(tiny_target, tiny_draft, alone):
    engine = make_engine(tiny_target, tiny_draft, block_size=4)
    first = engine.generate(PROMPTS[1], max_new_tokens=NEW)[0]
    follow_up = PROMPTS[1] + first.token_ids + [5, 6, 7]  # the history plus a tool result
    ar = make_engine(tiny_target, enable_prefix_cache=False)
    expected = ar.generate(follow_up, max_new_tokens=NEW)[0].token_ids
    again = engine.generate(follow_up, max_new_tokens=NEW)[0]
    assert again.token_ids == expected
    assert again.stats.cached_prompt_tokens >= len(PROMPTS[1]) + len(first.token_ids) - 8


def test_resume_from_a_stored_boundary_recomputes_nothing(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft, block_size=4)
    first = engine.generate(PROMPTS[3], max_new_tokens=NEW)[0]
    history = PROMPTS[3] + first.token_ids  # KV holds all but the last token: a boundary
    ar = make_engine(tiny_target, enable_prefix_cache=False)
    expected = ar.generate(history, max_new_tokens=NEW)[0].token_ids
    before = engine.scheduler.boundaries.hits
    resumed = engine.generate(history, max_new_tokens=NEW)[0]
    assert resumed.stats.resumed_from_boundary and engine.scheduler.boundaries.hits == before + 1
    assert resumed.stats.prefill_time == 0.0  # no target forward before the first round
    assert resumed.token_ids == expected


def test_boundary_of_other_weights_is_ignored(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft, block_size=4)
    first = engine.generate(PROMPTS[0], max_new_tokens=NEW)[0]
    history = PROMPTS[0] + first.token_ids
    engine.scheduler.reuse.draft_fingerprint = "another-draft"  # as if the draft had been retrained and reloaded
    resumed = engine.generate(history, max_new_tokens=NEW)[0]
    assert not resumed.stats.resumed_from_boundary and engine.scheduler.boundaries.stale == 1
    ar = make_engine(tiny_target, enable_prefix_cache=False)
    assert resumed.token_ids == ar.generate(history, max_new_tokens=NEW)[0].token_ids


def _with_model_costs(engine):
    """Freeze the cost model at a real model's proportions (a tiny test model's timings are
    all overhead and say nothing about when drafting pays)."""
    from dlite_ray.engine.speculation_policy import CostModel

    engine.policy.cost = CostModel(v0=0.04, v1=0.0008, d0=0.003, d1=0.0008)
    engine.policy.observe = lambda *args, **kwargs: None
    engine.policy.rates = None  # and decide by the model alone
    return engine


def test_adaptive_length_turns_a_useless_draft_off(tiny_target, tiny_draft, alone):
    engine = _with_model_costs(make_engine(tiny_target, tiny_draft, adaptive_draft_length=True))
    out = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in out] == alone
    drafted = sum(sum(r.stats.position_trials[:1]) for r in out)
    rounds = sum(len(r.stats.accept_lengths) for r in out)
    assert drafted < rounds / 2  # a random draft is rarely asked to speculate


def test_adaptive_length_keeps_a_good_draft_on(tiny_target, alone):
    from dlite_ray.bench.oracle import OracleDraftTransport

    oracle = OracleDraftTransport([p + a for p, a in zip(PROMPTS, alone)])
    engine = _with_model_costs(make_engine(tiny_target, oracle, adaptive_draft_length=True))
    out = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in out] == alone
    assert sum(r.stats.mean_accept_length for r in out) / len(out) > 3


def test_draft_side_state_does_not_grow_with_context(tiny_target, tiny_draft):
    """History-free: what crosses to the draft per request is [S, D] + G tokens, at 20 or 400 tokens of context."""
    from dlite_ray.engine.draft_transport import InProcessDraftTransport

    seen = []

    class Recording(InProcessDraftTransport):
        def propose(self, request):
            seen.append((tuple(request.features.shape[1:]), tuple(request.token_groups.shape[1:])))
            return super().propose(request)

    engine = make_engine(tiny_target, Recording(tiny_draft, "rec"))
    engine.generate([PROMPTS[0][:5]], max_new_tokens=8)
    short = set(seen)
    seen.clear()
    engine.generate([(PROMPTS[1] * 10)[:400]], max_new_tokens=8)
    assert short == set(seen) and len(short) == 1


def test_a_chunked_prefill_evicts_idle_cache_between_chunks(tiny_target, tiny_draft):
    """A long prompt prefilled chunk by chunk needs, after a few chunks, the blocks an
    earlier request's boundary still holds: they are evicted, not reported as exhaustion."""
    rng = random.Random(3)
    first, second = [rng.randrange(3, 128) for _ in range(40)], [rng.randrange(3, 128) for _ in range(60)]
    ar = make_engine(tiny_target, enable_prefix_cache=False)
    expected = ar.generate(second, max_new_tokens=12, ignore_eos=True)[0].token_ids
    engine = make_engine(tiny_target, tiny_draft, max_kv_tokens=96, block_size=4,
                         scheduler=SchedulerConfig(max_batch_tokens=16))
    engine.generate(first, max_new_tokens=12, ignore_eos=True)
    assert len(engine.scheduler.boundaries) == 1  # its KV stays cached, taking half the pool
    assert engine.generate(second, max_new_tokens=12, ignore_eos=True)[0].token_ids == expected
    assert len(engine.scheduler.boundaries) == 1  # the first one made room, the second one is kept

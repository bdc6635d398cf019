"""The measured guard on speculation: whichever mode delivered more tokens per second at a
batch size runs, the other is re-measured now and then; without a model."""

from __future__ import annotations

import random

from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.engine.speculation_policy import CostModel, SpeculationPolicy
from dlite_ray.engine.step_rates import StepRates, batch_bucket


def test_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


def _drive(rates: StepRates, batch: int, spec_rate: float, plain_rate: float, steps: int) -> list[bool]:
    """Run `steps` steps where speculation delivers spec_rate tokens/s and plain plain_rate."""
    modes = []
    for _ in range(steps):
        mode = rates.should_speculate(batch, model_says=True)
        rates.record(batch, mode, tokens=10, seconds=10 / (spec_rate if mode else plain_rate))
        modes.append(mode)
    return modes


def test_a_slower_speculation_is_turned_off_but_still_probed():
    rates = StepRates()
    modes = _drive(rates, 4, spec_rate=80.0, plain_rate=100.0, steps=200)
    assert modes[:3] == [True] * 3 and modes[3:6] == [False] * 3  # both measured first
    late = modes[50:]
    assert sum(late) <= len(late) / rates.EXPLORE_EVERY + 1  # only the probes speculate
    assert any(late)  # ... and they do happen


def test_a_faster_speculation_stays_on_and_batch_sizes_are_separate():
    rates = StepRates()
    spec_steps = sum(_drive(rates, 1, spec_rate=120.0, plain_rate=100.0, steps=200)[50:])
    assert spec_steps >= 150 - 150 / rates.EXPLORE_EVERY - 1
    assert sum(_drive(rates, 16, spec_rate=70.0, plain_rate=100.0, steps=200)[50:]) <= 150 / rates.EXPLORE_EVERY + 1


def test_recovery_when_speculation_becomes_faster():
    rates = StepRates()
    _drive(rates, 2, spec_rate=50.0, plain_rate=100.0, steps=100)
    modes = _drive(rates, 2, spec_rate=200.0, plain_rate=100.0, steps=100)
    assert sum(modes[-32:]) == 31  # all but one probe of plain decoding: at a 2x lead, one in 32 steps


def test_the_wider_the_gap_the_rarer_the_probe():
    rates = StepRates()
    assert rates.probe_interval(100.0, 100.0) == rates.EXPLORE_EVERY
    assert rates.probe_interval(200.0, 100.0) == rates.probe_interval(100.0, 200.0) == 4 * rates.EXPLORE_EVERY
    assert rates.probe_interval(1000.0, 1.0) == rates.MAX_EXPLORE_EVERY
    modes = _drive(rates, 1, spec_rate=200.0, plain_rate=100.0, steps=400)
    assert 300 / 32 - 1 <= 300 - sum(modes[100:]) <= 300 / 32 + 1  # the probes of plain decoding


def test_unlucky_speculative_steps_do_not_turn_a_faster_speculation_off():
    """Tokens per speculative step jump with acceptance (here 1 token in 55% of the steps,
    else 2-6: 45 tok/s on average against 29 for plain steps); the guard must judge the
    average, not the last unlucky step."""
    rng = random.Random(0)
    rates = StepRates()
    modes = []
    for _ in range(400):
        mode = rates.should_speculate(1, model_says=True)
        tokens = (1 if rng.random() < 0.55 else rng.randint(2, 6)) if mode else 1
        rates.record(1, mode, tokens, 0.05 if mode else 0.035)
        modes.append(mode)
    assert sum(modes[100:]) >= 0.8 * 300


def _seqs(n):
    return [Sequence([1, 2, 3], SamplingParams(max_new_tokens=8)) for _ in range(n)]


def test_policy_follows_the_measurements_not_the_cost_model():
    policy = SpeculationPolicy(max_draft_tokens=7)
    policy.cost = CostModel(v0=0.04, v1=0.0001, d0=0.001, d1=0.0001)  # says drafting always pays
    seqs = _seqs(4)
    chosen = []
    for _ in range(100):
        ks = policy.choose(seqs, [7] * 4)
        speculated = max(ks) > 0
        # measured: speculative steps deliver 30 tokens in 0.5 s, plain ones 4 tokens in 0.04 s
        policy.observe_step(4, ks, 30 if speculated else 4, 0.5 if speculated else 0.04)
        chosen.append(speculated)
    assert sum(chosen[20:]) <= 80 / SpeculationPolicy(7).rates.EXPLORE_EVERY + 1
    # steps with prefill follow the measured verdict (and are not probes)
    assert all(max(policy.choose(seqs, [7] * 4, prefill_tokens=64)) == 0 for _ in range(40))
    fresh = SpeculationPolicy(max_draft_tokens=7)
    fresh.cost = policy.cost
    assert max(fresh.choose(seqs, [7] * 4, prefill_tokens=64)) > 0  # nothing measured yet: the model decides


def test_non_adaptive_policy_always_drafts_the_cap():
    policy = SpeculationPolicy(max_draft_tokens=5, adaptive=False)
    assert policy.rates is None and policy.choose(_seqs(2), [7, 3]) == [5, 3]

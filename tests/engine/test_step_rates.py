"""The measured guard on speculation: whichever arm (plain, shallow or the model's drafts)
delivered more tokens per second at a batch size runs, the others are re-measured now and
then; without a model."""

from __future__ import annotations

import random

from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.engine.speculation_policy import CostModel, SpeculationPolicy
from dlite_ray.engine.step_rates import StepRates, batch_bucket
from tests.helpers import offers


def test_buckets_are_powers_of_two():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]


TWO_ARMS = (0, None)  # plain decoding and the cost model's allocation


def _drive(rates: StepRates, batch: int, spec_rate: float, plain_rate: float, steps: int) -> list[bool]:
    """Run `steps` steps where speculation (any depth) delivers spec_rate tokens/s and plain plain_rate."""
    modes = []
    for _ in range(steps):
        mode = rates.choose(batch, model_says=True) != 0
        # steps of equal time (the probe interval grows with a probe's step time too)
        rates.record(batch, None if mode else 0, tokens=(spec_rate if mode else plain_rate) / 10, seconds=0.1)
        modes.append(mode)
    return modes


def test_a_slower_speculation_is_turned_off_but_still_probed():
    rates = StepRates(TWO_ARMS)
    modes = _drive(rates, 4, spec_rate=80.0, plain_rate=100.0, steps=200)
    assert modes[:6] == [True, False] * 3  # both measured first, in turns
    late = modes[50:]
    assert sum(late) <= len(late) / rates.EXPLORE_EVERY + 1  # only the probes speculate
    assert any(late)  # ... and they do happen


def test_a_faster_speculation_stays_on_and_batch_sizes_are_separate():
    rates = StepRates(TWO_ARMS)
    spec_steps = sum(_drive(rates, 1, spec_rate=120.0, plain_rate=100.0, steps=200)[50:])
    assert spec_steps >= 150 - 150 / rates.EXPLORE_EVERY - 1
    assert sum(_drive(rates, 16, spec_rate=70.0, plain_rate=100.0, steps=200)[50:]) <= 150 / rates.EXPLORE_EVERY + 1


def test_recovery_when_speculation_becomes_faster():
    rates = StepRates(TWO_ARMS)
    _drive(rates, 2, spec_rate=50.0, plain_rate=100.0, steps=100)
    modes = _drive(rates, 2, spec_rate=200.0, plain_rate=100.0, steps=100)
    assert sum(modes[-32:]) == 31  # all but one probe of plain decoding: at a 2x lead, one in 32 steps


def test_the_wider_the_gap_the_rarer_the_probe():
    rates = StepRates(TWO_ARMS)
    assert rates.probe_interval(100.0, 100.0) == rates.EXPLORE_EVERY
    assert rates.probe_interval(200.0, 100.0) == rates.probe_interval(100.0, 200.0) == 4 * rates.EXPLORE_EVERY
    assert rates.probe_interval(1000.0, 1.0) == rates.MAX_EXPLORE_EVERY
    modes = _drive(rates, 1, spec_rate=200.0, plain_rate=100.0, steps=400)
    assert 300 / 32 - 1 <= 300 - sum(modes[100:]) <= 300 / 32 + 1  # the probes of plain decoding
    # with more arms, each is probed as much rarer as there are others: all probes together
    # cost about what one arm's did
    assert rates.probe_interval(100.0, 100.0, others=3) == 3 * rates.EXPLORE_EVERY


def test_unlucky_speculative_steps_do_not_turn_a_faster_speculation_off():
    """Tokens per speculative step jump with acceptance (here 1 token in 55% of the steps,
    else 2-6: 45 tok/s on average against 29 for plain steps); the guard must judge the
    average, not the last unlucky step."""
    rng = random.Random(0)
    rates = StepRates(TWO_ARMS)
    modes = []
    for _ in range(400):
        mode = rates.choose(1, model_says=True) is None
        tokens = (1 if rng.random() < 0.55 else rng.randint(2, 6)) if mode else 1
        rates.record(1, None if mode else 0, tokens, 0.05 if mode else 0.035)
        modes.append(mode)
    assert sum(modes[100:]) >= 0.8 * 300


def test_a_shallow_arm_wins_where_plain_beats_the_models_deep_drafts():
    """At 16 requests in flight on 2 cores (the measurements in step_rates.py): the model's
    deep drafts 480 tok/s, plain steps 630, one token a row 720, three 600. The guard settles
    on one token a row, and still probes the others."""
    rates = StepRates()
    delivered = {0: 630.0, 1: 720.0, 3: 600.0, None: 480.0}
    chosen = []
    for _ in range(600):
        arm = rates.choose(16, model_says=True)
        rates.record(16, arm, tokens=20, seconds=20 / delivered[arm])
        chosen.append(arm)
    assert chosen[:12] == [None, 0, 1, 3] * 3  # each measured first, in turns
    late = chosen[100:]
    assert late.count(1) >= 0.85 * len(late)
    assert all(late.count(arm) > 0 for arm in (0, 3, None))  # probed
    throughput = len(chosen[100:]) / sum(1 / delivered[arm] for arm in chosen[100:])
    assert throughput >= 0.97 * delivered[1]  # the probes cost little
    assert rates.verdict(16, model_says=True) == 1
    assert rates.verdict(8, model_says=True) == 1  # no step at 8 yet: 16's evidence carries over
    assert rates.verdict(4, model_says=True) is None  # ... but not two octaves down
    assert StepRates().verdict(4, model_says=True) is None  # nothing measured anywhere: the model's choice


# tokens per second per (batch bucket, arm) on a made-up machine: plain wins from 16 rows up,
# one token a row in between, the model's drafts at 1-2 rows
RAMP_RATES = {1: {0: 100.0, None: 180.0}, 2: {0: 190.0, None: 300.0},
              4: {0: 350.0, 1: 420.0, 3: 400.0, None: 380.0}, 8: {0: 520.0, 1: 600.0, 3: 520.0, None: 480.0},
              16: {0: 640.0, 1: 620.0, 3: 500.0, None: 430.0}, 32: {0: 680.0, 1: 610.0, 3: 470.0, None: 400.0}}


def _run_ramp(rates: StepRates, batches: list[int]) -> tuple[float, list]:
    """Steps at these batch sizes; each step's rows emit a token, faster on the better arm.
    Returns tokens per second over the whole run and the arms chosen."""
    tokens = seconds = 0.0
    chosen = []
    for batch in batches:
        arm = rates.choose(batch, model_says=True)
        rate = RAMP_RATES[batch_bucket(batch)][arm]
        rates.record(batch, arm, tokens=batch, seconds=batch / rate)
        tokens, seconds = tokens + batch, seconds + batch / rate
        chosen.append(arm)
    return tokens / seconds, chosen


def _drain(peak: int, steps_per_size: int) -> list[int]:
    """`peak` requests arrive together and finish one by one."""
    return [peak] * 30 + [b for b in range(peak - 1, 0, -1) for _ in range(steps_per_size)]


class _NoPrior(StepRates):
    def _nearest_measured(self, bucket):
        return None


def test_a_bucket_seen_first_starts_from_the_nearest_measured_one():
    rates = StepRates()
    _run_ramp(rates, [8] * 40)  # bucket 8 measured: one token a row is best there
    _, chosen = _run_ramp(rates, [16] * 12)
    assert chosen[0] == 1  # the neighbour's best arm, not the model's allocation nor an exploration round
    assert chosen.count(1) + chosen.count(0) >= 10  # no dozen-step exploration of the slow arms
    _, fresh = _run_ramp(StepRates(), [16] * 12)
    assert fresh == [None, 0, 1, 3] * 3  # without a neighbour: every arm measured first


def test_the_prior_gives_way_to_what_the_bucket_measures():
    """At 16 rows plain decoding is best, while bucket 8's order says one token a row: the
    guard moves to plain once its probe of plain runs here."""
    rates = StepRates()
    _run_ramp(rates, [8] * 40)
    _, chosen = _run_ramp(rates, [16] * 150)
    assert chosen[-50:].count(0) >= 45
    assert rates.verdict(16, model_says=True) == 0


def test_a_draining_batch_runs_faster_with_the_neighbours_prior_than_starting_over_in_every_bucket():
    """32 requests in flight finishing one by one, three steps at each size: each bucket the
    batch drains into starts from the one above instead of measuring every arm again."""
    batches = _drain(32, steps_per_size=3)
    with_prior, _ = _run_ramp(StepRates(), batches)
    without, _ = _run_ramp(_NoPrior(), batches)
    best = sum(batches) / sum(b / max(RAMP_RATES[batch_bucket(b)].values()) for b in batches)
    assert with_prior > 1.01 * without
    assert with_prior >= 0.93 * best


def test_one_or_two_requests_choose_between_plain_and_the_models_allocation_only():
    """At batch 1-2 a verify row costs little and capped arms would cut copies short."""
    rates = StepRates()
    chosen = []
    for _ in range(200):
        arm = rates.choose(2, model_says=True)
        rates.record(2, arm, tokens=4 if arm is None else 2, seconds=0.02)
        chosen.append(arm)
    assert set(chosen) == {0, None} and chosen[50:].count(None) >= 0.9 * 150


def _seqs(n):
    return [Sequence([1, 2, 3], SamplingParams(max_new_tokens=8)) for _ in range(n)]


def test_policy_follows_the_measurements_not_the_cost_model():
    policy = SpeculationPolicy(max_draft_tokens=7)
    policy.cost = CostModel(v0=0.04, v1=0.0001, d0=0.001, d1=0.0001)  # says drafting always pays
    seqs = _seqs(4)
    chosen = []
    for _ in range(100):
        ks = policy.choose(offers(seqs, [7] * 4))
        speculated = max(ks) > 0
        # measured: speculative steps deliver 30 tokens in 0.5 s, plain ones 4 tokens in 0.04 s
        policy.observe_step(4, ks, 30 if speculated else 4, 0.5 if speculated else 0.04)
        chosen.append(speculated)
    assert sum(chosen[20:]) <= 80 / SpeculationPolicy(7).rates.EXPLORE_EVERY + 1
    # steps with prefill follow the measured verdict (and are not probes)
    assert all(max(policy.choose(offers(seqs, [7] * 4), prefill_tokens=64)) == 0 for _ in range(40))
    fresh = SpeculationPolicy(max_draft_tokens=7)
    fresh.cost = policy.cost
    assert max(fresh.choose(offers(seqs, [7] * 4), prefill_tokens=64)) > 0  # nothing measured yet: the model decides


def test_non_adaptive_policy_always_drafts_the_cap():
    policy = SpeculationPolicy(max_draft_tokens=5, adaptive=False)
    assert policy.rates is None and policy.choose(offers(_seqs(2), [7, 3])) == [5, 3]


def test_a_capped_arm_bounds_every_rows_tokens_and_gives_each_at_least_one():
    policy = SpeculationPolicy(max_draft_tokens=7)
    seqs = _seqs(3)
    for arm, says_pays, expected in ((1, True, [1, 1, 1]), (3, True, [3, 3, 2]), (3, False, [1, 1, 1]),
                                     (0, True, [0, 0, 0])):
        policy.cost = (CostModel(v0=0.04, v1=0.0001, d0=0.001, d1=0.0001) if says_pays
                       else CostModel(v0=0.001, v1=0.05, d0=0.05, d1=0.05))  # drafting pays / does not
        recorded = []
        policy.rates = type("Fixed", (), {"choose": lambda self, n, pays, arm=arm: arm,
                                          "record": lambda self, *measured, out=recorded: out.append(measured)})()
        ks = policy.choose(offers(seqs, [7, 7, 2]))
        assert ks == expected
        policy.observe_step(3, ks, 5, 0.1)
        assert recorded == [(3, arm, 5, 0.1)]  # credited to the arm that ran

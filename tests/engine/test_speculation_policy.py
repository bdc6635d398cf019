"""The cost model's acceptance: a row's own rate, shaped by how much likelier each deeper
drafted position is accepted once reached (measured over all rows)."""

from __future__ import annotations

import random

import pytest

from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.engine.speculation_policy import CostModel, SpeculationPolicy
from tests.helpers import offers

# Acceptance of drafted position j once j - 1 was accepted, as measured for the default
# draft on the dev split (0.42 0.21 0.12 0.07 0.05 0.03 0.02 unconditional).
CONDITIONAL = [0.42, 0.5, 0.57, 0.58, 0.7, 0.75, 0.7]


def _seq() -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(max_new_tokens=64))


def _measured_policy(rounds: int = 400) -> SpeculationPolicy:
    policy = SpeculationPolicy(max_draft_tokens=7)
    policy.rates = None  # the cost model alone
    policy.cost = CostModel(v0=0.035, v1=0.0003, d0=0.004, d1=0.0007)  # bf16 CPU proportions
    rng = random.Random(0)
    for _ in range(rounds):
        seq = _seq()
        accepted = 0
        while accepted < 7 and rng.random() < CONDITIONAL[accepted]:
            accepted += 1
        policy.record(seq, 7, accepted)
    return policy


def test_depth_factors_follow_the_measured_conditional_acceptance():
    factors = _measured_policy()._depth_factors()
    assert factors[0] == 1.0
    for j in (1, 2, 3):
        assert factors[j] == pytest.approx(CONDITIONAL[j] / CONDITIONAL[0], rel=0.25)


def test_later_positions_accepted_more_often_are_drafted_deeper():
    measured = _measured_policy()
    flat = _measured_policy()
    flat._positions = [[0.0, 0.0] for _ in flat._positions]  # the same rows, no depth profile
    deep, shallow = measured.choose(offers([_seq()], [7]))[0], flat.choose(offers([_seq()], [7]))[0]
    assert deep > shallow >= 1


def _copy_policy(accept_rate: float, rounds: int = 200) -> tuple[SpeculationPolicy, Sequence]:
    """A policy that has seen `rounds` copies of 15 tokens accepted position by position at accept_rate."""
    policy = SpeculationPolicy(max_draft_tokens=7)
    policy.rates = None
    policy.cost = CostModel(v0=0.035, v1=0.0008, d0=0.004, d1=0.0007)  # a forward that grows with its tokens
    rng = random.Random(1)
    seq = _seq()
    for _ in range(rounds):
        accepted = 0
        while accepted < 15 and rng.random() < accept_rate:
            accepted += 1
        policy.record(seq, 15, accepted, copied=True)
    return policy, seq


def test_copies_that_keep_passing_are_verified_whole_and_failing_ones_are_cut():
    good, good_seq = _copy_policy(0.95)
    bad, bad_seq = _copy_policy(0.3)
    assert good.choose(offers([good_seq] * 4, [0] * 4, copy_caps=[15] * 4)) == [15] * 4
    cut = bad.choose(offers([bad_seq] * 4, [0] * 4, copy_caps=[15] * 4))
    assert max(cut) <= 3


def test_copy_evidence_leaves_the_draft_acceptance_alone():
    policy, seq = _copy_policy(0.3)
    assert policy.alpha(seq) == SpeculationPolicy(max_draft_tokens=7).alpha(seq)
    assert policy.copy_alpha(seq) == pytest.approx(0.3, abs=0.05)


def test_a_measured_no_to_speculating_stops_copying_too():
    """In a compute-bound batch, copies the cost model lets through can make a step slower
    than plain decoding (docs/bench: 0.75x at 32 in flight); the measured verdict holds them."""
    policy, seq = _copy_policy(0.95)
    policy.rates = type("NoSpeculation", (), {"choose": lambda self, n, pays: 0,
                                              "verdict": lambda self, n, pays: 0})()
    drafting, copying = _seq(), seq
    assert policy.choose(offers([drafting, copying], [7, 0], copy_caps=[0, 15])) == [0, 0]
    policy.rates = None  # the cost model alone copies it whole
    assert policy.choose(offers([drafting, copying], [7, 0], copy_caps=[0, 15]))[1] == 15


def test_steps_with_copied_rows_are_measured_and_steps_with_prefill_are_not():
    """Decode-only steps, copying or drafting, spend the guard's probes; a step with prefill
    chunks (its time mostly the prefill's) follows the verdict without one."""
    policy, seq = _copy_policy(0.95)
    asked = []
    def spy(kind):
        return lambda self, n, pays: asked.append(kind) or (None if pays else 0)

    policy.rates = type("Spy", (), {"choose": spy("probe"), "verdict": spy("verdict")})()
    policy.choose(offers([_seq(), seq], [7, 0], copy_caps=[0, 15]))
    policy.choose(offers([_seq(), _seq()], [7, 7]), prefill_tokens=64)
    assert asked == ["probe", "verdict"]


def test_a_row_whose_copies_were_cut_tries_copying_again():
    policy, seq = _copy_policy(0.02)  # compute-bound costs, copies that fail at once
    assert policy.choose(offers([seq] * 4, [0] * 4, copy_caps=[15] * 4)) == [0] * 4
    rounds = 1
    while max(policy.choose(offers([seq] * 4, [0] * 4, copy_caps=[15] * 4))) == 0 and rounds < 50:
        rounds += 1  # not copying: its copy evidence fades
    assert 1 < rounds < 50


def test_failing_copies_from_replies_give_rounds_back_to_the_draft_until_retried():
    policy, seq = SpeculationPolicy(max_draft_tokens=7), _seq()
    for _ in range(30):
        policy.record(seq, 7, 1)  # the row's drafts: half of the examined positions pass
    assert policy.copies_from_replies(seq, can_draft=True)  # no evidence against them yet
    for _ in range(20):
        policy.record(seq, 15, 0, copied=True, from_reply=True)  # rejected at once
    assert policy.reply_alpha(seq) < policy.reply_alpha() < 0.1 < policy.alpha(seq)
    assert policy.copy_alpha(seq) == SpeculationPolicy(max_draft_tokens=7).copy_alpha(_seq())  # context copies
    assert policy.copies_from_replies(seq, can_draft=False)  # better than plain decoding
    assert SpeculationPolicy(max_draft_tokens=7, adaptive=False).copies_from_replies(seq, can_draft=True)
    refusals = 0
    while not policy.copies_from_replies(seq, can_draft=True) and refusals < 1000:
        refusals += 1  # each refusal lets the evidence fade
    assert 20 < refusals < 1000
    cut = policy.choose(offers([seq], [7], copy_caps=[15], from_reply=[True]))[0]  # sized by the replies' own rate
    assert cut < policy.choose(offers([seq], [7], copy_caps=[15]))[0]


def test_copies_from_replies_are_judged_per_request():
    # Copies from the reply corpus fit a tool call's JSON and not a conversation's prose: a
    # request whose copies fail gives its rounds back to the draft, while another's keep copying.
    policy, prose, tool_call = SpeculationPolicy(max_draft_tokens=7), _seq(), _seq()
    for seq in (prose, tool_call):
        for _ in range(30):
            policy.record(seq, 7, 1)  # both rows' drafts: half of the examined positions pass
    for _ in range(6):
        policy.record(prose, 15, 0, copied=True, from_reply=True)  # rejected at once
        policy.record(tool_call, 15, 12, copied=True, from_reply=True)
    assert policy.reply_alpha(prose) < policy.alpha(prose) < policy.reply_alpha(tool_call)
    assert not policy.copies_from_replies(prose, can_draft=True)
    assert policy.copies_from_replies(tool_call, can_draft=True)
    fresh = _seq()  # a new request starts from the engine's rate
    assert policy.reply_alpha(fresh) == pytest.approx(policy.reply_alpha(), rel=0.01)


def test_cost_fits_are_not_tilted_by_a_few_slow_steps():
    """Draft calls cost 6.9 ms + 0.55 ms per position; a shared machine stalls now and then.
    Three stalled calls at the longest draft must not make deep positions look expensive."""
    policy = SpeculationPolicy(max_draft_tokens=7)
    rng = random.Random(0)
    for i in range(61):
        k = 3 + i % 5
        policy.observe(k + 1, 0.09, 0.0069 + 0.00055 * k + rng.uniform(-2e-4, 2e-4), [k])
    for _ in range(3):
        policy.observe(8, 0.09, 0.030, [7])  # stalls
    assert policy.cost.d1 == pytest.approx(0.00055, abs=1.5e-4)
    assert policy.cost.d0 == pytest.approx(0.0069, abs=1e-3)


def test_the_steps_room_cuts_the_longest_rows_first():
    policy = SpeculationPolicy(max_draft_tokens=7, adaptive=False)
    seqs = [_seq() for _ in range(3)]
    assert policy.choose(offers(seqs, [7, 3, 5]), room=9) == [3, 3, 3]
    assert policy.choose(offers(seqs, [7, 3, 5]), room=0) == [0, 0, 0]
    assert policy.choose(offers(seqs, [7, 3, 5]), room=None) == [7, 3, 5]
    forced = offers(seqs, [0, 0, 0], copy_caps=[15, 0, 2], forced=[True, False, False])
    assert policy.choose(forced, room=10) == [8, 0, 2]

"""What one engine step records: the prefill tokens (beside the decodes) the policy is told,
nothing measured from a step whose draft call failed, and the positions a round reached."""

from __future__ import annotations

import time

from dlite_ray.engine.draft_transport import DraftUnavailable, InProcessDraftTransport
from dlite_ray.engine.sequence import SamplingParams, SequenceStats
from tests.engine.conftest import make_engine


def test_the_policy_is_told_the_prefill_tokens_not_the_chunks(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft)
    calls = []
    choose = engine.policy.choose
    engine.policy.choose = lambda seqs, caps, prefill_tokens=0, *rest: (
        calls.append((len(seqs), prefill_tokens)) or choose(seqs, caps, prefill_tokens, *rest))
    engine.add_request(list(range(3, 12)), SamplingParams(max_new_tokens=8))
    engine.step()  # its prefill
    engine.add_request(list(range(20, 45)), SamplingParams(max_new_tokens=8))
    engine.step()  # the first request decodes beside the second one's prefill
    assert calls[-1] == (1, 24)  # 25 tokens, all but the last (the first anchor) prefilled


class FailingDraft(InProcessDraftTransport):
    """A draft that takes its time, then fails (a link timing out): long enough that no
    plain step of the tiny target, even on a loaded machine, takes as long."""

    calls = 0
    DELAY_S = 0.15

    def propose(self, request):
        self.calls += 1
        time.sleep(self.DELAY_S)
        raise DraftUnavailable("link down")


def test_a_failed_draft_call_decodes_plainly_and_measures_nothing(tiny_target, tiny_draft):
    plain = make_engine(tiny_target).generate([list(range(3, 12))], max_new_tokens=6, ignore_eos=True)
    failing = FailingDraft(tiny_draft, "failing")
    engine = make_engine(tiny_target, failing, adaptive_draft_length=True)
    measured = []
    engine.policy.observe_step = lambda *args: measured.append(args)
    out = engine.generate([list(range(3, 12))], max_new_tokens=6, ignore_eos=True)
    assert failing.calls > 0 and out[0].token_ids == plain[0].token_ids
    assert out[0].stats.draft_time == 0.0  # no row drafted
    assert all(a == 1 for a in out[0].stats.accept_lengths)
    # a step that spent its time on a failed call is not a plain step's rate
    assert not any(step[1] and max(step[1]) == 0 and step[3] >= FailingDraft.DELAY_S for step in measured)


def test_per_position_acceptance_counts_the_positions_a_round_reached():
    stats = SequenceStats()
    stats.record_round(5, 2)  # positions 1 and 2 accepted, 3 rejected, 4 and 5 never reached
    stats.record_round(3, 3)  # all three accepted
    stats.record_round(4, 0, copied=True)  # copies are not the draft's
    assert stats.position_trials == [2, 2, 2, 0, 0]
    assert stats.position_accepts == [2, 2, 1, 0, 0]  # P(3 | reached) = 1/2, not 1/2 of rounds drafting 3

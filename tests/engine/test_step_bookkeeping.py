"""What one engine step records: the prefill tokens (beside the decodes) the policy is told,
nothing measured from a step whose draft call failed, and the positions a round reached."""

from __future__ import annotations

from dlite_ray.engine.draft_transport import DraftUnavailable, InProcessDraftTransport
from dlite_ray.engine.sequence import SamplingParams, SequenceStats
from tests.engine.conftest import make_engine


def test_the_policy_is_told_the_prefill_tokens_not_the_chunks(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft)
    calls = []
    choose = engine.policy.choose
    engine.policy.choose = lambda offers, prefill_tokens=0, room=None: (
        calls.append((len(offers), prefill_tokens)) or choose(offers, prefill_tokens, room))
    engine.add_request(list(range(3, 12)), SamplingParams(max_new_tokens=8))
    engine.step()  # its prefill
    engine.add_request(list(range(20, 45)), SamplingParams(max_new_tokens=8))
    engine.step()  # the first request decodes beside the second one's prefill
    assert calls[-1] == (1, 24)  # 25 tokens, all but the last (the first anchor) prefilled


class FailingDraft(InProcessDraftTransport):
    """A draft whose every call fails (a link timing out)."""

    calls = 0

    def propose(self, request):
        self.calls += 1
        raise DraftUnavailable("link down")


def test_a_failed_draft_call_decodes_plainly_and_measures_nothing(tiny_target, tiny_draft):
    prompt = list(range(3, 12))
    plain = make_engine(tiny_target).generate([prompt], max_new_tokens=6, ignore_eos=True)
    failing = FailingDraft(tiny_draft, "failing")
    out = make_engine(tiny_target, failing, adaptive_draft_length=True).generate([prompt], max_new_tokens=6,
                                                                                 ignore_eos=True)
    assert failing.calls > 0 and out[0].token_ids == plain[0].token_ids
    assert out[0].stats.draft_time == 0.0  # no row drafted
    assert all(a == 1 for a in out[0].stats.accept_lengths)
    # step by step, on an engine that has not yet learned the draft is down: a step whose draft
    # call failed is not measured as a plain step (told apart by the call itself, not by how
    # long the step took)
    failing = FailingDraft(tiny_draft, "failing")
    engine = make_engine(tiny_target, failing, adaptive_draft_length=True)
    measured = []
    engine.policy.observe_step = lambda *args: measured.append(args)
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=6))
    failed_steps = 0
    while not seq.is_finished:
        calls, seen = failing.calls, len(measured)
        engine.step()
        if failing.calls > calls:
            failed_steps += 1
            assert len(measured) == seen, measured[seen:]
    assert failed_steps > 0


def test_per_position_acceptance_counts_the_positions_a_round_reached():
    stats = SequenceStats()
    stats.record_round(5, 2)  # positions 1 and 2 accepted, 3 rejected, 4 and 5 never reached
    stats.record_round(3, 3)  # all three accepted
    stats.record_round(4, 0, copied=True)  # copies are not the draft's
    assert stats.position_trials == [2, 2, 2, 0, 0]
    assert stats.position_accepts == [2, 2, 1, 0, 0]  # P(3 | reached) = 1/2, not 1/2 of rounds drafting 3

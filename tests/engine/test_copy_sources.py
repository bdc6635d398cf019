"""Copy sources (engine/copy_sources.py): asked in order, the first copy wins, a copy from
earlier replies only where the policy lets it take the round; a source of one's own plugs
in without touching the decoder, and whatever it proposes, the output stays the target's."""

from __future__ import annotations

from dlite_ray.engine.copy_sources import FromCorpus, FromReplies, copy_sources
from dlite_ray.engine.sequence import SamplingParams, Sequence
from tests.engine.conftest import make_engine


class Repeats:
    """A source of our own (what a new one needs: these two members): the row's last token
    three times again, a copy that is mostly wrong."""

    earlier_replies = False

    def __init__(self) -> None:
        self.asked = self.empty = 0

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        self.asked += 1
        self.empty += limit == 0  # no room left in the reply: no copy
        return [seq.token_ids[-1]] * min(3, limit)


class Never:
    earlier_replies = False

    def __init__(self) -> None:
        self.asked = 0

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        self.asked += 1
        return []


def test_the_sources_are_the_context_then_earlier_replies_then_the_corpus(tiny_target):
    engine = make_engine(tiny_target, lookup_tokens=8)
    lookup = engine.decoder.lookup
    sources = copy_sources(lookup, replies=object(), corpus=object())  # type: ignore[arg-type]
    assert [type(s) for s in sources] == [type(lookup), FromReplies, FromCorpus]
    assert [s.earlier_replies for s in sources] == [False, True, True]
    assert copy_sources(lookup) == [lookup]


def test_a_source_of_ones_own_is_asked_in_order_and_keeps_the_output_exact(tiny_target, tiny_draft):
    prompts = [[5, 17, 33, 2 + i, 90, 41] for i in range(3)]
    plain = [r.token_ids for r in make_engine(tiny_target).generate(prompts, max_new_tokens=12)]
    engine = make_engine(tiny_target, tiny_draft, lookup_tokens=8)
    repeats, never = Repeats(), Never()
    engine.decoder.sources = [repeats, never, *engine.decoder.sources]
    out = engine.generate(prompts, max_new_tokens=12)
    assert [r.token_ids for r in out] == plain  # its copies verified like any draft
    copied = sum(sum(r.stats.copied_rounds) for r in out)
    assert copied == repeats.asked - repeats.empty > 0  # the first source with a copy gave the round's
    assert never.asked == repeats.empty  # the next one was asked only where it had none


def test_a_copy_from_earlier_replies_yields_to_a_draft_that_passes_more_often(tiny_target, tiny_draft):
    """Where the policy finds such copies pass less often than the row's drafts, the row
    drafts (its offer holds no copy) rather than taking the reply's copy."""

    class FromReply(Repeats):
        earlier_replies = True

    engine = make_engine(tiny_target, tiny_draft, lookup_tokens=8, adaptive_draft_length=True)
    engine.decoder.sources = [FromReply()]
    seq = Sequence([5, 17, 33, 90], SamplingParams(max_new_tokens=12))
    seq.pivot_features = tiny_target.embed_tokens.weight[:1].clone()  # it can draft
    engine.policy._reply, engine.policy._global = [0.0, 50.0], [45.0, 50.0]  # replies never passed; drafts did
    offer = engine.decoder._offer(seq)
    assert offer.copy == [] and not offer.from_reply and offer.draft_cap > 0
    engine.policy._reply = [50.0, 50.0]  # replies always passed
    offer = engine.decoder._offer(seq)
    assert offer.copy == [90, 90, 90] and offer.from_reply

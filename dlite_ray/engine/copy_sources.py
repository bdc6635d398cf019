"""Where a round copies tokens from instead of drafting them, in the order they are asked:
the first source that has a copy for a row gives it (`SpecDecoder._offer`).

A source answers `propose(seq, limit)`: at most `limit` tokens to verify after the row's
anchor, [] where it has none. It says whether its copies come from other requests'
replies (`earlier_replies`): those pass less often than copies from a row's own context,
and the policy decides per row whether one may take a round from the draft
(`SpeculationPolicy.copies_from_replies`). Every source chooses without the target, so
verifying what it proposes keeps the output exact.

A new source is a class with these two members in a file of its own, and one entry in
`copy_sources` below (and a knob in engine_config.py if it may be switched off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dlite_ray.engine.context_lookup import ContextLookup
from dlite_ray.engine.reply_cache import ReplyCache
from dlite_ray.engine.reply_corpus import ReplyCorpus
from dlite_ray.engine.sequence import Sequence


class CopySource(Protocol):
    earlier_replies: bool  # its copies come from other requests' replies, not the row's context

    def propose(self, seq: Sequence, limit: int) -> list[int]: ...


@dataclass(slots=True)
class FromReplies:
    """The latest earlier reply of the row's namespace that holds its last tokens (reply_cache.py)."""

    cache: ReplyCache
    earlier_replies = True

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.cache.propose(seq.namespace, seq.token_ids, limit)


@dataclass(slots=True)
class FromCorpus:
    """The target's own replies that trained the draft (reply_corpus.py)."""

    corpus: ReplyCorpus
    earlier_replies = True

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.corpus.propose(seq.token_ids, limit)


def copy_sources(lookup: ContextLookup, replies: ReplyCache | None = None,
                 corpus: ReplyCorpus | None = None) -> list[CopySource]:
    """The row's context first, then its namespace's earlier replies, then the corpus (those on)."""
    sources: list[CopySource] = [lookup]
    if replies is not None:
        sources.append(FromReplies(replies))
    if corpus is not None:
        sources.append(FromCorpus(corpus))
    return sources

"""Context lookup: draft by copying what followed the latest earlier occurrence of a
sequence's last few tokens (prompt lookup decoding), next to the DLite draft.

Agents re-send code, tool schemas and logs, and their replies copy from them: a fixed
function, a file path, a JSON argument taken from the schema. Where the sequence's last
n tokens (n = 4, then 3, then 2) occurred before, the tokens that followed them there are
proposed instead of the DLite draft. The target verifies them like any draft, so the
output is unchanged; only how many tokens a round keeps changes.

Measured on the dev split's recorded replies (greedy acceptance, the shipped draft): DLite
alone tau 2.77; copying where a 2-to-4-token match exists and DLite elsewhere 3.55 with up
to 7 copied tokens, 4.22 with up to 15 (verify width is nearly free on this CPU).
"""

from __future__ import annotations

import weakref

from dlite_ray.engine.sequence import Sequence

NGRAM_SIZES = (4, 3, 2)  # longest first: a longer match is likelier to continue the same way
# Other continuations, verified next to a round's main proposal as branches of a tree
# (candidate_tree.py), may come from shorter matches too: a branch costs a few verify rows.
ALTERNATIVE_NGRAM_SIZES = (4, 3, 2, 1)
OCCURRENCES_LOOKED_AT = 16  # per n-gram size, latest first


class NgramIndex:
    """Where each n-gram of a token list ended with a token after it, updated as the list
    grows (sequences only ever append)."""

    def __init__(self, sizes: tuple[int, ...] = NGRAM_SIZES) -> None:
        """sizes: the n-gram sizes indexed (NGRAM_SIZES, or ALTERNATIVE_NGRAM_SIZES where
        `alternatives` is asked for)."""
        self._sizes = sizes
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._length = 0  # length at the last lookup; the n-grams ending before its last token are indexed

    def continuation(self, tokens: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the latest earlier occurrence of the
        longest suffix of `tokens` found (n in NGRAM_SIZES); [] when none occurred."""
        self._index(tokens)
        for n in NGRAM_SIZES:
            ends = self._ends.get(tuple(tokens[-n:])) if len(tokens) > n else None
            if ends:
                return tokens[ends[-1] + 1:ends[-1] + 1 + max_tokens]
        return []

    def alternatives(self, tokens: list[int], max_tokens: int, count: int) -> list[list[int]]:
        """Up to `count` different continuations (max_tokens each) of the suffixes of
        `tokens`: longest suffix first, then latest occurrence first."""
        self._index(tokens)
        found: list[list[int]] = []
        for n in self._sizes:
            ends = self._ends.get(tuple(tokens[-n:]), []) if len(tokens) > n else []
            for end in reversed(ends[-OCCURRENCES_LOOKED_AT:]):
                following = tokens[end + 1:end + 1 + max_tokens]
                if following not in found:
                    found.append(following)
                    if len(found) == count:
                        return found
        return found

    def _index(self, tokens: list[int]) -> None:
        # Only n-grams with a token after them are indexed, so the suffix being looked up
        # (it ends at the last token) never finds itself.
        if len(tokens) < self._length:
            raise ValueError("the token list shrank; an index belongs to one growing sequence")
        for end in range(max(0, self._length - 1), len(tokens) - 1):
            for n in self._sizes:
                if end + 1 >= n:
                    self._ends.setdefault(tuple(tokens[end + 1 - n:end + 1]), []).append(end)
        self._length = len(tokens)


class ContextLookup:
    """One NgramIndex per live sequence (dropped with the sequence). The first copy source
    a round asks (copy_sources.py)."""

    earlier_replies = False  # it copies from the row's own context

    def __init__(self, max_tokens: int, alternatives: bool = False):
        """alternatives: `alternatives` will be asked for (tree verification), so 1-grams are
        indexed too; without it the index holds only what `propose` reads."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._sizes = ALTERNATIVE_NGRAM_SIZES if alternatives else NGRAM_SIZES
        self._indexes: weakref.WeakKeyDictionary[Sequence, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        """Copied tokens to verify after seq's anchor (at most `limit`); [] to use the draft."""
        limit = min(limit, self.max_tokens)
        if limit <= 0:
            return []
        return self._index(seq).continuation(seq.token_ids, limit)

    def alternatives(self, seq: Sequence, limit: int, count: int) -> list[list[int]]:
        """Up to `count` different continuations of seq's last tokens in its context (at most
        `limit` tokens each), to verify next to a round's main proposal."""
        limit = min(limit, self.max_tokens)
        if limit <= 0 or count <= 0:
            return []
        return self._index(seq).alternatives(seq.token_ids, limit, count)

    def _index(self, seq: Sequence) -> NgramIndex:
        index = self._indexes.get(seq)
        if index is None:
            index = self._indexes[seq] = NgramIndex(self._sizes)
        return index

"""Context lookup: the n-gram index finds the latest earlier occurrence, and copied
tokens verified by the target leave greedy output unchanged."""

from __future__ import annotations

import dataclasses
import random
import types

import pytest

from dlite_ray.engine.context_lookup import NGRAM_SIZES, NgramIndex
from dlite_ray.engine.draft_transport import InProcessDraftTransport
from dlite_ray.engine.engine import DLiteEngine
from tests.engine.conftest import make_engine
from tests.engine.test_requests import CharTokenizer


def _brute_force(tokens: list[int], max_tokens: int) -> list[int]:
    for n in NGRAM_SIZES:
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 2, n - 2, -1):  # latest first, never the suffix itself
            if tokens[end + 1 - n:end + 1] == suffix:
                return tokens[end + 1:end + 1 + max_tokens]
    return []


def test_index_agrees_with_a_brute_force_search_as_the_sequence_grows():
    rng = random.Random(0)
    tokens, index, found = [], NgramIndex(), 0
    for _ in range(400):
        tokens.append(rng.randrange(6))  # a small alphabet: many repeats
        got = index.continuation(tokens, 5)
        assert got == _brute_force(tokens, 5)
        found += bool(got)
    assert found > 300


def test_longest_match_wins_and_a_suffix_never_matches_itself():
    index = NgramIndex()
    # "1 2" last occurred before 9, but "5 1 2" occurred before 7: the longer match wins
    assert index.continuation([5, 1, 2, 7, 8, 1, 2, 9, 4, 5, 1, 2], 3) == [7, 8, 1]
    assert NgramIndex().continuation([1, 2, 3, 4], 3) == []  # nothing repeats


def test_alternatives_are_distinct_continuations_longest_match_first():
    from dlite_ray.engine.context_lookup import ALTERNATIVE_NGRAM_SIZES

    index = NgramIndex(ALTERNATIVE_NGRAM_SIZES)
    # "5 1 2" before 7; "1 2" also before 9; "2" also before 6
    tokens = [5, 1, 2, 7, 8, 2, 6, 1, 2, 9, 4, 5, 1, 2]
    assert index.alternatives(tokens, 2, 4) == [[7, 8], [9, 4], [6, 1]]
    assert index.alternatives(tokens, 2, 1) == [[7, 8]]
    assert NgramIndex(ALTERNATIVE_NGRAM_SIZES).alternatives([1, 2, 3], 2, 4) == []  # nothing repeats


def test_a_shrinking_list_is_refused():
    index = NgramIndex()
    index.continuation([1, 2, 1, 2, 1], 4)
    with pytest.raises(ValueError, match="shrank"):
        index.continuation([1, 2], 4)
    with pytest.raises(ValueError, match="shrank"):  # by one token: its suffix would match itself
        index.continuation([1, 2, 1, 2], 4)


# Prompts that repeat themselves, so the first rounds already copy.
PROMPTS = [(p := [random.Random(i).randrange(3, 128) for _ in range(n)]) + p[:n // 2]
           for i, n in enumerate((12, 30, 8))]
NEW = 48


@pytest.fixture(scope="module")
def reference(tiny_target):
    return [r.token_ids for r in make_engine(tiny_target).generate(PROMPTS, max_new_tokens=NEW)]


@pytest.mark.parametrize("with_draft,adaptive", [(False, False), (True, False), (False, True), (True, True)])
def test_copied_tokens_leave_greedy_output_unchanged(tiny_target, tiny_draft, reference, with_draft, adaptive):
    engine = make_engine(tiny_target, tiny_draft if with_draft else None, lookup_tokens=15,
                         adaptive_draft_length=adaptive)
    out = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in out] == reference
    copied = [c for r in out for c in r.stats.copied_rounds]
    assert sum(copied) >= len(PROMPTS)  # every prompt copied at least once
    # a round never verifies more than 15 copied tokens
    assert max(a for r in out for a in r.stats.accept_lengths) <= 16
    if with_draft:
        assert not all(copied)  # and the draft drafted where nothing matched


def test_verify_rows_longer_than_the_position_exact_limit_are_refused(tiny_target, tiny_draft):
    with pytest.raises(ValueError, match="lookup_tokens"):
        make_engine(tiny_target, lookup_tokens=16)
    info = dataclasses.replace(InProcessDraftTransport(tiny_draft, "test").info, max_draft_tokens=16)
    long_draft = types.SimpleNamespace(info=info)  # only its limits are read before the check
    with pytest.raises(ValueError, match="num_draft_tokens"):
        make_engine(tiny_target, long_draft, num_draft_tokens=16)


def test_unset_lookup_copies_with_a_draft_only(tiny_target, tiny_draft):
    assert make_engine(tiny_target, tiny_draft, lookup_tokens=None).lookup_tokens == 15
    assert make_engine(tiny_target, lookup_tokens=None).lookup_tokens == 0
    engine = DLiteEngine(tiny_target, CharTokenizer(), InProcessDraftTransport(tiny_draft, "test"))
    assert engine.lookup_tokens == 15  # the library's default is the CLI's and the server's

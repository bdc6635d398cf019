"""The reply corpus: the target's training replies, shipped with the draft and copied from
where a request's context has no match (engine/reply_corpus.py)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from dlite_ray.engine import reply_corpus
from dlite_ray.engine.reply_corpus import REPLY_CORPUS_FILE, ReplyCorpus, save_reply_corpus
from dlite_ray.engine.sequence import SamplingParams
from tests.engine.conftest import make_engine

SIZES = (3, 2)


def _corpus(replies, sizes=SIZES) -> ReplyCorpus:
    return ReplyCorpus.of_replies(replies, ngram_sizes=sizes)


def test_proposes_what_followed_the_longest_match():
    corpus = _corpus([[1, 2, 3, 4, 5], [9, 2, 3, 7, 8]])
    assert corpus.propose([0, 1, 2, 3], 2) == [4, 5]  # the 3-gram 1 2 3 says 4
    assert corpus.propose([0, 9, 2, 3], 2) == [7, 8]
    assert corpus.propose([0, 2], 2) == []  # shorter than every n-gram size
    assert corpus.propose([1, 2, 3], 0) == []


def test_the_most_frequent_next_token_wins_then_the_latest_occurrence():
    corpus = _corpus([[5, 6, 2, 40], [5, 6, 1], [5, 6, 2, 41], [5, 6, 1]])
    assert corpus.propose([5, 6], 2) == [1]  # 1 and 2 follow twice each: the latest occurrence of either
    corpus = _corpus([[5, 6, 1], [5, 6, 2, 40], [5, 6, 2, 41], [7, 5, 6, 1]])
    assert corpus.propose([5, 6], 2) == [1]
    assert corpus.propose([9, 5, 6], 2) == [1]  # no 3-gram match: the 2-gram's
    corpus = _corpus([[5, 6, 1], [5, 6, 2, 40], [5, 6, 1, 42]])
    assert corpus.propose([5, 6], 2) == [1, 42]  # 1 follows twice


def test_a_copy_never_crosses_into_the_next_reply():
    corpus = _corpus([[1, 2, 3], [4, 5, 6]])
    assert corpus.propose([1, 2], 5) == [3]
    assert corpus.propose([2, 3], 5) == []  # 2 3 ends its reply: nothing followed it
    assert corpus.propose([3, 4], 5) == []  # no n-gram spans two replies


def test_a_hash_collision_proposes_nothing(monkeypatch):
    corpus = _corpus([[1, 2, 3, 4]])
    key = reply_corpus._hash([1, 2])
    monkeypatch.setattr(reply_corpus, "_hash", lambda tokens: key)  # every suffix looks like 1 2
    assert corpus.propose([7, 8], 1) == []
    assert corpus.propose([1, 2], 1) == [3]


def _brute_force(replies: list[list[int]], tokens: list[int], limit: int) -> list[int]:
    """The longest suffix; among its occurrences, the latest of those followed by the most
    frequent next token; what followed it within its reply."""
    for n in SIZES:
        suffix = tokens[-n:]
        if len(suffix) < n:
            continue
        places = [(i, e) for i, r in enumerate(replies) for e in range(n - 1, len(r) - 1)
                  if r[e + 1 - n:e + 1] == suffix]
        if places:
            counts = Counter(replies[i][e + 1] for i, e in places)
            best = max(counts.values())
            i, e = [p for p in places if counts[replies[p[0]][p[1] + 1]] == best][-1]
            return replies[i][e + 1:e + 1 + limit]
    return []


def test_agrees_with_a_brute_force_search():
    rng = random.Random(0)
    found = 0
    for _ in range(20):
        replies = [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(rng.randrange(1, 12))]
        corpus = _corpus(replies)
        assert corpus.num_tokens == sum(map(len, replies))
        for _ in range(40):
            tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 6))]
            got = corpus.propose(tokens, 5)
            assert got == _brute_force(replies, tokens, 5), (replies, tokens)
            found += bool(got)
    assert found > 400


def test_saved_next_to_a_draft_and_loaded(tmp_path):
    assert ReplyCorpus.load(tmp_path) is None  # a draft that ships none
    save_reply_corpus(tmp_path, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12]])
    assert (tmp_path / REPLY_CORPUS_FILE).exists()
    corpus = ReplyCorpus.load(tmp_path)
    assert corpus.num_tokens == 12
    assert corpus.propose(list(range(1, 9)), 3) == [9, 10]


@pytest.mark.parametrize("sizes", [(), (2, 3), (0,)])
def test_sizes_must_be_positive_and_longest_first(sizes):
    with pytest.raises(ValueError, match="ngram_sizes"):
        _corpus([[1, 2, 3]], sizes)


def test_tokens_must_be_ids_or_separators():
    with pytest.raises(ValueError, match="token ids"):
        ReplyCorpus(np.array([1, -2, 3]))


# -- in the engine ------------------------------------------------------------------------------
PROMPT = random.Random(1).sample(range(3, 128), 40)  # distinct tokens: the context has no match
NEW = 40


def _run(engine, prompt):
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
    while not seq.is_finished:
        engine.step()
    return seq


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_reply_in_the_corpus_is_copied_and_stays_plain_decoding(tiny_target, tiny_draft, with_draft):
    plain = _run(make_engine(tiny_target), PROMPT).output_ids
    corpus = ReplyCorpus.of_replies([PROMPT[-8:] + plain])
    engine = make_engine(tiny_target, tiny_draft if with_draft else None, lookup_tokens=15, corpus=corpus,
                         reply_corpus=True)
    seq = _run(engine, PROMPT)
    assert seq.output_ids == plain
    assert seq.stats.reply_rounds[0] and seq.stats.accept_lengths[0] == 16  # the whole copy was kept
    wrong = [(t + 1) % 128 for t in plain]
    engine = make_engine(tiny_target, lookup_tokens=15, corpus=ReplyCorpus.of_replies([PROMPT[-8:] + wrong]),
                         reply_corpus=True)
    seq = _run(engine, PROMPT)
    assert seq.output_ids == plain and seq.stats.reply_rounds[0]  # a wrong copy is verified away


def test_on_only_when_asked_and_copying(tiny_target, tiny_draft):
    corpus = ReplyCorpus.of_replies([[1, 2, 3, 4, 5]])
    assert make_engine(tiny_target, tiny_draft, lookup_tokens=15, corpus=corpus, reply_corpus=True).corpus is corpus
    assert make_engine(tiny_target, tiny_draft, lookup_tokens=0, corpus=corpus, reply_corpus=True).corpus is None
    assert make_engine(tiny_target, tiny_draft, lookup_tokens=15, corpus=corpus).corpus is None  # off by default

"""Reply cache: the index proposes what followed the longest match in the latest reply
held, within its bounds and the request's namespace; copies from it are verified like
context copies, so greedy output is plain decoding's and sampled output the target's."""

from __future__ import annotations

import random

import pytest

from dlite_ray.constants import REPLY_CACHE_TOKENS
from dlite_ray.engine.reply_cache import REPLY_NGRAM_SIZES, ReplyCache
from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint
from tests.engine.conftest import make_engine
from tests.engine.test_sampled_engine import PROMPT, VOCAB, _target_second_token_distribution
from tests.helpers import chi2_pvalue

SIZES = (4, 3, 2)


def _cache(max_tokens: int = 1000, max_namespaces: int = 4, prompt_tail: int = 0) -> ReplyCache:
    return ReplyCache(max_tokens, max_namespaces, SIZES, prompt_tail)


def test_proposes_what_followed_the_match():
    cache = _cache()
    cache.add(None, [], [10, 11, 12, 13, 14, 15])
    assert cache.propose(None, [99, 11, 12], 3) == [13, 14, 15]
    assert cache.propose(None, [99, 11, 12], 2) == [13, 14]  # within the limit
    assert cache.propose(None, [14, 15], 3) == []  # nothing followed it
    assert cache.propose(None, [98, 99], 3) == []  # no match
    assert cache.propose(None, [99, 11, 12], 0) == []


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    cache = _cache()
    cache.add(None, [], [5, 1, 2, 7, 8])  # older: "5 1 2" then 7
    cache.add(None, [], [1, 2, 9, 4])  # newer: only "1 2" then 9
    assert cache.propose(None, [0, 5, 1, 2], 2) == [7, 8]
    assert cache.propose(None, [0, 6, 1, 2], 2) == [9, 4]


def test_the_most_recent_occurrence_wins():
    cache = _cache()
    cache.add(None, [], [1, 2, 3, 4, 7])
    cache.add(None, [], [1, 2, 3, 4, 8, 1, 2, 3, 4, 9])
    assert cache.propose(None, [1, 2, 3, 4], 1) == [9]  # the later place in the newer reply
    cache.add(None, [], [0, 2, 3, 4, 6])
    assert cache.propose(None, [0, 2, 3, 4], 1) == [6]
    assert cache.propose(None, [1, 2, 3, 4], 1) == [9]  # "1 2 3 4" is still longest in the older reply


def test_default_sizes_refuse_short_matches_across_replies():
    cache = ReplyCache(1000, 4, prompt_tail=0)
    shortest = min(REPLY_NGRAM_SIZES)
    reply = list(range(10, 30))
    cache.add(None, [], reply)
    assert cache.propose(None, [1] + reply[:shortest], 2) == reply[shortest:shortest + 2]
    assert cache.propose(None, [1] + reply[1:shortest], 2) == []  # one token short of the shortest n-gram


def test_a_reply_starts_from_its_prompt_tail():
    cache = _cache(prompt_tail=3)
    cache.add(None, [40, 41, 42, 50, 51, 52], [60, 61, 62])
    # a later prompt ending with the same header proposes how the earlier reply began
    assert cache.propose(None, [7, 8, 50, 51, 52], 3) == [60, 61, 62]
    assert cache.propose(None, [41, 42], 3) == []  # before the tail: not kept
    assert cache.size_tokens == 6


def _brute_force(replies: list[list[int]], tokens: list[int], limit: int) -> list[int]:
    """The longest suffix (n in SIZES), in the newest reply holding it, at its latest place there."""
    for n in SIZES:
        suffix = tokens[-n:]
        for reply in reversed(replies):
            for end in range(len(reply) - 2, n - 2, -1):
                if reply[end + 1 - n:end + 1] == suffix:
                    return reply[end + 1:end + 1 + limit]
    return []


def test_agrees_with_a_brute_force_search_as_replies_come_and_go():
    rng = random.Random(0)
    cache, held, found = _cache(max_tokens=60), [], 0
    for _ in range(120):
        reply = [rng.randrange(5) for _ in range(rng.randrange(1, 25))]  # a small alphabet: many repeats
        cache.add(None, [], reply)
        held.append(reply)
        while sum(map(len, held)) > 60:
            held.pop(0)  # the oldest go first
        assert cache.size_tokens == sum(map(len, held)) and cache.num_replies == len(held)
        for _ in range(5):
            tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
            got = cache.propose(None, tokens, 6)
            assert got == _brute_force(held, tokens, 6)
            found += bool(got)
    assert found > 300


def test_an_evicted_reply_is_never_proposed():
    cache = _cache(max_tokens=10)
    cache.add(None, [], [1, 2, 3, 4, 5])
    cache.add(None, [], [6, 7, 8, 9, 10])
    assert cache.propose(None, [1, 2], 1) == [3]
    cache.add(None, [], [11, 12, 13])  # 13 tokens > 10: the oldest reply goes
    assert cache.propose(None, [1, 2], 1) == []
    assert cache.propose(None, [6, 7], 1) == [8]
    assert (cache.size_tokens, cache.num_replies) == (8, 2)
    cache.add(None, [], list(range(20, 40)))  # longer than the bound: its last 10 tokens are kept
    assert (cache.size_tokens, cache.num_replies) == (10, 1)
    assert cache.propose(None, [30, 31], 2) == [32, 33] and cache.propose(None, [20, 21], 2) == []


def test_namespaces_are_isolated():
    cache = _cache()
    cache.add("tenant-a", [], [1, 2, 3, 4])
    cache.add(None, [], [1, 2, 5, 6])
    assert cache.propose("tenant-a", [1, 2], 2) == [3, 4]
    assert cache.propose(None, [1, 2], 2) == [5, 6]  # the default namespace is one of its own
    assert cache.propose("tenant-b", [1, 2], 2) == []
    assert cache.propose("tenant-a", [5], 1) == [] and cache.propose(None, [1, 2, 3], 1) == []


def test_the_least_recently_used_namespace_goes():
    cache = _cache(max_namespaces=2)
    cache.add("a", [], [1, 2, 3])
    cache.add("b", [], [1, 2, 4])
    assert cache.propose("a", [1, 2], 1) == [3]  # a is used: b is now the least recent
    cache.add("c", [], [1, 2, 5])
    assert cache.num_namespaces == 2 and (cache.size_tokens, cache.num_replies) == (6, 2)
    assert cache.propose("b", [1, 2], 1) == []
    assert cache.propose("a", [1, 2], 1) == [3] and cache.propose("c", [1, 2], 1) == [5]


@pytest.mark.parametrize("args", [(0, 4), (10, 0)])
def test_bounds_must_be_positive(args):
    with pytest.raises(ValueError, match="must be >= 1"):
        ReplyCache(*args)


# -- in the engine ------------------------------------------------------------------------------
# Distinct tokens: no suffix of a prompt recurs in it, so the context lookup finds nothing
# before the reply begins and the first round can only copy from the reply cache.
PROMPT_A = random.Random(1).sample(range(3, 128), 40)
PROMPT_B = random.Random(2).sample(range(3, 128), 30) + PROMPT_A[-10:]  # the same tail, another prompt
NEW = 40
CACHE = REPLY_CACHE_TOKENS


@pytest.fixture(scope="module")
def plain(tiny_target):
    engine = make_engine(tiny_target)
    return {name: engine.generate(p, max_new_tokens=NEW, ignore_eos=True)[0].token_ids
            for name, p in (("a", PROMPT_A), ("b", PROMPT_B))}


def _run(engine, prompt, namespace=None):
    seq = engine.add_request(prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True), namespace=namespace)
    while not seq.is_finished:
        engine.step()
    return seq


@pytest.mark.parametrize("with_draft", [False, True])
def test_a_repeated_reply_is_copied_from_the_cache_and_stays_plain_decoding(tiny_target, tiny_draft, plain,
                                                                           with_draft):
    engine = make_engine(tiny_target, tiny_draft if with_draft else None, lookup_tokens=15, reply_cache_tokens=CACHE)
    first = _run(engine, PROMPT_A)
    assert first.output_ids == plain["a"] and not first.stats.reply_rounds[0]  # nothing held yet
    assert engine.reply_cache.num_replies == 1
    again = _run(engine, PROMPT_A)
    assert again.output_ids == plain["a"]
    assert again.stats.reply_rounds[0] and again.stats.accept_lengths[0] == 16  # the whole copy was kept
    other = _run(engine, PROMPT_B)  # the same prompt tail, another reply: copies are tried, and verified
    assert other.output_ids == plain["b"]
    assert other.stats.reply_rounds[0]


def test_another_namespace_never_copies_from_a_reply(tiny_target, plain):
    engine = make_engine(tiny_target, lookup_tokens=15, reply_cache_tokens=CACHE)
    _run(engine, PROMPT_A, namespace="tenant-a")
    other = _run(engine, PROMPT_A, namespace="tenant-b")
    assert other.output_ids == plain["a"] and not any(other.stats.reply_rounds)
    same = _run(engine, PROMPT_A, namespace="tenant-a")
    assert same.stats.reply_rounds[0]
    default = _run(engine, PROMPT_A)
    assert not any(default.stats.reply_rounds)


def test_off_without_copying_or_with_no_tokens(tiny_target, tiny_draft):
    assert make_engine(tiny_target, tiny_draft, lookup_tokens=15, reply_cache_tokens=0).reply_cache is None
    # plain decoding stays plain
    assert make_engine(tiny_target, lookup_tokens=0, reply_cache_tokens=CACHE).reply_cache is None
    assert make_engine(tiny_target, lookup_tokens=15).reply_cache is None  # off unless asked for
    assert make_engine(tiny_target, lookup_tokens=15, reply_cache_tokens=CACHE).reply_cache.max_tokens == CACHE
    with pytest.raises(ValueError, match="reply_cache_tokens"):
        make_engine(tiny_target, lookup_tokens=15, reply_cache_tokens=-1)


# -- sampled -------------------------------------------------------------------------------------
def _sample_from_cache(engine, reps: int = 4) -> tuple[list[int], list[int], int]:
    """Sampled replies to PROMPT (distinct tokens) after earlier ones: each batch's first
    round copies the start of the latest reply that an earlier batch left in the cache."""
    engine.generate([PROMPT], max_new_tokens=3, temperature=0.9, seed=99, ignore_eos=True)
    firsts, seconds, from_cache = [], [], 0
    for rep in range(reps):
        out = engine.generate([PROMPT] * 400, max_new_tokens=3, temperature=0.9, seed=rep * 1000, ignore_eos=True)
        firsts += [r.token_ids[0] for r in out]
        seconds += [r.token_ids[1] for r in out]
        from_cache += sum(r.stats.reply_rounds[0] for r in out)
    return firsts, seconds, from_cache


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    return load_target(make_tiny_checkpoint(tmp_path_factory.mktemp("v") / "llama", "llama", vocab=VOCAB))


def test_sampled_tokens_copied_from_the_cache_follow_the_target(small_target):
    want2, want1 = _target_second_token_distribution(small_target, 0.9)
    engine = make_engine(small_target, lookup_tokens=3, reply_cache_tokens=CACHE)
    firsts, seconds, from_cache = _sample_from_cache(engine)
    assert from_cache == len(firsts)  # every request's first round copied from an earlier reply
    for got, want in ((seconds, want2), (firsts, want1)):
        assert chi2_pvalue(got, want.double().numpy()) > 1e-3


def test_broken_acceptance_of_cached_copies_is_caught(small_target, monkeypatch):
    """Accept every copied token: the first token is then the latest earlier reply's."""
    import dlite_ray.engine.spec_decode as sd

    _, want1 = _target_second_token_distribution(small_target, 0.9)
    monkeypatch.setattr(sd, "verify_match", lambda p, drafts, num, gens: (num.clone(), drafts[:, 0]))
    firsts, _, _ = _sample_from_cache(make_engine(small_target, lookup_tokens=3, reply_cache_tokens=CACHE), reps=1)
    assert chi2_pvalue(firsts, want1.double().numpy()) < 1e-3

"""Stop strings end a request with the token that completes one, whether it came from a
plain step or from inside a drafted round, and its text ends before the stop."""

from __future__ import annotations

import random

import pytest

from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.engine.stop_strings import StopStrings, stop_prefix_length, text_before_stop
from dlite_ray.engine.stream_text import TextStream, text_to_send
from tests.engine.conftest import make_engine

PROMPTS = [[random.Random(90 + i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((6, 21, 40))]
NEW = 40


def test_text_before_stop_cuts_at_the_first_of_any_stop():
    assert text_before_stop("say hi. Observation: x", ("Observation:", ".")) == "say hi"
    assert text_before_stop("nothing here", ("STOP",)) == "nothing here"
    assert text_before_stop("abc", ()) == "abc"
    assert text_before_stop("a. b. c", (".",)) == "a"  # the first occurrence, not the last
    assert text_before_stop(". b", (".",)) == ""  # a reply that opens with its stop sends nothing


def test_a_stream_holds_back_what_could_begin_a_stop():
    assert stop_prefix_length("answer: Obs", ("Observation:",)) == 3
    # a prefix of every length is found, whatever the length of the text before it
    assert stop_prefix_length("say: Ob", ("Observation:",)) == stop_prefix_length("says: Ob", ("Observation:",)) == 2
    assert stop_prefix_length("answer: O", ("Observation:", "OK")) == 1
    assert stop_prefix_length("answer", ("Observation:",)) == 0
    assert stop_prefix_length("x\n\n", ("\n\n\n", "\n")) == 2
    assert stop_prefix_length("a", ("ab", "abc")) == 1


def test_a_stream_sends_what_can_no_longer_change():
    stops = ("Observation:",)
    assert text_to_send("look. Obs", stops, finished=False) == "look. "
    assert text_to_send("look. Obs", stops, finished=True) == "look. Obs"  # the reply ended without the stop
    assert text_to_send("look. Observation: 3", stops, finished=True) == "look. "
    assert text_to_send("caf\ufffd", (), finished=False) == "caf"  # the rest of the character's bytes are to come
    assert text_to_send("caf\ufffd", (), finished=True) == "caf\ufffd"


def test_a_text_stream_sends_each_character_once_and_never_a_stop():
    stream = TextStream(lambda ids: "".join(map(chr, ids)), ("XY",))
    pieces = [stream.push(list(map(ord, part)), finished=False) for part in ("ab", "cX", "Z", "X")]
    assert pieces == ["ab", "c", "XZ", ""]  # "X" waits until the next character shows it is no stop
    assert stream.push([ord("Y"), ord("d")], finished=True) == ""  # "XY" came: the reply ends before it
    assert "".join(pieces) == "abcXZ"


def test_only_the_tail_is_decoded_and_an_occurrence_there_is_new():
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return "".join(chr(i) for i in ids)

    stops = StopStrings(("xyz",), decode)
    out = [ord(c) for c in "a" * 100 + "xy"]
    assert not stops.completed_by_last(out)
    assert seen == [1]  # "y" holds no stop's last character: dismissed by its own text
    assert stops.completed_by_last(out + [ord("z")])
    assert seen[1:] == [1, stops.tail_tokens] and stops.tail_tokens < 100
    assert stops.completed_by_last([ord(c) for c in "xyz"])  # the output begins at its first token by default


def test_stops_ending_in_whitespace_or_split_characters_always_take_the_full_check():
    tails = []

    def decode(ids):
        tails.append(len(ids))
        return "".join("\ufffd" if i == 0 else chr(i) for i in ids)

    StopStrings(("a\n",), decode).completed_by_last([ord("b")] * 20)
    StopStrings(("ab",), decode).completed_by_last([ord("b")] * 20 + [0])
    assert tails == [StopStrings(("a\n",), decode).tail_tokens, 1, StopStrings(("ab",), decode).tail_tokens]


def _first_completion(engine, tokens: list[int], stop: str) -> int:
    """How many tokens plain decoding keeps: up to the first whose text holds the stop."""
    return next(k for k in range(1, len(tokens) + 1) if stop in engine.decode_output(tokens[:k]))


def test_drafted_rounds_stop_where_plain_decoding_stops(tiny_target):
    plain_engine = make_engine(tiny_target)
    full = plain_engine.generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True)
    stops = [r.text[15:18] for r in full]  # each reply stops by its 18th character at the latest
    oracle = OracleDraftTransport([p + r.token_ids for p, r in zip(PROMPTS, full, strict=True)])
    spec_engine = make_engine(tiny_target, oracle, num_draft_tokens=7)
    ran_past = []
    for prompt, reply, stop in zip(PROMPTS, full, stops, strict=True):
        kept = _first_completion(plain_engine, reply.token_ids, stop)
        for engine in (plain_engine, spec_engine):
            out = engine.generate(prompt, max_new_tokens=NEW, ignore_eos=True, stop=(stop,), logprobs=0)[0]
            assert out.token_ids == reply.token_ids[:kept]
            assert out.finish_reason == "stop" and stop not in out.text
            assert out.text == text_before_stop(reply.text, (stop,))
            assert len(out.logprobs) == kept
        ran_past.append(sum(out.stats.accept_lengths) > len(out.token_ids))
    assert any(ran_past)  # some stop fell inside a round, whose later accepted tokens were dropped


def test_a_stop_that_never_appears_changes_nothing(tiny_target):
    engine = make_engine(tiny_target)
    full = engine.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)[0]
    out = engine.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True, stop=("#never#",))[0]
    assert (out.token_ids, out.text, out.finish_reason) == (full.token_ids, full.text, "length")


def test_one_string_is_one_stop(tiny_target):
    assert SamplingParams(stop="Observation:").stop == ("Observation:",)
    engine = make_engine(tiny_target)
    full = engine.generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True)[0]
    stop = full.text[20:23]
    out = engine.generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True, stop=stop)[0]
    assert out.text == text_before_stop(full.text, (stop,))  # not cut at the first of its characters


def test_empty_stop_strings_are_refused():
    with pytest.raises(InvalidRequest, match="stop strings"):
        SamplingParams(stop=("",))
    with pytest.raises(InvalidRequest, match="stop strings"):
        SamplingParams(stop=(3,))

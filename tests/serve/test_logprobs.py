"""Logprob requests and responses in the OpenAI shapes: what the bodies ask for, and each
token's exact bytes with the default (byte-level BPE) tokenizer."""

from __future__ import annotations

import pytest

from dlite_ray.engine.logprobs import TokenLogprob
from dlite_ray.serve.config import LimitArgs
from dlite_ray.serve.errors import BadRequest
from dlite_ray.serve.logprobs import TokenRenderer, completion_logprobs
from dlite_ray.serve.openai_requests import parse_chat, parse_completion

LIMITS = LimitArgs()
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def renderer(default_model_dir):
    from transformers import AutoTokenizer

    return TokenRenderer(AutoTokenizer.from_pretrained(default_model_dir))


def test_token_bytes_join_into_the_text_even_when_tokens_split_characters(renderer):
    text = "naïve café → 数据 😀 <|im_end|>"
    ids = renderer.tokenizer.encode(text, add_special_tokens=False)
    pieces = [renderer.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == text
    assert any(_splits_a_character(p) for p in pieces)  # the emoji or the CJK spans tokens


def _splits_a_character(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_chat_entries_carry_text_bytes_and_alternatives(renderer):
    hello, space_world = renderer.tokenizer.encode(" hello world", add_special_tokens=False)[:2]
    entries = renderer.chat_entries([TokenLogprob(hello, -0.25, ((hello, -0.25), (space_world, -2.0)))])
    assert entries == [{"token": " hello", "logprob": -0.25, "bytes": list(b" hello"), "top_logprobs": [
        {"token": " hello", "logprob": -0.25, "bytes": list(b" hello")},
        {"token": " world", "logprob": -2.0, "bytes": list(b" world")}]}]


def test_completion_shape_counts_offsets_from_where_the_text_stands():
    entries = [{"token": "ab", "logprob": -1.0, "bytes": [97, 98], "top_logprobs": [{"token": "ab", "logprob": -1.0}]},
               {"token": "c", "logprob": -2.5, "bytes": [99], "top_logprobs": [{"token": "d", "logprob": -0.1}]}]
    assert completion_logprobs(entries, text_offset=3) == ({
        "tokens": ["ab", "c"], "token_logprobs": [-1.0, -2.5],
        "top_logprobs": [{"ab": -1.0}, {"d": -0.1, "c": -2.5}],  # the chosen token is always listed
        "text_offset": [3, 5]}, 6)


def test_ids_beyond_the_tokenizer_and_added_tokens_render(renderer):
    beyond = len(renderer.tokenizer) + 5  # padded vocabularies have such ids
    assert renderer.token_bytes(beyond) == b""
    im_end = renderer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert renderer.token_bytes(im_end) == b"<|im_end|>"


@pytest.mark.parametrize("fields, expected", [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": None}, None),
    ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": True, "top_logprobs": 20}, 20),
])
def test_chat_asks_with_a_flag_and_a_count(fields, expected):
    assert parse_chat(CHAT | fields, LIMITS).params.logprobs == expected


@pytest.mark.parametrize("fields, message", [
    ({"top_logprobs": 3}, "needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in [0, 20]"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": 3}, "logprobs must be true or false"),
    ({"logprobs": True, "top_logprobs": False}, "top_logprobs must be an integer"),
    ({"logprobs": True, "top_logprobs": 0.0}, "top_logprobs must be an integer"),
])
def test_bad_chat_logprobs_are_refused(fields, message):
    with pytest.raises(BadRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_chat(CHAT | fields, LIMITS)


def test_completions_ask_with_a_count():
    assert parse_completion({"prompt": "x"}, LIMITS).params.logprobs is None
    assert parse_completion({"prompt": "x", "logprobs": 0}, LIMITS).params.logprobs == 0
    assert parse_completion({"prompt": "x", "logprobs": 5}, LIMITS).params.logprobs == 5
    for bad in (True, 21, -1, 2.0, "3"):
        with pytest.raises(BadRequest, match="logprobs must be an integer"):
            parse_completion({"prompt": "x", "logprobs": bad}, LIMITS)

"""TextStream decodes a window of recent tokens per push; the text it streams must still be
exactly the reply's full decode (cut before a stop), with byte-level tokens that split
characters and pushes of any size."""

from __future__ import annotations

import random

import pytest

from dlite_ray.engine.stop_strings import text_before_stop
from dlite_ray.engine.stream_text import TextStream

TRICKY = ("naïve café — 日本語のテキスト 🙂🚀 emoji ZWJ 👩‍👩‍👧 and math ∑∫√ ✓\n"
          "Ünïcödé mixed with code: def f(x): return x ** 2  # ok\t\ttabs ÆØÅ ñ 한국어 Ελληνικά")


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def _stream(decode, ids: list[int], stops: tuple[str, ...], sizes: list[int]) -> str:
    stream, out, i = TextStream(decode, stops), [], 0
    for n in sizes:
        out.append(stream.push(ids[i:i + n], finished=i + n >= len(ids)))
        i += n
    assert all("\ufffd" not in piece for piece in out[:-1])  # a split character is never sent half
    return "".join(out)


def _sizes(rng: random.Random, total: int) -> list[int]:
    sizes = []
    while sum(sizes) < total:
        sizes.append(rng.choice((1, 1, 1, 2, 3, 7)))
    return sizes


@pytest.mark.parametrize("seed", range(5))
def test_streamed_text_is_the_full_decode(tokenizer, seed):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode(TRICKY, add_special_tokens=False)
    full = decode(ids)
    assert any("\ufffd" in decode([t]) for t in ids)  # the text holds characters split across tokens
    rng = random.Random(seed)
    assert _stream(decode, ids, (), _sizes(rng, len(ids))) == full
    for stop in ("日本語", "👩‍👩", "return x", "Ελλη"):
        assert _stream(decode, ids, (stop, "#never#"), _sizes(rng, len(ids))) == text_before_stop(full, (stop,))


def test_each_push_decodes_a_window_not_the_whole_reply(tokenizer):
    lengths = []

    def decode(ids):
        lengths.append(len(ids))
        return tokenizer.decode(ids, skip_special_tokens=True)

    ids = tokenizer.encode(TRICKY * 4, add_special_tokens=False)
    assert _stream(decode, ids, (), [1] * len(ids)) == tokenizer.decode(ids)
    assert max(lengths) <= 8 < len(ids)  # the longest run of tokens one character spans, and its context

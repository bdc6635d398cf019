"""Bad input to the library API: each a clear error naming the problem."""

from __future__ import annotations

import pytest

from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.sequence import InvalidRequest
from tests.conftest import make_tiny_checkpoint


class CharTokenizer:
    """A byte-level stand-in tokenizer for tiny random models (they have no tokenizer)."""

    eos_token_id = 2

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + (b % 120) for b in text.encode()]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return self("".join(f"<{m['role']}>{m['content']}" for m in messages))["input_ids"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from dlite_ray.runtime.loading import load_target

    d = make_tiny_checkpoint(tmp_path_factory.mktemp("m") / "llama", "llama")
    return DLiteEngine(load_target(d), CharTokenizer(), None)


def test_empty_prompt(engine):
    with pytest.raises(InvalidRequest, match="empty"):
        engine.generate("")


def test_prompt_longer_than_context(engine):
    with pytest.raises(InvalidRequest, match="does not fit the model context of 512"):
        engine.generate("x" * 600)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_must_be_positive(engine, n):
    with pytest.raises(InvalidRequest, match="max_new_tokens must be > 0"):
        engine.generate("hello", max_new_tokens=n)


@pytest.mark.parametrize("kw, msg", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                     ({"top_k": -2}, "top_k"), ({"temperature": 1, "verify_mode": "x"}, "verify_mode")])
def test_bad_sampling_params(engine, kw, msg):
    with pytest.raises(InvalidRequest, match=msg):
        engine.generate("hello", **kw)


def test_malformed_messages(engine):
    with pytest.raises(InvalidRequest, match="role"):
        engine.generate([{"role": "user"}])


def test_a_bad_request_leaves_the_engine_usable(engine):
    free = engine.scheduler.blocks.num_free_blocks  # earlier tests' prompts may sit in the prefix cache
    with pytest.raises(InvalidRequest):
        engine.generate(["fine", ""])
    assert engine.scheduler.blocks.num_free_blocks == free and not engine.scheduler.has_work()
    assert len(engine.generate("hello", max_new_tokens=5)[0].token_ids) == 5


def test_a_tuple_of_prompts_is_a_batch(engine):
    """generate takes any sequence of prompts (its type says so): a tuple answers each prompt
    as a list does, and one id list stays one prompt."""
    prompts = ([5, 6, 7], "hello")
    as_tuple = engine.generate(prompts, max_new_tokens=3)
    as_list = engine.generate(list(prompts), max_new_tokens=3)
    assert [r.token_ids for r in as_tuple] == [r.token_ids for r in as_list]
    assert len(engine.generate([5, 6, 7], max_new_tokens=3)) == 1

"""Structured output: replies follow a JSON schema, speculation stays exact under the mask
(greedy token for token, sampled in distribution), and bad schemas are refused."""

from __future__ import annotations

import json
import string

import pytest
import torch

from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.engine.draft_transport import InProcessDraftTransport
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.sequence import InvalidRequest
from dlite_ray.engine.structured_output import grammar_for_schema, unpack_bitmask
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import random_draft
from tests.helpers import chi2_pvalue, forward_all, new_runner, new_seq

CHARS = ' {}[]()=\'":,.-_' + string.digits + string.ascii_lowercase + string.ascii_uppercase
CHOICE = {"type": "object", "properties": {"x": {"enum": ["a", "b", "c", "d"]}}, "required": ["x"],
          "additionalProperties": False}
RECORD = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}
PROMPTS = [[5, 9, 11, 40], [7, 7, 30, 31, 32, 12], [50, 3, 60]]


def char_tokenizer():
    """A real (fast, byte-level) HF tokenizer with one token per character, for tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {c.replace(" ", "Ġ"): i + 3 for i, c in enumerate(CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", bos_token="<s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("so") / "llama", "llama")
    target = load_target(d)
    return target, random_draft(target, read_config(d), seed=5), char_tokenizer()


def _engine(tiny, draft=None, lookup_tokens: int = 0) -> DLiteEngine:
    """No copying unless asked: with it, rows propose what their grammar forces."""
    target, _, tok = tiny
    transport = draft if draft is None or hasattr(draft, "info") else InProcessDraftTransport(draft, "test")
    return DLiteEngine(target, tok, transport, adaptive_draft_length=False, lookup_tokens=lookup_tokens)


def _text(tok, ids: list[int]) -> str:
    return tok.decode([t for t in ids if t != 2])


def test_unpack_bitmask_reads_bit_j_of_word_w_as_token_32w_plus_j():
    words = torch.tensor([0b101, -2**31, 1], dtype=torch.int32)  # tokens 0, 2; 63; 64
    assert unpack_bitmask(words, 70).nonzero().flatten().tolist() == [0, 2, 63, 64]
    assert unpack_bitmask(words, 64).nonzero().flatten().tolist() == [0, 2, 63]


@pytest.mark.parametrize("schema", [CHOICE, RECORD], ids=["enum", "record"])
def test_greedy_speculation_under_a_schema_equals_plain_decoding_under_it(tiny, schema):
    _, draft, tok = tiny
    js = json.dumps(schema)
    plain = [r.token_ids for r in _engine(tiny).generate(PROMPTS, max_new_tokens=40, json_schema=js)]
    oracle = OracleDraftTransport([p + r for p, r in zip(PROMPTS, plain)], wrong_rate=0.3, vocab_size=128)
    for spec in (_engine(tiny, draft), _engine(tiny, oracle)):
        out = spec.generate(PROMPTS, max_new_tokens=40, json_schema=js)
        assert [r.token_ids for r in out] == plain
    assert sum(r.stats.mean_accept_length for r in out) > len(out)  # the oracle's drafts were accepted
    for ids in plain:  # random weights, yet every reply is complete JSON the schema accepts
        assert ids[-1] == 2
        reply = json.loads(_text(tok, ids))
        assert set(reply) == set(schema["required"])
        if schema is CHOICE:
            assert reply["x"] in "abcd"
        else:
            assert len(reply["name"]) <= 5 and 0 <= reply["n"] <= 99


def test_what_the_grammar_forces_is_proposed_and_accepted(tiny):
    draft = tiny[1]
    js = json.dumps(RECORD)
    plain = _engine(tiny).generate(PROMPTS, max_new_tokens=40, json_schema=js)
    out = _engine(tiny, draft, lookup_tokens=15).generate(PROMPTS, max_new_tokens=40, json_schema=js)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    for r in out:  # '{"name": "' opens every reply: one round proposes it and keeps it whole
        first = r.stats.accept_lengths[0]
        assert r.stats.copied_rounds[0] and first == len('{"name": "') + 1


def test_what_the_grammar_forces_is_verified_even_where_speculating_measured_slower(tiny):
    """Forced tokens are certain: a measured no to speculating (a compute-bound batch) must
    not cost each of them a step of its own."""
    target, draft, tok = tiny
    engine = DLiteEngine(target, tok, InProcessDraftTransport(draft, "test"), lookup_tokens=15)  # adaptive
    engine.policy.rates = type("NoSpeculation", (), {"choose": lambda self, n, pays: 0,
                                                     "verdict": lambda self, n, pays: 0,
                                                     "record": lambda self, *measured: None})()
    out = engine.generate(PROMPTS, max_new_tokens=40, json_schema=json.dumps(RECORD))
    assert [r.token_ids for r in out] == [r.token_ids for r in _engine(tiny).generate(
        PROMPTS, max_new_tokens=40, json_schema=json.dumps(RECORD))]
    for r in out:
        assert r.stats.copied_rounds[0] and r.stats.accept_lengths[0] == len('{"name": "') + 1


def test_a_constrained_request_leaves_its_batch_neighbours_unchanged(tiny):
    draft = tiny[1]
    alone = [r.token_ids for r in _engine(tiny, draft).generate(PROMPTS, max_new_tokens=24)]
    engine = _engine(tiny, draft)
    seqs = [engine.add_request(p, _params(json.dumps(CHOICE) if i == 1 else None)) for i, p in enumerate(PROMPTS)]
    while engine.has_unfinished():
        engine.step()
    assert [seqs[0].output_ids, seqs[2].output_ids] == [alone[0], alone[2]]
    assert seqs[1].output_ids != alone[1]


def _params(js: str | None):
    from dlite_ray.engine.sequence import SamplingParams

    return SamplingParams(max_new_tokens=24, grammar=None if js is None else grammar_for_schema(js))


def _masked_choice_distribution(target, tok, temperature: float) -> torch.Tensor:
    """P(value) under the mask: the target's distribution after '{"x": "' restricted to a..d."""
    prompt = PROMPTS[0] + tok('{"x": "', add_special_tokens=False)["input_ids"]
    logits = forward_all(new_runner(target), new_seq(prompt), prompt).logits[-1]
    p = torch.softmax(logits / temperature, -1)
    allowed = torch.zeros_like(p)
    ids = [tok.convert_tokens_to_ids(c) for c in "abcd"]
    allowed[ids] = p[ids]
    return allowed / allowed.sum()


@pytest.mark.parametrize("verify_mode", ["rejection", "match"])
def test_sampled_replies_under_a_schema_follow_the_masked_target(tiny, verify_mode):
    target, draft, tok = tiny
    want = _masked_choice_distribution(target, tok, 0.9)
    engine = _engine(tiny, draft)
    got = []
    for rep in range(2):
        out = engine.generate([PROMPTS[0]] * 300, max_new_tokens=16, temperature=0.9, seed=rep * 1000,
                              verify_mode=verify_mode, json_schema=json.dumps(CHOICE))
        got += [tok.convert_tokens_to_ids(json.loads(_text(tok, r.token_ids))["x"]) for r in out]
    assert chi2_pvalue(got, want.double().numpy()) > 1e-3


@pytest.mark.parametrize("schema, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "objekt"}', "not usable"),
])
def test_bad_schemas_are_refused_and_nothing_else_is_disturbed(tiny, schema, message):
    engine = _engine(tiny)
    with pytest.raises(InvalidRequest, match=message):
        engine.generate(PROMPTS[0], max_new_tokens=4, json_schema=schema)
    with pytest.raises(InvalidRequest, match=message):
        grammar_for_schema(schema)
    assert not engine.has_unfinished()
    assert len(engine.generate(PROMPTS[0], max_new_tokens=4)[0].token_ids) == 4


def test_a_schema_cannot_loosen_the_fixed_separators(tiny):
    """A schema's own x-guidance options would let whitespace back in; ours override them."""
    loose = CHOICE | {"x-guidance": {"whitespace_flexible": True, "item_separator": ",  "}}
    grammar = _engine(tiny)._grammar_tokenizer().matcher(grammar_for_schema(json.dumps(loose)))
    tok = tiny[2]
    for text, takes in [('{"x": "a"}', True), ('{"x":  "a"}', False), ('{ "x": "a"}', False)]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert (grammar.matcher.validate_tokens(ids) == len(ids)) == takes, text


def test_a_failed_matcher_ends_its_reply_instead_of_failing_the_step(tiny):
    grammar = _engine(tiny)._grammar_tokenizer().matcher(grammar_for_schema(json.dumps(CHOICE)))
    grammar.advance([tiny[2].convert_tokens_to_ids("x")])  # not JSON: the matcher enters its error state
    assert grammar.matcher.is_error()
    assert grammar.allowed_rows([7, 8]).nonzero().tolist() == [[0, 2], [1, 2], [2, 2]]  # end-of-sequence only


def test_a_try_that_fails_the_matcher_leaves_it_as_it_was(tiny):
    """A drafted token that puts the parser in its error state fails the rows after it (as
    plain decoding would fail after it), but the matcher that follows the reply is untouched."""
    tok = tiny[2]
    grammar = _engine(tiny)._grammar_tokenizer().matcher(grammar_for_schema(json.dumps(CHOICE)))
    prefix = tok('{"x": "', add_special_tokens=False)["input_ids"]
    grammar.advance(prefix)
    failing = grammar.matcher.deep_copy()
    failing.consume_token(tok.convert_tokens_to_ids("z"))  # refused: an error, as a parser limit would be
    grammar.matcher = _FailsOn(grammar.matcher, tok.convert_tokens_to_ids("b"), failing)
    rows = grammar.allowed_rows([tok.convert_tokens_to_ids(c) for c in 'b"}'])
    assert rows[0].nonzero().flatten().tolist() == [tok.convert_tokens_to_ids(c) for c in "abcd"]
    assert [r.nonzero().flatten().tolist() for r in rows[1:]] == [[2]] * 3
    assert not grammar.matcher.is_error()
    grammar.advance([tok.convert_tokens_to_ids("a")])
    assert grammar.allowed_rows([])[0].nonzero().flatten().tolist() == [tok.convert_tokens_to_ids('"')]


class _FailsOn:
    """A matcher whose try of one token fails it (becomes `failed`), as a parser limit would."""

    def __init__(self, matcher, token: int, failed):
        self._matcher, self._token, self._failed = matcher, token, failed

    def try_consume_tokens(self, tokens: list[int]) -> int:
        if tokens == [self._token]:
            self._matcher = self._failed
            return 0
        return self._matcher.try_consume_tokens(tokens)

    def __getattr__(self, name):
        return getattr(self._matcher, name)


def test_a_complete_reply_stays_under_its_grammar_when_decoding_goes_on(tiny):
    """With ignore_eos a reply goes on past its end: the grammar, complete, then allows only
    end-of-sequence, in every verify row after a drafted one as in plain decoding."""
    js = json.dumps(CHOICE)
    plain = [r.token_ids for r in _engine(tiny).generate(PROMPTS, max_new_tokens=24, json_schema=js,
                                                          ignore_eos=True)]
    oracle = OracleDraftTransport([p + r for p, r in zip(PROMPTS, plain)], wrong_rate=0.0, vocab_size=128)
    out = _engine(tiny, oracle).generate(PROMPTS, max_new_tokens=24, json_schema=js, ignore_eos=True)
    assert [r.token_ids for r in out] == plain
    assert all(2 in ids[:12] for ids in plain)  # each reply ended early and went on


def test_generate_takes_a_compiled_grammar_as_it_takes_a_schema(tiny):
    """A forced tool call reaches `generate` as a grammar (`grammar_for_calls`), not a schema."""
    js = json.dumps(CHOICE)
    by_schema = _engine(tiny).generate(PROMPTS, max_new_tokens=40, json_schema=js)
    by_grammar = _engine(tiny, tiny[1]).generate(PROMPTS, max_new_tokens=40, grammar=grammar_for_schema(js))
    assert [r.token_ids for r in by_grammar] == [r.token_ids for r in by_schema]
    assert [r.token_ids for r in by_schema] != [r.token_ids for r in _engine(tiny).generate(PROMPTS, max_new_tokens=40)]
    with pytest.raises(InvalidRequest, match="not both"):
        _engine(tiny).generate(PROMPTS, json_schema=js, grammar=grammar_for_schema(js))


def test_a_grammar_must_be_text_the_matcher_takes(tiny):
    from dlite_ray.engine.sequence import SamplingParams

    with pytest.raises(InvalidRequest, match="grammar's text"):
        SamplingParams(grammar={"type": "object"})
    with pytest.raises(InvalidRequest, match="grammar is not usable"):
        _engine(tiny).add_request(PROMPTS[0], SamplingParams(grammar="start: (("))


@pytest.mark.slow
def test_the_default_model_answers_in_the_schema_with_and_without_the_draft():
    spec = DLiteEngine.from_pretrained()
    plain = DLiteEngine(spec.target, spec.tokenizer, None)
    schema = json.dumps({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                         "required": ["city", "days"]})
    msgs = [{"role": "user", "content": "Plan a trip: which city, and for how many days? Answer in JSON."}]
    got = spec.generate(msgs, max_new_tokens=64, json_schema=schema)[0]
    want = plain.generate(msgs, max_new_tokens=64, json_schema=schema)[0]
    assert got.token_ids == want.token_ids  # float32: exact
    assert got.finish_reason == "stop"
    reply = json.loads(got.text)
    assert isinstance(reply["city"], str) and isinstance(reply["days"], int)


def test_serving_imports_leave_torch_compile_unloaded():
    """A replica, the draft actor and the CLI start without torch._dynamo / torch._inductor
    (seconds of every process start: llguidance.torch runs a torch.compile decorator on
    import, so structured output builds its masks itself)."""
    import subprocess
    import sys

    code = ("import sys, dlite_ray.serve.app, dlite_ray.serve.draft_worker, dlite_ray.cli; "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

"""A request's trace holds one row per output token, the same rows whether the tokens came
from plain steps or from drafted rounds, also when a stop token ends a round early."""

from __future__ import annotations

import random

import pytest
import torch

from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from tests.conftest import read_config
from tests.engine.conftest import make_engine, random_draft

PROMPTS = [[random.Random(70 + i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((7, 30, 61))]
NEW = 24
TOP_K = 5


def _traced(engine, **kw):
    return engine.generate(PROMPTS, max_new_tokens=NEW, trace_top_k=TOP_K, **kw)


def test_drafted_rounds_trace_the_rows_plain_decoding_traces(tiny_target):
    plain = _traced(make_engine(tiny_target), ignore_eos=True)
    references = [p + r.token_ids for p, r in zip(PROMPTS, plain, strict=True)]
    # a third of the drafted tokens wrong: rounds accept 0 to 7 tokens
    oracle = OracleDraftTransport(references, wrong_rate=0.3, seed=1, vocab_size=128)
    spec = _traced(make_engine(tiny_target, oracle, num_draft_tokens=7), ignore_eos=True)
    for p, s in zip(plain, spec, strict=True):
        assert s.token_ids == p.token_ids
        assert len(s.trace) == len(p.trace) == NEW
        assert s.trace.top_ids.tolist() == p.trace.top_ids.tolist()
        torch.testing.assert_close(s.trace.top_probs, p.trace.top_probs)
        assert s.trace.features is None  # the oracle reads no target layers
        # at T = 0 the most probable token at row i is output token i
        assert s.trace.top_ids[:, 0].tolist() == s.token_ids
    assert max(max(r.stats.accept_lengths) for r in spec) > 3


def test_a_draft_engine_traces_its_taps_as_a_plain_engine_tapping_them(tiny_target, tiny_target_dir):
    draft = random_draft(tiny_target, read_config(tiny_target_dir))
    layers = tuple(draft.cfg.target_layer_ids)
    plain = _traced(make_engine(tiny_target, tap_layers=layers), ignore_eos=True)
    spec = _traced(make_engine(tiny_target, draft, lookup_tokens=4), ignore_eos=True)
    for p, s in zip(plain, spec, strict=True):
        assert s.token_ids == p.token_ids
        assert p.trace.features.shape == (NEW, len(layers), tiny_target.cfg.hidden_size)
        assert p.trace.features.dtype == torch.bfloat16
        torch.testing.assert_close(s.trace.features.float(), p.trace.features.float(), atol=1e-2, rtol=1e-2)


def test_a_stop_token_inside_a_round_ends_the_trace_with_the_output(tiny_target):
    plain = _traced(make_engine(tiny_target), ignore_eos=True)
    stop = plain[1].token_ids[9]  # stops reply 1 at its 10th token (or earlier where it occurs)
    oracle = OracleDraftTransport([p + r.token_ids for p, r in zip(PROMPTS, plain, strict=True)])
    spec = _traced(make_engine(tiny_target, oracle, num_draft_tokens=7), stop_token_ids=(stop,), ignore_eos=True)
    assert len(spec[1].token_ids) <= 10
    for p, s in zip(plain, spec, strict=True):
        n = len(s.token_ids)
        assert len(s.trace) == n and s.trace.top_ids.tolist() == p.trace.top_ids[:n].tolist()


def test_untraced_requests_keep_no_trace_and_bad_sizes_are_refused(tiny_target, tiny_target_dir):
    engine = make_engine(tiny_target)
    assert engine.generate(PROMPTS[0], max_new_tokens=4)[0].trace is None
    with pytest.raises(InvalidRequest, match="trace_top_k"):
        SamplingParams(trace_top_k=-1)
    with pytest.raises(InvalidRequest, match="exceeds the vocabulary"):
        engine.add_request(PROMPTS[0], SamplingParams(trace_top_k=129))
    with pytest.raises(ValueError, match="differ from the draft"):
        make_engine(tiny_target, random_draft(tiny_target, read_config(tiny_target_dir)), tap_layers=(0,))
    with pytest.raises(ValueError, match="must lie in"):
        make_engine(tiny_target, tap_layers=(tiny_target.cfg.num_layers,))


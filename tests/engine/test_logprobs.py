"""Each output token's logprobs are the target's log-softmax where the token was chosen:
the same from drafted rounds as from plain steps, the chosen token's even when it was
sampled, and as many as the output, also when a stop token ends a round early."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.engine.logprobs import FLOOR, token_logprobs
from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from tests.conftest import read_config
from tests.engine.conftest import make_engine, random_draft
from tests.helpers import hf_logits

PROMPTS = [[random.Random(80 + i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((9, 33))]
NEW = 20
TOP = 4


def _reference(directory, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Log-softmax at the positions the output was chosen from, by transformers' model."""
    logits = hf_logits(directory, prompt + output[:-1]).logits[0, len(prompt) - 1:]
    return logits.float().log_softmax(-1)


def _chosen(result) -> list[float]:
    return [lp.logprob for lp in result.logprobs]


def test_drafted_rounds_report_the_logprobs_of_plain_decoding(tiny_target, tiny_target_dir):
    plain = make_engine(tiny_target).generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=TOP)
    oracle = OracleDraftTransport([p + r.token_ids for p, r in zip(PROMPTS, plain, strict=True)], wrong_rate=0.3,
                                  seed=2, vocab_size=128)
    spec = make_engine(tiny_target, oracle, num_draft_tokens=7).generate(PROMPTS, max_new_tokens=NEW,
                                                                         ignore_eos=True, logprobs=TOP)
    assert max(max(r.stats.accept_lengths) for r in spec) > 3  # rounds did accept drafts
    for prompt, p, s in zip(PROMPTS, plain, spec, strict=True):
        assert s.token_ids == p.token_ids and len(s.logprobs) == NEW
        assert [lp.top for lp in s.logprobs] == [lp.top for lp in p.logprobs]
        torch.testing.assert_close(torch.tensor(_chosen(s)), torch.tensor(_chosen(p)))
        ref = _reference(tiny_target_dir, prompt, p.token_ids)
        top_lp, top_ids = ref.topk(TOP, dim=-1)
        for i, lp in enumerate(s.logprobs):
            assert lp.token_id == p.token_ids[i] == lp.top[0][0]  # greedy: the chosen token is the most likely
            assert [t for t, _ in lp.top] == top_ids[i].tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top_lp[i], atol=1e-4, rtol=1e-4)
            assert lp.logprob == lp.top[0][1]


def test_sampled_tokens_report_their_own_logprob_at_temperature_one(tiny_target, tiny_target_dir):
    """Sampling at T = 1.5 from the top 8 picks unlikely tokens; each reports its own
    unscaled logprob, not the most likely token's and not the sampling distribution's."""
    draft = random_draft(tiny_target, read_config(tiny_target_dir))
    results = make_engine(tiny_target, draft).generate(PROMPTS, max_new_tokens=NEW, temperature=1.5, top_k=8,
                                                       seed=5, ignore_eos=True, logprobs=0)
    below_top = 0
    for prompt, r in zip(PROMPTS, results, strict=True):
        ref = _reference(tiny_target_dir, prompt, r.token_ids)
        expected = ref.gather(1, torch.tensor(r.token_ids).view(-1, 1)).squeeze(1)
        assert [lp.token_id for lp in r.logprobs] == r.token_ids
        assert all(lp.top == () for lp in r.logprobs)
        torch.testing.assert_close(torch.tensor(_chosen(r)), expected, atol=1e-4, rtol=1e-4)
        below_top += int((expected < ref.max(-1).values - 1e-3).sum())
    assert below_top > 0  # some samples were not the argmax, so the check above had teeth


def test_a_stop_token_inside_a_round_ends_the_logprobs_with_the_output(tiny_target):
    plain = make_engine(tiny_target).generate(PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=1)
    stop = plain[1].token_ids[7]
    oracle = OracleDraftTransport([p + r.token_ids for p, r in zip(PROMPTS, plain, strict=True)])
    spec = make_engine(tiny_target, oracle, num_draft_tokens=7).generate(
        PROMPTS, max_new_tokens=NEW, ignore_eos=True, logprobs=1, stop_token_ids=(stop,))
    assert len(spec[1].token_ids) <= 8
    for p, s in zip(plain, spec, strict=True):
        n = len(s.token_ids)
        assert [lp.token_id for lp in s.logprobs] == s.token_ids
        assert [lp.top for lp in s.logprobs] == [lp.top for lp in p.logprobs[:n]]


def test_logprobs_are_off_by_default_and_bad_counts_are_refused(tiny_target):
    engine = make_engine(tiny_target)
    assert engine.generate(PROMPTS[0], max_new_tokens=3)[0].logprobs is None
    for bad in (-1, 2.5, True):
        with pytest.raises(InvalidRequest, match="logprobs must be an integer"):
            SamplingParams(logprobs=bad)
    with pytest.raises(InvalidRequest, match="exceeds the vocabulary"):
        engine.add_request(PROMPTS[0], SamplingParams(logprobs=129))


def test_impossible_tokens_get_openais_floor_not_minus_infinity():
    """JSON has no -inf: a token of probability zero reports -9999, as OpenAI's API does."""
    [lp] = token_logprobs(torch.tensor([[0.0, -math.inf, 1.0]]), [1], top_n=3)
    assert lp.logprob == FLOOR and lp.top[-1] == (1, FLOOR)
    assert [t for t, _ in lp.top] == [2, 0, 1] and all(math.isfinite(v) for _, v in lp.top)

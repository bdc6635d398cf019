"""Greedy DLite output == greedy target output, token for token (float32)."""

from __future__ import annotations

import random

import pytest
import torch

from dlite_ray.bench.oracle import OracleDraftTransport
from tests.conftest import read_config
from tests.engine.conftest import make_engine, random_draft

PROMPTS = [[random.Random(i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((9, 17, 30, 12))]
NEW = 40


@pytest.fixture(scope="module")
def reference(tiny_target):
    ar = make_engine(tiny_target)
    return [r.token_ids for r in ar.generate(PROMPTS, max_new_tokens=NEW)]


def _oracle(prompts, reference, wrong_rate, vocab=128):
    return OracleDraftTransport([p + r for p, r in zip(prompts, reference)], wrong_rate=wrong_rate, vocab_size=vocab)


@pytest.mark.parametrize("batch", [1, 4])
def test_random_draft_matches_target(tiny_target, tiny_draft, reference, batch):
    engine = make_engine(tiny_target, tiny_draft)
    out = engine.generate(PROMPTS[:batch], max_new_tokens=NEW)
    assert [r.token_ids for r in out] == reference[:batch]


def test_a_draft_with_a_vocabulary_subset_matches_target(tiny_target, tiny_target_dir, reference):
    """Half the vocabulary, so some of the target's tokens can never be drafted (the
    sampled tests in test_sampled_engine.py are the ones a wrong token mapping fails)."""
    draft = random_draft(tiny_target, read_config(tiny_target_dir), seed=5)
    draft.sequential_head.restrict_vocabulary(torch.arange(0, 128, 2))
    out = make_engine(tiny_target, draft).generate(PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in out] == reference


@pytest.mark.parametrize("wrong_rate", [0.0, 0.3])
def test_oracle_draft_matches_target(tiny_target, reference, wrong_rate):
    engine = make_engine(tiny_target, _oracle(PROMPTS, reference, wrong_rate))
    out = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in out] == reference
    mean_tau = sum(r.stats.mean_accept_length for r in out) / len(out)
    if wrong_rate == 0:
        assert mean_tau > 5.5  # a perfect draft: full rounds of K + 1 = 8, short only at the end
    else:
        assert 1.5 < mean_tau < 6  # rejections happened, and output still matched


@pytest.mark.parametrize("verify_block_size", [1, 2, 4, 8])
def test_verify_block_sizes(tiny_target, reference, verify_block_size):
    engine = make_engine(tiny_target, _oracle(PROMPTS, reference, 0.2), verify_block_size=verify_block_size)
    out = engine.generate(PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in out] == reference
    # the drafting is shortened with the verify window: no round drafts what it cannot verify
    assert max(a for r in out for a in r.stats.accept_lengths) <= verify_block_size
    assert all(len(r.stats.position_trials) <= verify_block_size - 1 for r in out)


def test_rows_advance_by_their_own_acceptance(tiny_target, reference):
    engine = make_engine(tiny_target, _oracle(PROMPTS, reference, 0.3))
    out = engine.generate(PROMPTS, max_new_tokens=NEW)
    for r in out:  # every committed token came from this row's own rounds
        assert sum(r.stats.accept_lengths) == len(r.token_ids)
    assert len({tuple(r.stats.accept_lengths) for r in out}) > 1  # rows did not move in lockstep


def test_stop_tokens_end_the_request(tiny_target, tiny_draft, reference):
    engine = make_engine(tiny_target, tiny_draft)
    stop = reference[0][5]
    out = engine.generate(PROMPTS[0], max_new_tokens=NEW, stop_token_ids=(stop,))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == reference[0][:reference[0].index(stop) + 1]


def test_streaming_callback_sees_every_token_in_order(tiny_target, tiny_draft, reference):
    engine = make_engine(tiny_target, tiny_draft)
    seen: dict[int, list[int]] = {}
    engine.generate(PROMPTS, max_new_tokens=NEW, callback=lambda i, toks: seen.setdefault(i, []).extend(toks))
    assert [seen[i] for i in range(len(PROMPTS))] == reference


# Each prompt's last token occurred before with several different followers, so rounds
# verify trees: the draft's block and other continuations from the context next to it.
TREE_PROMPTS = [[5, 9, 7, 5, 11, 7, 5, 13, 7, 5, 17, 7, 5], [40, 41, 42, 40, 43, 44, 40, 45, 46, 40, 41, 47, 40]]


@pytest.mark.parametrize("draft_kind", ["random", "none"])
def test_tree_verification_matches_target(tiny_target, tiny_draft, draft_kind):
    want = [r.token_ids for r in make_engine(tiny_target).generate(TREE_PROMPTS, max_new_tokens=NEW)]
    engine = make_engine(tiny_target, tiny_draft if draft_kind == "random" else None, lookup_tokens=6,
                         tree_tokens=8)
    trees = []
    original = engine.runner.keep_branch
    engine.runner.keep_branch = lambda seq, branch: (trees.append(branch), original(seq, branch))
    out = engine.generate(TREE_PROMPTS, max_new_tokens=NEW)
    assert [r.token_ids for r in out] == want
    assert trees  # rounds did verify trees (and moved a kept branch's KV into place)
    if draft_kind == "random":  # a random draft is mostly wrong: some branch beat it
        assert sum(g for r in out for g in r.stats.branch_gains) > 0

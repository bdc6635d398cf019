"""End to end: the engine's sampled output follows the target's distribution at batch > 1,
and its paged KV after many rounds with rejections equals a fresh prefill."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.engine.model_runner import RowInput
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft
from tests.helpers import chi2_pvalue, forward_all, new_runner, new_seq

VOCAB = 12
PROMPT = [3, 5, 7, 4, 9, 6]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("v") / "llama", "llama", vocab=VOCAB)
    target = load_target(d)
    return target, random_draft(target, read_config(d), seed=3, block_size=4)


def _target_second_token_distribution(target, temperature, prompt=PROMPT):
    """P(token 2) = sum_t1 p(t1 | prompt) p(t2 | prompt, t1), enumerated exactly."""
    def probs(ids):
        logits = forward_all(new_runner(target), new_seq(ids), ids).logits[-1]
        return torch.softmax(logits / temperature, -1)

    p1 = probs(prompt)
    return sum(p1[t] * probs(prompt + [t]) for t in range(VOCAB)), p1


@pytest.mark.parametrize("verify_mode", ["rejection", "match"])
def test_sampled_tokens_follow_the_target(small_vocab, verify_mode):
    target, draft = small_vocab
    temperature = 0.9
    want2, want1 = _target_second_token_distribution(target, temperature)
    engine = make_engine(target, draft)
    firsts, seconds, rounds = [], [], 0
    for rep in range(4):  # 4 x 400 rows, each with its own seed
        out = engine.generate([PROMPT] * 400, max_new_tokens=3, temperature=temperature, seed=rep * 1000,
                              verify_mode=verify_mode, ignore_eos=True)
        firsts += [r.token_ids[0] for r in out]
        seconds += [r.token_ids[1] for r in out]
        rounds += sum(len(r.stats.accept_lengths) for r in out)
    for got, want in ((seconds, want2), (firsts, want1)):
        assert chi2_pvalue(got, want.double().numpy()) > 1e-3


@pytest.fixture(scope="module")
def subset_draft(small_vocab, tmp_path_factory):
    """A draft that proposes only half of the small vocabulary (draft_vocab.py)."""
    target, _ = small_vocab
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("sv") / "llama", "llama", vocab=VOCAB)
    draft = random_draft(target, read_config(d), seed=4, block_size=4)
    draft.sequential_head.restrict_vocabulary(torch.tensor([1, 4, 5, 6, 8, 11]))
    return draft


def _sample(target, draft, temperature: float, reps: int = 4) -> tuple[list[int], list[int]]:
    return _first_two_tokens(make_engine(target, draft), PROMPT, temperature, reps)


def _first_two_tokens(engine, prompt: list[int], temperature: float, reps: int) -> tuple[list[int], list[int]]:
    """The first and second tokens of reps x 400 sampled replies to `prompt`, each with its own seed."""
    firsts, seconds = [], []
    for rep in range(reps):
        out = engine.generate([prompt] * 400, max_new_tokens=3, temperature=temperature, seed=rep * 1000,
                              ignore_eos=True)
        firsts += [r.token_ids[0] for r in out]
        seconds += [r.token_ids[1] for r in out]
    return firsts, seconds


def test_a_vocabulary_subset_draft_still_samples_the_target(small_vocab, subset_draft):
    """Tokens the draft cannot propose still come, from the residual, as often as they should."""
    target, _ = small_vocab
    want2, want1 = _target_second_token_distribution(target, 0.9)
    firsts, seconds = _sample(target, subset_draft, 0.9)
    for got, want in ((seconds, want2), (firsts, want1)):
        assert chi2_pvalue(got, want.double().numpy()) > 1e-3


def test_a_subset_draft_whose_distributions_sit_on_the_wrong_tokens_is_caught(small_vocab, subset_draft,
                                                                             monkeypatch):
    """Put each subset probability on the next token id: verification then weighs each draft
    by another token's q, and the sampled tokens stop following the target."""
    from dlite_ray.runtime.draft_model import DraftProposal

    target, _ = small_vocab
    _, want1 = _target_second_token_distribution(target, 0.9)
    right = DraftProposal.vocabulary_probs
    monkeypatch.setattr(DraftProposal, "vocabulary_probs", lambda self, v: right(self, v).roll(1, dims=-1))
    firsts, _ = _sample(target, subset_draft, 0.9)
    assert chi2_pvalue(firsts, want1.double().numpy()) < 1e-3


def test_broken_acceptance_is_caught(small_vocab, monkeypatch):
    """Accept every draft: the second token then follows the draft, and the test sees it."""
    import dlite_ray.engine.spec_decode as sd

    target, draft = small_vocab
    want2, _ = _target_second_token_distribution(target, 0.9)

    def always_accept(p, q, drafts, num, gens):
        return num.clone(), drafts[:, 0]

    monkeypatch.setattr(sd, "verify_rejection", always_accept)
    engine = make_engine(target, draft)
    out = engine.generate([PROMPT] * 1200, max_new_tokens=3, temperature=0.9, seed=7, ignore_eos=True)
    assert chi2_pvalue([r.token_ids[1] for r in out], want2.double().numpy()) < 1e-3


# Ends in "3 5", which the prompt began with: the first round copies "7 4 9" from the context.
COPYING_PROMPT = PROMPT + PROMPT[:2]


def _sample_copying(engine, temperature: float, reps: int = 4) -> tuple[list[int], list[int], int]:
    firsts, seconds, copied = [], [], 0
    for rep in range(reps):
        out = engine.generate([COPYING_PROMPT] * 400, max_new_tokens=3, temperature=temperature, seed=rep * 1000,
                              ignore_eos=True)
        firsts += [r.token_ids[0] for r in out]
        seconds += [r.token_ids[1] for r in out]
        copied += sum(r.stats.copied_rounds[0] for r in out)
    return firsts, seconds, copied


def test_sampled_copied_tokens_follow_the_target(small_vocab):
    """Copied tokens have no draft distribution; sampled rows check them in match mode."""
    target, _ = small_vocab
    want2, want1 = _target_second_token_distribution(target, 0.9, COPYING_PROMPT)
    firsts, seconds, copied = _sample_copying(make_engine(target, lookup_tokens=3), 0.9)
    assert copied == len(firsts)  # every request's first round copied
    for got, want in ((seconds, want2), (firsts, want1)):
        assert chi2_pvalue(got, want.double().numpy()) > 1e-3


def test_broken_copy_acceptance_is_caught(small_vocab, monkeypatch):
    """Accept every copied token: the first token is then always the copied 7."""
    import dlite_ray.engine.spec_decode as sd

    target, _ = small_vocab
    _, want1 = _target_second_token_distribution(target, 0.9, COPYING_PROMPT)
    monkeypatch.setattr(sd, "verify_match", lambda p, drafts, num, gens: (num.clone(), drafts[:, 0]))
    firsts, _, _ = _sample_copying(make_engine(target, lookup_tokens=3), 0.9, reps=1)
    assert chi2_pvalue(firsts, want1.double().numpy()) < 1e-3


def test_seeded_generation_is_reproducible(small_vocab):
    target, draft = small_vocab
    engine = make_engine(target, draft)
    a = engine.generate([PROMPT, PROMPT[:3]], max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    b = engine.generate([PROMPT, PROMPT[:3]], max_new_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_kv_after_rounds_equals_fresh_prefill(tiny_target, tiny_draft):
    from dlite_ray.engine.sequence import SamplingParams

    engine = make_engine(tiny_target, tiny_draft, block_size=4)
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=30)) for p in (list(range(3, 20)), list(range(40, 49)))]
    for _ in range(8):
        engine.step()
    assert not any(s.is_finished for s in seqs)
    assert any(a < 8 for s in seqs for a in s.stats.accept_lengths)  # rejections happened
    cache = engine.runner.cache
    for seq in seqs:
        n = seq.num_computed
        fresh_runner = new_runner(tiny_target, block_size=4)
        fresh = new_seq(seq.token_ids[:n])
        fresh_runner.forward([RowInput(fresh, seq.token_ids[:n])])
        slots = torch.tensor([b * 4 + o for b in seq.block_table for o in range(4)])[:n]
        fresh_slots = torch.tensor([b * 4 + o for b in fresh.block_table for o in range(4)])[:n]
        for layer in range(tiny_target.cfg.num_layers):
            torch.testing.assert_close(cache.k[layer][:, slots], fresh_runner.cache.k[layer][:, fresh_slots],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.v[layer][:, slots], fresh_runner.cache.v[layer][:, fresh_slots],
                                       atol=1e-5, rtol=1e-5)
    blocks = engine.scheduler.blocks
    held = [b for s in seqs for b in s.block_table]
    assert held and blocks.num_used_blocks == len(set(held))
    for s in seqs:
        assert engine.abort(s.request_id)
    # an aborted request keeps no boundary: every block it held is free again (cached ones evictable)
    assert blocks.num_used_blocks == 0
    assert all(blocks.ref_count(b) == 0 for b in held)


# Ends in 3, which was followed by 5, 9, 4 and 6 earlier: the draft's block and those
# continuations are verified together as a tree (candidate_tree.py).
TREE_PROMPT = [3, 5, 7, 3, 9, 7, 3, 4, 7, 3, 6, 3]


def _sample_trees(target, draft, temperature: float, reps: int = 4) -> tuple[list[int], list[int], int]:
    engine = make_engine(target, draft, lookup_tokens=3, tree_tokens=8)
    trees = []
    original = engine.runner.keep_branch
    engine.runner.keep_branch = lambda seq, branch: (trees.append(branch), original(seq, branch))
    firsts, seconds = _first_two_tokens(engine, TREE_PROMPT, temperature, reps)
    return firsts, seconds, len(trees)


def test_sampled_trees_follow_the_target(small_vocab):
    """Drafted tokens (by min(1, r/q)) and copied ones (by r) compete at the same node."""
    target, draft = small_vocab
    want2, want1 = _target_second_token_distribution(target, 0.9, TREE_PROMPT)
    firsts, seconds, trees = _sample_trees(target, draft, 0.9)
    assert trees >= len(firsts)  # every request's first round verified a tree
    for got, want in ((seconds, want2), (firsts, want1)):
        assert chi2_pvalue(got, want.double().numpy()) > 1e-3


def test_a_tree_walk_that_forgets_rejected_candidates_is_caught(small_vocab, monkeypatch):
    """Draw from the whole distribution after a rejection, not from what remains: the
    rejected candidates come back too often, and the test sees it."""
    from dlite_ray.engine import candidate_tree

    target, draft = small_vocab
    _, want1 = _target_second_token_distribution(target, 0.9, TREE_PROMPT)
    monkeypatch.setattr(candidate_tree, "_residual", lambda r, x, q: r)
    firsts, _, _ = _sample_trees(target, draft, 0.9, reps=2)
    assert chi2_pvalue(firsts, want1.double().numpy()) < 1e-3

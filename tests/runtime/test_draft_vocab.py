"""The draft's vocabulary subset: which tokens, the file's checks, and a restricted head
that proposes only those tokens with distributions over the whole vocabulary."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from dlite_ray.runtime.draft_config import DraftConfigError
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.draft_vocab import DRAFT_VOCAB_FILE, frequent_tokens, load_draft_vocab, save_draft_vocab
from dlite_ray.runtime.loading import load_target
from dlite_ray.runtime.sampling import RowSampling
from tests.conftest import read_config
from tests.engine.conftest import random_draft


def test_frequent_tokens_are_the_most_counted_sorted_by_id():
    counts = torch.tensor([0, 5, 5, 1, 0, 9])
    assert frequent_tokens(counts, 3).tolist() == [1, 2, 5]
    # uncounted tokens fill the rest in id order (BPE ids follow merge order)
    assert frequent_tokens(counts, 5).tolist() == [0, 1, 2, 3, 5]
    with pytest.raises(ValueError, match="draft vocabulary size"):
        frequent_tokens(counts, 0)


def test_the_file_round_trips_and_is_checked(tmp_path):
    assert load_draft_vocab(tmp_path, 10) is None  # no file: the whole vocabulary
    save_draft_vocab(tmp_path, torch.tensor([1, 4, 7]))
    assert load_draft_vocab(tmp_path, 10).tolist() == [1, 4, 7]
    bad = {"must lie in": torch.tensor([1, 10]), "sorted and unique": torch.tensor([4, 4]),
           "int64": torch.tensor([1, 2], dtype=torch.int32)}
    for message, ids in bad.items():
        save_file({"token_ids": ids}, tmp_path / DRAFT_VOCAB_FILE)
        with pytest.raises(DraftConfigError, match=message):
            load_draft_vocab(tmp_path, 10)
    save_file({"ids": torch.tensor([1])}, tmp_path / DRAFT_VOCAB_FILE)
    with pytest.raises(DraftConfigError, match="token_ids"):
        load_draft_vocab(tmp_path, 10)


def test_restricting_a_head_needs_sorted_distinct_ids(tiny_dirs):
    target = load_target(tiny_dirs["llama"])
    head = random_draft(target, read_config(tiny_dirs["llama"])).sequential_head
    for bad in ([3, 3, 5], [5, 3], []):
        with pytest.raises(ValueError, match="sorted list of distinct ids"):
            head.restrict_vocabulary(torch.tensor(bad, dtype=torch.long))


@pytest.fixture
def saved(tiny_dirs, tmp_path):
    target = load_target(tiny_dirs["llama"])
    draft = random_draft(target, read_config(tiny_dirs["llama"]))
    draft.save(tmp_path / "draft", dtype=torch.float32)
    return target, tmp_path / "draft"


def _propose(draft, hidden: int, temperature: float, seed: int = 0):
    torch.manual_seed(seed)
    feats = torch.randn(3, draft.cfg.num_slots, hidden)
    groups = torch.tensor([[5], [9], [17]])
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    s = RowSampling.build([temperature] * 3, [0] * 3, [1.0] * 3, gens)
    return draft.propose(feats, groups, 5, s, torch.tensor([temperature == 0] * 3))


def _load(target, path):
    return DLiteDraftModel.load(path, target.embed_tokens, target.cfg.num_layers)


def test_a_restricted_draft_proposes_only_its_tokens(saved):
    target, path = saved
    hidden = target.cfg.hidden_size
    full = _propose(_load(target, path), hidden, 0.0).tokens
    # A subset holding every token the full head chose: the same greedy proposals.
    keep = torch.cat([full.flatten(), torch.arange(0, 128, 7)]).unique()
    save_draft_vocab(path, keep)
    assert torch.equal(_propose(_load(target, path), hidden, 0.0).tokens, full)
    # A subset without them: other tokens, all inside it.
    keep = torch.tensor(sorted(set(range(128)) - set(full.flatten().tolist())))
    save_draft_vocab(path, keep)
    greedy = _propose(_load(target, path), hidden, 0.0).tokens
    assert torch.isin(greedy, keep).all() and not torch.isin(greedy, full.flatten()).any()


def test_sampled_drafts_come_with_distributions_over_the_whole_vocabulary(saved):
    target, path = saved
    keep = torch.arange(3, 128, 5)
    save_draft_vocab(path, keep)
    out = _propose(_load(target, path), target.cfg.hidden_size, 0.8)
    assert out.probs.shape == (3, 5, len(keep)) and torch.equal(out.prob_ids, keep)  # subset-wide until used
    probs = out.vocabulary_probs(128)
    assert probs.shape == (3, 5, 128)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 5))
    outside = torch.ones(128, dtype=torch.bool)
    outside[keep] = False
    assert probs[..., outside].abs().max() == 0
    # every drafted token was drawn where its distribution puts mass
    drawn = probs.gather(-1, out.tokens[..., None])[..., 0]
    assert (drawn > 0).all() and torch.isin(out.tokens, keep).all()

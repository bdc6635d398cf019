"""Training over the draft's vocabulary: indices into the subset, logits over its rows."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.runtime.sequential_head import DLiteSequentialHead
from dlite_ray.training.batches import Batch
from dlite_ray.training.vocabulary import OUTSIDE, TrainingVocabulary


def _batch(labels, top_ids) -> Batch:
    labels, top_ids = torch.tensor(labels), torch.tensor(top_ids)
    return Batch(torch.zeros(1, 2, 4), labels[:, :1], labels.clone(), labels, torch.ones(labels.shape),
                 top_ids, torch.full(top_ids.shape, 0.1))


def test_labels_and_top_ids_become_indices_into_the_subset():
    vocab = TrainingVocabulary(torch.tensor([2, 5, 9]), vocab_size=12)
    batch = vocab.restrict(_batch([[5, 3, 9]], [[[2, 5], [3, 4], [9, 11]]]))
    assert batch.labels.tolist() == [[1, OUTSIDE, 2]]
    assert batch.top_ids.tolist() == [[[0, 1], [OUTSIDE, OUTSIDE], [2, OUTSIDE]]]
    assert batch.prev_tokens.tolist() == [[5, 3, 9]]  # the head's input embedding reads token ids


@pytest.mark.parametrize("ids", [[5, 2], [2, 2], [2, 12], [-1, 3]])
def test_a_subset_must_be_sorted_distinct_and_in_range(ids):
    with pytest.raises(ValueError, match="sorted, distinct"):
        TrainingVocabulary(torch.tensor(ids), vocab_size=12)


def test_subset_logits_are_the_whole_vocabularys_columns():
    torch.manual_seed(0)
    head = DLiteSequentialHead(hidden_size=8, rank=4, vocab_size=12)
    u, prev = torch.randn(3, 5, 8), torch.randint(0, 12, (3, 5))
    ids = torch.tensor([0, 4, 7, 11])
    full = head.teacher_forced(u, prev, head.initial_state(3, u))
    subset = head.teacher_forced(u, prev, head.initial_state(3, u), ids)
    torch.testing.assert_close(subset, full[..., ids])

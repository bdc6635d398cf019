"""Distillation losses against hand-computed values."""

from __future__ import annotations

import math

import torch

from dlite_ray.training.losses import (
    cosine_lr,
    cross_entropy,
    kl_divergence,
    log_probabilities,
    position_weights,
    total_variation_topk,
)


def test_position_weights_decay_and_average_one():
    w = position_weights(3, gamma=1.0)
    raw = torch.tensor([1.0, math.exp(-1), math.exp(-2)])
    torch.testing.assert_close(w, raw * 3 / raw.sum())
    assert w.mean().item() == 1.0 or abs(w.mean().item() - 1) < 1e-6


def test_cross_entropy_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # p = [1/4, 3/4]
    labels = torch.tensor([[1]])
    got = cross_entropy(log_probabilities(logits), labels, torch.ones(1))
    assert abs(got.item() + math.log(0.75)) < 1e-6


def test_total_variation_with_a_tail_bucket():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))
    top_ids = torch.tensor([[[0, 2]]])
    top_probs = torch.tensor([[[0.6, 0.1]]])  # target tail (token 1) = 0.3
    # |0.5-0.6| + |0.2-0.1| + |(1-0.7) - (1-0.7)| = 0.2
    got = total_variation_topk(log_probabilities(logits), top_ids, top_probs, torch.ones(1))
    assert abs(got.item() - 0.2) < 1e-6


def test_kl_is_zero_for_equal_and_positive_otherwise():
    a = torch.randn(2, 3, 5)
    w = torch.ones(3)
    assert kl_divergence(a, a, w).abs().item() < 1e-6
    assert kl_divergence(a, a.flip(-1), w).item() > 0


def test_cosine_schedule():
    assert cosine_lr(0, 100, 1.0, warmup=10) == 0.1
    assert abs(cosine_lr(10, 100, 1.0, warmup=10) - 1.0) < 1e-9
    assert cosine_lr(100, 100, 1.0, warmup=10) < 1e-9


def test_a_label_outside_the_drafts_vocabulary_trains_nothing():
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # p = [1/4, 3/4] twice
    got = cross_entropy(log_probabilities(logits), torch.tensor([[1, -1]]), torch.ones(2))
    assert abs(got.item() + math.log(0.75) / 2) < 1e-6  # the mean over both positions, the second adds 0


def test_total_variation_puts_top_ids_outside_the_vocabulary_in_the_tail():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2]]]))  # the draft's 3 tokens
    top_ids = torch.tensor([[[0, -1]]])
    top_probs = torch.tensor([[[0.6, 0.1]]])  # 0.1 on a token the draft lacks: tail 1 - 0.6
    # |0.5-0.6| + |(1-0.5) - (1-0.6)| = 0.2
    got = total_variation_topk(log_probabilities(logits), top_ids, top_probs, torch.ones(1))
    assert abs(got.item() - 0.2) < 1e-6

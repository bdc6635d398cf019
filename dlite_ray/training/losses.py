"""Distillation losses (REFERENCE.md section 4), each weighted by block position.

log_probs: [N, K, V] float32 log-softmax of the draft head (one log-softmax serves both
CE and TV: at 49152 vocabulary rows a step, each softmax pass and its backward is a
sizeable share of a CPU training step); labels: [N, K] target greedy tokens. Over the
draft's vocabulary (`vocabulary.py`) V is the subset's size, labels and top-k ids are
indices into it, and OUTSIDE stands for a token it lacks: such a label trains nothing, such
a top-k id joins the TV tail bucket.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

OUTSIDE = -1  # a label or top-k id the draft's vocabulary lacks


def position_weights(k: int, gamma: float, device=None) -> torch.Tensor:
    """exp(-j / gamma) for block positions j = 0..K-1, normalised to mean 1: later
    positions matter less because they are only reached when every earlier one passed."""
    w = torch.exp(-torch.arange(k, dtype=torch.float32, device=device) / gamma)
    return w * (k / w.sum())


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    return F.log_softmax(logits, dim=-1, dtype=torch.float32)


def cross_entropy(log_probs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    ce = F.nll_loss(log_probs.flatten(0, 1), labels.flatten().long(), reduction="none", ignore_index=OUTSIDE)
    return (ce.view(labels.shape) * weights).mean()


def total_variation_topk(log_probs: torch.Tensor, top_ids: torch.Tensor, top_probs: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    """sum_v |softmax(draft) - p_target| with the target known on its top-k ids only: the
    rest of the vocabulary is one bucket (a lower bound on the full L1, exact when p's mass
    sits in its top-k). Top-k ids OUTSIDE the draft's vocabulary join the bucket."""
    known = top_ids != OUTSIDE
    q_top = log_probs.gather(-1, top_ids.long().clamp(min=0)).exp() * known
    p_top = top_probs.float() * known
    head = (q_top - p_top).abs().sum(-1)
    tail = ((1 - q_top.sum(-1)) - (1 - p_top.sum(-1))).abs()
    return ((head + tail) * weights).mean()


def kl_divergence(teacher_logits: torch.Tensor, student_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Forward KL(teacher || student) per position."""
    t = teacher_logits.float().log_softmax(-1)
    s = student_logits.float().log_softmax(-1)
    return ((t.exp() * (t - s)).sum(-1) * weights).mean()


def cosine_lr(step: int, total: int, base: float, warmup: int) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return base * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

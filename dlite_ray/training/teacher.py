"""Two-stage distillation (REFERENCE.md section 4).

Stage 0, teacher: the draft's backbone and head plus a sliding window of the W positions
before the pivot, whose keys/values carry fused [first; middle; last] target layers. With
that history the head learns the in-block dependencies more easily than without it.
Stage 1, student: a history-free backbone from scratch under the teacher's sequential head,
copied in and frozen; the loss blends forward KL(teacher || student) into CE + TV along a
cosine. Stage 2 (`student_objective`): everything trainable, CE + TV.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dlite_ray.runtime.draft_model import DLiteDraftModel, HistoryWindow
from dlite_ray.runtime.layers import RMSNorm
from dlite_ray.training.batches import Batch
from dlite_ray.training.losses import kl_divergence, position_weights
from dlite_ray.training.trainer import Objective, TrainConfig, distillation_loss, draft_logits
from dlite_ray.training.vocabulary import Vocab


class WindowTeacher(nn.Module):
    def __init__(self, draft: DLiteDraftModel, window: int):
        super().__init__()
        if window <= 0:
            raise ValueError("the teacher needs a window of at least one position")
        self.draft, self.window = draft, window
        s, d = draft.cfg.num_slots, draft.cfg.layers.hidden_size
        # first, middle and last of the selected target layers
        self.history_slots = tuple(sorted({0, s // 2, s - 1}))
        self.fuse = nn.Linear(len(self.history_slots) * d, d, bias=False)
        self.fuse_norm = RMSNorm(d, draft.cfg.layers.rms_norm_eps)

    def head_logits(self, batch: Batch, vocab: Vocab = None) -> torch.Tensor:
        # the teacher's and the blend's objectives make their batches with the teacher's window
        assert batch.history is not None and batch.history_valid is not None
        states = self.fuse_norm(self.fuse(batch.history.flatten(2).to(batch.features.dtype)))
        distances = torch.arange(self.window, 0, -1, device=states.device)
        return draft_logits(self.draft, batch, HistoryWindow(states, distances, batch.history_valid), vocab)


def teacher_objective(teacher: WindowTeacher, cfg: TrainConfig, vocab: Vocab = None) -> Objective:
    def loss(batch: Batch, _progress: float, vocab: Vocab) -> tuple[torch.Tensor, dict[str, float]]:
        return distillation_loss(teacher.head_logits(batch, vocab), batch, cfg)

    return Objective(teacher, loss, teacher.head_logits, teacher.window, teacher.history_slots, vocab)


def adopt_teacher_head(student: DLiteDraftModel, teacher: WindowTeacher) -> None:
    """Stage 1 starts from the teacher's sequential head, frozen."""
    student.sequential_head.load_state_dict(teacher.draft.sequential_head.state_dict())
    student.sequential_head.requires_grad_(False)


def blend_weight(progress: float) -> float:
    """0 -> 1 along a half cosine: the stage starts on pure KL and ends on pure CE + TV."""
    return 0.5 * (1 - math.cos(math.pi * min(max(progress, 0.0), 1.0)))


def blend_objective(student: DLiteDraftModel, teacher: WindowTeacher, cfg: TrainConfig,
                    vocab: Vocab = None) -> Objective:
    def logits(batch: Batch, vocab: Vocab) -> torch.Tensor:
        return draft_logits(student, batch, vocab=vocab)

    def loss(batch: Batch, progress: float, vocab: Vocab) -> tuple[torch.Tensor, dict[str, float]]:
        drafted = logits(batch, vocab)
        with torch.no_grad():
            teacher.eval()
            target = teacher.head_logits(batch, vocab)
        w = position_weights(drafted.shape[1], cfg.gamma, drafted.device) * batch.label_mask
        kl = kl_divergence(target, drafted, w)
        direct, parts = distillation_loss(drafted, batch, cfg)
        alpha = blend_weight(progress)
        return (1 - alpha) * kl + alpha * direct, {"kl": kl.item(), **parts}

    # batches carry the teacher's window; the student never looks at it
    return Objective(student, loss, logits, teacher.window, teacher.history_slots, vocab)

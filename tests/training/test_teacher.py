"""Stage-0 teacher and the two-stage student: the teacher's window mask sees exactly the W
positions before each pivot, rows never see each other (the student's block-diagonal
mask), the teacher learns, and stage 1 keeps the teacher's head frozen."""

from __future__ import annotations

import torch

from dlite_ray.training.batches import all_anchors, history_window, make_batch
from dlite_ray.training.data import Record
from dlite_ray.training.teacher import (
    WindowTeacher,
    adopt_teacher_head,
    blend_objective,
    blend_weight,
    teacher_objective,
)
from dlite_ray.training.trainer import TrainConfig, draft_logits, greedy_acceptance, student_objective, train
from dlite_ray.training.vocabulary import TrainingVocabulary
from tests.conftest import read_config
from tests.engine.conftest import random_draft
from tests.training.test_train_tiny import _records

K = 7


def _record(n: int, s: int = 3, d: int = 4) -> Record:
    feats = torch.arange(n * s * d, dtype=torch.float32).view(n, s, d).to(torch.bfloat16)
    return Record(torch.arange(n + 5, dtype=torch.int32), 5, feats, torch.zeros(n, dtype=torch.int32),
                  torch.zeros(n, 2, dtype=torch.int32), torch.ones(n, 2, dtype=torch.float16) / 2)


def test_history_window_is_the_w_positions_before_the_pivot_right_aligned():
    rec = _record(10)
    hist, valid = history_window([rec], [(0, 2), (0, 6)], window=4, slots=(0, 2))
    assert valid.tolist() == [[False, False, True, True], [True, True, True, True]]
    torch.testing.assert_close(hist[0, 2:], rec.features[0:2, [0, 2]].float())
    torch.testing.assert_close(hist[1], rec.features[2:6, [0, 2]].float())
    assert hist[0, :2].abs().sum() == 0  # padding, masked out anyway


def _teacher_and_batch(tmp_path, window=5):
    target, draft, _engine, records = _records(tmp_path)
    teacher = WindowTeacher(random_draft(target, read_config(tmp_path / "t"), seed=3), window).eval()
    anchors = [(0, 1), (0, 9), (1, 12)]  # a short history (1 entry) and two full ones
    return target, draft, teacher, records, anchors


def test_teacher_sees_exactly_its_window(tmp_path):
    _, _, teacher, records, anchors = _teacher_and_batch(tmp_path)
    w = teacher.window
    batch = make_batch(records, anchors, K, w, teacher.history_slots)
    base = teacher.head_logits(batch)

    def logits_after(change_row: int, change_entry: int, value: float) -> torch.Tensor:
        b = make_batch(records, anchors, K, w, teacher.history_slots)
        b.history[change_row, change_entry] = value
        return teacher.head_logits(b)

    # an entry inside row 1's window changes row 1 only
    moved = logits_after(1, w - 1, 3.0)
    assert not torch.allclose(moved[1], base[1])
    torch.testing.assert_close(moved[0], base[0])
    torch.testing.assert_close(moved[2], base[2])
    # row 0 has one position of history: its padded entries are masked out
    torch.testing.assert_close(logits_after(0, 0, 5.0), base)
    # nothing at or after the pivot, nor before the window, is read: rebuilding the batch from
    # records whose features changed there leaves the logits as they were
    r, j = anchors[2]  # the only row on record 1
    saved = records[r].features
    records[r].features = saved.clone()
    records[r].features[j + 1:] = 7
    records[r].features[:j - w] = -7
    again = teacher.head_logits(make_batch(records, anchors, K, w, teacher.history_slots))
    records[r].features = saved
    torch.testing.assert_close(again, base)


def test_rows_never_attend_to_each_other(tmp_path):
    _, draft, _, records, anchors = _teacher_and_batch(tmp_path)
    together = draft_logits(draft, make_batch(records, anchors, K))
    for i, a in enumerate(anchors):
        torch.testing.assert_close(draft_logits(draft, make_batch(records, [a], K))[0], together[i],
                                   rtol=1e-4, atol=1e-4)


def test_blend_runs_from_kl_to_direct_loss():
    assert blend_weight(0.0) == 0.0 and abs(blend_weight(1.0) - 1) < 1e-12
    assert abs(blend_weight(0.5) - 0.5) < 1e-12


def test_two_stages_learn_and_stage_one_keeps_the_teacher_head(tmp_path):
    target, draft, _engine, records = _records(tmp_path)
    anchors = all_anchors(records, K)
    cfg = TrainConfig(steps=50, batch_size=32, lr=3e-3, warmup=5, eval_every=50, checkpoint_every=50,
                      bf16_autocast=False)
    teacher = WindowTeacher(random_draft(target, read_config(tmp_path / "t"), seed=3), window=8)
    for p in teacher.draft.embed_tokens.parameters():
        p.requires_grad_(False)
    summary = train(teacher_objective(teacher, cfg), records, anchors, records, anchors, K, cfg,
                    tmp_path / "run", "teacher")
    losses = [h["loss"] for h in summary["history"]]
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10])

    for p in draft.embed_tokens.parameters():
        p.requires_grad_(False)
    adopt_teacher_head(draft, teacher)
    head_before = {k: v.clone() for k, v in draft.sequential_head.state_dict().items()}
    backbone_before = draft.layers[0].mlp.down_proj.weight.clone()
    blend = train(blend_objective(draft, teacher, cfg), records, anchors, records, anchors, K,
                  cfg, tmp_path / "run", "student_blend")
    assert "kl" in blend["history"][0]
    for k, v in draft.sequential_head.state_dict().items():
        assert torch.equal(v, head_before[k]), k
    assert not torch.equal(draft.layers[0].mlp.down_proj.weight, backbone_before)
    # the blend starts on KL: the student's KL to the teacher falls
    kls = [h["kl"] for h in blend["history"]]
    assert sum(kls[-10:]) < sum(kls[:10])
    draft.sequential_head.requires_grad_(True)
    before_stage2 = greedy_acceptance(student_objective(draft, cfg), records, anchors, K)["tau"]
    stage2 = train(student_objective(draft, cfg), records, anchors, records, anchors, K, cfg,
                   tmp_path / "run", "student")
    assert not torch.equal(draft.sequential_head.output_proj.weight, head_before["output_proj.weight"])
    # stage 2 trains on the dev records themselves: their greedy acceptance must rise
    assert stage2["final_dev"]["tau"] > before_stage2, (before_stage2, stage2["final_dev"]["tau"])


def test_both_stages_train_over_the_drafts_vocabulary(tmp_path):
    target, draft, _engine, records = _records(tmp_path)
    anchors = all_anchors(records, K)[:16]
    vocab = TrainingVocabulary(torch.arange(0, 128, 4), vocab_size=128)
    cfg = TrainConfig(bf16_autocast=False)
    teacher = WindowTeacher(random_draft(target, read_config(tmp_path / "t"), seed=3), window=8)
    for objective in (teacher_objective(teacher, cfg, vocab), blend_objective(draft, teacher, cfg, vocab)):
        batch = objective.batch(records, anchors, K)
        assert objective.logits(batch).shape == (16, K, 32)
        loss, _ = objective.loss(batch, 0.5)
        assert torch.isfinite(loss)

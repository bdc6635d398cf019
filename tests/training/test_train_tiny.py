"""A tiny end-to-end distillation: features from a tiny target, a few steps, a loadable
draft whose loss went down; anchors and batches built as documented."""

from __future__ import annotations

import argparse
import logging
import random

import pytest
import torch
import torch.nn.functional as F

from dlite_ray import cli
from dlite_ray.engine.model_runner import ModelRunner, RowInput
from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.draft_vocab import frequent_tokens, load_draft_vocab, save_draft_vocab
from dlite_ray.runtime.loading import load_target
from dlite_ray.training import pipeline
from dlite_ray.training.batches import all_anchors, chain_mask, make_batch
from dlite_ray.training.data import TOP_K, Record, answer_prompts, label_counts, load_records, record_of, save_records
from dlite_ray.training.pipeline import init_weights, write_draft_vocab
from dlite_ray.training.trainer import (
    Objective,
    TrainConfig,
    decode_walk,
    distillation_loss,
    draft_logits,
    greedy_acceptance,
    student_objective,
    train,
)
from dlite_ray.training.vocabulary import TrainingVocabulary
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft


def _records(tmp_path):
    """(target, draft, tapping engine, records of its greedy replies to 6 random prompts)."""
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(d)
    draft = random_draft(target, read_config(d), seed=0)
    engine = make_engine(target, tap_layers=tuple(draft.cfg.target_layer_ids))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 128) for _ in range(rng.randrange(5, 20))] for _ in range(6)]
    replies = engine.generate(prompts, max_new_tokens=24, ignore_eos=True, trace_top_k=TOP_K)
    return target, draft, engine, [record_of(p, r) for p, r in zip(prompts, replies)]


def _one_forward(target, ids: list[int], outputs: int, tap_layers: tuple[int, ...]):
    """The logits and taps of the last `outputs` positions of one forward over `ids`."""
    runner = ModelRunner(target, tap_layers, max_kv_tokens=256, block_size=16, attention_backend="sdpa")
    seq = Sequence(ids, SamplingParams(max_new_tokens=1))
    with torch.inference_mode():
        out = runner.forward([RowInput(seq, ids, num_outputs=outputs)])[0]
    return out.logits, out.taps


def test_records_hold_what_one_forward_over_prompt_and_reply_computes(tmp_path):
    """Recorded while decoding, a record holds at each reply position what a forward over
    the whole text gives there: the taps, the greedy label, the top-k distribution."""
    target, draft, _engine, records = _records(tmp_path)
    for rec in records:
        n = len(rec.tokens) - 1 - rec.start  # one position per reply token
        assert rec.features.shape == (n, draft.cfg.num_slots, target.cfg.hidden_size)
        assert rec.argmax.tolist() == rec.tokens[rec.start + 1:].tolist()  # the reply is the greedy chain
        logits, taps = _one_forward(target, rec.tokens[:-1].tolist(), n, tuple(draft.cfg.target_layer_ids))
        torch.testing.assert_close(rec.features.float(), taps.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        assert rec.argmax.tolist() == logits.argmax(-1).tolist()
        probs, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
        assert rec.top_ids.tolist() == ids.tolist()
        torch.testing.assert_close(rec.top_probs.float(), probs, atol=1e-3, rtol=1e-2)
    save_records(records, tmp_path / "d.pt")
    again = load_records(tmp_path / "d.pt")
    assert torch.equal(again[0].features, records[0].features)


def test_records_need_an_engine_that_taps_the_drafts_layers(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    with pytest.raises(ValueError, match="taps"):
        answer_prompts(make_engine(load_target(d)), [], max_new_tokens=4)


def test_batch_layout():
    # positions 9..19 of the text 0..19; the target's greedy token after position p is p + 1
    # (the text is its own greedy chain) except after position 14, where it would say 99
    argmax = torch.arange(10, 21, dtype=torch.int32)
    argmax[5] = 99
    rec = Record(torch.arange(20, dtype=torch.int32), 9, torch.randn(11, 2, 4).to(torch.bfloat16), argmax,
                 torch.zeros(11, 3, dtype=torch.int32), torch.ones(11, 3, dtype=torch.float16) / 3)
    anchors = all_anchors([rec], k=3)
    # every pivot with 3 labels after it, but 14: its anchor (15) is not what the target says there
    assert anchors == [(0, j) for j in range(8) if j != 5]
    b = make_batch([rec], [(0, 2)], k=3)
    assert b.anchors.tolist() == [[12]]  # pivot at position 11, anchor token 12
    assert b.labels.tolist() == [[13, 14, 99]]  # the target's next tokens after the anchor
    assert b.prev_tokens.tolist() == [[12, 13, 14]]  # teacher forcing: anchor, then labels
    torch.testing.assert_close(b.features[0], rec.features[2].float())
    assert b.label_mask.tolist() == [[1.0, 1.0, 1.0]]  # 99 still follows the chain 12, 13, 14
    b = make_batch([rec], [(0, 3)], k=3)
    # labels 14, 99, 16: the text says 15 where the target says 99, so 16 (chosen after 15) is off the chain
    assert b.labels.tolist() == [[14, 99, 16]] and b.label_mask.tolist() == [[1.0, 1.0, 0.0]]


def test_a_decode_walk_drafts_where_the_last_round_ended():
    # record 0: anchors at 0..9, record 1 at 3..5; round at j accepts A and the next drafts at j + A + 1
    anchors = [(0, j) for j in range(10)] + [(1, j) for j in (3, 4, 5)]
    accepted = [2, 0, 0, 1, 0, 0, 3, 0, 0, 0] + [0, 5, 0]
    walked = [anchors[i] for i in decode_walk(anchors, accepted)]
    assert walked == [(0, 0), (0, 3), (0, 5), (0, 6), (1, 3), (1, 4)]  # (0, 10) and (1, 10) are no anchors


def test_chain_mask_keeps_labels_until_the_text_leaves_the_greedy_chain():
    labels = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    text = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])  # the recorded tokens after the anchor
    assert chain_mask(text, labels).tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]


def test_off_chain_labels_neither_train_nor_count_as_accepted(tmp_path):
    _target, draft, _engine, records = _records(tmp_path)
    cfg = TrainConfig(bf16_autocast=False)
    batch = make_batch(records, all_anchors(records, 3)[:8], k=3)
    assert batch.label_mask.eq(1).all()  # a target reply is its own greedy chain
    logits = draft_logits(draft, batch)
    loss, _ = distillation_loss(logits, batch, cfg)
    batch.label_mask[:, 2] = 0
    masked, _ = distillation_loss(logits, batch, cfg)
    batch.labels[:, 2] = (batch.labels[:, 2] + 1) % 128
    batch.top_ids[:, 2] = (batch.top_ids[:, 2] + 1) % 128
    relabelled, _ = distillation_loss(logits, batch, cfg)
    assert masked < loss and torch.equal(masked, relabelled)  # the masked label plays no part
    # acceptance: the draft is made to hit every label; a masked one ends the block
    hit = Objective(draft, None, lambda b, _vocab: F.one_hot(b.labels, 128).float())
    everything = greedy_acceptance(hit, records, all_anchors(records, 3), 3)
    assert everything["tau"] == 4.0 and everything["walk_tau"] == 4.0
    # 24 reply positions, K = 3: a walk drafts at 0, 4, 8, ..., 20 (21 pivots have K labels)
    assert everything["walk_rounds"] == 6 * len(records)
    for rec in records:
        rec.tokens = rec.tokens.clone()
        rec.tokens[rec.start + 3] = (rec.tokens[rec.start + 3] + 1) % 128  # the text leaves the chain
    first = [(r, 0) for r in range(len(records))]
    assert greedy_acceptance(hit, records, first, 3)["per_position"] == [1.0, 1.0, 0.0]


def _training_data(tmp_path, k: int):
    """(target, draft with its target embedding frozen, records, anchors) for a tiny run."""
    target, draft, _engine, records = _records(tmp_path)
    for p in draft.embed_tokens.parameters():
        p.requires_grad_(False)
    return target, draft, records, all_anchors(records, k)


def test_tiny_training_lowers_loss_and_saves_a_loadable_draft(tmp_path):
    target, draft, records, anchors = _training_data(tmp_path, 7)
    cfg = TrainConfig(steps=60, batch_size=32, lr=3e-3, warmup=5, eval_every=60, checkpoint_every=30,
                      bf16_autocast=False)
    before = greedy_acceptance(student_objective(draft, cfg), records, anchors, 7)
    summary = train(student_objective(draft, cfg), records, anchors, records, anchors, 7, cfg, tmp_path / "run")
    losses = [h["loss"] for h in summary["history"]]
    assert sum(losses[-10:]) / 10 < 0.7 * sum(losses[:10]) / 10
    assert summary["final_dev"]["tau"] > before["tau"]
    draft.save(tmp_path / "draft")
    loaded = DLiteDraftModel.load(tmp_path / "draft", target.embed_tokens, target.cfg.num_layers)
    assert loaded.cfg.target_layer_ids == draft.cfg.target_layer_ids
    # the draft's vocabulary: the labels the target said most often
    write_draft_vocab([tmp_path / "draft"], records, 16)
    counts = label_counts(records, 128)
    loaded = DLiteDraftModel.load(tmp_path / "draft", target.embed_tokens, target.cfg.num_layers)
    subset = loaded.sequential_head.drafted_ids
    assert subset.numel() == 16 and counts[subset].min() >= counts.sort(descending=True).values[15]
    save_records(records, tmp_path / "records.pt")  # the same through the CLI, for a shipped draft
    assert cli.main(["draft-vocab", str(tmp_path / "draft"), "--data", str(tmp_path / "records.pt"),
                     "--size", "8"]) == 0
    assert load_draft_vocab(tmp_path / "draft", 128).tolist() == frequent_tokens(counts, 8).tolist()
    # size 0 removes it (a retrain with --draft-vocab 0 into a directory that had one)
    assert cli.main(["draft-vocab", str(tmp_path / "draft"), "--data", str(tmp_path / "records.pt"),
                     "--size", "0"]) == 0
    assert load_draft_vocab(tmp_path / "draft", 128) is None
    assert cli.main(["draft-vocab", str(tmp_path), "--data", str(tmp_path / "records.pt")]) == 2  # not a draft
    # resuming from the checkpoint continues at the saved step
    cfg2 = TrainConfig(steps=70, batch_size=32, lr=3e-3, warmup=5, eval_every=70, checkpoint_every=35,
                       bf16_autocast=False)
    resumed = train(student_objective(draft, cfg2), records, anchors, records, anchors, 7, cfg2, tmp_path / "run")
    assert resumed["history"][-1]["step"] == 70 and len(resumed["history"]) == 70


def test_init_from_a_saved_draft(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target, hf = load_target(d), read_config(d)
    saved = random_draft(target, hf, seed=0)
    saved.save(tmp_path / "draft")
    fresh = random_draft(target, hf, seed=1)
    init_weights(fresh, tmp_path / "draft")
    for name, value in saved.checkpoint_state().items():
        # saved in bf16: the start is the checkpoint, rounded as it was written
        torch.testing.assert_close(fresh.checkpoint_state()[name], value.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="not a draft of this shape"):
        init_weights(random_draft(target, hf, rank=16), tmp_path / "draft")


def test_data_generation_resumes_at_the_last_saved_part(tmp_path, monkeypatch):
    asked = []

    def answer(engine, samples, max_new_tokens):
        if len(asked) == 1 and not getattr(answer, "restarted", False):
            raise KeyboardInterrupt  # the run dies during its second part
        asked.append(list(samples))
        return [Record(torch.tensor([s, s + 1], dtype=torch.int32), 0, torch.zeros(1, 1, 4, dtype=torch.bfloat16),
                       torch.tensor([s + 1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32),
                       torch.ones(1, 1, dtype=torch.float16)) for s in samples]

    monkeypatch.setattr(pipeline, "answer_prompts", answer)
    path = tmp_path / "data_extra.pt"
    with pytest.raises(KeyboardInterrupt):
        pipeline.records_in_parts(None, [10, 20, 30, 40, 50], path, 8, part_size=2)
    answer.restarted = True
    records = pipeline.records_in_parts(None, [10, 20, 30, 40, 50], path, 8, part_size=2)
    assert asked == [[10, 20], [30, 40], [50]]  # the first part was not answered again
    assert [r.tokens[0].item() for r in records] == [10, 20, 30, 40, 50]
    assert [r.tokens[0].item() for r in load_records(path)] == [10, 20, 30, 40, 50]
    assert not list(tmp_path.glob("*.part*"))
    again = pipeline.records_in_parts(None, [10, 20, 30, 40, 50], path, 8, part_size=2)
    assert len(asked) == 3 and len(again) == 5  # a finished file is read back, nothing answered again


def test_training_over_the_drafts_vocabulary(tmp_path):
    """The head learns the 24 tokens the target says most; a label outside them is a miss."""
    _target, draft, records, anchors = _training_data(tmp_path, 3)
    vocab = TrainingVocabulary(frequent_tokens(label_counts(records, 128), 24), 128)
    hit = Objective(draft, None, lambda b, _vocab: F.one_hot(b.labels.clamp(min=0), 24).float(), vocab=vocab)
    inside = torch.stack([vocab.index_of[make_batch(records, [a], 3).labels[0]] >= 0 for a in anchors])
    expected = inside.long().cumprod(dim=1).float().mean(0)
    assert 0 < expected[0] < 1  # some labels lie outside the 24 tokens
    torch.testing.assert_close(torch.tensor(greedy_acceptance(hit, records, anchors, 3)["per_position"]), expected)

    cfg = TrainConfig(steps=60, batch_size=32, lr=3e-3, warmup=5, eval_every=60, checkpoint_every=60,
                      bf16_autocast=False)
    objective = student_objective(draft, cfg, vocab)
    assert objective.logits(objective.batch(records, anchors[:4], 3)).shape == (4, 3, 24)
    before = greedy_acceptance(objective, records, anchors, 3)
    summary = train(objective, records, anchors, records, anchors, 3, cfg, tmp_path / "run")
    losses = [h["loss"] for h in summary["history"]]
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10])
    assert before["tau"] < summary["final_dev"]["tau"] <= 1 + expected.sum().item() + 1e-6


def test_a_run_resumes_only_over_the_vocabulary_it_trained_over(tmp_path):
    _target, draft, records, anchors = _training_data(tmp_path, 3)
    vocab = TrainingVocabulary(torch.arange(0, 128, 2), vocab_size=128)
    cfg = TrainConfig(steps=2, batch_size=8, checkpoint_every=1, eval_every=2, bf16_autocast=False)
    train(student_objective(draft, cfg, vocab), records, anchors, records, anchors, 3, cfg, tmp_path / "run")
    more = TrainConfig(steps=3, batch_size=8, checkpoint_every=1, eval_every=3, bf16_autocast=False)
    with pytest.raises(ValueError, match="another vocabulary"):
        train(student_objective(draft, more), records, anchors, records, anchors, 3, more, tmp_path / "run")
    resumed = train(student_objective(draft, more, vocab), records, anchors, records, anchors, 3, more,
                    tmp_path / "run")
    assert resumed["history"][-1]["step"] == 3
    # a head that ignores the objective's vocabulary is caught, not measured over the wrong tokens
    wrong = Objective(draft, None, lambda b, _vocab: draft_logits(draft, b), vocab=vocab)
    with pytest.raises(ValueError, match="vocabulary of 64 tokens"):
        greedy_acceptance(wrong, records, anchors, 3)


def test_continued_training_keeps_the_starting_drafts_vocabulary(tmp_path, caplog):
    records = [Record(torch.tensor([1, 5, 5, 6], dtype=torch.int32), 0, torch.zeros(3, 1, 4),
                      torch.tensor([5, 5, 6], dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32),
                      torch.ones(3, 1))]
    fresh = argparse.Namespace(init_from=None, draft_vocab=1)
    assert pipeline.training_vocabulary(records, fresh, 10).tolist() == [5]
    save_draft_vocab(tmp_path, torch.tensor([2, 3]))
    continued = argparse.Namespace(init_from=str(tmp_path), draft_vocab=1)
    assert pipeline.training_vocabulary(records, continued, 10).tolist() == [2, 3]


def test_draft_vocab_warns_when_it_widens_a_drafts_vocabulary(tmp_path, caplog):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    random_draft(load_target(d), read_config(d), seed=0).save(tmp_path / "draft")
    save_draft_vocab(tmp_path / "draft", torch.tensor([5, 6]))
    record = Record(torch.tensor([1, 5, 5, 7], dtype=torch.int32), 0, torch.zeros(3, 1, 4),
                    torch.tensor([5, 5, 7], dtype=torch.int32), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1))
    with caplog.at_level(logging.WARNING):
        write_draft_vocab([tmp_path / "draft"], [record], 1)  # [5]: inside, no warning
        assert not caplog.records
        write_draft_vocab([tmp_path / "draft"], [record], 2)  # [5, 7]: 7 never trained
    assert "1 of the new tokens lie outside" in caplog.text
    assert load_draft_vocab(tmp_path / "draft", 128).tolist() == [5, 7]  # written all the same

"""Replay recorded replies round by round (greedy) to see what a proposer would accept,
before building it. Usage:

    .venv/bin/python scripts/replay_rounds.py RECORDS.pt DRAFT_DIR

RECORDS.pt is a `dlite-ray train` data file (e.g. OUT/data_dev.pt); DRAFT_DIR a draft of the
default shape (2 layers, S = 5, R = 64). It prints per-round tau for six proposers:
  draft                 the draft alone (K tokens)
  draft+branch          plus a second branch that starts with its second choice at position 1
  copy                  copying from the context (up to 15 tokens) where a 2-4-token match
                        exists, else the draft (what the engine does)
  copy+branch           copy, with the second branch in drafted rounds
  copy-if-draft-agrees  copy only where the draft's first token agrees with the copy's
  copy+draft            copy, with the draft verified as a second branch beside each copy

Teacher-forced head logits condition each position on the true tokens. A round that
accepts A tokens then moves on A + 1, as decoding does. A second branch whose first token
is right continues exactly as the draft's own predictions at positions 2.., so it needs no
other draft call here.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dlite_ray.engine.context_lookup import NgramIndex
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.runtime.draft_vocab import load_draft_vocab
from dlite_ray.training.batches import all_anchors
from dlite_ray.training.data import load_records
from dlite_ray.training.pipeline import init_weights, new_draft
from dlite_ray.training.trainer import TrainConfig, student_objective
from dlite_ray.training.vocabulary import vocab_of

K, COPY_TOKENS = 7, 15
PROPOSERS = ("draft", "draft+branch", "copy", "copy+branch", "copy-if-draft-agrees", "copy+draft")


def predictions(records, draft_dir: Path):
    """Per anchor (record, reply position): the draft's K greedy tokens and its second choice at position 1."""
    engine = DLiteEngine.from_pretrained(None, draft=None)
    draft = new_draft(engine, 2, 5, 64, K + 1, 0)
    init_weights(draft, draft_dir)
    # over the draft's vocabulary, as the engine drafts: the head's other rows never trained
    vocab = vocab_of(load_draft_vocab(draft_dir, draft.cfg.layers.vocab_size), draft.cfg.layers.vocab_size)
    objective = student_objective(draft, TrainConfig(steps=1, batch_size=1, lr=1e-3), vocab)
    objective.model.eval()
    anchors = all_anchors(records, K)
    best, second = {}, {}
    with torch.no_grad():
        for i in range(0, len(anchors), 256):
            chunk = anchors[i:i + 256]
            top2 = objective.logits(objective.batch(records, chunk, K)).topk(2, dim=-1).indices
            if vocab is not None:
                top2 = vocab.token_ids[top2]  # subset indices -> token ids
            for anchor, rows in zip(chunk, top2.tolist()):
                best[anchor] = [r[0] for r in rows]
                second[anchor] = rows[0][1]
    return best, second


def accepted(proposal: list[int], truth: list[int]) -> int:
    n = 0
    for x, y in zip(proposal, truth):
        if x != y:
            break
        n += 1
    return n


def replay(records, best, second, proposer: str) -> list[int]:
    """Tokens each round kept (A + 1), walking every reply round by round."""
    rounds = []
    for r, record in enumerate(records):
        tokens = record.tokens.tolist()
        copies = NgramIndex()  # the engine's copy rule; the context only grows along a reply
        j = 0
        while j < record.argmax.shape[0] - K:
            context_end = record.start + j + 2
            context, truth = tokens[:context_end], tokens[context_end:]
            if (r, j) not in best:
                rounds.append(1)
                j += 1
                continue
            copied = copies.continuation(context, COPY_TOKENS) if proposer.startswith("copy") else []
            if proposer == "copy-if-draft-agrees" and copied and copied[0] != best[(r, j)][0]:
                copied = []  # the draft's first token disagrees with the copy's: verify the draft
            if copied:
                a = accepted(copied, truth)
                if proposer == "copy+draft":  # the draft verified as a second branch beside the copy
                    a = max(a, accepted(best[(r, j)], truth))
            else:
                a = accepted(best[(r, j)], truth)
                if proposer.endswith("branch") and a == 0 and second[(r, j)] == truth[0]:
                    a = 1 + accepted(best[(r, j)][1:], truth[1:])
            rounds.append(a + 1)
            j += a + 1
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("records")
    parser.add_argument("draft", type=Path)
    args = parser.parse_args()
    records = load_records(args.records)
    best, second = predictions(records, args.draft)
    for proposer in PROPOSERS:
        rounds = replay(records, best, second, proposer)
        print(f"{proposer:14s} per-round tau {sum(rounds) / len(rounds):.3f} over {len(rounds)} rounds")


if __name__ == "__main__":
    main()

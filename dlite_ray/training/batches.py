"""Anchors and training batches.

An anchor at absolute position t+1 has its pivot at t: the draft sees the pivot features,
the anchor token, and learns the target's next K greedy tokens. Many anchors of many
sequences go in one pass as independent rows [N, S + 1 + K]: attention never crosses rows,
which is the block-diagonal mask of the reference training code without the padding.

A label counts only while the recorded text before it follows the target's greedy chain
(`chain_mask`): always in a traced reply; records made before traces (by a second forward
per sequence) can hold positions where that pass in bf16 rounded to another argmax than
generation did.

The stage-0 teacher also gets a window of the W positions before each pivot (their
recorded features, left-padded where the response is younger than W, with a validity mask).
Records start at the last prompt token, so the window covers the response only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from dlite_ray.training.data import Record


@dataclass(slots=True)
class Batch:
    features: torch.Tensor  # [N, S, D]
    anchors: torch.Tensor  # [N, 1]
    prev_tokens: torch.Tensor  # [N, K]: d_0 = anchor, then the labels (teacher forcing)
    labels: torch.Tensor  # [N, K]
    label_mask: torch.Tensor  # [N, K] float: 1 where the label is the greedy chain's (`chain_mask`)
    top_ids: torch.Tensor  # [N, K, k]
    top_probs: torch.Tensor  # [N, K, k]
    history: torch.Tensor | None = None  # [N, W, F, D]: F fused layers at the W positions before the pivot
    history_valid: torch.Tensor | None = None  # [N, W] bool


def all_anchors(records: list[Record], k: int) -> list[tuple[int, int]]:
    """(record, relative pivot j) for every pivot with K labels after it whose anchor is the
    target's greedy token there, as every anchor is when drafting at T = 0: all through a
    reply, but where an older record's second forward rounded to another argmax than
    generation did (bf16)."""
    out = []
    for r, rec in enumerate(records):
        n = rec.argmax.shape[0]
        greedy = (rec.tokens[rec.start + 1:rec.start + 1 + n - k] == rec.argmax[:n - k]).tolist()
        out += [(r, j) for j in range(n - k) if greedy[j]]
    return out


def make_batch(records: list[Record], anchors: list[tuple[int, int]], k: int, window: int = 0,
               history_slots: tuple[int, ...] = ()) -> Batch:
    feats, anc, texts, labels, top_i, top_p = [], [], [], [], [], []
    for r, j in anchors:
        rec = records[r]
        feats.append(rec.features[j])
        anc.append(rec.tokens[rec.start + j + 1])
        texts.append(rec.tokens[rec.start + j + 2:rec.start + j + 1 + k])
        # argmax[j + m] is the target's token after relative position j + m
        labels.append(rec.argmax[j + 1:j + 1 + k])
        top_i.append(rec.top_ids[j + 1:j + 1 + k])
        top_p.append(rec.top_probs[j + 1:j + 1 + k])
    anchors_t = torch.stack(anc).long()[:, None]
    labels_t = torch.stack(labels).long()
    batch = Batch(torch.stack(feats).float(), anchors_t, torch.cat([anchors_t, labels_t[:, :-1]], dim=1),
                  labels_t, chain_mask(torch.stack(texts).long(), labels_t), torch.stack(top_i), torch.stack(top_p))
    if window > 0:
        batch.history, batch.history_valid = history_window(records, anchors, window, history_slots)
    return batch


def chain_mask(text: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[N, K] 1.0 where label m is the greedy chain's, else 0.0.

    text [N, K-1]: the recorded tokens after the anchor; labels [N, K]: the target's greedy
    token after each of them. Label m was chosen after text[:m], so it continues the chain
    d_1..d_m the draft feeds its head only if text[:m] == labels[:m]: true in a target
    reply up to a place where an older record's second forward and generation rounded
    differently."""
    same = (text == labels[:, :-1]).long().cumprod(dim=1)
    return torch.cat([torch.ones_like(labels[:, :1]), same], dim=1).float()


def history_window(records: list[Record], anchors: list[tuple[int, int]], window: int,
                   slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Features of the `window` positions before each pivot (entry w lies window - w before
    it), the selected tap slots only, and which entries exist."""
    n, d = len(anchors), records[0].features.shape[-1]
    out = torch.zeros(n, window, len(slots), d)
    valid = torch.zeros(n, window, dtype=torch.bool)
    for i, (r, j) in enumerate(anchors):
        have = min(window, j)
        if have:
            out[i, window - have:] = records[r].features[j - have:j, list(slots)].float()
            valid[i, window - have:] = True
    return out, valid


class AnchorSampler:
    def __init__(self, anchors: list[tuple[int, int]], batch_size: int, seed: int = 0):
        self.anchors, self.batch_size = anchors, batch_size
        self.rng = random.Random(seed)

    def __iter__(self):
        while True:
            order = list(self.anchors)
            self.rng.shuffle(order)
            for i in range(0, len(order) - self.batch_size + 1, self.batch_size):
                yield order[i:i + self.batch_size]

"""The training loop: AdamW, cosine schedule, resumable checkpoints, dev acceptance.

A stage is an `Objective`: the module it trains, its loss and the head logits used to
measure acceptance. The one-stage student is `student_objective`; the two-stage pipeline's
teacher and blended student are in `teacher.py`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from dlite_ray.runtime.draft_model import DLiteDraftModel, HistoryWindow
from dlite_ray.training.batches import AnchorSampler, Batch, make_batch
from dlite_ray.training.data import Record
from dlite_ray.training.losses import (
    cosine_lr,
    cross_entropy,
    log_probabilities,
    position_weights,
    total_variation_topk,
)
from dlite_ray.training.vocabulary import Vocab, drafted_token_ids

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TrainConfig:
    steps: int = 2000
    batch_size: int = 96
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 50
    gamma: float = 4.0  # position decay exp(-k / gamma)
    tv_weight: float = 1.0
    eval_every: int = 200
    checkpoint_every: int = 100
    seed: int = 0
    bf16_autocast: bool = True

    def __post_init__(self) -> None:
        if self.steps <= 0 or self.batch_size <= 0 or self.lr <= 0:
            raise ValueError("steps, batch_size and lr must be positive")


Loss = Callable[[Batch, float, Vocab], tuple[torch.Tensor, dict[str, float]]]  # (batch, progress 0..1, vocab)
HeadLogits = Callable[[Batch, Vocab], torch.Tensor]  # teacher-forced head logits [N, K, V], or [N, K, M] over vocab
# `train`'s data: (records, anchors, dev records, dev anchors, K)
TrainData = tuple[list[Record], list[tuple[int, int]], list[Record], list[tuple[int, int]], int]


@dataclass(slots=True)
class Objective:
    """What one training stage optimises. Its vocabulary is given here once: the batches, the
    loss and the logits all take it from the objective."""

    model: nn.Module  # trained and checkpointed; the target's embedding inside stays frozen and unsaved
    loss_fn: Loss
    logits_fn: HeadLogits
    window: int = 0  # history positions the batches carry (the teacher's)
    history_slots: tuple[int, ...] = ()
    vocab: Vocab = None

    def batch(self, records: list[Record], anchors: list[tuple[int, int]], k: int) -> Batch:
        batch = make_batch(records, anchors, k, self.window, self.history_slots)
        return batch if self.vocab is None else self.vocab.restrict(batch)

    def loss(self, batch: Batch, progress: float) -> tuple[torch.Tensor, dict[str, float]]:
        return self.loss_fn(batch, progress, self.vocab)

    def logits(self, batch: Batch) -> torch.Tensor:
        return self.logits_fn(batch, self.vocab)


def draft_logits(draft: DLiteDraftModel, batch: Batch, history: HistoryWindow | None = None,
                 vocab: Vocab = None) -> torch.Tensor:
    """Teacher-forced head logits [N, K, V] (the backbone sees the anchor and K masks),
    or [N, K, M] over `vocab`'s M tokens."""
    k = batch.labels.shape[1]
    u = draft.backbone(batch.features, batch.anchors, k, history)
    state = draft.sequential_head.initial_state(u.shape[0], u)
    return draft.sequential_head.teacher_forced(u, batch.prev_tokens, state, drafted_token_ids(vocab))


def distillation_loss(logits: torch.Tensor, batch: Batch, cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """CE on the target's greedy labels + TV against its top-k, decayed by block position."""
    w = position_weights(logits.shape[1], cfg.gamma, logits.device) * batch.label_mask
    log_probs = log_probabilities(logits)
    ce = cross_entropy(log_probs, batch.labels, w)
    tv = total_variation_topk(log_probs, batch.top_ids, batch.top_probs, w)
    return ce + cfg.tv_weight * tv, {"ce": ce.item(), "tv": tv.item()}


def student_objective(draft: DLiteDraftModel, cfg: TrainConfig, vocab: Vocab = None) -> Objective:
    """The history-free draft trained directly on CE + TV (the one-stage baseline, and stage 2)."""
    def logits(batch: Batch, vocab: Vocab) -> torch.Tensor:
        return draft_logits(draft, batch, vocab=vocab)

    def loss(batch: Batch, _progress: float, vocab: Vocab) -> tuple[torch.Tensor, dict[str, float]]:
        return distillation_loss(logits(batch, vocab), batch, cfg)

    return Objective(draft, loss, logits, vocab=vocab)


@torch.no_grad()
def greedy_acceptance(objective: Objective, records: list[Record], anchors: list[tuple[int, int]],
                      k: int, batch_size: int = 256) -> dict:
    """Exact greedy acceptance on recorded features: under greedy verification the draft's
    own prefix equals the labels up to the first miss, so teacher forcing gives the same A.

    `tau` averages over every anchor; `walk_tau` over the anchors a decode meets, drafting
    at the first and then A + 1 further each round, so every later round starts right after
    a rejection, where text is harder to predict. The default draft: 2.43 against 2.03 on
    the dev split; decoding it with K = 7 every round gave 1.97 (`runs/s19`)."""
    objective.model.eval()
    accepted = []
    for i in range(0, len(anchors), batch_size):
        batch = objective.batch(records, anchors[i:i + batch_size], k)
        logits = objective.logits(batch)
        if objective.vocab is not None and logits.shape[-1] != objective.vocab.size:
            raise ValueError(f"the head gave {logits.shape[-1]} logits a row for a vocabulary of "
                             f"{objective.vocab.size} tokens: its logits must take the objective's vocab")
        # a label off the greedy chain (bf16 rounding) ends the block: what would follow is unknown;
        # one outside the draft's vocabulary (index -1) is a miss, as it is when drafting
        hits = ((logits.argmax(-1) == batch.labels) & (batch.label_mask > 0)).long().cumprod(dim=1)
        accepted.append(hits.sum(1))
    objective.model.train()
    a = torch.cat(accepted)
    walk = a[decode_walk(anchors, a.tolist())]
    return {**_acceptance_stats(a, k), "walk_tau": (walk + 1).float().mean().item(), "walk_rounds": len(walk)}


def _acceptance_stats(a: torch.Tensor, k: int) -> dict:
    """tau, P(A >= m) for m = 1..k and the count, of per-anchor accepted lengths `a`."""
    return {"tau": (a + 1).float().mean().item(),
            "per_position": [(a >= m).float().mean().item() for m in range(1, k + 1)], "anchors": len(a)}


def decode_walk(anchors: list[tuple[int, int]], accepted: list[int]) -> list[int]:
    """Indices into `anchors` of the rounds a greedy decode drafts at: each record's first
    anchor, then A + 1 positions on each time, while the landing position is an anchor."""
    index = {anchor: i for i, anchor in enumerate(anchors)}
    first: dict[int, int] = {}
    for r, j in anchors:
        first[r] = min(j, first.get(r, j))
    rounds = []
    for r, j in first.items():
        i: int | None = index[(r, j)]
        while i is not None:
            rounds.append(i)
            i = index.get((r, anchors[i][1] + accepted[i] + 1))
    return rounds


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: v for n, v in model.state_dict().items() if "embed_tokens." not in n}


def _same_vocabulary(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def train(objective: Objective, records: list[Record], anchors: list[tuple[int, int]],
          dev_records: list[Record], dev_anchors: list[tuple[int, int]], k: int, cfg: TrainConfig,
          out_dir: Path, label: str = "student") -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    model = objective.model
    params = [p for n, p in model.named_parameters() if p.requires_grad and "embed_tokens." not in n]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=True)
    ckpt = out_dir / f"{label}.ckpt"
    step, history = 0, []
    vocab_ids = drafted_token_ids(objective.vocab)
    if ckpt.exists():
        state = torch.load(ckpt)
        if not _same_vocabulary(state.get("vocab"), vocab_ids):
            raise ValueError(f"{ckpt} was trained over another vocabulary than this run's (--draft-vocab, "
                             "or a checkpoint from before training over it): use a fresh --out")
        model.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        log.info("resumed %s from %s at step %d", label, ckpt, step)
    batches = iter(AnchorSampler(anchors, cfg.batch_size, cfg.seed + step))
    model.train()
    started = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {label}", unit="step")
    while step < cfg.steps:
        batch = objective.batch(records, next(batches), k)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup)
        # The math attention kernel: at 8 queries over ~13 keys a row, the fused CPU kernel's
        # backward took ~15% of a step.
        with (sdpa_kernel(SDPBackend.MATH),
              torch.autocast("cpu", dtype=torch.bfloat16,
                             enabled=cfg.bf16_autocast and batch.features.device.type == "cpu")):
            loss, parts = objective.loss(batch, step / cfg.steps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **{k_: f"{v:.3f}" for k_, v in parts.items()})
        entry: dict[str, object] = {"step": step, "loss": loss.item(), **parts}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            entry["dev"] = dev = greedy_acceptance(objective, dev_records, dev_anchors, k)
            log.info("%s step %d loss %.3f dev tau %.3f (walk %.3f) per-position %s", label, step, loss.item(),
                     dev["tau"], dev["walk_tau"], [round(x, 2) for x in dev["per_position"]])
        history.append(entry)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            torch.save({"model": trainable_state(model), "opt": opt.state_dict(), "step": step,
                        "history": history, "vocab": vocab_ids}, ckpt)
    bar.close()
    summary = {"label": label, "config": asdict(cfg), "seconds": time.perf_counter() - started,
               "final_dev": history[-1].get("dev"), "history": history}
    (out_dir / f"{label}_history.json").write_text(json.dumps(summary))
    return summary

"""The training loop: AdamW, cosine schedule, resumable checkpoints, dev acceptance."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.training.batches import AnchorSampler, Batch, make_batch
from dlite_ray.training.data import Record
from dlite_ray.training.losses import cosine_lr, cross_entropy, position_weights, total_variation_topk

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


def draft_logits(draft: DLiteDraftModel, batch: Batch) -> torch.Tensor:
    """Teacher-forced head logits [N, K, V] (the backbone sees the anchor and K masks)."""
    k = batch.labels.shape[1]
    u = draft.backbone(batch.features, batch.anchors, k)
    state = draft.sequential_head.initial_state(u.shape[0], u)
    return draft.sequential_head.teacher_forced(u, batch.prev_tokens, state)


def student_loss(draft: DLiteDraftModel, batch: Batch, cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    logits = draft_logits(draft, batch)
    w = position_weights(logits.shape[1], cfg.gamma, logits.device)
    ce = cross_entropy(logits, batch.labels, w)
    tv = total_variation_topk(logits, batch.top_ids, batch.top_probs, w)
    return ce + cfg.tv_weight * tv, {"ce": ce.item(), "tv": tv.item()}


@torch.no_grad()
def greedy_acceptance(draft: DLiteDraftModel, records: list[Record], anchors: list[tuple[int, int]],
                      k: int, batch_size: int = 256) -> dict:
    """Exact greedy acceptance on recorded features: under greedy verification the draft's
    own prefix equals the labels up to the first miss, so teacher forcing gives the same A."""
    draft.eval()
    accepted, per_pos = [], torch.zeros(k)
    for i in range(0, len(anchors), batch_size):
        batch = make_batch(records, anchors[i:i + batch_size], k)
        hits = (draft_logits(draft, batch).argmax(-1) == batch.labels).long().cumprod(dim=1)
        accepted.append(hits.sum(1))
        per_pos += hits.sum(0).float()
    draft.train()
    a = torch.cat(accepted).float()
    return {"tau": (a + 1).mean().item(), "per_position": (per_pos / len(a)).tolist(), "anchors": len(a)}


def train(draft: DLiteDraftModel, records: list[Record], anchors: list[tuple[int, int]],
          dev_records: list[Record], dev_anchors: list[tuple[int, int]], k: int, cfg: TrainConfig,
          out_dir: Path, label: str = "student") -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    params = [p for n, p in draft.named_parameters() if p.requires_grad and not n.startswith("embed_tokens.")]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    ckpt = out_dir / f"{label}.ckpt"
    step, history = 0, []
    if ckpt.exists():
        state = torch.load(ckpt)
        draft.load_state_dict(state["model"], strict=False)
        opt.load_state_dict(state["opt"])
        step, history = state["step"], state["history"]
        log.info("resumed %s from %s at step %d", label, ckpt, step)
    batches = iter(AnchorSampler(anchors, cfg.batch_size, cfg.seed + step))
    draft.train()
    started = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, desc=f"train {label}", unit="step")
    while step < cfg.steps:
        batch = make_batch(records, next(batches), k)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16_autocast and batch.features.device.type == "cpu"):
            loss, parts = student_loss(draft, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", **{k_: f"{v:.3f}" for k_, v in parts.items()})
        entry = {"step": step, "loss": loss.item(), **parts}
        if step % cfg.eval_every == 0 or step == cfg.steps:
            entry["dev"] = greedy_acceptance(draft, dev_records, dev_anchors, k)
            log.info("%s step %d loss %.3f dev tau %.3f per-position %s", label, step, loss.item(),
                     entry["dev"]["tau"], [round(x, 2) for x in entry["dev"]["per_position"]])
        history.append(entry)
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            torch.save({"model": draft.checkpoint_state(), "opt": opt.state_dict(), "step": step,
                        "history": history}, ckpt)
    bar.close()
    summary = {"label": label, "config": asdict(cfg), "seconds": time.perf_counter() - started,
               "final_dev": history[-1].get("dev"), "history": history}
    (out_dir / f"{label}_history.json").write_text(json.dumps(summary))
    return summary

"""`dlite-ray train`: prompts -> target replies and features -> [teacher ->] student -> draft.

With --teacher-steps 0 the student is trained in one stage (CE + TV); otherwise a
sliding-window teacher is trained first and the student learns under its head
(`teacher.py`). Every stage is cached in --out, so a rerun resumes where the last one stopped.
"""

from __future__ import annotations

import json
import logging
import resource
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.reply_corpus import PROMPT_TAIL_TOKENS, save_reply_corpus
from dlite_ray.engine.scheduler import SchedulerConfig
from dlite_ray.runtime.draft_config import DLITE_RAY_CONVENTIONS, DraftConfig, DraftConventions
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.draft_vocab import DRAFT_VOCAB_FILE, frequent_tokens, load_draft_vocab, save_draft_vocab
from dlite_ray.training.batches import all_anchors
from dlite_ray.training.data import Record, answer_prompts, dataset_bytes, label_counts, load_records, save_records
from dlite_ray.training.prompts import agent_eval_turns, build_prompt_set, turns_of
from dlite_ray.training.teacher import WindowTeacher, adopt_teacher_head, blend_objective, teacher_objective
from dlite_ray.training.trainer import TrainConfig, TrainData, greedy_acceptance, student_objective, train
from dlite_ray.training.vocabulary import Vocab, vocab_of

log = logging.getLogger(__name__)
MIN_HELD_OUT_CHARS = 20  # shorter user turns ("Hi") say nothing about where a prompt came from


def new_draft(engine: DLiteEngine, layers: int, slots: int, rank: int, block_size: int, seed: int,
              conventions: DraftConventions = DLITE_RAY_CONVENTIONS) -> DLiteDraftModel:
    """A random draft for the engine's target; its config records the conventions it trains under."""
    target_hf = _target_hf_config(engine)
    # MASK is a real vocabulary row; prefer one that never occurs in text (unk), never EOS.
    tok = engine.tokenizer
    mask_id = next(i for i in (tok.unk_token_id, tok.pad_token_id, engine.eos_ids[0]) if i is not None)
    cfg = DraftConfig.for_target(target_hf, layers, slots, rank, mask_id, block_size, conventions=conventions)
    torch.manual_seed(seed)
    draft = DLiteDraftModel(cfg, engine.target.embed_tokens)
    for p in draft.embed_tokens.parameters():
        p.requires_grad_(False)
    return draft


def init_weights(draft: DLiteDraftModel, directory: Path) -> None:
    """Start from a saved draft (e.g. to train the shipped one further on more data)."""
    state = load_file(directory / "model.safetensors")
    expected = draft.checkpoint_state()
    if set(state) != set(expected) or any(state[k].shape != v.shape for k, v in expected.items()):
        raise ValueError(f"{directory}: not a draft of this shape (--layers/--slots/--rank/--block-size)")
    draft.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    log.info("student starts from %s", directory)


def draft_conventions(init_from: str | None) -> DraftConventions:
    """The conventions a new draft trains under: those of the --init-from draft (its weights
    only make sense under them), else dlite-ray's own."""
    if not init_from:
        return DLITE_RAY_CONVENTIONS
    cfg = DraftConfig.from_dict(json.loads((Path(init_from) / "config.json").read_text()))
    return cfg.conventions


def _target_engine(target: str | None, dtype: str, tap_layers: tuple[int, ...] = (),
                   normed_last_tap: bool = False) -> DLiteEngine:
    # 64 replies in flight: 1.25x the reply tokens/s of 32 on 128 BFCL/code prompts in bf16
    # (207 -> 166 s); a 4096-token step budget did not help (177 s).
    return DLiteEngine.from_pretrained(target, draft=None, dtype=dtype, tap_layers=tap_layers,
                                       normed_last_tap=normed_last_tap,
                                       scheduler=SchedulerConfig(max_num_seqs=64, max_batch_tokens=2048))


def _target_hf_config(engine: DLiteEngine) -> dict:
    c = engine.target.cfg
    return {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
            "attention_bias": c.attention_bias, "bos_token_id": c.bos_token_id,
            "eos_token_id": list(c.eos_token_ids)}


def build_data(engine: DLiteEngine, out: Path, args) -> tuple[list, list]:
    paths = {split: out / f"data_{split}.pt" for split in ("train", "dev")}
    if all(p.exists() for p in paths.values()):
        return load_records(paths["train"]), load_records(paths["dev"])
    prompts = build_prompt_set(args.seed, args.per_source, multi_turn=args.multi_turn, code_tasks=args.code_tasks,
                               agent_loops=args.agent_loops)
    log.info("prompts: %d train, %d dev", len(prompts.train), len(prompts.dev))
    result = {}
    for split, samples in (("train", prompts.train), ("dev", prompts.dev)):
        records = records_in_parts(engine, samples, paths[split], args.max_new_tokens)
        log.info("%s: %d sequences, %d positions, %.1f MB", split, len(records),
                 sum(r.argmax.numel() for r in records), dataset_bytes(records) / 1e6)
        result[split] = records
    return result["train"], result["dev"]


def records_in_parts(engine: DLiteEngine, samples: list, path: Path, max_new_tokens: int,
                     part_size: int = 128) -> list:
    """Records (replies and features) for `samples`, saved every `part_size` prompts next to `path`
    so an interrupted run resumes at the last finished part; `path` holds them all at the end.
    Parts are numbered by their place in `samples`, so a rerun must ask for the same prompts
    (same prompt arguments); other prompts need a fresh --out. A finished `path` is read back."""
    if path.exists():  # its parts were joined into it and removed: answering again would redo them all
        return load_records(path)
    records = []
    for i in range(0, len(samples), part_size):
        part = path.with_name(f"{path.stem}.part{i // part_size:03d}.pt")
        if not part.exists():
            save_records(answer_prompts(engine, samples[i:i + part_size], max_new_tokens), part)
        records += load_records(part)
    save_records(records, path)
    for part in path.parent.glob(f"{path.stem}.part*.pt"):
        part.unlink()
    return records


def earlier_data(dirs: list[str]) -> tuple[list, list]:
    """(train, dev) of earlier runs (`--extend-from`): the first run's splits plus every
    run's data_extra.pt (train only)."""
    base = Path(dirs[0])
    train_records, dev_records = load_records(base / "data_train.pt"), load_records(base / "data_dev.pt")
    for d in dirs:
        if (Path(d) / "data_extra.pt").exists():
            train_records = train_records + load_records(Path(d) / "data_extra.pt")
    return train_records, dev_records


def extend_data(engine: DLiteEngine, out: Path, have: list, args) -> list:
    """More training data on top of earlier runs' (`--extend-from`): prompts whose tokens
    match none of the earlier sequences (train or dev), train split only; the earlier dev
    split stays the dev split, so nothing leaks into it."""
    path = out / "data_extra.pt"
    if path.exists():
        return load_records(path)
    seen = {tuple(r.tokens[:r.start + 1].tolist()) for r in have}
    bigger = build_prompt_set(args.seed, args.per_source, multi_turn=0, code_tasks=args.code_tasks)
    new = [s for s in bigger.train + bigger.dev
           if not s.later_turns and tuple(engine.encode(s.messages)) not in seen][:args.new_prompts]
    log.info("extra prompts, new to this target's data: %d", len(new))
    records = records_in_parts(engine, new, path, args.max_new_tokens)
    log.info("extra: %d sequences, %d positions, %.1f MB", len(records), sum(r.argmax.numel() for r in records),
             dataset_bytes(records) / 1e6)
    return records


def choose_draft_vocab(records: Iterable[Record], size: int, vocab_size: int) -> torch.Tensor | None:
    """The `size` tokens the target said most often in `records`, sorted; None for the whole
    vocabulary (size 0, or not smaller than it)."""
    if not 0 < size < vocab_size:
        return None
    counts = label_counts(records, vocab_size)
    ids = frequent_tokens(counts, size)
    log.info("draft vocabulary: %d tokens, covering %.2f%% of %d training labels", ids.numel(),
             100 * counts[ids].sum() / counts.sum().clamp(min=1), counts.sum())
    return ids


def training_vocabulary(records: list[Record], args, vocab_size: int) -> torch.Tensor | None:
    """The tokens the head trains over and will draft from: those of the --init-from draft
    when it has a vocabulary (its other rows of W_o may never have trained), else the
    --draft-vocab most frequent labels of `records`."""
    if args.init_from:
        ids = load_draft_vocab(args.init_from, vocab_size)
        if ids is not None:
            log.info("draft vocabulary: the %d tokens of %s", ids.numel(), args.init_from)
            return ids
    return choose_draft_vocab(records, args.draft_vocab, vocab_size)


def save_draft_vocab_next_to(directories: list[str | Path], token_ids: torch.Tensor | None) -> None:
    """Write the draft's vocabulary next to each copy of one draft; None removes an earlier
    subset, so the draft proposes every token."""
    for directory in directories:
        if token_ids is None:
            (Path(directory) / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
        else:
            save_draft_vocab(directory, token_ids)
    log.info("%s: the draft proposes %s", ", ".join(map(str, directories)),
             "every token" if token_ids is None else f"{token_ids.numel()} tokens")


def write_draft_vocab(directories: list[str | Path], records: Iterable[Record], size: int) -> None:
    """`dlite-ray draft-vocab`: give saved drafts the `size` tokens the target said most
    often in `records` (labels counted once, read lazily, after the directories are checked).
    A draft trained over a subset (`vocabulary.py`) never learned the other tokens' rows:
    giving it tokens outside its subset logs a warning."""
    configs = [Path(d) / "config.json" for d in directories]
    for config in configs:
        if not config.exists():
            raise ValueError(f"{config.parent} is not a draft checkpoint (no config.json)")
    vocab_size = DraftConfig.from_dict(json.loads(configs[0].read_text())).layers.vocab_size
    ids = choose_draft_vocab(records, size, vocab_size)
    for directory in directories:
        _warn_if_widened(directory, ids, vocab_size)
    save_draft_vocab_next_to(directories, ids)


def corpus_replies(records: Iterable[Record]) -> list[list[int]]:
    """Each record's reply after the last tokens of its prompt (how replies begin), once."""
    replies = {tuple(r.tokens[max(0, r.start + 1 - PROMPT_TAIL_TOKENS):].tolist()): None for r in records}
    return [list(reply) for reply in replies]


def write_reply_corpus(directories: list[str | Path], records: Iterable[Record]) -> None:
    """The target's replies in `records`, written next to each copy of a draft
    (`engine/reply_corpus.py`): what the engine copies from where a context has no match."""
    for directory in directories:
        if not (Path(directory) / "config.json").exists():
            raise ValueError(f"{directory} is not a draft checkpoint (no config.json)")
    replies = corpus_replies(records)
    for directory in directories:
        save_reply_corpus(directory, replies)
    log.info("%s: a reply corpus of %d replies, %d tokens", ", ".join(map(str, directories)), len(replies),
             sum(map(len, replies)))


def without_held_out_prompts(records: Iterable[Record], tokenizer) -> Iterator[Record]:
    """`records` but those whose prompt holds a user turn of the dev split or of the agentic
    benchmark (data runs made before the benchmark's pool was held out hold some)."""
    held_out = {t for t in agent_eval_turns() | turns_of(build_prompt_set().dev) if len(t) >= MIN_HELD_OUT_CHARS}
    dropped = 0
    for record in records:
        prompt = tokenizer.decode(record.tokens[:record.start + 1].tolist())
        if any(text in prompt for text in held_out):
            dropped += 1
            continue
        yield record
    log.info("left out %d records whose prompts hold a held-out turn", dropped)


def _warn_if_widened(directory: str | Path, ids: torch.Tensor | None, vocab_size: int) -> None:
    old = load_draft_vocab(directory, vocab_size)
    if old is None:
        return
    new = torch.arange(vocab_size) if ids is None else ids
    added = int((~torch.isin(new, old)).sum())
    if added:
        log.warning("%s: %d of the new tokens lie outside its current vocabulary; a draft trained over "
                    "that vocabulary (dlite-ray train does) never trained their rows", directory, added)


def train_two_stage(engine: DLiteEngine, draft: DLiteDraftModel, data: TrainData, cfg: TrainConfig, out: Path,
                    args, vocab: Vocab) -> dict:
    """Teacher (--teacher-steps), then the student: --blend-steps of KL blended into CE + TV
    under the teacher's frozen head, then the rest of --steps with everything trainable."""
    blend_steps = args.blend_steps if args.blend_steps is not None else args.steps // 3
    if not 0 < blend_steps < args.steps:
        raise ValueError(f"--blend-steps must lie in (0, --steps), got {blend_steps}")
    teacher = WindowTeacher(new_draft(engine, args.layers, args.slots, args.rank, args.block_size, args.seed + 1,
                                      draft.cfg.conventions), args.window)
    stages = {"teacher": train(teacher_objective(teacher, cfg, vocab), *data, replace(cfg, steps=args.teacher_steps),
                               out, "teacher")}
    adopt_teacher_head(draft, teacher)
    stages["student_blend"] = train(blend_objective(draft, teacher, cfg, vocab), *data, replace(cfg, steps=blend_steps),
                                    out, "student_blend")
    draft.sequential_head.requires_grad_(True)
    stages["student"] = train(student_objective(draft, cfg, vocab), *data, replace(cfg, steps=args.steps - blend_steps),
                              out, "student")
    for label, s in stages.items():
        log.info("%s: dev tau %.3f after %d steps, %.0f s", label, s["final_dev"]["tau"], s["config"]["steps"],
                 s["seconds"])
    return {**stages["student"], "seconds": sum(s["seconds"] for s in stages.values()),
            "stages": {label: {"final_dev": s["final_dev"], "steps": s["config"]["steps"], "seconds": s["seconds"]}
                       for label, s in stages.items()}}


def run(args) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    engine = _target_engine(args.target, "float32")
    draft = new_draft(engine, args.layers, args.slots, args.rank, args.block_size, args.seed,
                      draft_conventions(args.init_from))
    if args.init_from:
        init_weights(draft, Path(args.init_from))
    tap_layers = tuple(draft.cfg.target_layer_ids)
    log.info("draft: %d layers, S=%d %s, R=%d, %.1fM trainable parameters; conventions %s", args.layers,
             len(tap_layers), list(tap_layers), args.rank,
             sum(p.numel() for p in draft.checkpoint_state().values()) / 1e6, draft.cfg.conventions.describe())
    # The features are recorded as the draft will read them at inference.
    data_engine = _target_engine(args.target, args.data_dtype, tap_layers, draft.cfg.normed_last_tap)
    if args.extend_from:
        train_records, dev_records = earlier_data(args.extend_from)
        train_records = train_records + extend_data(data_engine, out, train_records + dev_records, args)
    else:
        train_records, dev_records = build_data(data_engine, out, args)
    del data_engine  # its weights and KV pool are not needed for training
    log.info("training on %d positions, dev %d", sum(r.argmax.numel() for r in train_records),
             sum(r.argmax.numel() for r in dev_records))
    k = args.block_size - 1
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                      weight_decay=args.weight_decay)
    dev_anchors = all_anchors(dev_records, k)
    vocab_ids = training_vocabulary(train_records, args, draft.cfg.layers.vocab_size)
    vocab = vocab_of(vocab_ids, draft.cfg.layers.vocab_size)
    data: TrainData = (train_records, all_anchors(train_records, k), dev_records, dev_anchors, k)
    initial_dev = None
    if args.init_from:  # so a drop from continued training shows at the first eval, not the last
        initial_dev = greedy_acceptance(student_objective(draft, cfg, vocab), dev_records, dev_anchors, k)
        log.info("dev tau %.3f before training (%s)", initial_dev["tau"], args.init_from)
    if args.teacher_steps > 0:
        summary = train_two_stage(engine, draft, data, cfg, out, args, vocab)
    else:
        summary = train(student_objective(draft, cfg, vocab), *data, cfg, out)
    directories = [d for d in (out / "draft", args.export) if d]
    for directory in directories:
        draft.save(directory)
    save_draft_vocab_next_to(directories, vocab_ids)
    write_reply_corpus(directories, train_records)  # not the dev split's: it measures unseen prompts
    if initial_dev is not None:
        summary["initial_dev"] = initial_dev
    summary["total_seconds"] = time.perf_counter() - started
    summary["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    (out / "summary.json").write_text(json.dumps({k_: v for k_, v in summary.items() if k_ != "history"}, indent=2))
    log.info("done in %.0f s, peak RSS %.0f MB, dev tau %.3f (walk %.3f)", summary["total_seconds"],
             summary["peak_rss_mb"], summary["final_dev"]["tau"], summary["final_dev"]["walk_tau"])
    return summary

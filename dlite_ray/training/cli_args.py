"""Arguments of `dlite-ray train` (kept apart so the CLI builds its parser without torch)."""

from __future__ import annotations

import argparse

from dlite_ray.constants import DEFAULT_DRAFT_VOCAB_SIZE


def _size(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF directory or .gguf (default: embedded SmolLM2)")
    p.add_argument("--out", default="runs/draft", help="working directory (data, checkpoints, history)")
    p.add_argument("--export", default=None, help="also write the final draft here (public layout)")
    p.add_argument("--layers", type=int, default=2, help="draft depth")
    p.add_argument("--slots", type=int, default=5, help="S: target layers read at the pivot")
    p.add_argument("--rank", type=int, default=64, help="R: sequential head rank")
    p.add_argument("--block-size", type=int, default=8, help="B = K + 1")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=96)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-new-tokens", type=int, default=96, help="length of the target's regenerated replies")
    p.add_argument("--per-source", type=int, default=40, help="prompts taken from each BFCL file")
    p.add_argument("--multi-turn", type=int, default=12, help="multi-turn BFCL conversations (long histories)")
    p.add_argument("--code-tasks", type=int, default=None, help="stdlib code tasks (default 2 x --per-source)")
    p.add_argument("--agent-loops", type=int, default=0,
                   help="whole BFCL tool-use conversations, every turn after a tool result (none the benchmark uses)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--extend-from", nargs="+", default=None, metavar="DIR",
                   help="reuse earlier runs' data and add new prompts: the first DIR's train and dev "
                        "splits (its dev split stays the dev split), then every DIR's data_extra.pt")
    p.add_argument("--new-prompts", type=int, default=None, help="with --extend-from: at most this many new prompts")
    p.add_argument("--data-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the target's dtype while it answers the prompts and records features "
                        "(bfloat16 is faster on AMX / AVX-512 bf16 CPUs; features are stored in bf16 either way)")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start the student from this draft checkpoint (same shape) instead of random weights")
    p.add_argument("--teacher-steps", type=int, default=0,
                   help="stage-0 sliding-window teacher steps (0 = one-stage student, CE + TV only)")
    p.add_argument("--window", type=int, default=64, help="teacher: positions of history before the pivot")
    p.add_argument("--blend-steps", type=int, default=None,
                   help="student steps under the teacher's frozen head, KL blended into CE + TV "
                        "(default: a third of --steps; the rest train everything on CE + TV)")
    p.add_argument("--draft-vocab", type=_size, default=DEFAULT_DRAFT_VOCAB_SIZE,
                   help="the draft proposes only the N tokens the target says most often in the training "
                        "replies, and its head trains over them alone (a smaller head read per drafted "
                        "position, a cheaper training step); 0 = the whole vocabulary")
    p.add_argument("--seed", type=int, default=0)


def add_reply_corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("draft", help="draft checkpoint directory to write reply_corpus.safetensors into")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="record files of `dlite-ray train` (data_train.pt, data_extra.pt; not data_dev.pt, "
                        "which measures the draft on prompts it has not seen)")
    p.add_argument("--target", default=None, help="the target whose tokenizer reads the records (default: embedded)")


def add_draft_vocab_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("draft", help="draft checkpoint directory to write draft_vocab.safetensors into")
    p.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="record files of `dlite-ray train` (data_train.pt, data_extra.pt) to count labels in")
    p.add_argument("--size", type=_size, default=DEFAULT_DRAFT_VOCAB_SIZE,
                   help="tokens the draft may propose (0: all of them; removes an earlier subset)")

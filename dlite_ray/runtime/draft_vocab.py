"""The draft's vocabulary: the tokens its head may propose, when not the whole vocabulary.

The sequential head ends in an R -> V projection that is read once per drafted position,
one position after another. For SmolLM2 that is 49152 x 64 bf16 weights (6.3 MB) per
position: at batch 1 on a CPU it was most of the draft's time. Restricted to the tokens the
target actually says (frequency-ranked, as in FR-Spec), the read shrinks with the subset
and acceptance barely moves, because what the draft gets right are frequent tokens, and
the rare ones (names, numbers) come from copying the context.

Exactness does not depend on the subset: greedy verification checks every token against
the target, and sampled verification uses the distribution the draft sampled from, which
is simply zero outside the subset.

On disk: `draft_vocab.safetensors` next to a draft checkpoint, one int64 tensor
`token_ids` (sorted, unique, in range). Without the file the draft uses every token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dlite_ray.runtime.draft_config import DraftConfigError

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"


def frequent_tokens(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most counted token ids, sorted by id. Ties (uncounted tokens, mostly)
    go to the lower id: BPE ids follow merge order, which roughly follows frequency."""
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocabulary size must lie in [1, {vocab}], got {size}")
    ids = torch.arange(vocab)
    # descending count, then ascending id: a stable sort on the count after an id order
    order = ids[torch.argsort(counts.to(torch.long), descending=True, stable=True)]
    return order[:size].sort().values


def sorted_and_distinct(ids: torch.Tensor) -> bool:
    """A usable subset: 1-D, non-empty, strictly increasing (a repeated id would make the
    scattered q disagree with what was sampled)."""
    return ids.dim() == 1 and ids.numel() > 0 and bool((ids[1:] > ids[:-1]).all())


def save_draft_vocab(directory: str | Path, token_ids: torch.Tensor) -> Path:
    """Write `token_ids` (sorted, unique) as the draft's vocabulary next to its checkpoint."""
    path = Path(directory) / DRAFT_VOCAB_FILE
    save_file({"token_ids": token_ids.to(torch.long).contiguous()}, path)
    return path


def load_draft_vocab(directory: str | Path, vocab_size: int) -> torch.Tensor | None:
    """The checkpoint's token subset, checked; None when it has none (the full vocabulary)."""
    path = Path(directory) / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    state = load_file(path)
    ids = state.get("token_ids")
    if ids is None or ids.dim() != 1 or ids.dtype != torch.long or ids.numel() == 0:
        raise DraftConfigError(f"{path}: needs one non-empty int64 tensor 'token_ids'")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise DraftConfigError(f"{path}: token ids must lie in [0, {vocab_size})")
    if not sorted_and_distinct(ids):
        raise DraftConfigError(f"{path}: token ids must be sorted and unique")
    return ids

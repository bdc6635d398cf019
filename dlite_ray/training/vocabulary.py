"""Training over the draft's vocabulary: the head learns only the tokens it will draft.

A draft with a vocabulary subset (`runtime/draft_vocab.py`) drafts from a softmax over
those tokens alone. Trained over the whole vocabulary, it learns a normalisation it never
uses, and the 49152-wide parts of a step (the head's logits for every block position, the
log-softmax, its backward, the zero-filled gradients of the gathers) took about three
quarters of a 1.35 s CPU step at batch 192. Here the head's logits cover only the subset's
rows of W_o, and labels and the target's top-k ids become indices into the subset, OUTSIDE
(-1) for the rest: a label the draft cannot propose trains nothing and counts as a miss in
dev acceptance (as it would when drafting); the target's probability on tokens outside
falls into the total-variation loss's tail bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from dlite_ray.runtime.draft_vocab import sorted_and_distinct
from dlite_ray.training.batches import Batch
from dlite_ray.training.losses import OUTSIDE


@dataclass(frozen=True, slots=True)
class TrainingVocabulary:
    token_ids: torch.Tensor  # [M] sorted, distinct: index i stands for token token_ids[i]
    vocab_size: int
    index_of: torch.Tensor = field(init=False)  # [V]: token id -> index, OUTSIDE for the tokens not drafted

    def __post_init__(self) -> None:
        ids = self.token_ids.to(torch.long)
        if not sorted_and_distinct(ids) or ids[0] < 0 or ids[-1] >= self.vocab_size:
            raise ValueError(f"the draft's vocabulary must be non-empty, sorted, distinct and lie in "
                             f"[0, {self.vocab_size})")
        index_of = torch.full((self.vocab_size,), OUTSIDE, dtype=torch.long)
        index_of[ids] = torch.arange(ids.numel())
        object.__setattr__(self, "token_ids", ids)
        object.__setattr__(self, "index_of", index_of)

    @property
    def size(self) -> int:
        return self.token_ids.numel()

    def restrict(self, batch: Batch) -> Batch:
        """The batch with labels and top-k ids as indices into the subset. The previous
        tokens the head reads stay token ids: its input embedding covers every token."""
        return replace(batch, labels=self.index_of[batch.labels], top_ids=self.index_of[batch.top_ids.long()])


Vocab = TrainingVocabulary | None  # None: the draft drafts from the whole vocabulary


def vocab_of(token_ids: torch.Tensor | None, vocab_size: int) -> Vocab:
    """The training vocabulary of a draft's token subset; None (every token) for none."""
    return None if token_ids is None else TrainingVocabulary(token_ids, vocab_size)


def drafted_token_ids(vocab: Vocab) -> torch.Tensor | None:
    """The token ids the head's logits cover: the subset's, or None for every token."""
    return None if vocab is None else vocab.token_ids

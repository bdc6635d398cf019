"""What the target computed at each position a request's output was chosen from
(`SamplingParams.trace_top_k`): its tap-layer hidden states and its top-k next-token
distribution.

Output token i was chosen at position num_prompt_tokens - 1 + i, so a trace holds one row
per output token, whether that token came from a plain step, a copied or a drafted round
(its verify row) or a bonus token. Training records its data this way: the features a
draft learns from are the ones the engine made while answering, with no second forward
over prompt and reply.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

TRACE_FEATURE_DTYPE = torch.bfloat16  # half the memory of float32; the draft reads them in bf16 anyway


@dataclass(slots=True)
class Trace:
    top_k: int
    _features: list[torch.Tensor] = field(default_factory=list)  # each [n, S, D]
    _top_ids: list[torch.Tensor] = field(default_factory=list)  # each [n, k]
    _top_probs: list[torch.Tensor] = field(default_factory=list)  # each [n, k]

    def add(self, logits: torch.Tensor, taps: torch.Tensor | None) -> None:
        """Rows of one step: logits [n, V] (float32), taps [n, S, D] or None where the
        engine taps no layers. Copied out, so the step's batch tensors are not kept alive."""
        probs, ids = logits.float().softmax(dim=-1).topk(self.top_k, dim=-1)
        self._top_ids.append(ids.to(torch.int32))
        self._top_probs.append(probs)
        if taps is not None:
            self._features.append(taps.to(TRACE_FEATURE_DTYPE, copy=True))

    def __len__(self) -> int:
        return sum(t.shape[0] for t in self._top_ids)

    @property
    def features(self) -> torch.Tensor | None:
        """[n, S, D] bf16, or None when the engine taps no layers."""
        return torch.cat(self._features) if self._features else None

    @property
    def top_ids(self) -> torch.Tensor:
        """[n, k] int32, most probable first."""
        return torch.cat(self._top_ids) if self._top_ids else torch.zeros(0, self.top_k, dtype=torch.int32)

    @property
    def top_probs(self) -> torch.Tensor:
        """[n, k] float32, the target's probabilities of top_ids (at temperature 1)."""
        return torch.cat(self._top_probs) if self._top_probs else torch.zeros(0, self.top_k)

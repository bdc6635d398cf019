"""An oracle draft: proposes the target's own future tokens (optionally corrupted).

It measures the engine's ceiling (every draft accepted) and, with corruption, exercises
rejections deterministically in tests. It finds its place in a known reference
continuation by matching the last G tokens, so it speaks the ordinary draft transport.
"""

from __future__ import annotations

import random

import torch

from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest
from dlite_ray.runtime.draft_model import DraftProposal

ORACLE_CONTEXT = 8  # tokens matched to find the position in a reference


class OracleDraftTransport:
    def __init__(self, references: list[list[int]], max_draft_tokens: int = 7, wrong_rate: float = 0.0,
                 seed: int = 0, vocab_size: int | None = None):
        self.references = references
        self.wrong_rate, self.rng, self.vocab_size = wrong_rate, random.Random(seed), vocab_size
        self.info = DraftInfo("oracle", ORACLE_CONTEXT, max_draft_tokens, ())

    def propose(self, request: DraftRequest) -> DraftProposal:
        rows = [self._continue(g, request.num_tokens) for g in request.token_groups.tolist()]
        return DraftProposal(torch.tensor(rows, dtype=torch.long), None)

    def _continue(self, context: list[int], k: int) -> list[int]:
        for ref in self.references:
            for end in range(len(context), len(ref) + 1):
                if ref[end - len(context):end] == context:
                    out = (ref[end:end + k] + [0] * k)[:k]
                    return [self._maybe_corrupt(t) for t in out]
        return [0] * k

    def _maybe_corrupt(self, token: int) -> int:
        if self.wrong_rate and self.rng.random() < self.wrong_rate:
            return (token + 1 + self.rng.randrange(3)) % (self.vocab_size or token + 4)
        return token

    def close(self) -> None:
        pass

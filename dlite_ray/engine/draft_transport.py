"""The engine's only way to reach a draft: a transport with the in-process version here.

The Ray deployment implements the same interface over torch.distributed (target and
draft on separate devices); the engine never calls the draft model directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from dlite_ray.engine.draft_graphs import DraftRoundGraphs
from dlite_ray.runtime.draft_config import DraftConfig
from dlite_ray.runtime.draft_model import DLiteDraftModel, DraftProposal
from dlite_ray.runtime.sampling import RowSampling


class DraftUnavailable(RuntimeError):
    """The draft could not answer this round; the engine decodes plainly meanwhile."""


@dataclass(slots=True)
class DraftRequest:
    """Target -> draft, for N rows: what a history-free draft needs, nothing more."""

    token_groups: torch.Tensor  # [N, G] real tokens ending at each anchor
    features: torch.Tensor | None  # [N, S, D] pivot features (None for drafts that read no target layers)
    num_tokens: int  # K for this call (<= block_size - 1)
    sampling: RowSampling
    draft_greedy: torch.Tensor  # [N] bool: rows drafting by argmax
    # whether every row drafts by argmax, known on the host from the requests (None: the
    # draft reads draft_greedy, a device read inside the round)
    all_greedy: bool | None = None


@dataclass(slots=True, frozen=True)
class DraftInfo:
    fingerprint: str
    anchor_group_size: int
    max_draft_tokens: int
    target_layer_ids: tuple[int, ...]
    normed_last_tap: bool = False  # the draft reads the target's last layer after its final norm

    @classmethod
    def of(cls, fingerprint: str, cfg: DraftConfig) -> DraftInfo:
        """What the engine needs to know of a draft with this config."""
        return cls(fingerprint, cfg.anchor_group_size, cfg.max_draft_tokens, tuple(cfg.target_layer_ids),
                   cfg.normed_last_tap)


class DraftTransport(Protocol):
    info: DraftInfo

    def propose(self, request: DraftRequest) -> DraftProposal: ...

    def close(self) -> None: ...


class InProcessDraftTransport:
    """Same process, same device: a direct call, no copies; greedy rounds from CUDA graphs
    where `round_graphs` is set (`use_round_graphs`)."""

    def __init__(self, draft: DLiteDraftModel, fingerprint: str):
        self.draft = draft
        self.info = DraftInfo.of(fingerprint, draft.cfg)
        self.round_graphs: DraftRoundGraphs | None = None

    @property
    def device(self) -> torch.device:
        return next(self.draft.parameters()).device

    def use_round_graphs(self, max_rows: int, capture: bool = True) -> None:
        """Greedy rounds of up to max_rows rows through CUDA graphs (capture=False: the same
        padded buffers, eagerly)."""
        self.round_graphs = DraftRoundGraphs(self.draft, max_rows, capture)

    def propose(self, request: DraftRequest) -> DraftProposal:
        if request.features is None:  # the engine sends none only to drafts that read no target layers
            raise ValueError("a DLite draft reads target features; the request has none")
        graphs = self.round_graphs
        if graphs is not None and graphs.serves(request.features, request.all_greedy):
            return graphs.propose(request.features, request.token_groups, request.num_tokens)
        return self.draft.propose(request.features, request.token_groups, request.num_tokens,
                                  request.sampling, request.draft_greedy, request.all_greedy)

    def close(self) -> None:
        pass

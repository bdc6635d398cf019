"""The draft's greedy round replayed from CUDA graphs, one per padded row-count bucket.

A draft round is small work in many launches: a 5-layer backbone and K steps of the
sequential head are ~250 kernels from Python, and a 7-token round at batch 1 took
9.4-12.1 ms on an H200 (docs/gpu/gpu-check-h200*.json) for a few hundred microseconds of
arithmetic. A CUDA graph replays them in one call, as `graph_runner.py` does the target's
decode and verify steps:

- a round of N rows runs as the smallest bucket of `graph_buckets` holding N, one graph
  per (bucket, K, anchor group size), captured the first time a round of that shape comes;
- its features and token groups are copied into the bucket's first rows of static
  buffers; the rows past N keep what they held (a row's draft reads only its own inputs,
  so a padding row changes nothing of a real one);
- the drafted tokens and runners-up come out in the graph's static outputs, sliced to
  the real rows and copied (the next replay rewrites them).

Only greedy rounds (every row drafts by argmax: no generator, nothing read back inside
the round); a sampled round, or more rows than the largest bucket, runs eagerly. A capture
that fails runs that shape eagerly, with the reason logged. With `capture=False` the same
bucketing and padding run eagerly: the CPU tests check the real rows get the unpadded
round's tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from dlite_ray.engine.graph_runner import bucket_for, capture_graph, graph_buckets
from dlite_ray.runtime.draft_model import DLiteDraftModel, DraftProposal
from dlite_ray.runtime.sampling import RowSampling

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Round:
    """One round shape's static inputs and, once captured, its graph and static outputs."""

    features: torch.Tensor  # [B, S, D]
    token_groups: torch.Tensor  # [B, G]
    sampling: RowSampling  # greedy rows: read by nothing, but propose takes them
    draft_greedy: torch.Tensor  # [B] all True
    graph: torch.cuda.CUDAGraph | None = None
    output: DraftProposal | None = None


@dataclass(slots=True)
class DraftGraphStats:
    captured: list[str] = field(default_factory=list)  # "KxB" of each captured shape
    failed: dict[str, str] = field(default_factory=dict)  # shape -> why it runs eagerly
    replays: int = 0
    padded_eager: int = 0  # rounds run eagerly over the static buffers (capture=False or failed)


class DraftRoundGraphs:
    """Greedy draft rounds through per-bucket CUDA graphs (capture=False: eagerly, padded)."""

    def __init__(self, draft: DLiteDraftModel, max_rows: int, capture: bool = True):
        self.draft, self.capture = draft, capture
        self.buckets = graph_buckets(max_rows)
        self.stats = DraftGraphStats()
        self._rounds: dict[tuple[int, int, int], _Round] = {}
        self._pool: Any = None  # torch's graph memory-pool handle, once the first graph is captured

    def serves(self, features: torch.Tensor | None, all_greedy: bool | None) -> bool:
        """Whether this round goes through the graphs: greedy, known so on the host, and no
        more rows than the largest bucket."""
        return bool(all_greedy) and features is not None and features.shape[0] <= self.buckets[-1]

    @torch.inference_mode()  # as draft.propose: its outputs, kept as static outputs, are rewritten in place
    def propose(self, features: torch.Tensor, token_groups: torch.Tensor, num_tokens: int) -> DraftProposal:
        """`draft.propose` of a greedy round, from the bucket's graph."""
        rows = features.shape[0]
        bucket = bucket_for(rows, self.buckets)
        round_ = self._round(bucket, num_tokens, features, token_groups)
        round_.features[:rows].copy_(features)
        round_.token_groups[:rows].copy_(token_groups)
        if round_.graph is not None:
            round_.graph.replay()
            output = round_.output
            self.stats.replays += 1
        else:
            output = self._run_into_outputs(round_, num_tokens)
            self.stats.padded_eager += 1
        assert output is not None and output.runners_up is not None  # a greedy round gives both
        return DraftProposal(output.tokens[:rows].clone(), None, runners_up=output.runners_up[:rows].clone())

    def _round(self, bucket: int, num_tokens: int, features: torch.Tensor, token_groups: torch.Tensor) -> _Round:
        key = (bucket, num_tokens, token_groups.shape[1])
        if key not in self._rounds:
            device = features.device
            round_ = _Round(features.new_zeros(bucket, *features.shape[1:]), token_groups.new_zeros(bucket, key[2]),
                            RowSampling.build([0.0] * bucket, [0] * bucket, [1.0] * bucket, [None] * bucket, device),
                            torch.ones(bucket, dtype=torch.bool, device=device))
            if self.capture:
                self._capture(round_, num_tokens, f"{num_tokens}x{bucket}")
            self._rounds[key] = round_
        return self._rounds[key]

    def _run(self, round_: _Round, num_tokens: int) -> DraftProposal:
        return self.draft.propose(round_.features, round_.token_groups, num_tokens, round_.sampling,
                                  round_.draft_greedy, all_greedy=True)

    def _run_into_outputs(self, round_: _Round, num_tokens: int) -> DraftProposal:
        """The round eagerly, its tokens written into the round's static outputs as a replay
        rewrites a graph's (so what callers keep must outlive the next round here too)."""
        fresh = self._run(round_, num_tokens)
        if round_.output is None:
            round_.output = fresh
        else:
            assert round_.output.runners_up is not None and fresh.runners_up is not None
            round_.output.tokens.copy_(fresh.tokens)
            round_.output.runners_up.copy_(fresh.runners_up)
        return round_.output

    def _capture(self, round_: _Round, num_tokens: int, name: str) -> None:
        """The round as a CUDA graph over its static buffers, or (logged) left to run eagerly."""
        device = round_.features.device
        if device.type != "cuda":
            self.stats.failed[name] = f"no CUDA graphs on {device}"
            return
        try:
            graph, output = capture_graph(lambda: self._run(round_, num_tokens), device, self._pool)
        except RuntimeError as exc:
            log.warning("CUDA graph capture of the draft's %s round failed; it runs eagerly: %s", name, exc)
            self.stats.failed[name] = f"capture failed: {exc}"
            return
        self._pool = graph.pool()
        round_.graph, round_.output = graph, output
        self.stats.captured.append(name)

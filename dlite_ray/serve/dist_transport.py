"""The draft transport over torch.distributed: target (rank 0) and draft (rank 1) on
separate devices or processes, NCCL with CUDA tensors, gloo on CPU.

Wire format per round, no pickling: a fixed int64 header, then fixed-dtype payloads
whose shapes the header gives.
  target -> draft: header [op, N, G, S, D, K, any_sampled, V]; token_groups int64 [N, G];
                   features bf16 [N, S, D]; temperature fp32 [N]; top_k int64 [N];
                   top_p fp32 [N]; draft_greedy uint8 [N]; seeds int64 [N]
  draft -> target: tokens int64 [N, K]; if any_sampled: width int64 [1] (W), the token
                   ids int64 [W] that probs' columns stand for when W < V, probs fp32 [N, K, W]
A draft with a vocabulary subset sends its distributions W wide (8192 of 49152 columns for
the shipped draft), and the target widens them to V where verification reads them.
The draft holds no per-request state between rounds (history-free), so there is nothing
else to keep in sync.
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest, DraftUnavailable
from dlite_ray.runtime.draft_model import DLiteDraftModel, DraftProposal
from dlite_ray.runtime.sampling import RowSampling

log = logging.getLogger(__name__)

OP_PROPOSE, OP_SHUTDOWN = 1, 2
HEADER = 8
TARGET_RANK, DRAFT_RANK = 0, 1


def init_pair(address: str, rank: int, backend: str, timeout_s: float = 30.0) -> None:
    """Join the two-process group (blocks until both ranks have joined)."""
    dist.init_process_group(backend, init_method=address, rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout_s))


class DistributedDraftTransport:
    """Target side: DraftTransport over the process group."""

    def __init__(self, info: DraftInfo, vocab_size: int, device: torch.device):
        self.info, self.vocab_size, self.device = info, vocab_size, device
        self.comm_time = 0.0  # seconds spent in send/recv, summed over rounds
        self.healthy = True

    def propose(self, request: DraftRequest) -> DraftProposal:
        if not self.healthy:
            raise DraftUnavailable("draft process is not connected")
        try:
            return self._round(request)
        except (RuntimeError, dist.DistBackendError) as exc:
            self.healthy = False
            raise DraftUnavailable(f"draft round failed: {exc}") from exc

    def _round(self, request: DraftRequest) -> DraftProposal:
        start = time.perf_counter()
        n, g = request.token_groups.shape
        feats = request.features.to(torch.bfloat16)
        s, d = feats.shape[1], feats.shape[2]
        k = request.num_tokens
        sampled = bool((~request.draft_greedy).any())
        rs = request.sampling
        seeds = torch.stack([torch.randint(0, 2**62, (1,), generator=gen) for gen in rs.generators]).view(-1) \
            if all(gen is not None for gen in rs.generators) else torch.randint(0, 2**62, (n,))
        header = torch.tensor([OP_PROPOSE, n, g, s, d, k, int(sampled), self.vocab_size], dtype=torch.int64)
        for t in (header, request.token_groups.long(), feats, rs.temperature.float(), rs.top_k.long(),
                  rs.top_p.float(), request.draft_greedy.to(torch.uint8), seeds.long()):
            dist.send(t.to(self.device).contiguous(), dst=DRAFT_RANK)
        tokens = torch.empty(n, k, dtype=torch.int64, device=self.device)
        dist.recv(tokens, src=DRAFT_RANK)
        probs = prob_ids = None
        if sampled:
            width = torch.empty(1, dtype=torch.int64, device=self.device)
            dist.recv(width, src=DRAFT_RANK)
            w = int(width)
            if not 0 < w <= self.vocab_size:
                raise RuntimeError(f"the draft sent distributions {w} wide for a vocabulary of {self.vocab_size}")
            if w < self.vocab_size:
                prob_ids = torch.empty(w, dtype=torch.int64, device=self.device)
                dist.recv(prob_ids, src=DRAFT_RANK)
            probs = torch.empty(n, k, w, dtype=torch.float32, device=self.device)
            dist.recv(probs, src=DRAFT_RANK)
        self.comm_time += time.perf_counter() - start
        return DraftProposal(tokens, probs, prob_ids)

    def close(self) -> None:
        if self.healthy and dist.is_initialized():
            try:
                dist.send(torch.tensor([OP_SHUTDOWN] + [0] * (HEADER - 1), dtype=torch.int64, device=self.device),
                          dst=DRAFT_RANK)
            except RuntimeError:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        self.healthy = False


def serve_draft(draft: DLiteDraftModel, device: torch.device) -> None:
    """Draft side: answer rounds until the target says stop (or the group breaks)."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    while True:
        dist.recv(header, src=TARGET_RANK)
        op, n, g, s, d, k, sampled, vocab = header.tolist()
        if op == OP_SHUTDOWN:
            break
        groups = _recv((n, g), torch.int64, device)
        feats = _recv((n, s, d), torch.bfloat16, device)
        temperature = _recv((n,), torch.float32, device)
        top_k = _recv((n,), torch.int64, device)
        top_p = _recv((n,), torch.float32, device)
        greedy = _recv((n,), torch.uint8, device).bool()
        seeds = _recv((n,), torch.int64, device).tolist()
        gens = [torch.Generator(device=device).manual_seed(x) for x in seeds]
        dtype = next(draft.parameters()).dtype
        proposal = draft.propose(feats.to(dtype), groups, k, RowSampling(temperature, top_k, top_p, gens), greedy)
        dist.send(proposal.tokens.contiguous(), dst=TARGET_RANK)
        if sampled:
            _send_probs(proposal, vocab)
    dist.destroy_process_group()


def _send_probs(proposal: DraftProposal, vocab: int) -> None:
    """The draft distributions at the width they were drawn at (see the wire format)."""
    probs = proposal.probs.float().contiguous()
    width = probs.shape[-1]
    dist.send(torch.tensor([width], dtype=torch.int64, device=probs.device), dst=TARGET_RANK)
    if width < vocab:
        dist.send(proposal.prob_ids.long().contiguous(), dst=TARGET_RANK)
    dist.send(probs, dst=TARGET_RANK)


def _recv(shape, dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src=TARGET_RANK)
    return t

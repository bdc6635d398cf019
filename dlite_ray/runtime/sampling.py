"""Sampling and speculative verification, vectorised over a batch of rows.

Each row carries its own temperature / top-k / top-p and its own number of drafted
tokens; every row gets its own accepted length A (no batch minimum). Randomness comes
from one torch.Generator per row, so no row draws from another's. A seeded request
reproduces its output when run again with the same batch and a fixed draft length; in
another batch, or with the adaptive length (which follows timings), a round may take
another number of draws, so the output differs while still following the target's
distribution.

Verification modes (REFERENCE.md section 2):
- greedy: accept while d_k == argmax p_k. Exactly the target's greedy output.
- rejection: exact speculative sampling. Accept d_k with prob min(1, p(d_k) / q(d_k)),
  on reject resample from norm(max(p - q, 0)), bonus from p when all pass. p and q are
  both the *processed* distributions (same temperature, top-k, top-p).
- match: the draft proposes greedily, the target samples a token at every position
  and drafts are accepted while they equal those samples. Each emitted token is a fresh
  target sample given the accepted prefix, so output follows the target, but acceptance
  is lower than the ratio rule (the draft's probabilities are ignored). The public
  release's default; a cheaper heuristic, not the ratio rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlite_ray.runtime import fused_ops

GREEDY, REJECTION, MATCH = "greedy", "rejection", "match"
VERIFY_MODES = (GREEDY, REJECTION, MATCH)

# The lowest temperature that samples; below it a request is greedy (SamplingParams sets it
# to 0). Logits are divided by T in float32: a T of 1e-45 (a denormal) or 1e-300 (0 in
# float32) turns them into inf and the distribution into NaN. At T = 1e-5 logits of
# magnitude <= 100 stay below 1e7, far from overflow, and a token 2e-4 below the top logit
# keeps under e^-20 (2e-9) of its mass: a lower temperature would differ from greedy only on
# ties closer than float32 logits resolve well. vLLM treats T < 1e-5 as greedy too (its
# _SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5


@dataclass(slots=True)
class RowSampling:
    """Per-row sampling knobs as tensors: temperature, top_k (0 = off), top_p ([B])."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: list[torch.Generator | None]

    @classmethod
    def build(cls, temperature: list[float], top_k: list[int], top_p: list[float],
              generators: list[torch.Generator | None], device: torch.device | str = "cpu") -> RowSampling:
        return cls(torch.tensor(temperature, dtype=torch.float32, device=device),
                   torch.tensor(top_k, dtype=torch.long, device=device),
                   torch.tensor(top_p, dtype=torch.float32, device=device), generators)


def probabilities(logits: torch.Tensor, s: RowSampling) -> torch.Tensor:
    """logits [B, N, V] -> processed probabilities [B, N, V] (temperature, top-k, top-p).

    Rows should have temperature >= MIN_TEMPERATURE (below it requests are greedy); a lower
    one is processed at the floor, so nothing divides into inf or NaN. The same function
    processes target p and draft q.
    """
    logits = logits.float() / s.temperature.clamp_min(MIN_TEMPERATURE)[:, None, None]
    vocab = logits.shape[-1]
    k = torch.where(s.top_k > 0, s.top_k.clamp(max=vocab), torch.full_like(s.top_k, vocab))
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(-1, (k - 1)[:, None, None].expand(-1, logits.shape[1], 1))
    logits = logits.masked_fill(logits < kth, float("-inf"))
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches p
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < s.top_p[:, None, None]
    cutoff = sorted_logits.masked_fill(~keep_sorted, float("inf")).amin(dim=-1, keepdim=True)
    logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return logits.softmax(dim=-1)


def sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """probs [B, N, V] -> tokens [B, N] by the exponential race argmax(p / E), E ~ Exp(1)."""
    return race(probs, uniforms(tuple(probs.shape[1:]), generators, probs.device))


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """`sample` with its uniforms drawn beforehand: probs and noise [..., V] -> tokens [...]."""
    return (probs / -torch.log(noise.clamp_min(1e-20))).argmax(dim=-1)


def uniforms(shape: tuple[int, ...], generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[B, *shape] uniforms, row b from generators[b]. A request's generator lives on the
    CPU, so its row is drawn there and copied to the rows' device (a no-op on the CPU). A CPU
    generator's stream is sequential: one call of shape [K, *rest] draws what K calls of
    [1, *rest] would (tests/runtime/test_sampling.py), so a round may take its draws at once."""
    draws = [torch.rand(shape, generator=g, device=device if g is None else g.device) for g in generators]
    return torch.stack([d.to(device, non_blocking=True) for d in draws])


def _accepted_length(accept: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """accept [B, K] bool, num_drafts [B] -> A [B]: length of the accepted prefix."""
    k = accept.shape[1]
    in_range = torch.arange(k, device=accept.device)[None, :] < num_drafts[:, None]
    return (accept & in_range).long().cumprod(dim=1).sum(dim=1)


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor):
    """target_logits [B, K+1, V], drafts [B, K], num_drafts [B] -> (A [B], next token [B])."""
    best = fused_ops.argmax(target_logits)  # [B, K+1]
    accepted = _accepted_length(drafts == best[:, :-1], num_drafts)
    return accepted, best.gather(1, accepted[:, None]).squeeze(1)


def verify_greedy_row(best: list[int], draft: list[int]) -> tuple[int, int]:
    """`verify_greedy` for one row on the host: the target's greedy tokens at its K + 1 rows
    against its K drafts -> (A, the next token)."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == best[accepted]:
        accepted += 1
    return accepted, best[accepted]


def verify_rejection(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                     generators: list[torch.Generator | None]):
    """p [B, K+1, V] target probs, q [B, K, V] draft probs (what the drafts were sampled from)."""
    k = drafts.shape[1]
    p_d = p[:, :k].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = uniforms((k,), generators, p.device)
    accept = u * q_d < p_d  # u < min(1, p/q) without dividing by a possibly tiny q
    accepted = _accepted_length(accept, num_drafts)
    residual = (p[:, :k] - q).clamp_min(0)
    residual = torch.cat([residual, p[:, k:]], dim=1)  # index K: the bonus comes from p
    rows = torch.arange(p.shape[0], device=p.device)
    # all of a row's drafts passed -> bonus from p at that index; else the residual there
    p_at = p[rows, accepted]
    r_at = residual[rows, accepted]
    use_p = (accepted >= num_drafts)[:, None] | (r_at.sum(-1, keepdim=True) <= 0)
    final = torch.where(use_p, p_at, r_at / r_at.sum(-1, keepdim=True).clamp_min(1e-30))
    return accepted, sample(final[:, None], generators).squeeze(1)


def verify_match(p: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                 generators: list[torch.Generator | None]):
    """Target samples at every position; drafts accepted while equal to those samples."""
    target_tokens = sample(p, generators)  # [B, K+1]
    accepted = _accepted_length(drafts == target_tokens[:, :-1], num_drafts)
    return accepted, target_tokens.gather(1, accepted[:, None]).squeeze(1)

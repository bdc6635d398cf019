"""Per-token log-probabilities of a request's output (`SamplingParams.logprobs`), as
OpenAI-style APIs return them: the chosen token's and the n most likely tokens'.

They are the target's log-softmax at temperature 1, before temperature, top-k and top-p
shape the sampling distribution (what the OpenAI API and vLLM report). They come from the
rows that chose the tokens, plain or verify rows alike; verify rows give the same bits as
plain steps, so a speculative request reports exactly what plain decoding would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob) of the n most likely, most likely first


FLOOR = -9999.0  # OpenAI's value for a token too unlikely to have a finite logprob; JSON has no -inf


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """One entry per chosen token: row i of `logits` [n, V] is the distribution token i was chosen from."""
    logits = logits.float()
    norm = logits.logsumexp(dim=-1, keepdim=True)  # log-softmax at the few entries asked, not a [n, V] copy
    chosen_ids = torch.tensor(tokens, device=logits.device).view(-1, 1)
    chosen = _finite(logits.gather(1, chosen_ids) - norm).squeeze(1).tolist()
    if top_n == 0:
        return [TokenLogprob(t, lp, ()) for t, lp in zip(tokens, chosen)]
    top_logits, top_ids = logits.topk(top_n, dim=-1)
    top_lp = _finite(top_logits - norm)
    return [TokenLogprob(t, lp, tuple(zip(row_ids, row_lps)))
            for t, lp, row_ids, row_lps in zip(tokens, chosen, top_ids.tolist(), top_lp.tolist())]


def _finite(logprobs: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(logprobs, nan=FLOOR, neginf=FLOOR, posinf=0.0).clamp(min=FLOOR)

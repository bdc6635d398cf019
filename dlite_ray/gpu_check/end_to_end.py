"""End to end: `DLiteEngine.generate` with a draft of fixed acceptance against plain decoding
on the same runtime, at a batch and context a user runs.

The draft is an oracle that knows plain decoding's reply (`FixedAcceptanceOracle`): each
round it proposes the reply's next K tokens with one of them wrong, at index 3 and 4 in
turn, so a round accepts 3 or 4 drafts and commits the target's token after them: tau
(tokens a round commits) is 4.5 whatever the weights say. What the pair then shows is the
engine's round cost against its decode step at that tau, with no draft model's cost in it.
"""

from __future__ import annotations

import gc

import torch

from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest, DraftTransport
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.gpu_check.exactness import IdTokenizer, mean_accept_length, ragged_prompts
from dlite_ray.runtime.draft_model import DraftProposal
from dlite_ray.runtime.target_model import TargetModel

ORACLE_GROUP = 16  # tokens a row's place in its reply is found by
WRONG_AT = (3, 4)  # the index of the wrong token, round by round: tau = 1 + mean(WRONG_AT) = 4.5
DRAFT_TOKENS = 7


class FixedAcceptanceOracle:
    """A draft transport that proposes plain decoding's continuation with one wrong token."""

    def __init__(self, references: list[list[int]], vocab_size: int):
        self.info = DraftInfo("oracle", ORACLE_GROUP, DRAFT_TOKENS, ())
        self.references, self.vocab_size = references, vocab_size
        # each group of ORACLE_GROUP tokens -> (reference, the position after it); a group
        # seen twice keeps its first place (random prompts repeat none; a reply may)
        self._places: dict[tuple[int, ...], tuple[int, int]] = {}
        for r, ref in enumerate(references):
            for end in range(ORACLE_GROUP, len(ref) + 1):
                self._places.setdefault(tuple(ref[end - ORACLE_GROUP:end]), (r, end))
        self._rounds = 0

    def propose(self, request: DraftRequest) -> DraftProposal:
        wrong = WRONG_AT[self._rounds % len(WRONG_AT)]
        self._rounds += 1
        k = request.num_tokens
        rows = [self._continue(tuple(group), k, wrong) for group in request.token_groups.tolist()]
        return DraftProposal(torch.tensor(rows, dtype=torch.long), None)

    def _continue(self, group: tuple[int, ...], k: int, wrong: int) -> list[int]:
        place = self._places.get(group)
        if place is None:
            return [0] * k
        ref, end = self.references[place[0]], place[1]
        out = (ref[end:end + k] + [0] * k)[:k]
        if wrong < k:
            out[wrong] = (out[wrong] + 1) % self.vocab_size
        return out

    def close(self) -> None:
        pass


def compare(target: TargetModel, batch: int, context: int, new_tokens: int, cuda_graphs: bool) -> dict:
    """Plain decoding, then the oracle from its replies, each on a fresh engine over the same
    prompts (prefill outside the decode rate, as `decode_tokens_per_second` counts it)."""
    vocab = target.cfg.vocab_size
    prompts = ragged_prompts(batch, [context - batch], vocab, seed=batch)  # lengths context - batch + i
    kv = batch * (context + new_tokens + 64)

    def engine(draft: DraftTransport | None) -> DLiteEngine:
        return DLiteEngine(target, IdTokenizer(), draft, max_kv_tokens=kv, lookup_tokens=0,
                           adaptive_draft_length=False, cuda_graphs=cuda_graphs, enable_prefix_cache=False)

    plain = _generate(engine(None), prompts, new_tokens)
    references = [p + r.token_ids for p, r in zip(prompts, plain)]
    oracle = FixedAcceptanceOracle(references, vocab)
    spec = _generate(engine(oracle), prompts, new_tokens)
    return {"batch": batch, "context": context, "new_tokens": new_tokens, "tau": mean_accept_length(spec),
            "dlite_tokens_per_second": _rate(spec), "ar_tokens_per_second": _rate(plain),
            "greedy_equal": all(a.token_ids == b.token_ids for a, b in zip(plain, spec))}


def _generate(engine: DLiteEngine, prompts: list[list[int]], new_tokens: int):
    try:
        return engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    finally:
        del engine  # its KV pool, before the next engine allocates one
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _rate(results) -> float:
    """The batch's decode rate: every request's tokens after its first round over the
    longest decode time (requests decode together)."""
    tokens = sum(len(r.token_ids) - (r.stats.accept_lengths[0] if r.stats.accept_lengths else 1) for r in results)
    seconds = max(r.stats.decode_wall_time for r in results)
    return tokens / seconds if seconds > 0 else 0.0

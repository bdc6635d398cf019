"""Exactness checks: a verify row computes what decoding that token alone computes, greedy
speculative output equals plain decoding, rejection sampling keeps the target's law."""

from __future__ import annotations

import torch

from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.engine.draft_transport import InProcessDraftTransport
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.model_runner import ModelRunner, RowInput
from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.sampling import verify_rejection
from dlite_ray.runtime.target_model import TargetModel

VERIFY_ROWS = 8  # the anchor and K = 7 drafted tokens


class IdTokenizer:
    """Prompts are token ids here; the engine only asks for an end-of-text id and text."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def ragged_prompts(batch: int, lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (lengths[i % len(lengths)] + i,), generator=gen).tolist() for i in range(batch)]


def row_exactness(runner: ModelRunner, contexts: list[int], vocab: int) -> dict:
    """Verify VERIFY_ROWS tokens per sequence in one forward, then decode each of those
    tokens again (all sequences together, one row each, over the same KV): every row's
    logits must have the same bits. This is the engine's batch shape in both steps."""
    prompts = ragged_prompts(len(contexts), contexts, vocab, 7)
    seqs = [Sequence(p, SamplingParams(max_new_tokens=VERIFY_ROWS)) for p in prompts]
    block = torch.randint(0, vocab, (len(seqs), VERIFY_ROWS), generator=torch.Generator().manual_seed(8)).tolist()
    first = []
    for seq in seqs:  # the prompt minus its last VERIFY_ROWS tokens is the KV history
        history = len(seq.token_ids) - VERIFY_ROWS
        runner.forward([RowInput(seq, seq.token_ids[:history])])
        runner.commit(seq, history)
        first.append(history)
    verified = runner.forward([RowInput(s, b, num_outputs=VERIFY_ROWS) for s, b in zip(seqs, block)])
    max_diff, equal = 0.0, True
    for j in range(VERIFY_ROWS):
        for seq, start in zip(seqs, first):
            seq.num_computed = start + j
        decoded = runner.forward([RowInput(s, [b[j]]) for s, b in zip(seqs, block)])
        for v, d in zip(verified, decoded):
            equal &= torch.equal(v.logits[j], d.logits[0])
            max_diff = max(max_diff, (v.logits[j] - d.logits[0]).abs().max().item())
    for seq in seqs:
        runner.release(seq)
    return {"equal": bool(equal), "max_abs_diff": max_diff}


def greedy_equality(target: TargetModel, draft: DLiteDraftModel, batch: int, lengths: list[int],
                    new_tokens: int, max_kv_tokens: int) -> dict:
    """Plain decoding against speculation with the random draft and with an oracle draft
    (the plain output itself, 30% of tokens corrupted: long accepted runs and rejections)."""
    prompts = ragged_prompts(batch, lengths, target.cfg.vocab_size, seed=batch)
    kw = {"max_kv_tokens": max_kv_tokens, "lookup_tokens": 0, "adaptive_draft_length": False}

    def run(transport):
        engine = DLiteEngine(target, IdTokenizer(), transport, **kw)
        results = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
        del engine
        return results

    plain = run(None)
    drafted = run(InProcessDraftTransport(draft, "random"))
    references = [p + r.token_ids for p, r in zip(prompts, plain)]
    oracle = run(OracleDraftTransport(references, wrong_rate=0.3, vocab_size=target.cfg.vocab_size))
    return {
        "draft_equal": all(a.token_ids == b.token_ids for a, b in zip(plain, drafted)),
        "oracle_equal": all(a.token_ids == b.token_ids for a, b in zip(plain, oracle)),
        "first_divergence": _first_divergence(plain, drafted + oracle),
        "draft_mean_accept_length": mean_accept_length(drafted),
        "oracle_mean_accept_length": mean_accept_length(oracle),
    }


def _first_divergence(plain, others) -> int | None:
    """The earliest output index where a speculative reply leaves its plain reply."""
    found = None
    for i, other in enumerate(others):
        a, b = plain[i % len(plain)].token_ids, other.token_ids
        for j, (x, y) in enumerate(zip(a, b)):
            if x != y:
                found = j if found is None else min(found, j)
                break
    return found


def mean_accept_length(results) -> float:
    lengths = [a for r in results for a in r.stats.accept_lengths]
    return sum(lengths) / max(len(lengths), 1)


def rejection_chi_square(device: torch.device, samples: int = 20000, rows: int = 2000) -> dict:
    """The first committed token of a round (the draft's if accepted, else the residual's
    draw) must follow the target's p whatever the draft's q. A sampler that accepts every
    draft (a classic bug) gives q instead: the same statistic must reject it, or the check
    has no power."""
    p = torch.tensor([0.35, 0.25, 0.15, 0.12, 0.08, 0.05], device=device)
    q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10], device=device)
    exact, broken = [], []
    for _ in range(samples // rows):
        drafts = torch.multinomial(q, rows, replacement=True)[:, None]  # [B, 1]
        p_rows, q_rows = p.expand(rows, 2, -1), q.expand(rows, 1, -1)
        accepted, nxt = verify_rejection(p_rows, q_rows, drafts, torch.ones(rows, dtype=torch.long, device=device),
                                         [None] * rows)
        exact.append(torch.where(accepted >= 1, drafts[:, 0], nxt))
        broken.append(drafts[:, 0])
    return {"p_value": _chi2_pvalue(torch.cat(exact), p), "broken_sampler_p_value": _chi2_pvalue(torch.cat(broken), p)}


def _chi2_pvalue(tokens: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    expected = p.double() * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor(p.numel() - 1, dtype=torch.float64, device=stat.device)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # the chi-square survival function

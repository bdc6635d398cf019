"""Small drivers the runtime tests share: run token ids through our runtime's paged KV."""

from __future__ import annotations

import torch

from dlite_ray.engine.model_runner import ModelRunner, RowInput
from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.engine.speculation_policy import RowOffer


def new_runner(model, tap_layers=(), max_kv_tokens=4096, block_size=16) -> ModelRunner:
    return ModelRunner(model, tuple(tap_layers), max_kv_tokens, block_size, "sdpa")


def new_seq(ids: list[int]) -> Sequence:
    return Sequence(list(ids), SamplingParams(max_new_tokens=8))


def forward_all(runner: ModelRunner, seq: Sequence, tokens: list[int]):
    """Feed `tokens` after what the sequence already holds; logits/taps at every new position."""
    out = runner.forward([RowInput(seq, tokens, num_outputs=len(tokens))])[0]
    runner.commit(seq, seq.num_computed + len(tokens))
    return out


def prefilled(runner: ModelRunner, n: int) -> list[Sequence]:
    """n sequences of 5, 14, 23, ... tokens (some across block boundaries), prefilled."""
    seqs = []
    for i in range(n):
        prompt = [(7 * i + 3 * j) % 120 + 3 for j in range(5 + 9 * i)]
        seq = new_seq(prompt)
        runner.forward([RowInput(seq, prompt)])
        runner.commit(seq, len(prompt))
        seqs.append(seq)
    return seqs


def step_rows(runner: ModelRunner, seqs: list[Sequence], q: int):
    """One forward of q new tokens a sequence, logits and taps at each of them (not committed)."""
    rows = [RowInput(s, [(11 * i + j) % 120 + 3 for j in range(q)], num_outputs=q) for i, s in enumerate(seqs)]
    return runner.forward(rows)


def hf_logits(directory, ids: list[int], dtype=torch.float32, hidden=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=hidden)
    return out


def chi2_pvalue(samples, probs) -> float:
    """Chi-square goodness of fit of integer samples to a probability vector."""
    import numpy as np
    from scipy.stats import chisquare

    probs = np.asarray(probs, dtype=float)
    counts = np.bincount(np.asarray(samples), minlength=len(probs)).astype(float)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability zero"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return chisquare(counts[keep], expected).pvalue


def offers(seqs: list[Sequence], caps: list[int], copy_caps: list[int] | None = None,
           from_reply: list[bool] | None = None, forced: list[bool] | None = None) -> list[RowOffer]:
    """What each row could verify, as SpeculationPolicy.choose weighs it: a draft of up to
    caps[i] tokens, or a copy of copy_caps[i] tokens (their values do not matter to it)."""
    n = len(seqs)
    copy_caps, from_reply, forced = copy_caps or [0] * n, from_reply or [False] * n, forced or [False] * n
    return [RowOffer(s, cap, [0] * copy, reply, must)
            for s, cap, copy, reply, must in zip(seqs, caps, copy_caps, from_reply, forced, strict=True)]

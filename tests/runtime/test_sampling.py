"""Speculative sampling follows the target distribution; a broken sampler fails the same test."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.runtime.sampling import (
    RowSampling,
    probabilities,
    sample,
    uniforms,
    verify_greedy,
    verify_greedy_row,
    verify_match,
    verify_rejection,
)
from tests.helpers import chi2_pvalue

V, K, N = 8, 3, 40000


def _dists(seed=0):
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q_logits = torch.randn(K, V, generator=g) * 1.5
    return p_logits, q_logits


def _sampling(n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    gens = [None] * n
    torch.manual_seed(seed)
    return RowSampling.build([temperature] * n, [top_k] * n, [top_p] * n, gens)


def _run(verify, temperature=1.0, top_k=0, top_p=1.0):
    """N independent rows with the same p, q: returns (first emitted token, second, A, p, q)."""
    p_logits, q_logits = _dists()
    s = _sampling(N, temperature, top_k, top_p)
    p = probabilities(p_logits.expand(N, -1, -1), s)
    q = probabilities(q_logits.expand(N, -1, -1), s)
    drafts = sample(q, s.generators)
    accepted, nxt = verify(p, q, drafts, torch.full((N,), K), s.generators)
    emitted = torch.cat([drafts, torch.zeros(N, 1, dtype=torch.long)], dim=1)
    emitted[torch.arange(N), accepted] = nxt
    return emitted, accepted, p[0], q[0]


def _always_accept(p, q, drafts, num, gens):
    return num.clone(), sample(p[:, -1:], gens)[:, 0]


def _chi2_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    return chi2_pvalue(samples.numpy(), probs.double().numpy())


@pytest.mark.parametrize("knobs", [{}, {"temperature": 0.7}, {"top_k": 4}, {"top_p": 0.8},
                                   {"temperature": 1.3, "top_k": 5, "top_p": 0.9}])
def test_first_token_follows_target(knobs):
    emitted, _, p, _ = _run(verify_rejection, **knobs)
    assert _chi2_pvalue(emitted[:, 0], p[0]) > 1e-3


def test_token_after_a_rejection_follows_target():
    emitted, accepted, p, _ = _run(verify_rejection, top_p=0.9)
    # rows whose first draft was accepted: the second emitted token is d_2 or a resample at index 1
    rows = accepted >= 1
    assert _chi2_pvalue(emitted[rows, 1], p[1]) > 1e-3
    # rows rejected at 0: the emitted token is a residual sample; together with accepted rows it is p
    assert (accepted == 0).any()


def test_accept_counts_match_analytic_beta():
    _, accepted, p, q = _run(verify_rejection)
    beta = torch.minimum(p[:K], q).sum(-1)  # per-position acceptance probability
    expected_tail = torch.cumprod(beta, 0)  # P(A >= j), j = 1..K
    observed_tail = torch.stack([(accepted >= j).float().mean() for j in range(1, K + 1)])
    torch.testing.assert_close(observed_tail, expected_tail.float(), atol=0.015, rtol=0)
    expected_tau = 1 + expected_tail.sum()
    assert abs((accepted + 1).float().mean() - expected_tau) < 0.03


def test_broken_sampler_fails_the_same_test():
    emitted, _, p, _ = _run(_always_accept)
    assert _chi2_pvalue(emitted[:, 0], p[0]) < 1e-6


def test_match_mode_follows_target():
    def match(p, q, drafts, num, gens):
        return verify_match(p, q.argmax(-1), num, gens)

    p_logits, q_logits = _dists()
    s = _sampling(N)
    p = probabilities(p_logits.expand(N, -1, -1), s)
    q = probabilities(q_logits.expand(N, -1, -1), s)
    accepted, nxt = match(p, q, None, torch.full((N,), K), s.generators)
    drafts = q.argmax(-1)
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    assert _chi2_pvalue(first, p[0, 0]) > 1e-3


def test_top_k_top_p_processing_matches_a_direct_computation():
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.5, 0.0, -1.0]]])
    s = RowSampling.build([0.5], [4], [0.9], [None])
    got = probabilities(logits, s)[0, 0]
    scaled = torch.softmax(logits[0, 0] / 0.5, -1)
    top4 = scaled[:4] / scaled[:4].sum()
    keep = (torch.cumsum(top4, 0) - top4) < 0.9
    want = torch.zeros(6)
    want[:4] = torch.where(keep, top4, 0)
    want /= want.sum()
    torch.testing.assert_close(got, want)


def test_greedy_rows_each_get_their_own_length():
    logits = torch.zeros(3, 4, 5)
    logits[:, :, 1] = 5  # target argmax is always 1
    drafts = torch.tensor([[1, 1, 1], [1, 2, 1], [3, 1, 1]])
    accepted, nxt = verify_greedy(logits, drafts, torch.tensor([3, 3, 2]))
    assert accepted.tolist() == [3, 1, 0]
    assert nxt.tolist() == [1, 1, 1]


def test_one_greedy_row_on_the_host_is_verify_greedys_row():
    gen = torch.Generator().manual_seed(3)
    for k in range(5):
        for _ in range(20):
            logits = torch.randn(1, k + 1, 4, generator=gen)
            best = logits.argmax(-1)[0].tolist()
            draft = [b if torch.rand(1, generator=gen) < 0.7 else (b + 1) % 4 for b in best[:k]]
            accepted, nxt = verify_greedy(logits, torch.tensor([draft], dtype=torch.long).view(1, k), torch.tensor([k]))
            assert verify_greedy_row(best, draft) == (accepted.item(), nxt.item())


def test_seeded_sampling_is_reproducible():
    p = torch.softmax(torch.randn(4, 2, V), -1)
    a = sample(p, [torch.Generator().manual_seed(i) for i in range(4)])
    b = sample(p, [torch.Generator().manual_seed(i) for i in range(4)])
    assert torch.equal(a, b)


def test_a_round_drawn_at_once_is_the_stream_of_its_draws():
    """The draft takes a round's uniforms in one call per row (no host work per drafted
    token): a seeded row must get what K calls of one position each gave it."""
    at_once = uniforms((5, V), [torch.Generator().manual_seed(i) for i in range(3)], "cpu")
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    one_by_one = torch.stack([uniforms((1, V), gens, "cpu")[:, 0] for _ in range(5)], dim=1)
    assert torch.equal(at_once, one_by_one)

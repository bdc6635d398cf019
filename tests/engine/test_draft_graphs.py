"""The draft's greedy rounds through per-bucket static buffers (engine/draft_graphs.py), run
eagerly on the CPU (capture=False): the real rows get the unpadded round's tokens, padding
rows left from an earlier round change nothing, and an engine drafting through them keeps
its output and its acceptance."""

from __future__ import annotations

import torch

from dlite_ray.engine.draft_graphs import DraftRoundGraphs
from dlite_ray.engine.draft_transport import DraftRequest, InProcessDraftTransport
from dlite_ray.runtime.sampling import RowSampling
from tests.engine.conftest import make_engine


def _round(draft, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, draft.cfg.num_slots, draft.cfg.layers.hidden_size, generator=gen)
    groups = torch.randint(3, 120, (rows, draft.cfg.anchor_group_size), generator=gen)
    return features, groups


def _eager(draft, features: torch.Tensor, groups: torch.Tensor, k: int):
    rows = features.shape[0]
    sampling = RowSampling.build([0.0] * rows, [0] * rows, [1.0] * rows, [None] * rows)
    return draft.propose(features, groups, k, sampling, torch.ones(rows, dtype=torch.bool), all_greedy=True)


def test_a_padded_round_gives_each_real_row_the_unpadded_rounds_tokens(tiny_draft):
    """3 rows in the bucket of 4, then 1 row in the bucket of 1, then 3 other rows in the
    bucket of 4 again (its 4th row still holds the first round's padding): each time the
    tokens and runners-up of the round run alone."""
    graphs = DraftRoundGraphs(tiny_draft, max_rows=8, capture=False)
    assert graphs.buckets == (1, 2, 4, 8)
    for rows, seed, k in ((3, 0, 5), (1, 1, 5), (3, 2, 5), (3, 3, 2)):
        features, groups = _round(tiny_draft, rows, seed)
        got = graphs.propose(features, groups, k)
        want = _eager(tiny_draft, features, groups, k)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.runners_up, want.runners_up)
        assert got.probs is None and got.tokens.shape == (rows, k)
    assert graphs.stats.padded_eager == 4 and not graphs.stats.captured
    assert sorted(graphs._rounds) == [(1, 5, 1), (4, 2, 1), (4, 5, 1)]  # one per (bucket, K, group size)


def test_a_round_keeps_its_tokens_after_the_next_round_rewrites_the_buffers(tiny_draft):
    graphs = DraftRoundGraphs(tiny_draft, max_rows=4, capture=False)
    first = graphs.propose(*_round(tiny_draft, 2, seed=4), 4)
    kept = first.tokens.clone()
    graphs.propose(*_round(tiny_draft, 2, seed=5), 4)
    assert torch.equal(first.tokens, kept)


def test_only_greedy_rounds_that_fit_a_bucket_are_served(tiny_draft):
    graphs = DraftRoundGraphs(tiny_draft, max_rows=4, capture=True)
    features, _ = _round(tiny_draft, 4, seed=6)
    assert graphs.serves(features, all_greedy=True)
    assert not graphs.serves(features, all_greedy=False)  # a sampled row draws from generators
    assert not graphs.serves(features, all_greedy=None)  # unknown on the host: eager reads it
    assert not graphs.serves(torch.cat([features, features]), all_greedy=True)  # 8 rows > the largest bucket
    graphs.propose(*_round(tiny_draft, 1, seed=7), 3)  # on a CPU capture is refused, the round still answered
    assert graphs.stats.failed == {"3x1": "no CUDA graphs on cpu"} and graphs.stats.padded_eager == 1


def test_an_engine_drafting_through_the_buckets_keeps_its_output_and_acceptance(tiny_target, tiny_draft):
    """Greedy speculation with the draft's rounds through the padded buffers: the same tokens
    as plain decoding, and the same accepted lengths as the draft called directly (its
    proposals are the same)."""
    prompts = [[5, 17, 33, 2 + i, 90] for i in range(3)]
    plain = [r.token_ids for r in make_engine(tiny_target).generate(prompts, max_new_tokens=12)]
    direct = make_engine(tiny_target, tiny_draft).generate(prompts, max_new_tokens=12)
    transport = InProcessDraftTransport(tiny_draft, "test")
    transport.use_round_graphs(max_rows=4, capture=False)
    bucketed = make_engine(tiny_target, transport).generate(prompts, max_new_tokens=12)
    assert [r.token_ids for r in bucketed] == plain == [r.token_ids for r in direct]
    assert [r.stats.accept_lengths for r in bucketed] == [r.stats.accept_lengths for r in direct]
    assert transport.round_graphs is not None and transport.round_graphs.stats.padded_eager > 0


def test_a_sampled_round_goes_to_the_draft_itself(tiny_draft):
    transport = InProcessDraftTransport(tiny_draft, "test")
    transport.use_round_graphs(max_rows=4, capture=False)
    features, groups = _round(tiny_draft, 2, seed=8)
    sampling = RowSampling.build([0.8] * 2, [0] * 2, [1.0] * 2, [torch.Generator().manual_seed(i) for i in range(2)])
    proposal = transport.propose(DraftRequest(groups, features, 3, sampling, torch.tensor([False, True]), False))
    assert proposal.probs is not None  # drawn by the draft's sampler, with its distributions
    assert transport.round_graphs is not None and transport.round_graphs.stats.padded_eager == 0

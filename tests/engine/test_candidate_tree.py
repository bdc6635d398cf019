"""Candidate trees: merging branches, the greedy walk, and multi-candidate rejection sampling
that emits every token from the target's distribution (chi-square tests a broken walk fails)."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.engine import candidate_tree
from dlite_ray.engine.candidate_tree import CandidateTree, walk_greedy, walk_sampled
from tests.helpers import chi2_pvalue

V = 6
COPY = [2, 4]  # a copy proposes tokens 2 then 4 after the anchor
TRIALS = 12000


def test_branches_share_the_nodes_they_agree_on():
    tree = CandidateTree.chain(9, [1, 2, 3])
    assert tree.add([1, 2, 5, 6]) == 2 and tree.add([4]) == 1 and tree.add([1, 2]) == 0
    assert tree.tokens == [9, 1, 2, 3, 5, 6, 4]
    assert tree.parents == [-1, 0, 1, 2, 2, 4, 0]
    assert tree.children(2) == [3, 4] and not tree.is_chain and CandidateTree.chain(9, [1]).is_chain
    assert tree.main_accepted([0, 1, 2, 4, 5]) == 2 and tree.main_accepted([0, 6]) == 0


def test_the_greedy_walk_keeps_the_targets_chain():
    tree = CandidateTree.chain(9, [1, 2, 3])
    tree.add([1, 5])
    tree.add([4, 4])
    # node:         0  1  2  3  4  5  6
    # tokens:       9  1  2  3  5  4  4
    best = [4, 5, 3, 0, 7, 4, 8]  # after the anchor the target says 4, then 4, then 8
    assert walk_greedy(tree, best) == ([0, 5, 6], 8)
    assert walk_greedy(tree, [1, 2, 3, 7, 0, 0, 0]) == ([0, 1, 2, 3], 7)
    assert walk_greedy(tree, [0] * 7) == ([0], 0)


def _distributions(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p_root = torch.rand(V, generator=g).softmax(0)
    p_after = torch.rand(V, V, generator=g).mul(3).softmax(-1)  # the target's p after token a
    q = torch.rand(2, V, generator=g).mul(2).softmax(-1)  # the draft's q at depths 1 and 2
    return p_root, p_after, q


def _walks(trials: int = TRIALS):
    """Each trial: the draft samples a 2-token block from q, a copy proposes COPY, and the
    tree of both is walked against a target whose distribution depends on the last token."""
    p_root, p_after, q = _distributions()
    g = torch.Generator().manual_seed(1)
    emitted = []
    for _ in range(trials):
        drafted = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)]
        tree = CandidateTree.chain(0, drafted, q)
        tree.add(COPY)
        p = torch.stack([p_root] + [p_after[t] for t in tree.tokens[1:]])
        branch, nxt = walk_sampled(tree, p, g)
        emitted.append([tree.tokens[j] for j in branch[1:]] + [nxt])
    return emitted, p_root, p_after


def test_sampled_walks_emit_every_token_from_the_target():
    emitted, p_root, p_after = _walks()
    assert chi2_pvalue([e[0] for e in emitted], p_root.double().numpy()) > 1e-3
    # after the copy's first token was kept, the next token follows the target's p after it
    after_copy = [e[1] for e in emitted if len(e) > 1 and e[0] == COPY[0]]
    assert len(after_copy) > 1000
    assert chi2_pvalue(after_copy, p_after[COPY[0]].double().numpy()) > 1e-3
    # and branches do get kept past the first token (the test would pass vacuously otherwise)
    assert sum(len(e) > 2 for e in emitted) > 500


def test_a_walk_that_forgets_the_rejected_candidates_fails(monkeypatch):
    monkeypatch.setattr(candidate_tree, "_residual", lambda r, x, q: r)
    emitted, p_root, _ = _walks()
    assert chi2_pvalue([e[0] for e in emitted], p_root.double().numpy()) < 1e-6


def test_a_walk_that_tries_copies_as_drafts_fails(monkeypatch):
    """A copy has no q: testing it by a draft's ratio against some q breaks the distribution."""
    _, _, q = _distributions()
    real = candidate_tree.CandidateTree.add

    def add_with_q(self, tokens, q_rows=None):
        return real(self, tokens, q_rows if q_rows is not None else q.flip(-1))

    monkeypatch.setattr(candidate_tree.CandidateTree, "add", add_with_q)
    emitted, p_root, _ = _walks()
    assert chi2_pvalue([e[0] for e in emitted], p_root.double().numpy()) < 1e-6


@pytest.mark.parametrize("seed", [3, 4])
def test_a_copy_alone_is_kept_as_often_as_the_target_samples_it(seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(2, V, generator=g).softmax(-1)
    tree = CandidateTree.chain(0, [3])
    kept = sum(len(walk_sampled(tree, p, g)[0]) > 1 for _ in range(4000)) / 4000
    assert abs(kept - p[0, 3].item()) < 0.03

"""Candidate trees: several proposals for a row's next tokens verified in one forward.

A round's main proposal (the draft's block or a copy) is a chain after the anchor; other
candidates (copies of other earlier occurrences, copies from earlier replies) branch off
it where they first disagree, sharing the nodes they agree on. The target scores every
node in one forward (tree rows, `RowInput.parents`), and the row keeps the longest branch
the target accepts:

- greedy: from the anchor, go to the child holding the target's argmax while there is one
  (`walk_greedy`): the kept tokens are exactly the target's greedy chain;
- sampled: at each node its children are tried in turn by multi-candidate rejection sampling
  (`walk_sampled`): a child drawn from the draft's q is accepted with probability
  min(1, r(x) / q(x)), one chosen without sampling (a copy) with probability r(x), where r
  starts as the target's p; a rejected child leaves the residual norm(max(r - q, 0)) (r with
  x removed, for a copy) for the next, and when none is accepted the next token is drawn
  from what remains. Each step is exact speculative sampling of r against one candidate
  whose token does not depend on the target's draws, so the token emitted at every node
  follows p exactly (tests/engine/test_candidate_tree.py checks it with a chi-square test).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class CandidateTree:
    """Node 0 is the anchor; every other node is a candidate token after its parent."""

    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    q: list[torch.Tensor | None] = field(default_factory=lambda: [None])  # the draft's q a node was drawn from
    main: int = 0  # nodes 1..main are the main proposal's chain

    @classmethod
    def chain(cls, anchor: int, tokens: list[int], q: torch.Tensor | None = None) -> CandidateTree:
        """The main proposal: `tokens` after the anchor, drawn from q's rows where given."""
        tree = cls([anchor])
        tree.add(tokens, q)
        tree.main = len(tokens)
        return tree

    @property
    def num_candidates(self) -> int:
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parents))

    def add(self, tokens: list[int], q: torch.Tensor | None = None, max_new: int | None = None) -> int:
        """Merge a branch after the anchor (its tokens drawn from q's rows where given) into
        the tree: it follows the nodes it agrees with, then grows its own, at most max_new
        of them. -> nodes added."""
        node, added = 0, 0
        for j, token in enumerate(tokens):
            child = self.child(node, token)
            if child is None:
                if max_new is not None and added >= max_new:
                    break
                self.tokens.append(token)
                self.parents.append(node)
                self.q.append(q[j] if q is not None else None)
                child, added = len(self.tokens) - 1, added + 1
            node = child
        return added

    def child(self, node: int, token: int) -> int | None:
        for j in range(node + 1, len(self.tokens)):
            if self.parents[j] == node and self.tokens[j] == token:
                return j
        return None

    def children(self, node: int) -> list[int]:
        return [j for j in range(node + 1, len(self.tokens)) if self.parents[j] == node]

    def main_accepted(self, branch: list[int]) -> int:
        """How many of the main proposal's tokens a kept branch holds."""
        return sum(1 for depth, node in enumerate(branch[1:], 1) if node == depth and node <= self.main)


def walk_greedy(tree: CandidateTree, best: list[int]) -> tuple[list[int], int]:
    """best[j]: the target's argmax after node j -> (the kept branch from the anchor, the next token)."""
    branch = [0]
    while (child := tree.child(branch[-1], best[branch[-1]])) is not None:
        branch.append(child)
    return branch, best[branch[-1]]


def walk_sampled(tree: CandidateTree, p: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
    """p [nodes, V]: the target's processed distribution after each node -> (the kept branch
    from the anchor, the next token), by multi-candidate rejection sampling (module docstring)."""
    branch = [0]
    while True:
        r = p[branch[-1]]
        for child in tree.children(branch[-1]):
            x, q = tree.tokens[child], tree.q[child]
            u = _uniform(generator)
            if (u < r[x]) if q is None else (u * q[x] < r[x]):  # u < min(1, r / q) without dividing
                branch.append(child)
                break
            r = _residual(r, x, q)
        else:
            return branch, _draw(r, generator)


def _residual(r: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """What remains of r once candidate x (drawn from q; None: chosen) was rejected, normalised."""
    if q is None:
        rest = r.clone()
        rest[x] = 0
    else:
        rest = (r - q).clamp_min(0)
    total = rest.sum()
    return rest / total if total > 0 else r  # nothing left only where the candidate was certain to pass


def _uniform(generator: torch.Generator | None) -> float:
    return torch.rand((), generator=generator, device=generator.device if generator is not None else "cpu").item()


def _draw(r: torch.Tensor, generator: torch.Generator | None) -> int:
    device = generator.device if generator is not None else r.device
    return int(torch.multinomial(r.to(device), 1, generator=generator).item())

"""One engine step: the DLite round for every decoding row, prefill chunks alongside
(REFERENCE.md section 1).

Per step: rows whose grammar forces their next tokens propose those, and rows whose last
tokens occurred earlier in their context copy what followed there (`context_lookup.py`),
else in an earlier reply of their namespace (`reply_cache.py`), else in the target's own
replies that trained the draft (`reply_corpus.py`; these two where on); the others draft K_i
tokens in one draft call. Where the policy finds it pays, other continuations from the
context branch off that main proposal as a tree (`candidate_tree.py`). Then prefill
chunks and [anchor, d_1..d_K_i] verify rows (or trees) run in one ragged target forward;
each row accepts A_i along its kept branch, commits A_i + 1 tokens (its KV now holds
n_i + A_i + 1 positions, a tree's kept branch moved into place: the scheduler crops the
rest after the step), and takes its next pivot features from the verify pass at the kept
branch's last node. Rows with K_i = 0 decode plainly.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dlite_ray.engine.candidate_tree import CandidateTree, walk_greedy, walk_sampled
from dlite_ray.engine.context_lookup import ContextLookup
from dlite_ray.engine.copy_sources import CopySource, copy_sources
from dlite_ray.engine.draft_transport import DraftRequest, DraftTransport, DraftUnavailable
from dlite_ray.engine.logprobs import token_logprobs
from dlite_ray.engine.model_runner import ModelRunner, RowInput, RowOutput
from dlite_ray.engine.scheduler import Schedule
from dlite_ray.engine.sequence import Sequence
from dlite_ray.engine.speculation_policy import RowOffer, SpeculationPolicy
from dlite_ray.engine.structured_output import mask_rows
from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.sampling import (
    GREEDY,
    MATCH,
    REJECTION,
    RowSampling,
    probabilities,
    verify_greedy,
    verify_greedy_row,
    verify_match,
    verify_rejection,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ProposedRow:
    """One decode row's part of a round: its candidates after the anchor, and where they came from."""

    seq: Sequence
    tree: CandidateTree  # its main proposal (nodes 1..main; none: plain decoding), and other branches where any
    copied: bool = False  # the main proposal was copied (its context, an earlier reply, its grammar), not drafted
    from_reply: bool = False  # copied from an earlier reply or the reply corpus
    drafted: int = 0  # tokens drafted for it (0 where copied, plain, or the draft call failed)
    q_probs: torch.Tensor | None = None  # the draft's distributions of its drafted tokens (sampled drafting)

    @property
    def main(self) -> list[int]:
        return self.tree.tokens[1:self.tree.main + 1]


@dataclass(slots=True)
class RoundProposal:
    """What each decode row verifies after its anchor in one step."""

    rows: list[ProposedRow]
    draft_time: float = 0.0
    draft_failed: bool = False

    @property
    def lengths(self) -> list[int]:
        return [row.tree.main for row in self.rows]

    @property
    def drafted(self) -> list[int]:
        return [row.drafted for row in self.rows]


class SpecDecoder:
    # Other continuations looked at for a tree's branches, per row and round.
    MAX_BRANCHES = 4

    def __init__(self, runner: ModelRunner, draft: DraftTransport | None, eos_ids: tuple[int, ...],
                 policy: SpeculationPolicy, lookup: ContextLookup | None = None,
                 sources: list[CopySource] | None = None, tree_tokens: int = 0):
        """lookup: copies from each row's context (lookup.max_tokens bounds every copy, and
        its other continuations are a tree's branches); sources: where copies come from, in
        order (copy_sources.py; default: the lookup alone); tree_tokens: at most this many
        tokens of other continuations verified next to a row's main proposal."""
        self.runner, self.draft, self.eos_ids, self.policy = runner, draft, eos_ids, policy
        self.lookup = lookup or ContextLookup(0)
        self.sources = sources if sources is not None else copy_sources(self.lookup)
        self.tree_tokens = tree_tokens if runner.verifies_trees else 0

    def step(self, schedule: Schedule) -> dict[Sequence, list[int]]:
        step_started = time.perf_counter()
        decodes = schedule.decodes
        proposal = self._propose_round(decodes, sum(n for _, n in schedule.prefills), schedule.spare_tokens)
        rows = [RowInput(s, s.token_ids[s.num_computed:s.num_computed + n]) for s, n in schedule.prefills]
        rows += [RowInput(r.seq, r.tree.tokens, len(r.tree.tokens), None if r.tree.is_chain else r.tree.parents)
                 for r in proposal.rows]
        branches: list[list[int]] = []
        next_tokens: list[int] = []
        with _timer(self.runner.device) as t:
            outs = self.runner.run(rows, schedule.copies)
            if decodes:
                branches, next_tokens = self._verify(proposal.rows, outs[len(schedule.prefills):])
        self.policy.observe(sum(len(r.tokens) for r in rows), t.elapsed, proposal.draft_time, proposal.drafted)
        self._commit_prefills(schedule.prefills, outs, t.elapsed)
        emitted = self._commit_decodes(proposal, branches, next_tokens, outs[len(schedule.prefills):], t.elapsed)
        # Only decode-only steps measure speculating (drafting or copying) against plain
        # decoding; a failed draft call would blur that comparison.
        if decodes and not schedule.prefills and not proposal.draft_failed:
            self.policy.observe_step(len(decodes), proposal.lengths, sum(len(e) for e in emitted.values()),
                                     time.perf_counter() - step_started)
        return emitted

    def _propose_round(self, decodes: list[Sequence], prefill_tokens: int, room: int | None = None) -> RoundProposal:
        """What each decode row verifies this step: a copy (from its context or an earlier
        reply), a draft, or nothing (plain decoding), as the policy allocates."""
        offers = [self._offer(s) for s in decodes]
        ks = self.policy.choose(offers, prefill_tokens, room)
        copies = [o.copy[:k] for o, k in zip(offers, ks)]  # what the policy kept of each copy
        draft_ks = [0 if c else k for c, k in zip(copies, ks)]
        drafts, runners_up, q_probs, draft_time, failed = self._draft(decodes, draft_ks)
        rows = []
        for i, (offer, copy, drafted) in enumerate(zip(offers, copies, drafts)):
            seq, q = offer.seq, q_probs.get(i) if q_probs else None
            # a greedy draft's tokens were not drawn from its q: only a rejection row's tree keeps it
            tree = CandidateTree.chain(seq.anchor, copy or drafted,
                                       q if not copy and seq.params.mode == REJECTION else None)
            rows.append(ProposedRow(seq, tree, bool(copy), bool(copy) and offer.from_reply, len(drafted), q))
        left = None if room is None else room - sum(ks)  # the step's budget, for branches
        for row, others in zip(rows, runners_up):
            added = self._branch_out(row.seq, row.tree, others, left)
            left = None if left is None else left - added
        return RoundProposal(rows, draft_time, failed)

    def _offer(self, seq: Sequence) -> RowOffer:
        """What the row could verify: what its grammar forces next, else the first copy a
        source has (copy_sources.py; one from earlier replies only where the policy lets it
        take the round from the draft), and how far it could draft."""
        cap = self._max_draft(seq)
        limit = min(self._room(seq), self.lookup.max_tokens)
        forced = seq.grammar.forced_tokens(limit) if seq.grammar else []
        if forced:
            return RowOffer(seq, cap, forced, forced=True)
        for source in self.sources:
            copy = source.propose(seq, limit)
            if not copy:
                continue
            if source.earlier_replies and not self.policy.copies_from_replies(seq, can_draft=cap > 0):
                return RowOffer(seq, cap)  # such copies have passed less often than this row's drafts
            return RowOffer(seq, cap, copy, from_reply=source.earlier_replies)
        return RowOffer(seq, cap)

    def _branch_out(self, seq: Sequence, tree: CandidateTree, runners_up: list[int], step_room: int | None) -> int:
        """Branches next to the row's main proposal, within the tokens the policy finds worth
        verifying and what is left of the step's budget (`step_room`; None: no bound): at each
        drafted position the draft's runner-up (one token, where the drafted one may be
        rejected), then other continuations of the row's last tokens in its context. Each is
        chosen without the target, so verifying it keeps the output exact. -> tokens added."""
        if not self.tree_tokens or not tree.main or seq.grammar is not None:  # grammars mask a chain
            return 0
        # branch nodes are stored after the main proposal: within the model's context too
        room = self.runner.max_context - seq.num_computed - 1 - tree.main
        budget = min(self.policy.branch_budget(self.tree_tokens), room)
        if step_room is not None:
            budget = min(budget, step_room)
        if budget <= 0:
            return 0
        main = tree.tokens[1:tree.main + 1]
        branches = [main[:depth] + [token] for depth, token in enumerate(runners_up)]
        added = 0
        for branch in branches + self.lookup.alternatives(seq, self._room(seq), self.MAX_BRANCHES):
            if budget <= added:
                break
            added += tree.add(branch, max_new=budget - added)
        return added

    def _commit_prefills(self, prefills: list[tuple[Sequence, int]], outs: list[RowOutput], seconds: float) -> None:
        for (seq, n), out in zip(prefills, outs):
            seq.num_computed += n  # the scheduler's postprocess publishes the blocks
            seq.stats.prefill_time += seconds
            if seq.num_to_prefill == 0:
                seq.pivot_features = out.taps[-1] if out.taps is not None else None

    def _commit_decodes(self, proposal: RoundProposal, branches: list[list[int]], next_tokens: list[int],
                        outs: list[RowOutput], seconds: float) -> dict[Sequence, list[int]]:
        """Each row keeps its accepted branch and the target's next token, its KV ends there and
        it takes its next pivot features from the verify pass at the branch's last node."""
        emitted = {}
        now = time.perf_counter()
        for row, branch, next_token, out in zip(proposal.rows, branches, next_tokens, outs):
            seq, tree = row.seq, row.tree
            kept = emitted[seq] = seq.append_tokens([tree.tokens[j] for j in branch[1:]] + [next_token], self.eos_ids)
            if seq.grammar is not None:
                seq.grammar.advance(kept)
                if seq.grammar.error is not None:  # a parser limit met mid-reply: not a "stop"
                    seq.fail(f"the output grammar failed: {seq.grammar.error}")
            rows = branch[:len(kept)]  # verify row m (a node of the branch) chose the m-th token kept
            if seq.trace is not None:
                seq.trace.add(out.logits[rows], out.taps[rows] if out.taps is not None else None)
            if seq.logprobs is not None and seq.params.logprobs is not None:  # set together (Sequence)
                seq.logprobs += token_logprobs(out.logits[rows], kept, seq.params.logprobs)
            if not tree.is_chain:
                self.runner.keep_branch(seq, branch)
            seq.num_computed += len(branch)  # the KV of rejected candidates is cropped by the scheduler's postprocess
            seq.pivot_features = out.taps[branch[-1]] if out.taps is not None else None
            self._record(row, branch, proposal.draft_time, seconds, now)
        return emitted

    def _record(self, row: ProposedRow, branch: list[int], draft_seconds: float, verify_seconds: float,
                now: float) -> None:
        """A row's round, in one place: its request's stats and the policy's evidence."""
        tree, st = row.tree, row.seq.stats
        accepted, main = len(branch) - 1, tree.main_accepted(branch)
        st.record_round(tree.main, accepted, copied=row.copied, from_reply=row.from_reply, main_accepted=main)
        self.policy.record(row.seq, tree.main, main, copied=row.copied, from_reply=row.from_reply)
        if tree.num_candidates > tree.main:
            self.policy.record_branches(tree.num_candidates - tree.main, accepted - main)
        if st.first_token_time is None:
            st.first_token_time = now
        if row.drafted:
            st.draft_time += draft_seconds  # the draft call it took part in
        st.verify_time += verify_seconds
        st.decode_wall_time = now - st.first_token_time
        st.last_token_time = now

    def _room(self, seq: Sequence) -> int:
        """The most tokens a round can verify after the anchor: within the output budget and the context."""
        remaining = seq.params.max_new_tokens - seq.num_outputs
        return max(0, min(remaining - 1, self.runner.max_context - seq.num_computed - 1))

    def _max_draft(self, seq: Sequence) -> int:
        """The most tokens worth drafting: within the draft's limit and the room."""
        if self.draft is None or (seq.pivot_features is None and self.draft.info.target_layer_ids):
            return 0
        return min(self.draft.info.max_draft_tokens, self._room(seq))

    def _draft(self, seqs: list[Sequence], ks: list[int]):
        """Draft for the rows with k > 0 in one call: (drafts, their runners-up, q, seconds,
        whether the call failed; every row then decodes plainly this step)."""
        rows = [i for i, k in enumerate(ks) if k > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        runners_up: list[list[int]] = [[] for _ in seqs]
        draft = self.draft
        if not rows or draft is None:  # rows draft only with a draft (_max_draft)
            return drafts, runners_up, None, 0.0, False
        g = draft.info.anchor_group_size
        sub = [seqs[i] for i in rows]
        device = self.runner.device
        greedy = [s.params.mode != REJECTION for s in sub]
        request = DraftRequest(
            token_groups=torch.tensor([_token_group(s.token_ids, g) for s in sub], dtype=torch.long, device=device),
            features=_stacked_features(sub),
            num_tokens=max(ks[i] for i in rows),
            sampling=_row_sampling(sub, device),
            draft_greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy),
        )
        failure = None
        with _timer(device) as t:
            try:
                proposal = draft.propose(request)
                tokens, others = _proposed_lists(proposal)
            except DraftUnavailable as exc:
                failure = exc
        if failure is not None:
            log.warning("draft unavailable, decoding plainly this step: %s", failure)
            return drafts, runners_up, None, t.elapsed, True
        for j, i in enumerate(rows):
            drafts[i] = tokens[j][:ks[i]]
            runners_up[i] = others[j][:ks[i]] if others is not None else []
        probs = proposal.vocabulary_probs(self.runner.target.cfg.vocab_size)
        q_probs = {i: probs[j, :ks[i]] for j, i in enumerate(rows)} if probs is not None else None
        return drafts, runners_up, q_probs, t.elapsed, False

    def _verify(self, rows: list[ProposedRow], outs: list[RowOutput]) -> tuple[list[list[int]], list[int]]:
        """-> each row's kept branch (node indices from the anchor) and the target's next token."""
        # A tree that stayed a chain but grew past its main proposal (a longer copy of the
        # same continuation) is walked too: its extra nodes are candidates to verify.
        walked = [row.tree.num_candidates > row.tree.main for row in rows]
        trees = [i for i, w in enumerate(walked) if w]
        chains = [i for i, w in enumerate(walked) if not w]
        branches: list[list[int]] = [[] for _ in rows]
        next_tokens = [0] * len(rows)
        if chains:
            a, n = self._verify_chains([rows[i] for i in chains], [outs[i] for i in chains])
            for i, accepted, token in zip(chains, a, n):
                branches[i], next_tokens[i] = list(range(accepted + 1)), token
        for i in trees:
            branches[i], next_tokens[i] = self._verify_tree(rows[i].seq, rows[i].tree, outs[i].logits)
        return branches, next_tokens

    @staticmethod
    def _verify_tree(seq: Sequence, tree: CandidateTree, logits: torch.Tensor) -> tuple[list[int], int]:
        if seq.params.mode == GREEDY:
            return walk_greedy(tree, fused_ops.argmax(logits).tolist())
        p = probabilities(logits[None], _row_sampling([seq], logits.device))[0]
        return walk_sampled(tree, p, seq.generator)

    def _verify_chains(self, rows: list[ProposedRow], outs: list[RowOutput]) -> tuple[list[int], list[int]]:
        """Rows whose candidates are one chain -> (A, next token), a list each: vectorised over
        the rows, except greedy ones on the CPU, which go row by row."""
        seqs, drafts = [r.seq for r in rows], [r.main for r in rows]
        modes = [_verify_mode(r.seq, r.copied) for r in rows]
        if outs[0].logits.device.type == "cpu" and all(m == GREEDY and s.grammar is None for s, m in zip(seqs, modes)):
            # On the CPU one batched call saves nothing: each row's argmax where its logits lie,
            # without stacking them into a padded copy (~0.2 ms a step of 8 rows).
            verified = [verify_greedy_row(fused_ops.argmax(o.logits).tolist(), d) for o, d in zip(outs, drafts)]
            return [a for a, _ in verified], [t for _, t in verified]
        ks = [len(d) for d in drafts]
        width = max(ks) + 1
        logits = torch.stack([F.pad(o.logits, (0, 0, 0, width - o.logits.shape[0])) for o in outs])  # [B, W, V]
        for i, seq in enumerate(seqs):
            if seq.grammar is not None:
                mask_rows(logits[i], seq.grammar.allowed_rows(drafts[i]))
        draft_t = torch.tensor([d + [0] * (width - 1 - len(d)) for d in drafts], dtype=torch.long,
                               device=logits.device).view(len(seqs), width - 1)
        num = torch.tensor(ks, device=logits.device)
        accepted = torch.zeros(len(seqs), dtype=torch.long, device=logits.device)
        next_tokens = torch.zeros_like(accepted)
        for mode in (GREEDY, REJECTION, MATCH):
            idx = [i for i, m in enumerate(modes) if m == mode]
            if not idx:
                continue
            it = torch.tensor(idx, device=logits.device)
            if mode == GREEDY:
                a, t = verify_greedy(logits[it], draft_t[it], num[it])
            else:
                sub = [seqs[i] for i in idx]
                rs = _row_sampling(sub, logits.device)
                p = probabilities(logits[it], rs)
                if mode == MATCH:
                    a, t = verify_match(p, draft_t[it], num[it], rs.generators)
                else:
                    q = _stack_q([rows[i].q_probs for i in idx], width - 1, p)
                    a, t = verify_rejection(p, q, draft_t[it], num[it], rs.generators)
            accepted[it], next_tokens[it] = a, t
        accepted, next_tokens = torch.stack([accepted, next_tokens]).tolist()  # the step's one read of the verify
        return accepted, next_tokens


def _proposed_lists(proposal) -> tuple[list[list[int]], list[list[int]] | None]:
    """A draft's tokens and runners-up on the host, in one read of the device."""
    if proposal.runners_up is None:
        return proposal.tokens.tolist(), None
    k = proposal.tokens.shape[1]
    both = torch.cat([proposal.tokens, proposal.runners_up.to(proposal.tokens)], dim=1).tolist()
    return [row[:k] for row in both], [row[k:] for row in both]


def _verify_mode(seq: Sequence, copied: bool) -> str:
    """Copied tokens have no draft distribution: a sampled row checks them against the
    target's own samples (match mode), which is exact for any draft chosen without sampling."""
    mode = seq.params.mode
    return MATCH if copied and mode == REJECTION else mode


def _token_group(ids: list[int], g: int) -> list[int]:
    """The G tokens ending at the anchor (left-padded with the first token if shorter)."""
    return ([ids[0]] * g + ids[-g:])[-g:]


def _stacked_features(seqs: list[Sequence]) -> torch.Tensor | None:
    """The rows' pivot features [N, S, D]; None where the first row holds none (a draft that
    reads no target layers; one that reads them drafts only for rows holding them, _max_draft)."""
    if seqs[0].pivot_features is None:
        return None
    features = [s.pivot_features for s in seqs if s.pivot_features is not None]
    if len(features) < len(seqs):
        raise ValueError("some rows of the draft call hold no pivot features")
    return torch.stack(features)


def _row_sampling(seqs: list[Sequence], device) -> RowSampling:
    return RowSampling.build([s.params.temperature for s in seqs], [s.params.top_k for s in seqs],
                             [s.params.top_p for s in seqs], [s.generator for s in seqs], device)


def _stack_q(q_rows: list[torch.Tensor | None], k: int, p: torch.Tensor) -> torch.Tensor:
    """Draft distributions for the rejection rows, padded to [B, K, V] (rows with no draft: zeros)."""
    vocab = p.shape[-1]
    rows = []
    for q in q_rows:
        q = torch.zeros(0, vocab, device=p.device) if q is None else q
        rows.append(F.pad(q, (0, 0, 0, k - q.shape[0])))
    return torch.stack(rows)


class _Elapsed:
    elapsed = 0.0


@contextmanager
def _timer(device: torch.device):
    """Wall time of a synchronised region (the device queue is drained at both ends)."""
    out = _Elapsed()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    yield out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out.elapsed = time.perf_counter() - start

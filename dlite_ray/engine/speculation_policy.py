"""Load-aware draft length: per step, K_i per request from measured costs and acceptance.

Cost model (refit online from the steps themselves): a target forward over T new tokens
takes v0 + v1 * T; a draft call for k tokens takes d0 + d1 * k. Row i accepts each
drafted position j, once reached, with probability alpha_i * f_j: alpha_i is its own
running acceptance (from a prior), f_j the engine's measured depth factor (later positions
are accepted more often once reached: ~0.42, 0.5, 0.57, ... for the default draft). Its
j-th drafted token adds prod_{m <= j} alpha_i * f_m expected tokens. Starting from plain decoding,
draft tokens are added greedily while they raise expected tokens per second of the
whole step; when speculation does not pay (low acceptance, compute-bound batch), every
K_i stays 0 and the engine decodes plainly. Whether to speculate at all, by drafting or by
copying, and how deep, is then settled by what plain steps and speculative steps of a few
depths measurably delivered at this batch size (`StepRates`: plain, at most 1 or 3 tokens a
row, or this allocation), so a wrong cost model cannot make the engine slower than plain
decoding, and where it drafts too deep for a compute-bound batch a shallower arm wins. Copies
are held to it too: in the first `make bench` run, copies the cost
model let through made compute-bound steps slower than plain decoding (0.83x at 16 requests
in flight, 0.75x at 32; 0.94x and 0.88x once copies answered to the guard), while at batch 1
they are what agent turns gain most from, and the measured rate says so. What a grammar
forces is exempt (a `RowOffer`'s `forced`): those tokens are certain.

Rows that copy from their context (`context_lookup.py`) are allocated by the same model:
their tokens cost forward time but no draft call, and each is accepted with the row's own
copy acceptance (tracked apart from the draft's, with its own prior). At batch 1 on a CPU
a verify token is nearly free and whole copies pass; in a compute-bound batch copies that
keep failing are cut short, and tried again once that evidence has faded; and where the
measured steps say speculating does not pay at this batch size, nothing is copied.

Copies from earlier replies (`reply_cache.py`, `reply_corpus.py`) match across unrelated
requests and pass less often than copies from a request's own context; their acceptance is
tracked per request over an engine-wide prior, sizes their allocation, and decides whether
such a copy may take a round from the draft at all (`copies_from_replies`): per request,
because they pass well on some replies (a tool call's JSON) and badly on others (a
conversation whose drafts pass).

Other branches verified next to a round's main proposal (a tree, `candidate_tree.py`:
the draft's runners-up, other copies) cost forward time only. What their tokens kept beyond
the main proposal, per token verified, is tracked engine-wide; they are verified while that
value per second of forward time beats the rate the step's allocation expects: meant for
where a verify row costs little next to a step, not a CPU at long context, where each row
is milliseconds of attention (docs/bench/tree-verification.md; trees are off by default).
"""

from __future__ import annotations

import statistics
import weakref
from collections import deque
from dataclasses import dataclass, field

from dlite_ray.engine.sequence import Sequence
from dlite_ray.engine.step_rates import Arm, StepRates


@dataclass(slots=True)
class RowOffer:
    """What one decode row could verify after its anchor this round, as the policy weighs it."""

    seq: Sequence
    draft_cap: int  # the most tokens worth drafting for it (0: it cannot draft)
    copy: list[int] = field(default_factory=list)  # tokens it could copy instead of drafting
    from_reply: bool = False  # the copy comes from an earlier reply (or the reply corpus), not its context
    forced: bool = False  # the copy is what the row's grammar allows next: verified whole


@dataclass(slots=True)
class CostModel:
    v0: float = 0.03  # s per forward (weights read once): priors for a small CPU model
    v1: float = 0.0008  # s per extra token in the forward
    d0: float = 0.003  # s per draft call
    d1: float = 0.0008  # s per drafted position


class SpeculationPolicy:
    # A new request starts from the engine's recent acceptance (floored, so a request can
    # always rediscover a draft that got better), worth PRIOR_WEIGHT examined positions.
    PRIOR_WEIGHT, PRIOR_FLOOR, GLOBAL_DECAY = 2.0, 0.3, 0.98
    # A request that is not drafting (or not copying) forgets its evidence about that
    # proposer geometrically, so it retries after a few rounds instead of staying off for
    # good after one bad round.
    IDLE_DECAY = 0.7
    WINDOW = 64
    MAX_ACCEPT = 0.95  # no drafted position is ever counted as certain
    DEPTH_DECAY = 0.998  # the depth profile is the draft's, slow to change: ~500 rounds
    # A copy from a reply refused in favour of the draft lets the evidence against such copies
    # fade by this much (by half every ~14 refusals), so that they are retried.
    REPLY_RETRY_DECAY = 0.95
    # Branches start from an optimistic prior worth BRANCH_PRIOR_WEIGHT verified tokens, and
    # a refusal lets the evidence fade as for copies from replies, so they are retried.
    BRANCH_PRIOR, BRANCH_PRIOR_WEIGHT = 0.2, 16.0

    def __init__(self, max_draft_tokens: int, adaptive: bool = True):
        self.max_draft_tokens, self.adaptive = max_draft_tokens, adaptive
        self.cost = CostModel()
        self.rates: StepRates | None = StepRates() if adaptive else None
        self._forward: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)
        self._draft: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)
        self._accept: weakref.WeakKeyDictionary[Sequence, list[float]] = weakref.WeakKeyDictionary()
        self._global = [0.6, 1.0]  # decayed (accepted, examined) over all requests
        self._copy_accept: weakref.WeakKeyDictionary[Sequence, list[float]] = weakref.WeakKeyDictionary()
        self._copy_global = [0.6, 1.0]  # the same for copied tokens
        self._reply = [0.0, 0.0]  # decayed (accepted, examined) of tokens copied from earlier replies
        self._reply_accept: weakref.WeakKeyDictionary[Sequence, list[float]] = weakref.WeakKeyDictionary()
        # decayed (accepted, reached) per drafted position over all requests
        self._positions = [[0.0, 0.0] for _ in range(max_draft_tokens)]
        self._branches = [0.0, 0.0]  # decayed (tokens kept beyond the main proposal, branch tokens verified)
        self._step_rate = 0.0  # tokens per second the last allocation expected of its step
        self._arm: Arm = 0  # what the guard chose for the step being run (StepRates)

    def alpha(self, seq: Sequence) -> float:
        return _rate(self._accept.get(seq, (0.0, 0.0)), self._global, self.PRIOR_FLOOR, self.PRIOR_WEIGHT)

    def copy_alpha(self, seq: Sequence) -> float:
        return _rate(self._copy_accept.get(seq, (0.0, 0.0)), self._copy_global, self.PRIOR_FLOOR,
                     self.PRIOR_WEIGHT)

    def reply_alpha(self, seq: Sequence | None = None) -> float:
        """How often tokens copied from earlier replies pass: engine-wide, over a prior of the
        context copies' rate; for `seq`, its own, over a prior of the engine-wide rate."""
        engine = _rate(self._reply, self._copy_global, self.PRIOR_FLOOR, self.PRIOR_WEIGHT)
        if seq is None:
            return engine
        return _rate(self._reply_accept.get(seq, (0.0, 0.0)), [engine, 1.0], self.PRIOR_FLOOR, self.PRIOR_WEIGHT)

    def copies_from_replies(self, seq: Sequence, can_draft: bool) -> bool:
        """Whether a copy from an earlier reply may take this row's round: always where the row
        cannot draft, else while such copies pass at least as often as the row's drafts (for
        this row). A refusal lets the evidence against them fade, so they are retried after a
        while."""
        if not self.adaptive or not can_draft or self.reply_alpha(seq) >= self.alpha(seq):
            return True
        self._reply = [x * self.REPLY_RETRY_DECAY for x in self._reply]
        if seq in self._reply_accept:
            self._reply_accept[seq] = [x * self.REPLY_RETRY_DECAY for x in self._reply_accept[seq]]
        return False

    def branch_value(self) -> float:
        """Tokens a verified branch token has kept beyond the main proposal, on average."""
        kept, verified = self._branches
        return (kept + self.BRANCH_PRIOR * self.BRANCH_PRIOR_WEIGHT) / (verified + self.BRANCH_PRIOR_WEIGHT)

    def branch_budget(self, limit: int) -> int:
        """Tokens of other branches a row may verify next to its main proposal this round:
        `limit` while their measured value per second of forward time beats the step's
        expected rate, else none (and the evidence against them fades)."""
        if limit <= 0:
            return 0
        if not self.adaptive or self.branch_value() / self.cost.v1 >= self._step_rate:
            return limit
        self._branches = [x * self.REPLY_RETRY_DECAY for x in self._branches]
        return 0

    def record_branches(self, verified: int, kept: int) -> None:
        """A round verified `verified` branch tokens, which kept `kept` tokens beyond its main proposal."""
        d = self.GLOBAL_DECAY
        self._branches = [self._branches[0] * d + kept, self._branches[1] * d + verified]

    def choose(self, offers: list[RowOffer], prefill_tokens: int = 0, room: int | None = None) -> list[int]:
        """Tokens to verify after each row's anchor: drafted (up to its draft_cap), or copied
        where it offers a copy (up to all of it; the row then drafts nothing), from its context
        or an earlier reply; a forced copy (its grammar allows only those tokens) whole,
        whatever was measured; `room` tokens at most in all (the step's token budget), the
        longest rows cut first."""
        seqs = [o.seq for o in offers]
        copy_caps = [len(o.copy) for o in offers]
        from_reply = [o.from_reply for o in offers]
        forced = [o.forced for o in offers]
        caps = [0 if copy else min(o.draft_cap, self.max_draft_tokens) for o, copy in zip(offers, copy_caps)]
        self._arm = 0
        if not self.adaptive or not seqs or max(caps) + max(copy_caps) == 0:
            return _within([copy or c for c, copy in zip(caps, copy_caps)], room)
        ks, pays = self._allocate(seqs, caps, copy_caps, from_reply, prefill_tokens)
        arm: Arm = None if pays else 0
        if self.rates is not None:
            # Steps with prefill chunks are not measured (their time is mostly the prefill's),
            # but they follow what the measured steps found.
            arm = self.rates.choose(len(seqs), pays) if prefill_tokens == 0 else self.rates.verdict(len(seqs), pays)
        self._arm = arm
        limits = [copy or cap for cap, copy in zip(caps, copy_caps)]
        if arm is None and not any(ks):
            # measuring speculation the model would not try: one drafted (or copied) token a row
            ks = [min(limit, 1) for limit in limits]
        elif arm:  # a capped arm: at least 1 and at most `arm` tokens a row, the model's allocation between
            ks = [min(arm, max(k, 1), limit) for k, limit in zip(ks, limits)]
        # forced tokens are certain, each a step saved for one row's cost: verified whole
        chosen = _within([copy if must else (k if arm != 0 else 0) for k, copy, must in zip(ks, copy_caps, forced)],
                         room)
        for seq, k, copy, reply in zip(seqs, chosen, copy_caps, from_reply):
            _decay_idle(self._accept, seq, k == 0 and not copy, self.IDLE_DECAY)
            _decay_idle(self._copy_accept, seq, not (copy and k and not reply), self.IDLE_DECAY)
        return chosen

    def _allocate(self, seqs: list[Sequence], caps: list[int], copy_caps: list[int], from_reply: list[bool],
                  prefill_tokens: int) -> tuple[list[int], bool]:
        """Verify positions per row by the cost model, and whether they beat plain decoding."""
        c = self.cost
        plain_time = c.v0 + c.v1 * (prefill_tokens + len(seqs))
        plain_rate = len(seqs) / plain_time
        # With drafting, the call's fixed cost is paid once; then add the positions that
        # raise tokens per second most, one at a time, while they still do. Copied
        # positions cost forward time only.
        ks = [0] * len(seqs)
        factors = self._depth_factors() if any(caps) else []  # no draft rows (or no draft at all)
        gains = [self._copy_gains(s, copy, reply) if copy else self._gains(s, cap, factors)
                 for s, cap, copy, reply in zip(seqs, caps, copy_caps, from_reply)]
        limits = [copy or cap for cap, copy in zip(caps, copy_caps)]
        gain, time = float(len(seqs)), plain_time + (c.d0 if any(caps) else 0.0)
        while True:
            best, best_ratio, best_cost = None, 0.0, 0.0
            k_max = max((k for k, copy in zip(ks, copy_caps) if not copy), default=0)  # the draft call's length
            for i, (k, cap) in enumerate(zip(ks, limits)):
                if k < cap:
                    extra = c.v1 + (c.d1 if k + 1 > k_max and not copy_caps[i] else 0.0)
                    ratio = gains[i][k] / extra
                    if ratio > best_ratio:
                        best, best_ratio, best_cost = i, ratio, extra
            if best is None or best_ratio <= gain / time:
                break
            gain += gains[best][ks[best]]
            time += best_cost
            ks[best] += 1
        self._step_rate = gain / time
        return ks, gain / time > plain_rate

    def _depth_factors(self) -> list[float]:
        """How much likelier than the first drafted position each position is accepted once
        reached, over all rows (1 where nothing was measured yet)."""
        # Relative to the first position, not to the average over examined positions that a
        # row's alpha is: that overestimates deep positions somewhat (alpha is a little above
        # the first position's rate), but a row that was just rejected at its first position
        # is not penalised twice, so it retries once its evidence decays. The measured guard
        # (StepRates) bounds what an optimistic depth can cost.
        (first_accepted, first_reached) = self._positions[0]
        overall = max(self.PRIOR_FLOOR, self._global[0] / self._global[1])
        first = (first_accepted + overall * self.PRIOR_WEIGHT) / (first_reached + self.PRIOR_WEIGHT)
        return [1.0] + [(accepted + first * self.PRIOR_WEIGHT) / (reached + self.PRIOR_WEIGHT) / first
                        for accepted, reached in self._positions[1:]]

    def _gains(self, seq: Sequence, cap: int, factors: list[float]) -> list[float]:
        """Expected tokens that drafted positions 1..cap add for this row: its own acceptance
        (which recovers when idle), shaped by the engine's depth factors."""
        alpha = self.alpha(seq)
        gains, reach = [], 1.0
        for factor in factors[:cap]:
            reach *= min(self.MAX_ACCEPT, alpha * factor)
            gains.append(reach)
        return gains

    def _copy_gains(self, seq: Sequence, cap: int, from_reply: bool = False) -> list[float]:
        """Expected tokens that copied positions 1..cap add: the row's copy acceptance (the
        row's rate of copies from earlier replies, for those), flat."""
        alpha = min(self.MAX_ACCEPT, self.reply_alpha(seq) if from_reply else self.copy_alpha(seq))
        return [alpha ** j for j in range(1, cap + 1)]

    def observe_step(self, batch: int, ks: list[int], tokens: int, seconds: float) -> None:
        """What a decode-only step delivered: `tokens` emitted in `seconds` of the whole step,
        credited to the arm the guard chose for it (not to plain decoding where a grammar's
        forced tokens were verified in it anyway)."""
        if self.rates is not None and batch > 0 and not (self._arm == 0 and max(ks, default=0) > 0):
            self.rates.record(batch, self._arm, tokens, seconds)

    def observe(self, forward_tokens: int, forward_time: float, draft_time: float, ks: list[int]) -> None:
        """One step's costs: the forward over `forward_tokens` new tokens (verification
        included), and the draft call that drafted max(ks) tokens, if any."""
        self._forward.append((forward_tokens, forward_time))
        if max(ks, default=0) > 0:
            self._draft.append((max(ks), draft_time))
        self.cost.v0, self.cost.v1 = _fit(self._forward, self.cost.v0, self.cost.v1)
        self.cost.d0, self.cost.d1 = _fit(self._draft, self.cost.d0, self.cost.d1)

    def record(self, seq: Sequence, k: int, accepted: int, copied: bool = False, from_reply: bool = False) -> None:
        if k == 0:
            return
        examined = min(accepted + 1, k)  # positions examined up to the first rejection
        if from_reply:  # apart from the row's context copies: its own and engine-wide
            own = self._reply_accept.setdefault(seq, [0.0, 0.0])
            own[0] += accepted
            own[1] += examined
            self._reply = [self._reply[0] * self.GLOBAL_DECAY + accepted, self._reply[1] * self.GLOBAL_DECAY + examined]
            return
        stats = (self._copy_accept if copied else self._accept).setdefault(seq, [0.0, 0.0])
        stats[0] += accepted
        stats[1] += examined
        g = self._copy_global if copied else self._global
        g[0], g[1] = g[0] * self.GLOBAL_DECAY + accepted, g[1] * self.GLOBAL_DECAY + examined
        if copied:
            return  # the depth profile is the draft's
        for j, position in enumerate(self._positions):
            reached = j < examined
            position[0] = position[0] * self.DEPTH_DECAY + (reached and j < accepted)
            position[1] = position[1] * self.DEPTH_DECAY + reached


def _within(ks: list[int], room: int | None) -> list[int]:
    """ks cut to `room` tokens in all (None: as they are): the longest first, one at a time."""
    if room is None or sum(ks) <= room:
        return ks
    ks = list(ks)
    for _ in range(sum(ks) - max(room, 0)):
        ks[ks.index(max(ks))] -= 1
    return ks


def _decay_idle(evidence: weakref.WeakKeyDictionary, seq: Sequence, idle: bool, decay: float) -> None:
    """A row that did not use a proposer this step forgets some of its evidence about it."""
    if idle and seq in evidence:
        evidence[seq] = [x * decay for x in evidence[seq]]


def _rate(own, overall: list[float], floor: float, weight: float) -> float:
    """A row's acceptance: its own (accepted, examined) over a prior of `weight` positions at
    the engine's recent rate (floored, so a row can always rediscover a better draft)."""
    prior = max(floor, overall[0] / overall[1])
    return (own[0] + prior * weight) / (own[1] + weight)


def _fit(samples, intercept: float, slope: float) -> tuple[float, float]:
    """Least squares through the median time at each x, weighted by its count, when x varies
    enough; else keep the slope and refit the intercept. On a shared machine one slow step
    would otherwise tilt the line: a draft slope fitted through raw times came out 3 ms per
    position where 0.55 was measured, and cut drafts short."""
    if len(samples) < 4:
        return intercept, slope
    times_at: dict[int, list[float]] = {}
    for x, t in samples:
        times_at.setdefault(x, []).append(t)
    points = [(x, statistics.median(ts), len(ts)) for x, ts in times_at.items()]
    n = sum(w for _, _, w in points)
    mx = sum(x * w for x, _, w in points) / n
    mt = sum(t * w for _, t, w in points) / n
    var = sum(w * (x - mx) ** 2 for x, _, w in points)
    if max(times_at) - min(times_at) >= 4 and var > 0:
        slope = max(1e-6, sum(w * (x - mx) * (t - mt) for x, t, w in points) / var)
    return max(1e-6, mt - slope * mx), slope

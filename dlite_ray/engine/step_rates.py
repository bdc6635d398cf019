"""Measured tokens per second of plain steps and of speculative steps at a few depths, per
batch-size bucket.

The cost model in `speculation_policy.py` allocates draft positions, but a model can be
wrong about a machine (per-row overheads, a compute-bound CPU at batch 16, a draft whose
acceptance drifts). This guard settles how deep a step speculates on what the steps
actually delivered. Its arms: plain decoding (0), every row verifying at most 1 or 3
proposed tokens (and at least 1 where it has any), and the cost model's own allocation
(None). In the first `make bench` runs the guard had only plain and the model's allocation:
at 16 requests in flight on 2 cores the model's deep drafts delivered ~450-530 tokens/s and
plain steps ~630, so it decoded plainly, while one proposed token a row delivered 660-750.
After each arm has been measured a few times at this batch size, the fastest runs, and the
others are re-measured now and then so that a change (a better draft, other prompts) is
noticed. A probe costs the gap between the arms, so the wider an arm's gap, the rarer its
probe: EXPLORE_EVERY steps at a tie, EXPLORE_EVERY * lead**2 at a lead (32 at 2x, the usual
lead of a trained draft at batch 1 on a CPU, where probing every 8 steps cost ~6% of the
throughput), times the number of other arms, so that all probes together cost about what one
other arm's would; never rarer than MAX_EXPLORE_EVERY. (Probing an arm the rarer the longer
its step takes, at most every 256 steps, let a guard that had once measured speculation
slower stay on plain decoding for hundreds of steps: a `make bench` run's structured replies
fell from tau 3.4 to 1.3, and were back at 3.3 without it.)

A bucket seen for the first time does not start over: while a batch ramps up or drains it
crosses a bucket every few dozen steps, and measuring four arms three times each there cost
a dozen steps per bucket, most of them on slower arms. Its arms start from a neighbouring
bucket (half or twice its size) whose arms are all measured (the prior), scaled to this bucket
by the arms measured in both (a batch twice as large delivers more tokens per second in every
arm; the arms' order is what carries over), and give way to this bucket's own samples as those come in; an arm still
leaning on its prior is probed as often as at a tie. In a simulated drain from 32 requests
to 1, three steps a size, this lifted throughput from 0.93 to 0.94 of always choosing the
best arm (tests/engine/test_step_rates.py).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

Arm = int | None  # 0: plain decoding; n: at most n proposed tokens a row; None: the cost model's allocation


@dataclass(slots=True)
class _Rate:
    """Tokens per step over seconds per step, each an exponentially weighted mean.

    The two move at different speeds: a speculative step's tokens jump between 1 and K + 1
    with acceptance, so one unlucky probe must not flip the verdict (long memory), while its
    time depends on the batch and the machine and is steady (short memory, so a change in
    cost shows after two or three probes)."""

    tokens: float = 0.0
    seconds: float = 0.0
    token_weight: float = 0.0
    second_weight: float = 0.0
    samples: int = 0
    last_step: int = 0  # the bucket's step count at its last sample

    def add(self, tokens: int, seconds: float, token_decay: float, second_decay: float) -> None:
        self.tokens = self.tokens * token_decay + tokens
        self.token_weight = self.token_weight * token_decay + 1
        self.seconds = self.seconds * second_decay + seconds
        self.second_weight = self.second_weight * second_decay + 1
        self.samples += 1

    @property
    def value(self) -> float:
        if self.seconds <= 0:
            return 0.0
        return (self.tokens / self.token_weight) / (self.seconds / self.second_weight)


def batch_bucket(batch: int) -> int:
    """1, 2, 4, 8, ...: the smallest power of two >= batch."""
    return 1 << max(0, batch - 1).bit_length()


class StepRates:
    # SECOND_DECAY: an arm's step time is mostly its last two or three samples, so two or
    # three probes notice that a slower arm became the faster one (within ~100 steps at
    # a 2x lead, ~25 at a tie). TOKEN_DECAY: tokens per step average over ~10 samples
    # (acceptance is noisy step to step).
    MIN_SAMPLES, EXPLORE_EVERY, MAX_EXPLORE_EVERY, SECOND_DECAY, TOKEN_DECAY = 3, 8, 64, 0.5, 0.9
    ARMS: tuple[Arm, ...] = (0, 1, 3, None)
    # Below this bucket only plain and the cost model's allocation: a verify row there costs
    # little next to the weights' read, and the capped arms cut copies from the context short.
    # With them at every bucket, `make bench`'s agent turns fell from tau 4.6 to 2.6 (the arm
    # best on one request's rounds held for the next one's copies).
    SHALLOW_FROM = 4

    def __init__(self, arms: tuple[Arm, ...] = ARMS) -> None:
        self.arms = arms
        self._rates: dict[tuple[int, Arm], _Rate] = {}
        self._steps: Counter[int] = Counter()

    def record(self, batch: int, arm: Arm, tokens: int, seconds: float) -> None:
        b = batch_bucket(batch)
        rate = self._rates.setdefault((b, arm), _Rate())
        rate.add(tokens, seconds, self.TOKEN_DECAY, self.SECOND_DECAY)
        rate.last_step = self._steps[b]

    def rate(self, batch: int, arm: Arm) -> float:
        """Tokens per second of `arm` at this batch size: measured here, or from the prior."""
        return self._estimate(batch_bucket(batch), arm) or 0.0

    def verdict(self, batch: int, model_says: bool) -> Arm:
        """The measured choice without probing (for steps that are not measured, e.g. with
        prefill chunks in them): the fastest arm once all are known, else the model's."""
        b = batch_bucket(batch)
        if self._unknown(b):
            return None if model_says else 0
        return self._best(b)

    def choose(self, batch: int, model_says: bool) -> Arm:
        """The arm this step runs: while some arm has fewer than MIN_SAMPLES samples, the one
        with fewest (the model's choice first, then the other of plain and the model's, then
        the capped ones), so that each arm's first samples spread over the same stretch of time
        (on a shared machine a slow second can fall on three steps in a row, and an arm
        measured only then looks slower than it is until its next probe); then the fastest,
        but an arm whose probe is due, the longest overdue, once every probe interval."""
        b = batch_bucket(batch)
        self._steps[b] += 1
        preferred = (None, 0) if model_says else (0, None)
        arms = self._arms(b)
        order = [arm for arm in dict.fromkeys((*preferred, *arms)) if arm in arms]
        without_estimate = set(self._unknown(b))
        unknown = [arm for arm in order if arm in without_estimate]
        if unknown:
            return min(unknown, key=lambda arm: self._get(b, arm).samples)
        best_arm = self._best(b)
        best = self._estimate(b, best_arm) or 0.0
        overdue: dict[Arm, int] = {}  # per slower arm: steps past its probe's due
        for arm in arms:
            if arm != best_arm:
                # an arm still leaning on the prior is probed as at a tie: its lead is a guess
                other = (self._estimate(b, arm) or 0.0) if self._measured(b, arm) else best
                interval = self.probe_interval(best, other, len(arms) - 1)
                overdue[arm] = self._steps[b] - self._get(b, arm).last_step - interval
        arm = max(overdue, key=overdue.__getitem__)
        return arm if overdue[arm] >= 0 else best_arm

    def probe_interval(self, best_rate: float, other_rate: float, others: int = 1) -> int:
        """Steps between probes of a slower arm: EXPLORE_EVERY times the squared lead, times
        the number of other arms."""
        lead = max(best_rate, other_rate) / max(min(best_rate, other_rate), 1e-9)
        steps = self.EXPLORE_EVERY * lead ** 2 * others
        return min(self.MAX_EXPLORE_EVERY, round(steps))

    def _arms(self, bucket: int) -> tuple[Arm, ...]:
        if bucket >= self.SHALLOW_FROM:
            return self.arms
        return tuple(arm for arm in self.arms if arm in (0, None))

    def _best(self, bucket: int) -> Arm:
        return max(self._arms(bucket), key=lambda arm: self._estimate(bucket, arm) or 0.0)

    def _measured(self, bucket: int, arm: Arm) -> bool:
        return self._get(bucket, arm).samples >= self.MIN_SAMPLES

    def _unknown(self, bucket: int) -> list[Arm]:
        """The arms with neither MIN_SAMPLES samples here nor a prior: measured first."""
        return [arm for arm in self._arms(bucket) if self._estimate(bucket, arm) is None]

    def _estimate(self, bucket: int, arm: Arm) -> float | None:
        """Tokens per second: this bucket's own rate once it has MIN_SAMPLES samples; before
        that, the prior's (scaled) blended with what was measured here, sample by sample;
        None without either."""
        own = self._get(bucket, arm)
        if own.samples >= self.MIN_SAMPLES:
            return own.value
        prior = self._prior(bucket, arm)
        if prior is None:
            return None
        weight = own.samples / self.MIN_SAMPLES
        return weight * own.value + (1 - weight) * prior

    def _prior(self, bucket: int, arm: Arm) -> float | None:
        """`arm`'s rate in a neighbouring bucket whose arms are all measured, times how much
        faster the arms measured in both buckets ran here than there (1 before any ran here)."""
        source = self._nearest_measured(bucket)
        if source is None or not self._measured(source, arm):
            return None
        shared = [a for a in self._arms(bucket) if self._get(bucket, a).samples > 0 and self._measured(source, a)]
        scale = statistics.fmean(self._get(bucket, a).value / max(self._get(source, a).value, 1e-9) for a in shared) \
            if shared else 1.0
        return self._get(source, arm).value * scale

    def _nearest_measured(self, bucket: int) -> int | None:
        """A neighbour of `bucket` (half or twice its size; the smaller where both are) with all
        its arms measured. Not further: in a simulated ramp, a prior from two sizes away (8 for
        32) held the wrong arm for a hundred steps, where measuring every arm took twelve."""
        near = [b for b in (bucket // 2, bucket * 2)
                if b >= 1 and all(self._measured(b, arm) for arm in self._arms(b))]
        return min(near, default=None)

    def _get(self, bucket: int, arm: Arm) -> _Rate:
        return self._rates.get((bucket, arm)) or _Rate()

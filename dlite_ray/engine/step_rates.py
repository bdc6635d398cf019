"""Measured tokens per second of speculative vs plain steps, per batch-size bucket.

The cost model in `speculation_policy.py` allocates draft positions, but a model can be
wrong about a machine (per-row overheads, a compute-bound CPU at batch 4, a draft whose
acceptance drifts). This guard settles "speculate or not" on what the steps actually
delivered: after each mode has been measured a few times at this batch size, the faster
one runs, and the slower one is re-measured now and then so a change (a better draft,
other prompts) is noticed. A probe costs the gap between the two modes, so the wider the
gap, the rarer the probe: every EXPLORE_EVERY steps at a tie, every EXPLORE_EVERY * lead**2
at a lead (32 at 2x, the usual lead of a trained draft at batch 1 on a CPU, where probing
every 8 steps cost ~6% of the throughput), never rarer than MAX_EXPLORE_EVERY.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


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
    # SECOND_DECAY: a mode's step time is mostly its last two or three samples, so two or
    # three probes notice that the slower mode became the faster one (within ~100 steps at
    # a 2x lead, ~25 at a tie). TOKEN_DECAY: tokens per step average over ~10 samples
    # (acceptance is noisy step to step).
    MIN_SAMPLES, EXPLORE_EVERY, MAX_EXPLORE_EVERY, SECOND_DECAY, TOKEN_DECAY = 3, 8, 64, 0.5, 0.9

    def __init__(self) -> None:
        self._rates: dict[tuple[int, bool], _Rate] = {}
        self._since_probe: Counter[int] = Counter()

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        rate = self._rates.setdefault((batch_bucket(batch), speculated), _Rate())
        rate.add(tokens, seconds, self.TOKEN_DECAY, self.SECOND_DECAY)

    def rate(self, batch: int, speculated: bool) -> float:
        return self._rates.get((batch_bucket(batch), speculated), _Rate()).value

    def verdict(self, batch: int, model_says: bool) -> bool:
        """The measured choice without probing (for steps that are not measured, e.g. with
        prefill chunks in them): the faster mode once both are known, else the model's."""
        spec, plain = (self._rates.get((batch_bucket(batch), mode), _Rate()) for mode in (True, False))
        if spec.samples < self.MIN_SAMPLES or plain.samples < self.MIN_SAMPLES:
            return model_says
        return spec.value >= plain.value

    def should_speculate(self, batch: int, model_says: bool) -> bool:
        b = batch_bucket(batch)
        self._since_probe[b] += 1
        spec, plain = (self._rates.get((b, mode), _Rate()) for mode in (True, False))
        known_spec, known_plain = spec.samples >= self.MIN_SAMPLES, plain.samples >= self.MIN_SAMPLES
        if not known_spec and not known_plain:
            return model_says  # measure the model's choice first
        if not known_spec or not known_plain:
            return not known_spec  # then the other one
        best = spec.value >= plain.value
        if self._since_probe[b] >= self.probe_interval(spec.value, plain.value):
            self._since_probe[b] = 0
            return not best  # keep the other figure current
        return best

    def probe_interval(self, spec_rate: float, plain_rate: float) -> int:
        """Steps between probes of the slower mode: EXPLORE_EVERY times the squared lead."""
        lead = max(spec_rate, plain_rate) / max(min(spec_rate, plain_rate), 1e-9)
        return min(self.MAX_EXPLORE_EVERY, round(self.EXPLORE_EVERY * lead ** 2))

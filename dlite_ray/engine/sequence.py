"""A request's state inside the engine."""

from __future__ import annotations

import enum
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dlite_ray.engine.logprobs import TokenLogprob
from dlite_ray.engine.stop_strings import StopStrings
from dlite_ray.engine.trace import Trace
from dlite_ray.runtime.sampling import GREEDY, MATCH, MIN_TEMPERATURE, REJECTION, VERIFY_MODES

if TYPE_CHECKING:
    from dlite_ray.engine.structured_output import OutputGrammar


class InvalidRequest(ValueError):
    """A request the engine refuses, with the reason."""


# Why a sequence finished (Sequence.finish_reason): an end-of-sequence token, a stop token or
# a stop string; the token budget; the caller gave up; or the request could not go on
# (Sequence.error says why: its grammar failed mid-reply). Only "stop" ends a reply that
# its grammar accepts.
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"


@dataclass(slots=True)
class SamplingParams:
    """How a request samples and when it stops.

    temperature: 0 is greedy; so is any temperature below MIN_TEMPERATURE (runtime/sampling.py),
    which is normalised to 0 here: dividing logits by less rounds them to inf in float32 (and
    1e-300 is 0 there), and a distribution that peaked differs from greedy only on near ties.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    verify_mode: str | None = None  # None: greedy at T = 0, else rejection
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings: the output ends with the token completing one (stop_strings.py)
    ignore_eos: bool = False  # generate exactly max_new_tokens (benchmarks, distribution tests)
    trace_top_k: int = 0  # > 0: keep a Trace of each output position (tap features, top-k distribution)
    logprobs: int | None = None  # n >= 0: each output token's logprob and the n most likely tokens'
    grammar: str | None = None  # what the output must match: structured_output.grammar_for_schema / grammar_for_calls

    def __post_init__(self) -> None:
        if self.max_new_tokens <= 0:
            raise InvalidRequest(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0  # greedy (see the class docstring)
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # one string is one stop
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequest(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {self.top_k}")
        if self.trace_top_k < 0:
            raise InvalidRequest(f"trace_top_k must be >= 0, got {self.trace_top_k}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or self.logprobs < 0):
            raise InvalidRequest(f"logprobs must be an integer >= 0 (or None), got {self.logprobs!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequest(f"grammar must be a grammar's text, got {type(self.grammar).__name__}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if self.verify_mode is not None and self.verify_mode not in VERIFY_MODES:
            raise InvalidRequest(f"verify_mode must be one of {VERIFY_MODES}, got {self.verify_mode!r}")
        if self.verify_mode in (REJECTION, MATCH) and self.temperature == 0:
            self.verify_mode = GREEDY  # T = 0 has one answer; every mode reduces to greedy

    @classmethod
    def from_dict(cls, params: dict) -> SamplingParams:
        """SamplingParams from a request's fields; InvalidRequest names any field it does not
        have (such as n, logit_bias or a penalty): refused, never silently ignored."""
        unknown = sorted(set(params) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidRequest(f"unsupported sampling parameters: {', '.join(unknown)}")
        return cls(**params)

    @property
    def mode(self) -> str:
        if self.temperature == 0:
            return GREEDY
        return self.verify_mode if self.verify_mode in (REJECTION, MATCH) else REJECTION


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SequenceStats:
    accept_lengths: list[int] = field(default_factory=list)  # A + 1 per round
    copied_rounds: list[bool] = field(default_factory=list)  # per round: tokens copied from the context
    reply_rounds: list[bool] = field(default_factory=list)  # per round: copied from an earlier reply (of the above)
    branch_gains: list[int] = field(default_factory=list)  # per round: tokens kept beyond the main proposal's (a tree)
    position_accepts: list[int] = field(default_factory=list)  # [k] DLite rounds whose draft k was accepted
    position_trials: list[int] = field(default_factory=list)  # [k] DLite rounds that drafted position k
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    decode_wall_time: float = 0.0
    first_token_time: float | None = None
    last_token_time: float | None = None
    cached_prompt_tokens: int = 0  # prompt positions found in the prefix cache
    resumed_from_boundary: bool = False  # KV and pivot features reused with no target recompute

    def record_round(self, num_drafted: int, accepted: int, copied: bool = False, from_reply: bool = False,
                     main_accepted: int | None = None) -> None:
        """accepted: tokens the round kept before the target's own; main_accepted: how many of
        them the main proposal held (fewer where a tree's other branch went further)."""
        main_accepted = accepted if main_accepted is None else main_accepted
        self.accept_lengths.append(accepted + 1)
        self.copied_rounds.append(copied)
        self.reply_rounds.append(from_reply)
        self.branch_gains.append(accepted - main_accepted)
        if copied:
            return  # per-position acceptance describes the DLite draft
        while len(self.position_trials) < num_drafted:
            self.position_trials.append(0)
            self.position_accepts.append(0)
        # the positions the round reached: the accepted ones and the first rejected, so that
        # accepts / trials is P(position k accepted | reached), the paper's per-position figure
        for k in range(min(num_drafted, main_accepted + 1)):
            self.position_trials[k] += 1
            self.position_accepts[k] += k < main_accepted

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Invariant: the KV cache holds token_ids[:num_computed]; the last token is the anchor
    (chosen, not yet run through the target). A sequence is ready to decode once
    num_computed == len(token_ids) - 1; until then it is prefilling, in chunks."""

    token_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    status: Status = Status.WAITING
    num_prompt_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the full, committed blocks
    num_computed: int = 0
    pivot_features: torch.Tensor | None = None  # [S, D] taps at position num_computed - 1
    finish_reason: str | None = None
    stats: SequenceStats = field(default_factory=SequenceStats)
    generator: torch.Generator | None = None
    trace: Trace | None = None  # with params.trace_top_k > 0: a row per output token
    logprobs: list[TokenLogprob] | None = None  # with params.logprobs set: an entry per output token
    stop_strings: StopStrings | None = None  # with params.stop: set by the engine, which holds the tokenizer
    grammar: OutputGrammar | None = None  # with params.grammar: set by the engine, likewise
    error: str | None = None  # with finish_reason "error": why the request could not go on
    namespace: str | None = None  # whose earlier replies it may copy (a tenant; None: the engine-wide default)
    arrival: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise InvalidRequest("the prompt is empty")
        self.token_ids = list(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.trace_top_k > 0:
            self.trace = Trace(self.params.trace_top_k)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def anchor(self) -> int:
        return self.token_ids[-1]

    @property
    def num_to_prefill(self) -> int:
        return len(self.token_ids) - 1 - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_tokens(self, tokens: list[int], eos_ids: tuple[int, ...]) -> list[int]:
        """Commit tokens, stopping at a stop token or the length limit; returns what was kept."""
        kept = []
        for tok in tokens:
            self.token_ids.append(tok)
            kept.append(tok)
            if (tok in eos_ids and not self.params.ignore_eos) or tok in self.params.stop_token_ids:
                self.finish(FINISH_STOP)
                break
            stops = self.stop_strings
            if stops is not None and stops.completed_by_last(self.token_ids, self.num_prompt_tokens):
                self.finish(FINISH_STOP)
                break
            if self.num_outputs >= self.params.max_new_tokens:
                self.finish(FINISH_LENGTH)
                break
        return kept

    def finish(self, reason: str) -> None:
        self.status, self.finish_reason = Status.FINISHED, reason

    def fail(self, error: str) -> None:
        """End the request as one that could not go on (finish_reason "error"), saying why."""
        self.error = error
        self.finish(FINISH_ERROR)

"""RequestStats: what one finished request measured, as a typed record.

It travels with a request's last chunk (through Serve handles, pickled) and with a
library result; readers use attributes, so a renamed or missing field fails loudly
instead of reading as a default.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlite_ray.engine.sequence import Sequence


@dataclass(slots=True)
class RequestStats:
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt positions found in the prefix cache
    resumed_from_boundary: bool = False  # KV and pivot features reused with no target recompute
    accept_lengths: list[int] = field(default_factory=list)  # A + 1 per speculation round
    copied_rounds: list[bool] = field(default_factory=list)  # per round: tokens copied from the context
    reply_rounds: list[bool] = field(default_factory=list)  # per round: copied from an earlier reply (reply_cache.py)
    branch_gains: list[int] = field(default_factory=list)  # per round: tokens kept beyond the main proposal (a tree)
    position_accepts: list[int] = field(default_factory=list)  # [k] DLite rounds whose draft k was accepted
    position_trials: list[int] = field(default_factory=list)  # [k] DLite rounds that reached drafted position k
    prefill_time: float = 0.0
    decode_wall_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    decode_tokens_per_second: float = 0.0  # after the first round, whose tokens arrive at TTFT
    ttft: float | None = None  # seconds from arrival to the first token

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @classmethod
    def of(cls, seq: Sequence) -> RequestStats:
        st = seq.stats
        after_first = seq.num_outputs - (st.accept_lengths[0] if st.accept_lengths else 0)
        return cls(num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=seq.num_outputs,
                   cached_prompt_tokens=st.cached_prompt_tokens, resumed_from_boundary=st.resumed_from_boundary,
                   accept_lengths=list(st.accept_lengths), copied_rounds=list(st.copied_rounds),
                   reply_rounds=list(st.reply_rounds), branch_gains=list(st.branch_gains),
                   position_accepts=list(st.position_accepts), position_trials=list(st.position_trials),
                   prefill_time=st.prefill_time, decode_wall_time=st.decode_wall_time, draft_time=st.draft_time,
                   verify_time=st.verify_time,
                   decode_tokens_per_second=after_first / st.decode_wall_time if st.decode_wall_time > 0 else 0.0,
                   ttft=(st.first_token_time - seq.arrival) if st.first_token_time else None)

    def as_dict(self) -> dict[str, Any]:
        """Every field and `mean_accept_length`, for JSON."""
        return asdict(self) | {"mean_accept_length": self.mean_accept_length}

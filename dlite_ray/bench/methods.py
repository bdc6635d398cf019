"""The decoding methods a benchmark compares, behind one interface.

Every method gets the same token ids and reports: generated ids, time to first token,
decode tokens/s (tokens after the first / time from first to last token, prefill
excluded as the paper measures), end-to-end tokens/s and the request's latency, plus
DLite's round statistics. Only our engines decode under a grammar (`grammar=True`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.engine_config import DTYPES

ASSISTANT_LAYERS = 6  # hf-assisted's draft: the target's first layers and its head (LayerSkip-style)
HF_METHODS = ("hf", "hf-prompt-lookup", "hf-assisted")


@dataclass(slots=True)
class Run:
    token_ids: list[int]
    ttft_s: float
    decode_tps: float
    e2e_tps: float
    accept_lengths: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(default_factory=list)
    position_trials: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    decode_time: float = 0.0
    copied_rounds: list[bool] = field(default_factory=list)  # per round: copied from the context, not drafted
    branch_gains: list[int] = field(default_factory=list)  # per round: tokens kept beyond the main proposal (a tree)
    latency_s: float = 0.0  # the whole request: prefill and every token


class EngineMethod:
    """Ours: DLite (trained or oracle draft) or plain decoding, on our runtime."""

    lossless = True
    grammar = True

    def __init__(self, name: str, engine: DLiteEngine):
        self.name, self.engine = name, engine

    def run(self, ids: list[int], max_new_tokens: int, grammar: str | None = None) -> Run:
        start = time.perf_counter()
        r = self.engine.generate(ids, max_new_tokens=max_new_tokens, grammar=grammar)[0]
        total = time.perf_counter() - start
        s = r.stats
        return Run(r.token_ids, s.ttft or total, s.decode_tokens_per_second, len(r.token_ids) / total,
                   s.accept_lengths, s.position_accepts, s.position_trials, s.draft_time,
                   s.verify_time, s.decode_wall_time, copied_rounds=s.copied_rounds, branch_gains=s.branch_gains,
                   latency_s=total)


class _TimingStreamer:
    """transformers streamer that timestamps each emission (the first put is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFMethod:
    """transformers `generate`: plain, prompt lookup, or assisted by a small draft with its own KV."""

    # its own kernels round differently from ours (in bf16 a tie can flip a greedy token), so its
    # replies are compared with ours, not counted as errors; it is lossless against itself
    lossless = False
    grammar = False  # generate has no JSON-schema / tool-call grammar of its own

    def __init__(self, name: str, model, **generate_kwargs):
        self.name, self.model, self.kwargs = name, model, generate_kwargs

    @torch.inference_mode()
    def run(self, ids: list[int], max_new_tokens: int) -> Run:
        streamer = _TimingStreamer()
        start = time.perf_counter()
        out = self.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  streamer=streamer, **self.kwargs)
        end = time.perf_counter()
        # the first put is the prompt; the rest are generated-token emissions
        return timed_run(out[0, len(ids):].tolist(), start, streamer.times[1:], streamer.counts[1:], end)


def timed_run(token_ids: list[int], start: float, emitted_at: list[float], counts: list[int], end: float) -> Run:
    """A Run of a method timed by its token emissions (`counts[i]` tokens at `emitted_at[i]`):
    time to first token, and decode speed as the tokens after the first emission over the
    time from the first emission to the last."""
    first = emitted_at[0] if emitted_at else end
    decode = emitted_at[-1] - first if len(emitted_at) > 1 else 0.0
    return Run(token_ids, first - start, sum(counts[1:]) / decode if decode > 0 else 0.0,
               len(token_ids) / (end - start), decode_time=decode, latency_s=end - start)


def truncated_draft(model, num_layers: int):
    """LayerSkip-style draft for assisted generation: the target's first layers + its head."""
    draft = copy.deepcopy(model)
    draft.model.layers = draft.model.layers[:num_layers]
    draft.config.num_hidden_layers = num_layers
    return draft


def hf_target(target: str | None, dtype: str):
    """The target as transformers loads it (the default model's converted checkpoint)."""
    from transformers import AutoModelForCausalLM

    from dlite_ray.runtime.model_store import default_model_dir

    return AutoModelForCausalLM.from_pretrained(target or default_model_dir(), dtype=DTYPES[dtype]).eval()


def hf_method(name: str, hf) -> HFMethod:
    if name == "hf-prompt-lookup":
        return HFMethod(name, hf, prompt_lookup_num_tokens=10)
    if name == "hf-assisted":
        return HFMethod(name, hf, assistant_model=truncated_draft(hf, ASSISTANT_LAYERS))
    return HFMethod(name, hf)

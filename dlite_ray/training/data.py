"""Training data: the target answers the prompts itself and, while it answers, records what
the draft learns from at each reply position (`engine/trace.py`):

- `features` [n, S, D] bf16: the S selected target layers at each pivot position,
- `argmax`  [n] int32: the target's greedy next token at each position (the labels),
- `top_ids` / `top_probs` [n, k]: the target's top-k distribution (for the TV loss),
  instead of V-wide rows (49152 floats a position would be 196 KB; top-8 is 48 bytes).

Positions start at the last prompt token (the first pivot) and run to the last but one
token: reply token i was chosen at position start + i, so every label is the token the
reply holds, and a block's labels are the chain the draft meets when drafting. The features
are the ones the engine made while decoding, as a serving engine makes its drafts' pivot
features. An earlier pipeline ran a second forward over prompt and reply for them: half the
time of the data, and in bf16 ~1.3% of its argmaxes rounded away from the reply.

Prompt positions were tried as extra data, with labels kept only while the prompt text
follows the target's greedy chain: at equal steps they lowered dev tau (1.62 vs 1.80 after
600 steps from scratch), so records keep the reply only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dlite_ray.engine.engine import DLiteEngine, GenerationResult
from dlite_ray.training.prompts import PromptSample, tool_turn

log = logging.getLogger(__name__)

TOP_K = 8  # target probabilities kept per position (TV loss)


@dataclass(slots=True)
class Record:
    tokens: torch.Tensor  # [L] int32, prompt + response
    start: int  # first recorded position (the last prompt token)
    features: torch.Tensor  # [n, S, D] bf16, n <= L - start
    argmax: torch.Tensor  # [n] int32
    top_ids: torch.Tensor  # [n, k] int32
    top_probs: torch.Tensor  # [n, k] float16


def answer_prompts(engine: DLiteEngine, samples: list[PromptSample], max_new_tokens: int,
                   batch_size: int = 64) -> list[Record]:
    """A record of the target's greedy reply to every turn of every sample. `engine` taps
    the draft's target layers (`DLiteEngine(tap_layers=...)`) and decodes plainly."""
    if not engine.runner.tap_layers or engine.draft is not None:
        raise ValueError("records need a draft-less engine that taps the draft's target layers")
    out: list[Record] = []
    single = [s for s in samples if not s.later_turns]
    # Chunks of many requests through the continuous-batching engine: weights are read once
    # per step for every request in flight.
    for i in tqdm(range(0, len(single), batch_size), desc="target replies", unit="chunk"):
        prompts = [engine.encode(s.messages) for s in single[i:i + batch_size]]
        results = engine.generate(prompts, max_new_tokens=max_new_tokens, trace_top_k=TOP_K)
        out += [record_of(prompt, r) for prompt, r in zip(prompts, results)]
    conversations = [s for s in samples if s.later_turns]
    for i in tqdm(range(0, len(conversations), batch_size), desc="multi-turn replies", unit="chunk"):
        out += _answer_conversations(engine, conversations[i:i + batch_size], max_new_tokens)
    return out


def _answer_conversations(engine: DLiteEngine, samples: list[PromptSample], max_new_tokens: int) -> list[Record]:
    """Every turn of every conversation, turn by turn: each wave answers the next turn of all
    conversations at once (their replies join their histories, then a tool result and the next
    user turn), until a conversation runs out of turns or of context."""
    chats = [list(s.messages) for s in samples]
    later = [s.later_turns for s in samples]
    live = list(range(len(samples)))  # conversations still answered: a stopped one never resumes
    out = []
    for wave in range(1 + max(map(len, later))):
        live = [i for i in live if wave <= len(later[i])]
        if wave:  # a later turn: the tool's result, then the next request
            for i in live:
                chats[i].append(tool_turn(later[i][wave - 1]))
        prompts = {i: engine.encode(chats[i]) for i in live}
        live = [i for i in live if len(prompts[i]) + max_new_tokens < engine.runner.max_context]
        if not live:
            break
        replies = engine.generate([prompts[i] for i in live], max_new_tokens=max_new_tokens, trace_top_k=TOP_K)
        for i, reply in zip(live, replies):
            out.append(record_of(prompts[i], reply))
            chats[i].append({"role": "assistant", "content": reply.text})
    return out


def record_of(prompt: list[int], reply: GenerationResult) -> Record:
    """The record of one greedy reply from its trace: row i chose reply token i."""
    trace = reply.trace
    assert trace is not None and trace.features is not None and len(trace) == len(reply.token_ids)
    return Record(torch.tensor(prompt + reply.token_ids, dtype=torch.int32), len(prompt) - 1, trace.features,
                  torch.tensor(reply.token_ids, dtype=torch.int32), trace.top_ids,
                  trace.top_probs.to(torch.float16))


def save_records(records: list[Record], path) -> None:
    torch.save([{f: getattr(r, f) for f in Record.__slots__} for r in records], path)


def load_records(path) -> list[Record]:
    return [Record(**d) for d in torch.load(path)]


def label_counts(records: Iterable[Record], vocab_size: int) -> torch.Tensor:
    """How often each token is the target's greedy label (for the draft's vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in records:
        counts += torch.bincount(r.argmax.long(), minlength=vocab_size)
    return counts


def dataset_bytes(records: list[Record]) -> int:
    return sum(t.numel() * t.element_size() for r in records
               for t in (r.tokens, r.features, r.argmax, r.top_ids, r.top_probs))

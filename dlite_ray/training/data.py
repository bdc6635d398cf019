"""Training data: the target answers the prompts itself, then one forward pass per sequence
records what the draft learns from, only where drafting happens (the response):

- `features` [n, S, D] bf16: the S selected target layers at each pivot position,
- `argmax`  [n] int32: the target's greedy next token at each position (the labels),
- `top_ids` / `top_probs` [n, k]: the target's top-k distribution (for the TV loss),
  instead of V-wide rows (49152 floats a position would be 196 KB; top-8 is 48 bytes).

Positions start at the last prompt token (the first pivot) and run to the end. Every reply
token is the target's greedy choice, so a block's labels are the chain the draft meets when
drafting; in bf16 the feature pass can round to another argmax than generation did (~1.3% of
reply positions), and `batches` drops the labels that no longer follow the chain.

Prompt positions were tried as extra data (the feature pass runs over the prompt anyway),
with labels kept only while the prompt text follows the target's greedy chain: at equal
steps they lowered dev tau (1.62 vs 1.80 after 600 steps from scratch), so records keep the
reply only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.model_runner import ModelRunner, RowInput
from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.training.prompts import PromptSample

log = logging.getLogger(__name__)

TOOL_RESULT = '{"status": "ok", "result": "done"}'


@dataclass(slots=True)
class Record:
    tokens: torch.Tensor  # [L] int32, prompt + response
    start: int  # first recorded position (the last prompt token)
    features: torch.Tensor  # [L - start, S, D] bf16
    argmax: torch.Tensor  # [L - start] int32
    top_ids: torch.Tensor  # [L - start, k] int32
    top_probs: torch.Tensor  # [L - start, k] float16


def generate_conversations(engine: DLiteEngine, samples: list[PromptSample], max_new_tokens: int,
                           batch_size: int = 64) -> list[tuple[list[int], int]]:
    """(token ids of prompt + target reply, prompt length) for every turn of every sample."""
    out: list[tuple[list[int], int]] = []
    single = [s for s in samples if not s.later_turns]
    # Chunks of many requests through the continuous-batching engine: weights are read once
    # per step for every request in flight.
    for i in tqdm(range(0, len(single), batch_size), desc="target replies", unit="chunk"):
        chunk = single[i:i + batch_size]
        prompts = [engine.encode(s.messages) for s in chunk]
        results = engine.generate(prompts, max_new_tokens=max_new_tokens)
        for prompt, r in zip(prompts, results):
            out.append((prompt + r.token_ids, len(prompt)))
    for s in tqdm([s for s in samples if s.later_turns], desc="multi-turn replies", unit="conv"):
        messages = list(s.messages)
        for turn in [None, *s.later_turns]:
            if turn is not None:
                messages += [{"role": "user", "content": f"Tool result: {TOOL_RESULT}\n\n{turn}"}]
            prompt = engine.encode(messages)
            if len(prompt) + max_new_tokens >= engine.runner.max_context:
                break
            reply = engine.generate(messages, max_new_tokens=max_new_tokens)[0]
            out.append((prompt + reply.token_ids, len(prompt)))
            messages.append({"role": "assistant", "content": reply.text})
    return out


@torch.inference_mode()
def extract_records(engine: DLiteEngine, conversations: list[tuple[list[int], int]], tap_layers: tuple[int, ...],
                    top_k: int = 8) -> list[Record]:
    runner = ModelRunner(engine.target, tap_layers, max_kv_tokens=engine.runner.max_context + 64,
                         block_size=engine.runner.cache.block_size, attention_backend="sdpa")
    records = []
    for ids, prompt_len in tqdm(conversations, desc="target features", unit="seq"):
        start = prompt_len - 1
        seq = Sequence(ids, SamplingParams(max_new_tokens=1))
        out = runner.forward([RowInput(seq, ids, num_outputs=len(ids) - start)])[0]
        runner.release(seq)
        probs = out.logits.softmax(dim=-1)
        top_p, top_i = probs.topk(top_k, dim=-1)
        records.append(Record(torch.tensor(ids, dtype=torch.int32), start, out.taps.to(torch.bfloat16),
                              out.logits.argmax(-1).to(torch.int32), top_i.to(torch.int32), top_p.to(torch.float16)))
    return records


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

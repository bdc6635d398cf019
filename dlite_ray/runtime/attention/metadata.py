"""Attention metadata: where each sequence's new tokens and context lie in the paged KV,
built once per forward (`build_attention_metadata`) and passed down to every layer.

Also the bounds of the position-exact way that both backends and the engine read: which
spans are decode / verify rows (up to MAX_POSITIONED_TOKENS new tokens) and the windows of
keys their calls read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dlite_ray.runtime.window_batch import WindowPlan

if TYPE_CHECKING:
    from dlite_ray.runtime.attention.device_rows import DeviceRows
    from dlite_ray.runtime.attention.row_plan import FlashPlan


# Decode and verify steps (up to MAX_POSITIONED_TOKENS new tokens per sequence) go the
# position-exact way: one kernel call per window of rows, over the keys of positions
# [0, w + WINDOW) where w = p - p % WINDOW, masked after each row's position p. The key
# count is then a function of the position alone, so a row sees the same arithmetic in a
# decode step and in a verify step. A call holds at most MAX_POSITIONED_ROWS GQA-folded
# query rows (query heads per KV head x new tokens): 48 hold all 16 positions of SmolLM2
# (3 query heads per KV head). A call reads WINDOW / 2 masked keys on average, and a verify
# step crosses into the next window (a second call) in about K / WINDOW of steps: at 300
# positions, a window of 64 instead of 256 made a forward 5% (1 row) to 8% (8 rows) faster.
MAX_POSITIONED_TOKENS, MAX_POSITIONED_ROWS, WINDOW = 16, 48, 64


@dataclass(slots=True)
class SequenceSpan:
    """One sequence of a ragged batch: its new tokens [q_start, q_start + q_len) attend to
    its first ctx_len cached positions (the new ones included)."""

    q_start: int
    q_len: int
    ctx_len: int
    kv_runs: list[slice]  # the context as runs of consecutive slots
    kv_slots: torch.Tensor | None = None  # [ctx_len] slots, built by the first layer that gathers
    folded_mask: torch.Tensor | None = None  # causal mask per GQA-folded row (prefill), built once
    window_reads: dict[int, WindowReads] = field(default_factory=dict)  # by a call's first position
    tree: int = -1  # where >= 0: the span is a chain of the tree of candidates this names (`_chain_spans`)


@dataclass(slots=True)
class WindowReads:
    """Where one position-exact call reads its keys: the same in every layer of a forward,
    so it is worked out by the first layer only."""

    keys: slice | torch.Tensor  # positions [0, end): a view's slots, or the slots to gather (padded)
    mask: torch.Tensor  # [rows, end] additive: -inf after each row's position; rows: the call's, padding included
    split_keys: bool = False  # attend the two key halves as a batch of two (`_attend_key_halves`)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each new token
    spans: list[SequenceSpan]
    block_tables: list[list[int]]
    block_size: int
    window_plan: WindowPlan | None = None  # accelerators' decode/verify calls (window_batch.py), built once
    flash_plan: FlashPlan | None = None  # flash-attn's tensors for the step, built once
    device_rows: DeviceRows | None = None  # a CUDA graph's rows, from its static tensors (spans then empty)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()


def build_attention_metadata(
    q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]], block_size: int, device: torch.device,
    parents: list[list[int] | None] | None = None,
) -> AttentionMetadata:
    """New tokens of sequence i sit at positions [ctx_lens[i] - q_lens[i], ctx_lens[i]).

    parents[i], where given, makes sequence i's new tokens a tree (tree verification): token
    j follows token parents[j] (< j) instead of token j - 1, and the first follows the
    context (parents[i][0] = -1). Token j is still stored at position ctx_lens[i] - q_lens[i] + j
    of the block table, but attends like the last token of its branch: its ancestors' keys
    after the context's, at the position of its depth (`tree_positions`). The tree becomes one
    span per chain (a run of tokens each following the one before), whose keys are listed
    slot by slot, so every backend that reads keys through slots attends it unchanged, and
    each token gets the arithmetic of the same branch decoded as a plain sequence.
    """
    slot_mapping: list[int] = []
    spans: list[SequenceSpan] = []
    q_start = 0
    parents = parents or [None] * len(q_lens)
    for q_len, ctx_len, table, tree in zip(q_lens, ctx_lens, block_tables, parents, strict=True):
        if q_len <= 0 or ctx_len < q_len:
            raise ValueError(f"bad span: q_len={q_len}, ctx_len={ctx_len}")
        if len(table) * block_size < ctx_len:
            raise ValueError(f"block table of {len(table)} blocks cannot hold {ctx_len} tokens")
        first = ctx_len - q_len
        new_slots = [table[p // block_size] * block_size + p % block_size for p in range(first, ctx_len)]
        slot_mapping += new_slots
        if tree is None:
            spans.append(SequenceSpan(q_start, q_len, ctx_len, _context_runs(table, ctx_len, block_size)))
        else:
            context = [s for run in _context_runs(table, first, block_size) for s in range(run.start, run.stop)]
            spans += _chain_spans(tree, q_start, context, new_slots, device, len(spans))
        q_start += q_len
    return AttentionMetadata(torch.tensor(slot_mapping, dtype=torch.long, device=device), spans, block_tables,
                             block_size)


def tree_positions(parents: list[int]) -> list[int]:
    """Each tree token's depth below the context (the first token's is 0); checks the tree."""
    if not parents or parents[0] != -1 or any(not 0 <= p < j for j, p in enumerate(parents) if j):
        raise ValueError(f"a tree's first token follows the context and every other an earlier token: {parents}")
    depths = [0] * len(parents)
    for j in range(1, len(parents)):
        depths[j] = depths[parents[j]] + 1
    return depths


def _chain_spans(parents: list[int], q_start: int, context: list[int], new_slots: list[int],
                 device: torch.device, tree: int) -> list[SequenceSpan]:
    """A tree's spans, one per chain: its keys are the context's, its first token's
    ancestors' and its own, in order of depth. They carry the tree's name (its first span's
    index), so that a kernel may read the context they share once for all of them."""
    depths = tree_positions(parents)
    spans = []
    j = 0
    while j < len(parents):
        end = j + 1
        while end < len(parents) and parents[end] == end - 1:
            end += 1
        ancestors, node = [], parents[j]
        while node >= 0:
            ancestors.append(new_slots[node])
            node = parents[node]
        slots = context + ancestors[::-1] + new_slots[j:end]
        ctx_len = len(context) + depths[end - 1] + 1
        assert len(slots) == ctx_len
        spans.append(SequenceSpan(q_start + j, end - j, ctx_len, _slot_runs(slots),
                                  torch.tensor(slots, dtype=torch.long, device=device), tree=tree))
        j = end
    return spans


def _slot_runs(slots: list[int]) -> list[slice]:
    """A list of slots as runs of consecutive ones."""
    runs: list[slice] = []
    for s in slots:
        if runs and runs[-1].stop == s:
            runs[-1] = slice(runs[-1].start, s + 1)
        else:
            runs.append(slice(s, s + 1))
    return runs


def _context_runs(table: list[int], ctx_len: int, block_size: int) -> list[slice]:
    """Slot ranges of the first ctx_len positions, consecutive blocks merged into one run."""
    runs: list[slice] = []
    for i, block in enumerate(table[: -(-ctx_len // block_size)]):
        start = block * block_size
        stop = start + min(block_size, ctx_len - i * block_size)
        if runs and runs[-1].stop == start:
            runs[-1] = slice(runs[-1].start, stop)
        else:
            runs.append(slice(start, stop))
    return runs


def _inside_one_run(runs: list[slice], a: int, b: int) -> slice | None:
    """The slots of positions [a, b) when one run of consecutive slots holds them all."""
    offset = 0
    for run in runs:
        length = run.stop - run.start
        if offset <= a and b <= offset + length:
            return slice(run.start + a - offset, run.start + b - offset)
        if a < offset + length:
            return None  # the range starts in this run and goes past it
        offset += length
    return None


def _context_slots(span: SequenceSpan, device: torch.device) -> torch.Tensor:
    """The span's context as one slot index per position, built once per forward."""
    if span.kv_slots is None:
        span.kv_slots = torch.cat([torch.arange(r.start, r.stop, device=device) for r in span.kv_runs])
    return span.kv_slots

"""Decode and verify rows planned on the device, from the static tensors a CUDA graph reads.

A captured forward replays with the addresses it was captured with and nothing from the
host, so the graph runner (engine/graph_runner.py) refills its static inputs in place
before every replay: slot mapping, per-sequence context lengths, block tables. The
per-row tensors the paged kernel reads (each row's token, length and block table) are
then derived from those on the device, once per forward, by its first layer: inside the
captured region, so every replay derives them anew. The kernel's grid is fixed by the
table's width (its capacity in positions), which bounds every row's length; programs past
a row's last key chunk do nothing, and a larger bound gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlite_ray.runtime.attention.row_plan import FlashPlan


@dataclass(slots=True)
class DeviceRows:
    """B sequences of `query_len` new tokens each; their tensors are refilled in place
    between forwards, so this holds the tensors, never their values."""

    block_tables: torch.Tensor  # [B, M] int64, unused entries on a block no sequence owns
    context_lens: torch.Tensor  # [B] int64, each sequence's context including its new tokens
    query_len: int
    block_size: int
    _plan: FlashPlan | None = None
    _layer: int = -1  # the layer the plan was last read by

    @property
    def max_seqlen(self) -> int:
        """The grid's bound on a row's keys: all the positions the table can hold."""
        return self.block_tables.shape[1] * self.block_size

    def plan(self, layer: int) -> FlashPlan:
        """The rows' kernel inputs for this forward. A forward reads its layers in order, so
        a layer not past the last one that asked starts the next forward: derived again."""
        if self._plan is None or layer <= self._layer:
            self._plan = self._derive()
        self._layer = layer
        return self._plan

    def _derive(self) -> FlashPlan:
        rows, q = self.block_tables.shape[0], self.query_len
        device = self.block_tables.device
        # Row j of a sequence is its new token j at position context - q + j: it sees keys [0, context - q + j].
        offsets = torch.arange(1 - q, 1, device=device)  # [q]
        seqlens = (self.context_lens[:, None] + offsets[None, :]).flatten().to(torch.int32)  # [B * q]
        width = self.block_tables.shape[1]
        tables = self.block_tables.to(torch.int32)[:, None, :].expand(rows, q, width).reshape(rows * q, width)
        tokens = torch.arange(rows * q, device=device)  # verify rows are every token, in order
        return FlashPlan(tokens, seqlens, tables, [], self.max_seqlen)

"""DLiteSequentialHead: the low-rank gated RNN that restores dependencies inside a block.

For k = 1..K, with u_k the backbone output at mask k and d_0 the anchor:
    v = E_R[d_{k-1}]                         (V x R table)
    [g, c] = W_s [s_{k-1}; v] + b_s
    s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)
    r_k = W_h [s_k; u_k] + b_h               (no activation)
    logits_k = W_o r_k                       (R -> V, no bias)
The vocabulary distribution comes only from the R-wide bottleneck, never the target's
LM head. A loaded draft may draft from a subset of the vocabulary (`draft_vocab.py`):
then only those rows of W_o are read, once per drafted position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.draft_vocab import sorted_and_distinct
from dlite_ray.runtime.frozen_linear import FrozenLinear, RowLinear, freeze_linear


class DLiteSequentialHead(nn.Module):
    def __init__(self, hidden_size: int, rank: int, vocab_size: int):
        super().__init__()
        self.rank = rank
        self.prev_token_embedding = nn.Embedding(vocab_size, rank)
        self.state_proj = nn.Linear(2 * rank, 2 * rank)
        self.state_hidden_mlp = nn.Linear(rank + hidden_size, rank)
        self.output_proj = nn.Linear(rank, vocab_size, bias=False)
        # Set by restrict_vocabulary (inference only): the tokens drafted, and W_o's rows for them.
        self.drafted_ids: torch.Tensor | None = None
        self._subset_proj: FrozenLinear | None = None

    def restrict_vocabulary(self, token_ids: torch.Tensor) -> None:
        """Draft only `token_ids` (sorted, unique). The full W_o stays in the state dict;
        a frozen copy of its rows for these tokens does the drafting. Call it once the head
        sits on its device: the copy does not move with the module."""
        ids = token_ids.to(torch.long)
        if not sorted_and_distinct(ids):
            raise ValueError("token_ids must be a non-empty, sorted list of distinct ids")
        weight = self.output_proj.weight.detach()
        self.drafted_ids = ids.to(weight.device)
        self._subset_proj = freeze_linear(weight[self.drafted_ids].contiguous())

    def initial_state(self, batch: int, like: torch.Tensor, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """s_0 = 0; with G > 1 seeded by one step on the token before the anchor."""
        state = torch.zeros(batch, self.rank, dtype=like.dtype, device=like.device)
        if prev_tokens is not None:
            state = self.advance(state, prev_tokens)
        return state

    def advance(self, state: torch.Tensor, prev_tokens: torch.Tensor) -> torch.Tensor:
        # state: [N, R], prev_tokens: [N] -> [N, R]
        v = self.prev_token_embedding(prev_tokens)
        gate, cand = self.state_proj(torch.cat([state, v], dim=-1)).chunk(2, dim=-1)
        z = torch.sigmoid(gate)
        return z * state + (1 - z) * torch.tanh(cand)

    def hidden(self, state: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        # state: [..., R], u: [..., D] -> r [..., R], what W_o reads
        return self.state_hidden_mlp(torch.cat([state, u], dim=-1))

    def logits(self, state: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        # state: [..., R], u: [..., D] -> [..., V]
        return self.output_proj(self.hidden(state, u))

    def draft_logits(self, state: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Logits over the tokens this head drafts: all of them, or the subset in
        `drafted_ids` order (index i stands for token drafted_ids[i])."""
        if self._subset_proj is None:
            return self.logits(state, u)
        return self._subset_proj(self.hidden(state, u))

    @torch.inference_mode()
    def greedy_block(self, u: torch.Tensor, state: torch.Tensor, token: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """K steps from s_0 = `state` and the anchor `token` [N], each feeding its argmax to
        the next: u [N, K, D] -> (tokens [N, K], runners-up [N, K]: at each step the likeliest
        other token). In one kernel call where the compiled kernels serve a float32 head
        (inference), else step by step."""
        linears = self._row_linears()
        if linears is None or not fused_ops.serves(u):
            return self._greedy_steps(u, state, token)
        step, hidden, out = linears
        ids = self.drafted_ids if self.drafted_ids is not None else torch.empty(0, dtype=torch.long)
        return fused_ops.greedy_head(u.float(), state.float(), token, self.prev_token_embedding.weight.detach(),
                                     step.packed, step.bias, hidden.packed, hidden.bias, out.packed,
                                     out.out_features, ids)

    def _greedy_steps(self, u: torch.Tensor, state: torch.Tensor, token: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """`greedy_block` eagerly, a few small calls a step: the reference."""
        tokens, runners_up = [], []
        for k in range(u.shape[1]):
            state = self.advance(state, token)
            logits = self.draft_logits(state, u[:, k]).float()
            index = logits.argmax(dim=-1)
            runners_up.append(self.to_token_ids(logits.scatter(-1, index[:, None], -torch.inf).argmax(dim=-1)))
            token = self.to_token_ids(index)
            tokens.append(token)
        return torch.stack(tokens, 1), torch.stack(runners_up, 1)

    def _row_linears(self) -> tuple[RowLinear, RowLinear, RowLinear] | None:
        """W_s, W_h and the drafted rows of W_o where each is computed by our kernel
        (`freeze_linears` on a CPU that has it), else None."""
        step, hidden = self.state_proj.forward, self.state_hidden_mlp.forward
        out = self._subset_proj if self._subset_proj is not None else self.output_proj.forward
        if isinstance(step, RowLinear) and isinstance(hidden, RowLinear) and isinstance(out, RowLinear):
            return step, hidden, out
        return None

    def to_token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """draft_logits indices -> token ids."""
        return index if self.drafted_ids is None else self.drafted_ids[index]

    def teacher_forced(self, u: torch.Tensor, prev_tokens: torch.Tensor, state: torch.Tensor,
                       token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Training: u [N, K, D], prev_tokens [N, K] (d_0..d_{K-1}) -> logits [N, K, V],
        or [N, K, M] over `token_ids` only (the draft's vocabulary, in that order)."""
        states = []
        for k in range(u.shape[1]):
            state = self.advance(state, prev_tokens[:, k])
            states.append(state)
        # One vocabulary projection for the whole block (the loop only carries R-wide states).
        weight = self.output_proj.weight if token_ids is None else self.output_proj.weight[token_ids]
        return F.linear(self.hidden(torch.stack(states, dim=1), u), weight)

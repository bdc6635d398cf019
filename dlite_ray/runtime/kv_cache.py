"""Paged KV cache tensors: one pool of fixed-size blocks per layer, allocated once.

The pool is addressed by *slots* (block_id * block_size + offset). Which blocks belong to
which sequence is the engine's business (`engine.block_manager`); this class only owns
the tensors, so cropping a sequence is pure bookkeeping there and costs nothing here.
"""

from __future__ import annotations

import torch

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.config import ModelConfig


class PagedKVCache:
    """Layouts: `head_major` [L, Hkv, slots, Dh] (SDPA: a sequence on consecutive blocks is
    one strided view per head, no copy) or `block_major` [L, blocks, block_size, Hkv, Dh]
    (what flash-attn's paged kernel reads)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, block_major: bool = False):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must be positive")
        self.num_blocks, self.block_size, self.block_major = num_blocks, block_size, block_major
        hkv, dh, layers = cfg.num_kv_heads, cfg.head_dim, cfg.num_layers
        shape: tuple[int, ...]
        if block_major:
            shape = (layers, num_blocks, block_size, hkv, dh)
        else:
            shape = (layers, hkv, num_blocks * block_size, dh)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # One view per layer, made once: indexing self.k[layer] is an operation per call.
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slot_mapping: [T]; k, v: [T, Hkv, Dh]
        # The cache holds only finite values: attention reads masked keys past a sequence's
        # end (a view over slots other sequences wrote), and a masked key counts for exactly
        # nothing only if it is finite. A request whose activations overflow thus cannot
        # poison another's attention (its own output is garbage either way).
        if self.block_major:
            if not fused_ops.write_kv_block_major(self.k_layers[layer], self.v_layers[layer], slot_mapping, k, v):
                self.k_layers[layer].flatten(0, 1).index_copy_(0, slot_mapping, _finite(k))
                self.v_layers[layer].flatten(0, 1).index_copy_(0, slot_mapping, _finite(v))
        elif not fused_ops.write_kv(self.k_layers[layer], self.v_layers[layer], slot_mapping, k, v):
            self.k_layers[layer].index_copy_(1, slot_mapping, _finite(k).transpose(0, 1))
            self.v_layers[layer].index_copy_(1, slot_mapping, _finite(v).transpose(0, 1))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write of a shared block)."""
        if self.block_major:
            self.k[:, dst].copy_(self.k[:, src])
            self.v[:, dst].copy_(self.v[:, src])
        else:
            bs = self.block_size
            self.k[:, :, dst * bs:(dst + 1) * bs].copy_(self.k[:, :, src * bs:(src + 1) * bs])
            self.v[:, :, dst * bs:(dst + 1) * bs].copy_(self.v[:, :, src * bs:(src + 1) * bs])

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """K/V of slots `src` into slots `dst` in every layer (a tree's accepted branch into
        place); all are read before any is written."""
        if self.block_major:
            raise NotImplementedError("slots are moved in the head-major layout only")
        s = torch.tensor(src, dtype=torch.long, device=self.k.device)
        d = torch.tensor(dst, dtype=torch.long, device=self.k.device)
        self.k[:, :, d] = self.k[:, :, s]
        self.v[:, :, d] = self.v[:, :, s]

    def memory_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


def _finite(x: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

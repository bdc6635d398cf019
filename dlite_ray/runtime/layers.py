"""Decoder building blocks shared by the target and the draft (Llama / Qwen2 / Qwen3 / Mistral).

Layers work on any leading shape (`[T, D]` ragged for the target, `[N, L, D]` for the
draft); the attention core itself is passed in, so the same layer runs causal attention
over a paged cache (target) or bidirectional attention over one block (draft).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.config import ModelConfig
from dlite_ray.runtime.frozen_linear import FrozenLinear, RowLinear, freeze_linear, freeze_linears
from dlite_ray.runtime.fused_ops import apply_rotary

# (q [..., Hq, Dh], k [..., Hkv, Dh], v [..., Hkv, Dh]) -> out [..., Hq, Dh]
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _fuse_into_views(linears: tuple[nn.Linear, ...], name: str) -> torch.Tensor:
    """Concatenate the linears' tensors and make each one a view of the result (no 2x memory)."""
    fused = torch.cat([getattr(m, name).detach() for m in linears])
    start = 0
    for m in linears:
        n = getattr(m, name).shape[0]
        setattr(m, name, nn.Parameter(fused[start:start + n], requires_grad=False))
        start += n
    return fused


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_ops.rms_norm(x, self.weight, self.eps)

    def after_residual(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this norm of x + delta, x + delta) in one go."""
        return fused_ops.add_rms_norm(x, delta, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotate-half RoPE (the Hugging Face convention); cos/sin built once per forward."""

    inv_freq: torch.Tensor  # [Dh / 2] a buffer (registered in __init__)

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] -> cos, sin [..., 1, Dh] (the 1 broadcasts over heads). The sine
        carries rotate-half's sign (-sin on the first half), so `apply_rotary` swaps halves
        instead of negating one: one small operation fewer per call, the same bits."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        cos, signed_sin = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
        return cos[..., None, :].to(dtype), signed_sin[..., None, :].to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Set by freeze(): one q/k/v linear instead of three (CPU decode is one weight read per call).
        self.qkv: FrozenLinear | None = None

    def freeze(self) -> None:
        """Inference only: fuse q/k/v and fix the weights (packed for the CPU where that pays)."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bias = _fuse_into_views(projs, "bias") if self.q_proj.bias is not None else None
        self.qkv = freeze_linear(_fuse_into_views(projs, "weight"), bias)
        freeze_linears(self.o_proj)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv = self.num_kv_heads * self.head_dim
        return self.qkv(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values only (the draft's context slots): once frozen in the one fused call,
        since a few wasted q rows cost less than a second call; in training, only k and v."""
        if self.qkv is None:
            return self.k_proj(x), self.v_proj(x)
        return self.project_qkv(x)[1:]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        q, k, v = self._rotated_qkv(x, cos, sin)
        out = attend(q, k, v)
        return self.o_proj(out.flatten(-2))

    def _rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [..., Hq, Dh], k and v [..., Hkv, Dh], q and k rotated."""
        hq, hkv, dh = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv is not None:
            # Frozen, q and k sit side by side in one output: rotating (and norming) the q and
            # k heads in one go cuts the small operations rotation costs a decode step.
            q_norm, k_norm = self.q_norm, self.k_norm  # both set or neither (cfg.qk_norm)
            norms = None if q_norm is None or k_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
            return fused_ops.rotate_qkv(self.qkv(x), cos, sin, hq, hkv, norms)
        q, k, v = self.project_qkv(x)
        q, k, v = q.unflatten(-1, (hq, dh)), k.unflatten(-1, (hkv, dh)), v.unflatten(-1, (hkv, dh))
        q_norm, k_norm = self.q_norm, self.k_norm
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up: FrozenLinear | None = None  # set by freeze()

    def freeze(self) -> None:
        self.gate_up = freeze_linear(_fuse_into_views((self.gate_proj, self.up_proj), "weight"))
        freeze_linears(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(fused_ops.silu_mul(self.gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttentionFn) -> torch.Tensor:
        normed, x = self.post_attention_layernorm.after_residual(
            x, self.self_attn(self.input_layernorm(x), cos, sin, attend))
        return x + self.mlp(normed)


def decoder_layers(layers: nn.ModuleList) -> Iterable[DecoderLayer]:
    """A model's `layers` as what they hold (nn.ModuleList types its items as nn.Module)."""
    return cast("Iterable[DecoderLayer]", layers)


def add_frozen_layers(stack, layers: nn.ModuleList) -> None:
    """Hand each frozen layer's norms and packed linears to a C++ layer stack (csrc's
    DecoderLayers, DraftLayers), in the order its `add_layer` takes them."""
    for layer in decoder_layers(layers):
        linears = row_linears(layer)
        if linears is None:
            raise ValueError("a layer's linears are not all RowLinear (the loop's for_model checks them)")
        qkv, o_proj, gate_up, down_proj = linears
        stack.add_layer(layer.input_layernorm.weight.detach(), qkv.packed, qkv.bias, o_proj.packed,
                        layer.post_attention_layernorm.weight.detach(), gate_up.packed, down_proj.packed)


def row_linears(layer: DecoderLayer) -> tuple[RowLinear, RowLinear, RowLinear, RowLinear] | None:
    """A frozen layer's q/k/v, o, gate/up and down linears where each computes through
    `RowLinear` (what the loops' kernels read), else None."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o_proj, gate_up, down_proj = attn.qkv, attn.o_proj.forward, mlp.gate_up, mlp.down_proj.forward
    if (type(qkv) is RowLinear and type(o_proj) is RowLinear and type(gate_up) is RowLinear
            and type(down_proj) is RowLinear):
        return qkv, o_proj, gate_up, down_proj
    return None

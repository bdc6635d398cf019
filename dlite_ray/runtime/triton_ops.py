"""A decoder layer's small operations on CUDA, one Triton kernel each (the GPU's counterpart
of csrc/fused_ops.cpp; `fused_ops` picks between them).

Eager PyTorch spends a kernel launch per arithmetic step: a bf16 RMSNorm with its residual
add is ~4 kernels, rotating q and k ~8 (Qwen3's q/k norms ~6 more), SiLU-mul 2, a
block-major cache write with its non-finite guard 4: ~25 a layer, ~900 for a 36-layer
Qwen3-8B step, each a few microseconds of a GPU that reads the step's weights in ~4 ms.
Here each group is one kernel:

- `rms_norm`, `add_rms_norm`: one program per row (the residual sum stored, then its norm);
- `rotate_qkv`: one program per (row, q or k head): the head's optional RMS norm (Qwen3's
  q_norm / k_norm), then rotate-half RoPE; v stays a view of the projection;
- `silu_mul`: one program per (row, column tile);
- `write_kv`: one program per new token, its k and v into their slots of a block-major
  cache, non-finite values as 0 (`PagedKVCache.write` says why).

A row's program reads that row alone and reduces it in a fixed order (one `tl.sum` over
the padded width), so its bits do not depend on how many rows share the launch: what exact
speculative decoding needs (decode and verify rows agree). Norms round as Hugging Face's
do (normalised in float32, rounded to the model's dtype, then scaled by the weight);
rotation and SiLU-mul compute in float32 and round once.

Inference only, no autograd. Off CUDA the kernels run under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_TILE = 1024  # columns per silu_mul program


@triton.jit
def _rms_norm_rows(X, Res, Sum, W, Out, stride_x, stride_r, stride_s, stride_o, eps,
                   D: tl.constexpr, D_PAD: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D_PAD)
    ok = d < D
    x = tl.load(X + row * stride_x + d, mask=ok, other=0.0)
    if ADD:  # x is the delta: the residual stream is its sum with Res, rounded to the dtype
        x = (x.to(tl.float32) + tl.load(Res + row * stride_r + d, mask=ok, other=0.0).to(tl.float32))
        x = x.to(Sum.dtype.element_ty)
        tl.store(Sum + row * stride_s + d, x, mask=ok)
    x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    normed = (x * inv_rms).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + d, (normed * w).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rotate_heads(QKV, Cos, Sin, QW, KW, Out, stride_t, stride_c, stride_ot, stride_oh, eps,
                  HQ: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    row, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i = tl.arange(0, HALF)
    src = QKV + row * stride_t + head * (2 * HALF)  # q heads, then k heads, side by side
    x1 = tl.load(src + i).to(tl.float32)
    x2 = tl.load(src + HALF + i).to(tl.float32)
    if NORM:
        inv_rms = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        if head < HQ:
            w1, w2 = tl.load(QW + i).to(tl.float32), tl.load(QW + HALF + i).to(tl.float32)
        else:
            w1, w2 = tl.load(KW + i).to(tl.float32), tl.load(KW + HALF + i).to(tl.float32)
        x1 = ((x1 * inv_rms).to(Out.dtype.element_ty).to(tl.float32) * w1).to(Out.dtype.element_ty).to(tl.float32)
        x2 = ((x2 * inv_rms).to(Out.dtype.element_ty).to(tl.float32) * w2).to(Out.dtype.element_ty).to(tl.float32)
    # Rotary.cos_sin: cos is [c, c], the signed sine [-s, s]
    c1 = tl.load(Cos + row * stride_c + i).to(tl.float32)
    c2 = tl.load(Cos + row * stride_c + HALF + i).to(tl.float32)
    s1 = tl.load(Sin + row * stride_c + i).to(tl.float32)
    s2 = tl.load(Sin + row * stride_c + HALF + i).to(tl.float32)
    dst = Out + row * stride_ot + head * stride_oh
    tl.store(dst + i, (x1 * c1 + x2 * s1).to(Out.dtype.element_ty))
    tl.store(dst + HALF + i, (x2 * c2 + x1 * s2).to(Out.dtype.element_ty))


@triton.jit
def _silu_mul_rows(GU, Out, stride_g, stride_o, WIDTH: tl.constexpr, TILE: tl.constexpr):
    row, tile = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = tile * TILE + tl.arange(0, TILE)
    ok = cols < WIDTH
    gate = tl.load(GU + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(GU + row * stride_g + WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _write_kv_rows(K, V, Slots, KC, VC, stride_k, stride_v, WIDTH: tl.constexpr, W_PAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + token).to(tl.int64)
    d = tl.arange(0, W_PAD)
    ok = d < WIDTH
    k = tl.load(K + token * stride_k + d, mask=ok, other=0.0)
    v = tl.load(V + token * stride_v + d, mask=ok, other=0.0)
    # non-finite -> 0: x != x is NaN; |x| == inf the infinities
    k = tl.where((k != k) | (tl.abs(k) == float("inf")), 0.0, k)
    v = tl.where((v != v) | (tl.abs(v) == float("inf")), 0.0, v)
    tl.store(KC + slot * WIDTH + d, k.to(KC.dtype.element_ty), mask=ok)
    tl.store(VC + slot * WIDTH + d, v.to(VC.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (D,), weight, eps) over the last dim, any leading shape."""
    rows = _rows(x)
    out = torch.empty_like(rows)
    _launch_norm(rows, None, weight, out, eps)
    return out.view(x.shape)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta) in one kernel."""
    rows, res = _rows(delta), _rows(residual)
    summed, out = torch.empty_like(rows), torch.empty_like(rows)
    _launch_norm(rows, (res, summed), weight, out, eps)
    return out.view(delta.shape), summed.view(delta.shape)


def _launch_norm(x: torch.Tensor, residual: tuple[torch.Tensor, torch.Tensor] | None, weight: torch.Tensor,
                 out: torch.Tensor, eps: float) -> None:
    """out = rms_norm(x), or with residual = (res, summed): summed = res + x, out = rms_norm(summed)."""
    d = x.shape[-1]
    add = residual is not None
    res, summed = residual if residual is not None else (x, out)  # unread without ADD
    _rms_norm_rows[(x.shape[0],)](x, res, summed, weight, out, x.stride(0),
                                  res.stride(0) if add else 0, summed.stride(0) if add else 0, out.stride(0), eps,
                                  D=d, D_PAD=triton.next_power_of_2(d), ADD=add)


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_heads: int, num_kv_heads: int,
               norms: tuple[torch.Tensor, torch.Tensor, float] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's rows [T, (Hq + 2 Hkv) * Dh] -> q [T, Hq, Dh], k [T, Hkv, Dh]
    (each head RMS-normed by `norms` = (q weight, k weight, eps) where given, then rotated
    with `Rotary.cos_sin`'s cos and signed sine [T, 1, Dh]) and v [T, Hkv, Dh], a view."""
    rows = qkv.shape[0]
    dh = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, signed_sin = cos.reshape(rows, dh).contiguous(), signed_sin.reshape(rows, dh).contiguous()
    qk = torch.empty(rows, num_heads + num_kv_heads, dh, dtype=qkv.dtype, device=qkv.device)
    q_weight, k_weight, eps = norms if norms is not None else (qk, qk, 0.0)
    if rows:
        _rotate_heads[(rows, num_heads + num_kv_heads)](
            qkv, cos, signed_sin, q_weight, k_weight, qk, qkv.stride(0), cos.stride(0), qk.stride(0), qk.stride(1),
            eps, HQ=num_heads, HALF=dh // 2, NORM=norms is not None)
    v = qkv[:, (num_heads + num_kv_heads) * dh:].unflatten(-1, (num_kv_heads, dh))
    return qk[:, :num_heads], qk[:, num_heads:], v


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up [..., I]."""
    rows = _rows(gate_up)
    width = rows.shape[-1] // 2
    out = torch.empty(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
    if rows.shape[0]:
        _silu_mul_rows[(rows.shape[0], triton.cdiv(width, SILU_TILE))](rows, out, rows.stride(0), out.stride(0),
                                                                       WIDTH=width, TILE=SILU_TILE)
    return out.view(*gate_up.shape[:-1], width)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
             ) -> None:
    """k, v [T, Hkv, Dh] into one layer of a block-major cache [blocks, block_size, Hkv, Dh]
    (contiguous) at `slots` [T], non-finite values as 0."""
    width = k.shape[-2] * k.shape[-1]
    k, v = (x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous() for x in (k, v))
    if k.shape[0]:
        _write_kv_rows[(k.shape[0],)](k, v, slots, k_cache, v_cache, k.stride(0), v.stride(0),
                                      WIDTH=width, W_PAD=triton.next_power_of_2(width))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit stride along it (a view where it already is)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()

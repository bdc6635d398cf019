"""Kernels of our own for a decoder layer: on the CPU its small operations, its linears, its
decode attention and the loop over the layers (C++); on CUDA its small operations (Triton,
`triton_ops.py`: RMSNorm with its residual add, q/k norm with RoPE, SiLU-mul, the cache write).

A decode step of a small model on CPU is mostly small operations: an eager RMSNorm is
eight calls of ~2-5 us each, rotary six, a cache write six. `csrc/fused_ops.cpp` does each
group in one call; `csrc/decode_attention.cpp` attends a step's few new rows over the paged
cache (float32 or bf16, AVX-512); `csrc/row_linear.cpp` computes the frozen linears
(`frozen_linear.RowLinear`); `csrc/decoder_layers.cpp` runs a decode or verify forward's
layers in one call (`layer_loop.py`); `csrc/draft_head.cpp` runs the draft's sequential head
for greedy rows (`sequential_head.py`), and `csrc/draft_backbone.cpp` its backbone's layers
(`draft_layer_loop.py`); `csrc/argmax.cpp` picks greedy tokens (`argmax`). They are compiled
by torch's extension loader (ninja and the system C++ compiler, ~1-3 min once per source
set and CPU, cached under ~/.cache/torch_extensions) at `dlite-ray build-kernels` (`make
setup`), else when a CPU target is loaded (`kernel_build.py`: a directory per source set, a
dead build's lock removed, a live one waited on with a deadline); where that fails, or with
DLITE_FUSED_OPS=0, the same operations run as eager PyTorch calls and attention through the
CPU flash kernel.

The kernels serve inference only (no autograd): a call with gradients enabled, or on a
device without kernels of ours, takes the eager way. On CUDA the Triton kernels serve where
the `triton` package is installed (extra `triton`) and DLITE_TRITON_OPS is not 0. Each way
computes a row the same way whatever the row count, which exact speculative decoding needs,
but the ways round differently from each other: the way is settled once per process, so
decode and verify steps always share it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from dlite_ray.constants import KERNEL_BUILD_WAIT_S
from dlite_ray.runtime.kernel_build import KernelBuild, KernelBuildTimeout, default_root, load_kernels

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name
           for name in ("fused_ops.cpp", "decode_attention.cpp", "row_linear.cpp", "decoder_layers.cpp",
                        "draft_head.cpp", "draft_backbone.cpp", "argmax.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]  # -ffp-contract=off: products rounded as written


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled kernels, or None (switched off, or they would not build: logged once)."""
    if os.environ.get("DLITE_FUSED_OPS", "1") == "0":
        return None
    wait_s = float(os.environ.get("DLITE_KERNEL_BUILD_WAIT_S", KERNEL_BUILD_WAIT_S))
    try:
        log.info("loading the fused CPU kernels (built once per source set and CPU, 1-3 min; "
                 "`dlite-ray build-kernels` builds them ahead)")
        built = load_kernels(kernel_build(), wait_s)
        if built.row_linear_uses_amx(32):  # the unit is fixed per process: it sets speed and bits
            log.info("bf16 linears and attention run on the AMX tile unit (DLITE_AMX=0: the dot-product instruction)")
        return built
    except KernelBuildTimeout as exc:
        log.warning("fused CPU kernels not loaded: %s; using eager PyTorch operations for this process", exc)
        return None
    except (ImportError, OSError, RuntimeError) as exc:  # no compiler or ninja, a read-only cache
        log.warning("fused CPU kernels unavailable (%s); using eager PyTorch operations", exc)
        return None


def loaded_kernels() -> ModuleType:
    """`kernels()` for a caller that checked they serve (`attends_decode_rows`, `serves`,
    `row_linear_serves`, a loop's `for_model`): RuntimeError where they are not loaded."""
    ops = kernels()
    if ops is None:
        raise RuntimeError("the fused CPU kernels are not loaded (check that they serve before calling them)")
    return ops


def kernel_build() -> KernelBuild:
    """This checkout's build of the kernels, for this CPU."""
    return KernelBuild("dlite_fused_ops", tuple(SOURCES), tuple(CFLAGS), _cpu_tag(), default_root(),
                       headers=tuple(sorted(SOURCES[0].parent.glob("*.h"))))


def _cpu_tag() -> str:
    """Names the build after the CPU's instruction sets: it is compiled for this CPU
    (-march=native), and a home directory may be shared by machines with other CPUs."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else platform.processor()
    flags = [line for line in text.splitlines() if line.startswith("flags")][:1] or [text]
    return hashlib.sha1(flags[0].encode()).hexdigest()[:10]


def _fused(x: torch.Tensor) -> ModuleType | None:
    if x.device.type != "cpu" or torch.is_grad_enabled():
        return None
    return kernels()


def _gpu(x: torch.Tensor) -> ModuleType | None:
    """The Triton kernels for an inference call on CUDA, where they serve (else None)."""
    if x.device.type != "cuda" or torch.is_grad_enabled():
        return None
    return triton_kernels()


@functools.cache
def triton_kernels() -> ModuleType | None:
    """`triton_ops`, or None where Triton is not installed or DLITE_TRITON_OPS=0 (settled once
    per process, as the CPU's way is)."""
    if os.environ.get("DLITE_TRITON_OPS", "1") == "0" or importlib.util.find_spec("triton") is None:
        return None
    from dlite_ray.runtime import triton_ops

    return triton_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    gpu = _gpu(x)
    if gpu is not None and weight.dtype == x.dtype:
        return gpu.rms_norm(x, weight, eps)
    ops = _fused(x)
    if ops is None or weight.dtype != x.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return ops.rms_norm(_rows(x), weight, eps).view(x.shape)


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta): a residual add and the norm that follows it."""
    gpu = _gpu(delta)
    if gpu is not None and weight.dtype == delta.dtype == residual.dtype:
        return gpu.add_rms_norm(residual, delta, weight, eps)
    ops = _fused(delta)
    if ops is None or weight.dtype != delta.dtype:
        summed = residual + delta
        return F.rms_norm(summed, (delta.shape[-1],), weight, eps), summed
    normed, summed = ops.add_rms_norm(_rows(delta), _rows(residual), weight, eps)
    return normed.view(delta.shape), summed.view(delta.shape)


def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, num_heads: int,
               num_kv_heads: int, norms: tuple[torch.Tensor, torch.Tensor, float] | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's output [..., (Hq + 2 Hkv) * Dh] -> q [..., Hq, Dh] and k
    [..., Hkv, Dh] rotated (`apply_rotary`), v [..., Hkv, Dh]. norms: (q weight, k weight,
    eps) where each q and k head is RMS-normed before rotation (Qwen3's q_norm / k_norm)."""
    dh = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    ragged = qkv.dim() == 2 and cos.shape[0] == qkv.shape[0]  # the target's rows (the kernels' shape)
    gpu = _gpu(qkv)
    if gpu is not None and ragged:
        return gpu.rotate_qkv(qkv, cos, signed_sin, num_heads, num_kv_heads, norms)
    ops = _fused(qkv)
    if ops is not None and ragged and norms is None:
        rows = qkv.shape[0]
        return ops.rotate_qkv(qkv.contiguous(), cos.reshape(rows, dh), signed_sin.reshape(rows, dh),
                              num_heads, num_kv_heads)
    v = qkv[..., (num_heads + num_kv_heads) * dh:].unflatten(-1, (num_kv_heads, dh))
    if norms is not None:
        q_weight, k_weight, eps = norms
        q = rms_norm(qkv[..., :num_heads * dh].unflatten(-1, (num_heads, dh)), q_weight, eps)
        k = rms_norm(qkv[..., num_heads * dh:(num_heads + num_kv_heads) * dh].unflatten(-1, (num_kv_heads, dh)),
                     k_weight, eps)
        return apply_rotary(q, cos, signed_sin), apply_rotary(k, cos, signed_sin), v
    qk = apply_rotary(qkv[..., :(num_heads + num_kv_heads) * dh].unflatten(-1, (-1, dh)), cos, signed_sin)
    return qk[..., :num_heads, :], qk[..., num_heads:, :], v


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, Dh] rotated with `Rotary.cos_sin`'s cos and signed sine (eager)."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return x * cos + swapped * signed_sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up [..., I]."""
    gpu = _gpu(gate_up)
    if gpu is not None:
        return gpu.silu_mul(gate_up)
    ops = _fused(gate_up)
    if ops is None:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ops.silu_mul(_rows(gate_up)).view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
             ) -> bool:
    """k, v [T, Hkv, Dh] into one layer of a head-major cache [Hkv, slots, Dh] at `slots`,
    non-finite values as 0, in one call. False, having written nothing, where the kernel
    does not serve: the caller writes them eagerly (`PagedKVCache.write`)."""
    ops = _fused(k)
    if ops is None or not k_cache.is_contiguous():
        return False
    ops.write_kv(k_cache, v_cache, slots, k.contiguous(), v.contiguous())
    return True


def write_kv_block_major(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor) -> bool:
    """`write_kv` for one layer of a block-major cache [blocks, block_size, Hkv, Dh], by the
    Triton kernel on CUDA; False, having written nothing, elsewhere."""
    gpu = _gpu(k)
    if gpu is None or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        return False
    gpu.write_kv(k_cache, v_cache, slots, k, v)
    return True


def attends_decode_rows(q: torch.Tensor) -> bool:
    """Whether `decode_attention` serves these query rows [T, Hq, Dh] (see
    `decode_kernel_serves`); else the CPU flash kernel does."""
    return _fused(q) is not None and decode_kernel_serves(q.shape[-1], q.dtype)


# What one `decode_attention` call may hold in per-chunk partial results (a row of Dh floats
# and its softmax state for each query row, KV head's chunk of 256 positions, ~(Dh + 16) x 4
# bytes): SmolLM2's 512-token prefill chunk at 8K positions holds 47 MB.
PREFILL_PARTIALS_BYTES = 64 << 20


def attends_prefill_rows(q: torch.Tensor, ctx_len: int) -> bool:
    """Whether `decode_attention` also attends a prefill chunk q [T, Hq, Dh] whose last row is
    at position ctx_len - 1: where it serves the rows, and while its partial results stay
    under PREFILL_PARTIALS_BYTES; else the CPU flash kernel does (which took a bf16 SmolLM2
    prefill of 4K tokens 8.4 s, ours 6.3: scripts/step_bench.py)."""
    rows, heads, head_dim = q.shape
    partials = heads * rows * -(-ctx_len // 256) * (head_dim + 16) * 4
    return partials <= PREFILL_PARTIALS_BYTES and attends_decode_rows(q)


def decode_kernel_serves(head_dim: int, dtype: torch.dtype) -> bool:
    """Whether CPU decode and verify rows of this head dim and cache dtype go through our
    kernel: a head dim of 64 or 128 on a CPU with AVX-512 (float32) or AVX-512 BF16 (bf16).
    Its rows have the same bits whatever torch's thread count; the CPU flash kernel's
    float32 verify rows do not (tests/runtime/test_default_model.py)."""
    return head_dim in (64, 128) and dtype in kernel_dtypes()


@functools.cache
def kernel_dtypes() -> frozenset[torch.dtype]:
    """The dtypes the build's AVX-512 kernels (`decode_attention`, `row_linear`) compute, none
    without the kernels (asked once, not in every layer)."""
    ops = kernels()
    names = ops.kernel_dtypes() if ops is not None else []
    return frozenset(getattr(torch, name) for name in names)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     first: int) -> torch.Tensor:
    """q [T, Hq, Dh] at positions first .. first + T - 1, attending causally the keys and values
    of positions [0, first + T) at `slots` of one layer's head-major cache [Hkv, S, Dh]; each row
    computed as it would be alone (csrc/decode_attention.cpp). Only where `attends_decode_rows`."""
    ops = loaded_kernels()
    return ops.decode_attention(q.contiguous(), k_cache, v_cache, slots, first)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   chains: list[tuple[int, int, int, torch.Tensor]], shared: int) -> torch.Tensor:
    """The chains of one tree of candidates in one call: chain (start, len, first, slots) is
    rows [start, start + len) of q, attended as `decode_attention(q[start:start + len],
    k_cache, v_cache, slots, first)` would, bit for bit; the chains' slots agree on the
    tree's context, positions [0, shared), whose keys are read once for every chain."""
    ops = loaded_kernels()
    return ops.tree_attention(q.contiguous(), k_cache, v_cache, chains, shared)


def greedy_head(u: torch.Tensor, state: torch.Tensor, token: torch.Tensor, embedding: torch.Tensor,
                state_packed: torch.Tensor, state_bias: torch.Tensor | None, hidden_packed: torch.Tensor,
                hidden_bias: torch.Tensor | None, out_packed: torch.Tensor, out_features: int, out_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's sequential head, K greedy steps in one call, bit for bit its eager loop
    (csrc/draft_head.cpp; `DLiteSequentialHead.greedy_block`): u [N, K, D] float32 -> (tokens
    [N, K], runners-up [N, K]). The linears packed by `pack_row_linear`. Only where `serves(u)`."""
    ops = loaded_kernels()
    return ops.greedy_head(u, state, token, embedding, state_packed, state_bias, hidden_packed, hidden_bias,
                           out_packed, out_features, out_ids)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) (the first of equal maxima; a row's first NaN), by our
    kernel where it serves float32 CPU logits: ~30x faster than torch's on 49,152 logits. An
    argmax has no gradient, so unlike the other kernels it serves with gradients on too
    (verification runs outside the forward's inference mode)."""
    ops = kernels() if logits.device.type == "cpu" else None
    if ops is None or logits.dtype != torch.float32 or logits.shape[-1] == 0 or logits.numel() == 0:
        return logits.argmax(dim=-1)
    return ops.argmax_rows(_rows(logits)).view(logits.shape[:-1])


def serves(x: torch.Tensor) -> bool:
    """Whether the compiled kernels take this inference call's tensor (on the CPU, built, no gradients)."""
    return _fused(x) is not None


ROW_LINEAR_PANEL = 64  # output columns per packed panel (csrc/row_linear.cpp)


def row_linear_serves(weight: torch.Tensor) -> bool:
    """Whether `row_linear` computes a linear of this weight [N, K]: on a CPU with AVX-512
    (float32) or AVX-512 BF16 (bf16, K even)."""
    if weight.device.type != "cpu" or weight.dtype not in kernel_dtypes():
        return False
    return weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0


def pack_row_linear(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> `row_linear`'s panels of 64 output columns, each one sequential
    stream: [panels, K, 64] in float32, [panels, K / 2, 64, 2] (pairs along K) in bf16;
    zero columns pad N up to whole panels."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, (-n) % ROW_LINEAR_PANEL))
    panels = padded.view(-1, ROW_LINEAR_PANEL, k)
    if weight.dtype == torch.bfloat16:
        return panels.view(-1, ROW_LINEAR_PANEL, k // 2, 2).transpose(1, 2).contiguous()
    return panels.transpose(1, 2).contiguous()


def row_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) with W packed by `pack_row_linear`: each row's bits the same
    in a call of any row count (csrc/row_linear.cpp). Only where `row_linear_serves`."""
    ops = loaded_kernels()
    return ops.row_linear(x.contiguous(), packed, bias, out_features)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as contiguous [rows, last dim] (a view when it already is contiguous)."""
    return x.reshape(-1, x.shape[-1]).contiguous()

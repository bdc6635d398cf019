"""Inference-only linears: weights fixed at load time, packed for oneDNN on CPU.

On CPU, a bf16 `F.linear` lays the weight out for the matrix unit (AMX / AVX-512 bf16) on
every call, and a float32 one (MKL) grows with the rows. Packed once at load, a linear
costs about one weight read for anything from 1 to ~16 rows (float32 on an EPYC, 576 x
1536: 1 row 43 us packed / 49 us plain, 8 rows 61 / 185 us). That is what makes verifying
K + 1 drafted tokens nearly as cheap as decoding one token on this kind of machine.

Speculative decoding is exact only if a verify step computes each row exactly as decoding
that token alone would. A linear call must then give a row the same bits whatever the
call's row count. Kernels differ: on an AMX Xeon a packed bf16 linear does for 1-32 rows;
on an AMD EPYC (AVX-512 bf16) a one-row call takes another kernel for a 1536-wide input
and rounds some rows differently, while every call of 2-2048 rows agrees for SmolLM2's
shapes (unpacked float32 needs 16 rows there, packed float32 2). So each linear's shape is
measured once: calls with fewer rows than agree are padded up (`fewest_exact_rows`), and
where longer calls than EXACT_ROWS (a step that carries a prefill chunk, or many requests'
verify rows) disagree with EXACT_ROWS-row calls, they are made in pieces of EXACT_ROWS
rows (`large_calls_agree`). Both are measured at the thread count of the first load.
tests/runtime/test_frozen_linear.py checks this.

Where our own kernel serves (a CPU with AVX-512 for float32, AVX-512 BF16 for bf16; the
fused kernels built), none of that is needed: `RowLinear` computes each row in a fixed
order whatever the call (csrc/row_linear.cpp), and reads the weights faster for a handful of
rows (a bf16 SmolLM2 decode step on the EPYC: 21.0 ms through oneDNN, 10.8 through ours, 8.4
with the layer loop; scripts/step_bench.py, docs/bench/cpu-step.md). The probed oneDNN path stays for other
CPUs and half precision.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dlite_ray.runtime import fused_ops

# oneDNN picks its kernel from this row count hint; decode and verify steps are small.
PACKING_ROW_HINT = 8
# Every row of a call of at most this many rows gets the bits a call of this many rows gives
# it; longer calls are split into pieces of this size unless measured to agree.
EXACT_ROWS = 32
# The longer calls measured against EXACT_ROWS-row ones (up to the scheduler's default step).
LARGE_CALL_ROWS = (33, 100, 1024)


def can_pack(weight: torch.Tensor) -> bool:
    # oneDNN packs bf16 weights only on CPUs with AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; on an
    # AVX2-only CPU (seen: an AMD EPYC without AVX-512) the reorder raises instead of falling back.
    return (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and (weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class FrozenLinear:
    """y = x W^T + b with W fixed; a plain callable, not a module (nothing here trains).
    Calls of fewer than `min_rows` rows are padded, and with `split_large`, calls of more
    than EXACT_ROWS rows are made in pieces of EXACT_ROWS (see the module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = 1,
                 split_large: bool = False):
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]
        self.min_rows = min_rows
        self.max_rows = EXACT_ROWS if split_large else math.inf

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.min_rows <= x.shape[0] <= self.max_rows:
            return self._linear(x)  # the target's ragged rows, as they are
        flat = x.reshape(-1, x.shape[-1])
        if len(flat) > self.max_rows:
            out = torch.cat([self._padded(flat[i:i + EXACT_ROWS]) for i in range(0, len(flat), EXACT_ROWS)])
        else:
            out = self._padded(flat)
        return out.view(*x.shape[:-1], self.out_features)

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """A call of at most EXACT_ROWS rows, padded up to min_rows."""
        rows = len(flat)
        if rows >= self.min_rows:
            return self._linear(flat)
        return self._linear(F.pad(flat, (0, 0, 0, self.min_rows - rows)))[:rows]

    def _linear(self, flat: torch.Tensor) -> torch.Tensor:
        return F.linear(flat, self.weight, self.bias)


class PackedLinear(FrozenLinear):
    """A FrozenLinear whose weight oneDNN re-laid out once (CPU, see can_pack).

    The packed copy sits next to the parameter (kept for state_dict and fingerprints), so
    packed weights take twice their memory (270 MB more for SmolLM2-135M in bf16, 540 MB in
    float32). It is a snapshot: changing the weights or moving the model after freezing is
    not supported."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int = 1,
                 split_large: bool = False):
        super().__init__(weight, bias, min_rows, split_large)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, PACKING_ROW_HINT)

    def _linear(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")


class RowLinear(FrozenLinear):
    """A FrozenLinear computed by our CPU kernel (`fused_ops.row_linear`): a row's bits do not
    depend on the call, by construction, so nothing is padded, split or probed. Its weight is
    packed once into panels beside the parameter, as PackedLinear's is (the same memory)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(weight, bias)
        self.packed = fused_ops.pack_row_linear(self.weight)

    def _linear(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.requires_grad:  # the kernel has no backward (training a module through a frozen linear)
            return F.linear(flat, self.weight, self.bias)
        return fused_ops.row_linear(flat, self.packed, self.bias, self.out_features)


def freeze_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> FrozenLinear:
    if fused_ops.row_linear_serves(weight):
        return RowLinear(weight, bias)
    if weight.is_cuda:
        prefer_cublaslt()
    return probed_linear(PackedLinear if can_pack(weight) else FrozenLinear, weight, bias)


def probed_linear(kind: type[FrozenLinear], weight: torch.Tensor, bias: torch.Tensor | None = None) -> FrozenLinear:
    """A linear of a kernel that is not row-exact by construction, padded and split as the
    probes of its shape measured it needs (`fewest_exact_rows`, `large_calls_agree`)."""
    out_features, in_features = weight.shape
    probe_key = (kind, out_features, in_features, bias is not None, weight.dtype, weight.device)
    # type[X] is hashable, but mypy does not see it (python/mypy#11469), so functools.cache's key check fails
    return kind(weight, bias, fewest_exact_rows(*probe_key),  # type: ignore[arg-type]
                split_large=not large_calls_agree(*probe_key))  # type: ignore[arg-type]


@functools.cache
def prefer_cublaslt() -> None:
    """GEMMs through cuBLASLt, process-wide, before any probe. With cuBLAS's defaults on an
    H200, calls of 33-1024 rows of Qwen3-8B's o_proj and down_proj round some rows unlike
    32-row calls (a split-K chosen by row count), so every prefill ran as 32-row GEMMs, each
    reading the weights again; through cuBLASLt they agree, at the same speed (`dlite-ray
    gpu-check`, section gemm_settings). The probes below still decide each shape."""
    torch.backends.cuda.preferred_blas_library("cublaslt")


@functools.cache
def fewest_exact_rows(kind: type[FrozenLinear], out_features: int, in_features: int, has_bias: bool,
                      dtype: torch.dtype, device: torch.device) -> int:
    """The fewest rows a call of this linear's kind and shape must have for each of its rows
    to come out with the same bits as in an EXACT_ROWS-row call (random weights and inputs:
    every row count, every row alone; once per process and shape). A rounding difference
    shows only for some rows: on the EPYC about one row in 25 for one-row calls, so 128 rows
    are tried."""
    linear, randn = _probe(kind, out_features, in_features, has_bias, dtype, device, seed=0)
    xs = randn(4, EXACT_ROWS, in_features)
    fulls = [linear(x) for x in xs]
    for min_rows in (1, 2, 4, 8, 16):
        linear.min_rows = min_rows
        if all(_rows_agree(linear, x, full) for x, full in zip(xs, fulls)):
            return min_rows
    return EXACT_ROWS


@functools.cache
def large_calls_agree(kind: type[FrozenLinear], out_features: int, in_features: int, has_bias: bool,
                      dtype: torch.dtype, device: torch.device) -> bool:
    """Whether calls of LARGE_CALL_ROWS rows give every row the bits EXACT_ROWS-row calls
    give it (random weights and inputs; once per process and shape). On the EPYC, SmolLM2's
    linears agree up to 2048 rows in bf16 and float32, so nothing is split there."""
    return _calls_agree(kind, out_features, in_features, has_bias, dtype, device, LARGE_CALL_ROWS)


@functools.cache
def calls_agree(kind: type[FrozenLinear], out_features: int, in_features: int, has_bias: bool,
                dtype: torch.dtype, device: torch.device, row_counts: tuple[int, ...]) -> bool:
    """`large_calls_agree` for calls of `row_counts` rows (a graph runner's bucket sizes)."""
    return _calls_agree(kind, out_features, in_features, has_bias, dtype, device, row_counts)


def _calls_agree(kind: type[FrozenLinear], out_features: int, in_features: int, has_bias: bool,
                 dtype: torch.dtype, device: torch.device, row_counts: tuple[int, ...]) -> bool:
    linear, randn = _probe(kind, out_features, in_features, has_bias, dtype, device, seed=1)
    x = randn(max(row_counts), in_features)
    pieces = torch.cat([linear(x[i:i + EXACT_ROWS]) for i in range(0, len(x), EXACT_ROWS)])
    return all(torch.equal(linear(x[:rows]), pieces[:rows]) for rows in row_counts)


def cover_row_counts(module: nn.Module, row_counts: tuple[int, ...]) -> int:
    """Extend the probes of every probed linear in `module` (frozen) to calls of
    `row_counts` rows, each over EXACT_ROWS: a CUDA graph fixes a step's row count to its
    bucket's, which LARGE_CALL_ROWS may not include. A linear whose calls of one of them
    round a row unlike EXACT_ROWS-row calls is split into EXACT_ROWS-row calls from then
    on. -> how many linears were split."""
    if not row_counts:
        return 0
    split = 0
    for linear in frozen_linears(module):
        if type(linear) is RowLinear or linear.max_rows <= EXACT_ROWS:
            continue  # row-exact by construction, or already split
        key = (type(linear), linear.out_features, linear.weight.shape[1], linear.bias is not None,
               linear.weight.dtype, linear.weight.device)
        if not calls_agree(*key, tuple(row_counts)):  # type: ignore[arg-type]  # type[X] is hashable (as above)
            linear.max_rows = EXACT_ROWS
            split += 1
    return split


def frozen_linears(module: nn.Module) -> list[FrozenLinear]:
    """Every FrozenLinear in a frozen module: the fused ones its submodules hold (q/k/v,
    gate/up) and those standing in for an nn.Linear's forward."""
    found: dict[int, FrozenLinear] = {}
    for sub in module.modules():
        candidates = [getattr(sub, "forward", None)] if isinstance(sub, nn.Linear) else list(vars(sub).values())
        for value in candidates:
            if isinstance(value, FrozenLinear):
                found[id(value)] = value
    return list(found.values())


def _probe(kind: type[FrozenLinear], out_features: int, in_features: int, has_bias: bool, dtype: torch.dtype,
           device: torch.device, seed: int) -> tuple[FrozenLinear, Callable[..., torch.Tensor]]:
    """A linear of this kind and shape with random weights, and a seeded source of inputs."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    return kind(randn(out_features, in_features), randn(out_features) if has_bias else None), randn


def _rows_agree(linear: FrozenLinear, x: torch.Tensor, full: torch.Tensor) -> bool:
    """Every shorter call (the first rows, and each row alone) gives its rows as `full` does."""
    return (all(torch.equal(linear(x[:rows]), full[:rows]) for rows in range(1, EXACT_ROWS))
            and all(torch.equal(linear(x[i:i + 1]), full[i:i + 1]) for i in range(1, EXACT_ROWS)))


def freeze_linears(module: nn.Module) -> None:
    """Inference only: every nn.Linear inside `module` computes through a FrozenLinear
    (packed where that pays); the parameters stay where they are, for state_dict."""
    for linear in module.modules():
        if isinstance(linear, nn.Linear):
            # An instance attribute shadowing the method, on purpose (nn.Module.__call__ calls self.forward)
            linear.forward = freeze_linear(linear.weight, linear.bias)  # type: ignore[method-assign,assignment]

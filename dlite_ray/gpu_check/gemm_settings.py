"""Which BLAS settings keep a linear's rows independent of the call's row count, and what
they cost: frozen_linear.py pads and splits calls where rows are not. On an H200, with
cuBLAS's defaults, Qwen3-8B's o_proj and down_proj split every prefill into 32-row GEMMs;
through cuBLASLt they need not (what `frozen_linear.prefer_cublaslt` now sets). Measured,
not assumed: each setting's probe result and its call times."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from dlite_ray.gpu_check.timing import timed_ms
from dlite_ray.runtime.frozen_linear import FrozenLinear, fewest_exact_rows, large_calls_agree


@contextlib.contextmanager
def _setting(name: str) -> Iterator[None]:
    matmul = torch.backends.cuda.matmul
    saved = (torch.backends.cuda.preferred_blas_library(), matmul.allow_bf16_reduced_precision_reduction)
    try:
        torch.backends.cuda.preferred_blas_library("cublas")  # the default, whatever the runtime set
        if name in ("cublaslt", "cublaslt_fp32_reduction"):
            torch.backends.cuda.preferred_blas_library("cublaslt")
        if name in ("fp32_reduction", "cublaslt_fp32_reduction"):
            matmul.allow_bf16_reduced_precision_reduction = False
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(saved[0])
        matmul.allow_bf16_reduced_precision_reduction = saved[1]


SETTINGS = ("default", "cublaslt", "fp32_reduction", "cublaslt_fp32_reduction")


def compare_settings(shapes: dict[str, tuple[int, int]], dtype: torch.dtype, device: torch.device) -> dict:
    """shapes: name -> (out_features, in_features)."""
    report = {}
    for setting in SETTINGS if device.type == "cuda" else ("default",):  # the others name CUDA libraries
        with _setting(setting):
            report[setting] = {name: _probe(out_f, in_f, dtype, device) for name, (out_f, in_f) in shapes.items()}
    return report


def _probe(out_features: int, in_features: int, dtype: torch.dtype, device: torch.device) -> dict:
    key = (FrozenLinear, out_features, in_features, False, dtype, device)
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device) * 0.02
    linear = FrozenLinear(weight)
    def run(rows: int) -> torch.Tensor:
        return linear(torch.randn(rows, in_features, dtype=dtype, device=device))

    times = {f"rows{r}_ms": timed_ms(functools.partial(run, r), device) for r in (1, 8, 64, 512)}
    return {"min_rows": fewest_exact_rows.__wrapped__(*key), "large_calls_agree": large_calls_agree.__wrapped__(*key),
            **times}

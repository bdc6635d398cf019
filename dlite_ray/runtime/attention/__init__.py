"""Attention over the paged KV cache: metadata built in one place, and two backends.

- metadata.py: `AttentionMetadata`, built once per forward by `build_attention_metadata`
  and passed to every layer; the bounds of the position-exact way (decode / verify rows).
- sdpa.py: `SdpaBackend`, PyTorch scaled_dot_product_attention on CPU and accelerators.
- cpu_exactness.py: how the CPU kernel is called so that a row's bits do not depend on
  the step it is in (measured once per process and shape).
- flash.py: `FlashAttnBackend`, CUDA, paged `flash_attn_with_kvcache` (extra `gpu`).
- row_plan.py, device_rows.py: the rows the paged kernels (flash-attn's, triton's) read, built
  once per forward on the host, or on the device from a CUDA graph's static buffers.
- paged_triton.py, triton_backend.py: `TritonPagedBackend`, CUDA, a paged decode / verify
  kernel of our own in Triton (extra `triton`); on CPU only under TRITON_INTERPRET=1 (tests).

`make_backend("auto", ...)` picks flash-attn on CUDA in fp16 / bf16 when the package is
installed, else the triton backend on CUDA when Triton is, else SDPA.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from dlite_ray.runtime.attention.flash import (
    FLASH_ATTN_DTYPES,
    FLASH_ATTN_PAGE_MULTIPLE,
    FlashAttnBackend,
    flash_attn_available,
)
from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_TOKENS, WINDOW, build_attention_metadata
from dlite_ray.runtime.attention.sdpa import SdpaBackend

if TYPE_CHECKING:
    from dlite_ray.runtime.attention.triton_backend import TritonPagedBackend

# What the engine (and its tests) import from here; the rest: from the module that holds it.
__all__ = ["FLASH_ATTN_PAGE_MULTIPLE", "MAX_POSITIONED_TOKENS", "WINDOW", "build_attention_metadata", "make_backend"]


def make_backend(name: str, device: torch.device,
                 dtype: torch.dtype) -> SdpaBackend | FlashAttnBackend | TritonPagedBackend:
    """`auto`: flash-attn on CUDA in fp16 / bf16 when it is installed, else the triton
    backend on CUDA when Triton is, else SDPA (the CPU keeps its own kernels)."""
    if name == "auto":
        if device.type == "cuda" and dtype in FLASH_ATTN_DTYPES and flash_attn_available():
            name = "flash_attn"
        else:
            name = "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if name == "sdpa":
        return SdpaBackend()
    if name == "triton":
        if not triton_available():
            raise ValueError("attention_backend='triton' needs the triton package (extra 'triton')")
        from dlite_ray.runtime.attention.paged_triton import interpreting  # optional dependency
        from dlite_ray.runtime.attention.triton_backend import TritonPagedBackend
        if device.type != "cuda" and not interpreting():
            raise ValueError("attention_backend='triton' runs on CUDA; elsewhere only under TRITON_INTERPRET=1 "
                             "(Triton's interpreter, for tests)")
        return TritonPagedBackend()
    if name == "flash_attn":
        if device.type != "cuda" or not flash_attn_available():
            raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package (extra 'gpu')")
        if dtype not in FLASH_ATTN_DTYPES:
            raise ValueError(f"attention_backend='flash_attn' runs in float16 or bfloat16, not {dtype}; "
                             "use attention_backend='sdpa' (or 'auto') for this dtype")
        return FlashAttnBackend()
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, sdpa, flash_attn or triton")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None

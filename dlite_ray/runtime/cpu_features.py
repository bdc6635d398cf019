"""What this CPU can do, read once from /proc/cpuinfo (nothing is known elsewhere)."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_bf16_math() -> bool:
    """AVX-512 BF16 or AMX: bf16 linears run on the matrix or dot-product units and our bf16
    attention kernel builds, so bf16 is the faster of the two exact modes here."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())

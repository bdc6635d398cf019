"""What a benchmark reports about the machine it ran on, and its memory bandwidth."""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch


def machine_info() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def memory_bandwidth_gbs(megabytes: int = 1024, repeats: int = 5) -> float:
    """Read bandwidth: summing a buffer much larger than the caches (median of repeats)."""
    x = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9

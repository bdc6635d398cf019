"""Engines timed side by side on the same requests: alternating order, a warm-up pass,
then per-request ratios (this machine is shared and noisy, so medians and quartiles)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from dlite_ray.engine.engine import DLiteEngine, GenerationResult


def paired_runs(engines: dict[str, DLiteEngine], requests: list[Any], repeats: int,
                generate: Callable[[DLiteEngine, Any], GenerationResult]):
    """(seconds per engine, one result per request from the first timed pass, per engine).

    Pass 0 warms up; later passes alternate which engine goes first on each request."""
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    results: dict[str, list[GenerationResult]] = {name: [] for name in engines}
    for rep in tqdm(range(repeats + 1), desc="passes (the first warms up)"):
        order = list(engines.items()) if rep % 2 else list(engines.items())[::-1]
        for req in requests:
            for name, engine in order:
                started = time.perf_counter()
                result = generate(engine, req)
                if rep:
                    seconds[name].append(time.perf_counter() - started)
                if rep == 1:
                    results[name].append(result)
    return seconds, results


def speedup_lines(seconds: dict[str, list[float]], fast: str, slow: str) -> list[str]:
    """Median request times, and slow/fast per request: median, quartiles, total."""
    lines = [f"{name}: median request {1000 * statistics.median(s):.1f} ms" for name, s in seconds.items()]
    ratios = [s / f for s, f in zip(seconds[slow], seconds[fast])]
    q = statistics.quantiles(ratios, n=4)
    lines.append(f"{slow} / {fast} per request: median {statistics.median(ratios):.2f}x, quartiles {q[0]:.2f}x-"
                 f"{q[2]:.2f}x; total {sum(seconds[slow]) / sum(seconds[fast]):.2f}x")
    return lines

"""Load that rises and falls: requests in flight ramp from 1 to a peak and back to 1.

A fixed level (`runner.measure_concurrency`) starts every request at once and measures the
batch while it drains; agents' traffic arrives and leaves over time, so every batch size
between 1 and the peak is crossed, up and down, and the speculation guard (`StepRates`) meets
each size afresh on the way up. Both engines must face the same load, so the schedule is set
by progress, not by the clock (a faster engine would otherwise face less load): `R` requests
are admitted in order, and while `a` of them have been admitted the engine may hold at most
`in_flight_cap(a)` at once, rising linearly from 1 to the peak over the first half and falling
back to 1 over the second. Throughput is the generated tokens over the whole run's wall time.
"""

from __future__ import annotations

import statistics
import time

from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.sequence import SamplingParams, Sequence

REQUESTS_PER_PEAK = 4  # R = 4 x the peak: each size is crossed by a few admissions up and down


def in_flight_cap(admitted: int, total: int, peak: int) -> int:
    """How many requests may be in flight once `admitted` of `total` have been admitted."""
    half = total / 2
    rising = admitted < half
    progress = admitted / half if rising else (admitted - half) / half
    cap = 1 + (peak - 1) * progress if rising else peak - (peak - 1) * progress
    return max(1, round(cap))


def run_ramp(engine: DLiteEngine, prompts: list[list[int]], peak: int, max_new_tokens: int) -> dict:
    """One pass of the ramp over `prompts` (cycled to REQUESTS_PER_PEAK x peak requests):
    generated tokens/s, the in-flight count of every step, and the replies in order."""
    total = REQUESTS_PER_PEAK * peak
    seqs: list[Sequence] = []
    in_flight: list[int] = []
    start = time.perf_counter()
    while len(seqs) < total or any(not s.is_finished for s in seqs):
        running = sum(not s.is_finished for s in seqs)
        while len(seqs) < total and running < in_flight_cap(len(seqs), total, peak):
            prompt = prompts[len(seqs) % len(prompts)]
            seqs.append(engine.add_request(list(prompt), SamplingParams(max_new_tokens=max_new_tokens)))
            running += 1
        in_flight.append(running)
        engine.step()
    wall = time.perf_counter() - start
    return {"tokens_per_second": sum(len(s.output_ids) for s in seqs) / wall, "steps": len(in_flight),
            "in_flight": in_flight, "replies": [list(s.output_ids) for s in seqs]}


def measure_ramp(engines: dict[str, DLiteEngine], prompts: list[list[int]], peak: int, max_new_tokens: int,
                 repeats: int) -> dict:
    """The ramp on each engine, engines alternating, medians over `repeats`; how many replies
    differ between the engines (greedy: none may); each engine's in-flight trajectory of
    the last repeat (steps differ: speculation takes fewer)."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for rep in range(repeats):
        order = list(engines.items()) if rep % 2 == 0 else list(reversed(engines.items()))
        for name, engine in order:
            runs[name].append(run_ramp(engine, prompts, peak, max_new_tokens))
    out: dict = {"peak": peak, "requests": REQUESTS_PER_PEAK * peak}
    for name, rs in runs.items():
        out[name] = {"tokens_per_second": statistics.median(r["tokens_per_second"] for r in rs),
                     "steps": statistics.median(r["steps"] for r in rs), "in_flight": rs[-1]["in_flight"]}
    out["dlite/ar"] = out["dlite"]["tokens_per_second"] / out["ar"]["tokens_per_second"]
    out["greedy_mismatches"] = sum(d != a for d, a in zip(runs["dlite"][-1]["replies"], runs["ar"][-1]["replies"]))
    print(f"ramp 1 -> {peak} -> 1: dlite {out['dlite']['tokens_per_second']:.1f} tok/s, "
          f"ar {out['ar']['tokens_per_second']:.1f} tok/s, ratio {out['dlite/ar']:.2f}x")
    return out

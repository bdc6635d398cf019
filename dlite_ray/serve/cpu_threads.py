"""How many threads torch runs a CPU worker's forward on.

Ray sets OMP_NUM_THREADS to an actor's logical `num_cpus`, and 1 when it is 0, which is how
a 2-core machine fits target, draft and ingress (`replica_num_cpus: 0`). torch then runs
the target's forward on one core: measured here, the served engine decoded at 58-66% of
the library engine's speed with the same model and prompts, its verify time 1.3-1.7x."""

from __future__ import annotations

import os

import torch


def use_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads to `requested`, or to every core this process may run
    on. Target and draft take turns within a round, so each may use them all."""
    n = requested or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n

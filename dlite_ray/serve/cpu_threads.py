"""How many threads torch runs a CPU worker's forward on.

Ray sets OMP_NUM_THREADS to an actor's logical `num_cpus`, and 1 when it is 0, which is how
a 2-core machine fits target, draft and ingress (`replica_num_cpus: 0`). So the served
target decoded on one core. Measured here (`dlite-ray bench-serve --workload tool-use
--limit 3 --max-new-tokens 64`, served tok/s as a share of the library engine's in the same
run): target and draft on 1 thread each 58% and 69%; both on 2 threads 38% (an OpenMP
thread that has just finished spins for a while, and the two processes take turns within
every round); the target on 2 threads and the draft on 1: 86% and 82%.
"""

from __future__ import annotations

import os

import torch


def use_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads to `requested`, or to every core this process may run on."""
    n = requested or len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    return n

"""How many threads torch runs a CPU worker's forward on.

Ray sets OMP_NUM_THREADS to an actor's logical `num_cpus`, and 1 when it is 0, which is how
a small machine fits target, draft and ingress (`replica_num_cpus: 0`): the target would
run on one core whatever the machine has. The workers set their own count instead:

- the target, by default, every core but one. An OpenMP team waits at every barrier for
  its slowest thread, so a team spanning every core stalls whenever the ingress, the proxy
  or the draft runs, and under load they always do. On this 2-core machine (one core for
  the target): `dlite-ray loadtest --clients 4 --duration-s 90` gave 11.7 tok/s (p99 18.6 s)
  with the target on 1 thread and 8.2 tok/s (p99 35.4 s) on 2. A single request at a time
  is faster on 2 (`dlite-ray bench-serve --workload tool-use --limit 3 --max-new-tokens 64`:
  82-86% of the library engine's speed, against 58-69% on 1), so `cpu_threads` is a setting;
- the draft, one thread: target and draft take turns within a round, and a draft on two
  threads left OpenMP threads spinning against the target's forward (38% in that bench).
"""

from __future__ import annotations

import os

import torch


def use_cpu_threads(requested: int | None) -> None:
    """Set torch's intra-op threads to `requested`, or to every core this process may run on
    but one (at least one)."""
    torch.set_num_threads(requested or max(1, len(os.sched_getaffinity(0)) - 1))

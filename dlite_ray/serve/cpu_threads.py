"""How many threads torch runs a CPU worker's forward on.

Ray sets OMP_NUM_THREADS to an actor's logical `num_cpus`, and 1 when it is 0, which is how
a small machine fits target, draft and ingress (`replica_num_cpus: 0`): the target would
run on one core whatever the machine has. The workers set their own count instead:

- the target, by default, follows its load: every core while at most one request runs,
  every core but one when more do. An OpenMP team waits at every barrier for its slowest
  thread, so a team spanning every core stalls whenever the ingress, the proxy or the draft
  runs, and under load they always do. On this 2-core machine:
  `dlite-ray loadtest --clients 4 --duration-s 90` gave 11.7 tok/s (p99 18.6 s) with the
  target on 1 thread and 8.2 tok/s (p99 35.4 s) on 2, while a single request at a time is
  faster on 2 (`dlite-ray bench-serve --workload tool-use --limit 3 --max-new-tokens 64`:
  82-86% of the library engine's speed, against 58-69% on 1): the target and the draft
  take turns within a round and the rest is idle. `cpu_threads` fixes the count instead;
- the draft, one thread: target and draft take turns within a round, and a draft on two
  threads left OpenMP threads spinning against the target's forward (38% in that bench).
"""

from __future__ import annotations

import os

import torch

from dlite_ray.runtime.fused_ops import decode_kernel_serves
from dlite_ray.runtime.target_model import TargetModel


def usable_cores() -> int:
    return len(os.sched_getaffinity(0))


def use_cpu_threads(requested: int | None) -> None:
    """Set torch's intra-op threads to `requested`, or to every core this process may run on
    but one (at least one)."""
    torch.set_num_threads(requested or max(1, usable_cores() - 1))


class LoadFollowingThreads:
    """Called by the engine loop before each step with the number of running requests:
    `solo` threads while at most one runs, `busy` threads when more do. torch's thread
    count is the process's, and only the engine thread runs forwards, so it is set there,
    and only when it changes (a new OpenMP team costs a few hundred microseconds)."""

    def __init__(self, solo: int | None = None, busy: int | None = None):
        cores = usable_cores()
        self.solo = solo or cores
        self.busy = busy or max(1, cores - 1)

    def __call__(self, running: int) -> None:
        want = self.solo if running <= 1 else self.busy
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)


def target_thread_policy(device: str, cpu_threads: int | None, target: TargetModel) -> LoadFollowingThreads | None:
    """The target's per-step thread policy: load-following on CPU unless `cpu_threads` fixes
    the count (set once, when the engine is built), or where a row's bits would change with
    the thread count (attention by the CPU flash kernel, not ours), which would make a reply
    at T = 0 depend on the server's load."""
    if device != "cpu" or cpu_threads is not None:
        return None
    if not decode_kernel_serves(target.cfg.head_dim, target.embed_tokens.weight.dtype):
        return None
    return LoadFollowingThreads()

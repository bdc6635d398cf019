"""DraftLink: the TargetWorker's DraftTransport to a DraftWorker actor, a PairLink (see
draft_process) whose launcher starts the actor in bundle 1 of the replica's placement group.

Connecting (spawn the actor, join the pair, warm the payload channel) happens on a
background thread, never in the replica's constructor or health check. Until the pair is
connected, and whenever a round fails (actor dead, deadline passed), `propose` raises
DraftUnavailable: the engine decodes plainly for that step (same greedy output), and the
link reconnects, to a fresh actor when the old one does not answer.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray
import torch
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dlite_ray.engine.draft_transport import DraftInfo
from dlite_ray.engine.engine_config import normalize_device
from dlite_ray.serve.draft_process import DEFAULT_MAX_JOIN_FAILURES, PairLink
from dlite_ray.serve.draft_worker import DraftWorker
from dlite_ray.serve.pair_channels import PayloadKind

ACTOR_START_TIMEOUT_S = 300.0  # loading the draft on a cold node
JOIN_TIMEOUT_S = 60.0


def draft_actor_options(device: str, gpu_share: float = 1) -> dict:
    """The DraftWorker's actor options: bundle 1 of the caller's placement group (GPU 1 of
    the pair, or the half of the target's GPU it shares), or anywhere outside one."""
    options: dict = {"num_cpus": 0}
    if device == "cuda":
        options["num_gpus"] = gpu_share
    pg = get_current_placement_group()
    if pg is not None and pg.bundle_count > 1:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=1)
    return options


class ActorLauncher:
    """DraftLauncher: one DraftWorker actor at a time."""

    def __init__(self, spec: tuple, gpu_share: float = 1):
        self._spec = spec  # DraftWorker's constructor arguments
        self._gpu_share = gpu_share
        self._actor: Any = None  # the DraftWorker's actor handle (ray's ActorHandle is untyped)

    def address(self, authkey: bytes) -> tuple[str, int]:
        if self._actor is None:
            options = draft_actor_options(self._spec[4], self._gpu_share)
            # @ray.remote makes DraftWorker an ActorClass; ray's stubs keep the class's own type
            self._actor = DraftWorker.options(**options).remote(*self._spec)  # type: ignore[attr-defined]
            ray.get(self._actor.ping.remote(), timeout=ACTOR_START_TIMEOUT_S)
        return tuple(ray.get(self._actor.listen.remote(authkey, JOIN_TIMEOUT_S), timeout=60))

    def kill(self) -> None:
        if self._actor is not None:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self._actor, no_restart=True)

    def restart(self) -> None:
        self.kill()
        self._actor = None

    close = restart


class DraftLink(PairLink):
    def __init__(self, info: DraftInfo, vocab_size: int, target_path: str, draft_path: str, num_target_layers: int,
                 dtype: str, device: str, timeout_s: float, cpu_threads: int, payload: PayloadKind = "dist",
                 max_join_failures: int = DEFAULT_MAX_JOIN_FAILURES):
        """payload "dist": a GPU pair has one GPU each (bundles 0 and 1), tensors go straight
        over NCCL; "host": the two share one GPU (half each) and stage tensors through host
        memory."""
        gpu_share = 0.5 if payload == "host" else 1  # as app.pair_gpu_share gives the bundles
        spec = (target_path, draft_path, num_target_layers, dtype, device, cpu_threads)
        super().__init__(info, vocab_size, ActorLauncher(spec, gpu_share),
                         device=torch.device(normalize_device(device)), payload=payload,
                         timeout_s=timeout_s, join_timeout_s=JOIN_TIMEOUT_S, max_join_failures=max_join_failures)

    def kill_actor(self) -> None:
        """Fault injection for tests and drills (TargetWorker.kill_draft)."""
        self.kill_draft()

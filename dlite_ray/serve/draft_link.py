"""DraftLink: the TargetWorker's DraftTransport to a DraftWorker actor.

Connecting (spawn the actor, exchange the address, join the process group) happens on a
background thread, never in the replica's constructor or health check. Until the pair is
connected, and whenever a round fails (actor dead, timeout), `propose` raises
DraftUnavailable: the engine decodes plainly for that step (same greedy output), and the
link restarts the actor and reconnects behind the scenes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import ray
import torch
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest, DraftUnavailable
from dlite_ray.runtime.draft_model import DraftProposal
from dlite_ray.serve.dist_transport import TARGET_RANK, DistributedDraftTransport, init_pair
from dlite_ray.serve.draft_worker import DraftWorker, free_address

log = logging.getLogger(__name__)


class DraftLink:
    def __init__(self, info: DraftInfo, vocab_size: int, target_path: str, draft_path: str, num_target_layers: int,
                 dtype: str, device: str, timeout_s: float, cpu_threads: int):
        self.info = info
        self._spec = (target_path, draft_path, num_target_layers, dtype, device, cpu_threads)
        self._vocab, self._timeout = vocab_size, timeout_s
        self._device = torch.device("cuda:0" if device == "cuda" else "cpu")
        self._backend = "nccl" if device == "cuda" else "gloo"
        self._transport: DistributedDraftTransport | None = None
        self._actor = None
        self._serving = None  # the actor's serve() call, pending for the actor's life
        self._lock = threading.Lock()
        self._connecting = False
        self.restarts = 0
        self.cpu_threads: int | None = None  # what the connected draft worker runs on
        self.connect_async()

    @property
    def connected(self) -> bool:
        return self._transport is not None and self._transport.healthy

    @property
    def comm_time(self) -> float:
        return self._transport.comm_time if self._transport else 0.0

    def propose(self, request: DraftRequest) -> DraftProposal:
        transport = self._transport
        if transport is None or not transport.healthy:
            raise DraftUnavailable("draft worker not connected (yet)")
        try:
            return transport.propose(request)
        except DraftUnavailable:
            self._reconnect_async()
            raise

    def kill_actor(self) -> None:
        """Fault injection for tests and drills."""
        if self._actor is not None:
            ray.kill(self._actor, no_restart=True)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if self._actor is not None:
            ray.kill(self._actor, no_restart=True)

    # -- connection management ---------------------------------------------------------------
    def connect_async(self) -> None:
        with self._lock:
            if self._connecting:
                return
            self._connecting = True
        threading.Thread(target=self._connect, name="draft-link", daemon=True).start()

    def _reconnect_async(self) -> None:
        log.warning("draft round failed: plain decoding while the draft worker restarts")
        self.restarts += 1
        self.connect_async()

    def _connect(self) -> None:
        try:
            self._teardown()
            self._actor = self._spawn()
            ray.get(self._actor.ping.remote(), timeout=300)
            self.cpu_threads = ray.get(self._actor.cpu_threads.remote(), timeout=60)
            address = free_address()
            self._serving = self._actor.serve.remote(address, self._backend, self._timeout)
            init_pair(address, TARGET_RANK, self._backend, self._timeout)  # blocks until rank 1 joins
            self._transport = DistributedDraftTransport(self.info, self._vocab, self._device)
            log.info("draft worker connected over %s at %s", self._backend, address)
        except Exception:  # keep serving plainly; try again later
            log.exception("could not connect the draft worker; retrying in 5 s")
            time.sleep(5)
            with self._lock:
                self._connecting = False
            self.connect_async()
            return
        with self._lock:
            self._connecting = False

    def _spawn(self):
        pg = get_current_placement_group()
        options = {"num_cpus": 0}
        if self._spec[4] == "cuda":
            options["num_gpus"] = 1
        if pg is not None and pg.bundle_count > 1:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=1)
        return DraftWorker.options(**options).remote(*self._spec)

    def _teardown(self) -> None:
        old, self._transport = self._transport, None
        if old is not None:
            old.healthy = False
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        if self._actor is not None:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(self._actor, no_restart=True)
            self._actor = None

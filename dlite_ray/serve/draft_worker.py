"""DraftWorker: the draft model in its own Ray actor (bundle 1 of its TargetWorker's
placement group), answering rounds through a DraftServer (dist_transport). It holds the
target's token embedding and the draft weights, nothing per request."""

from __future__ import annotations

import logging

import ray
import torch

from dlite_ray.engine.engine_config import normalize_device, torch_dtype
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import checkpoint_fingerprint, load_embedding
from dlite_ray.serve.cpu_threads import use_cpu_threads
from dlite_ray.serve.dist_transport import DraftServer

log = logging.getLogger(__name__)


@ray.remote
class DraftWorker:
    def __init__(self, target_path: str, draft_path: str, num_target_layers: int, dtype: str, device: str,
                 cpu_threads: int):
        self.device = torch.device(normalize_device(device))
        if device == "cpu":
            use_cpu_threads(cpu_threads)
        embedding = load_embedding(target_path, torch_dtype(dtype))
        self.draft = DLiteDraftModel.load(draft_path, embedding, num_target_layers, torch_dtype(dtype), self.device)
        self.draft.embed_tokens.to(self.device)
        self.fingerprint = checkpoint_fingerprint(draft_path)
        self._server: DraftServer | None = None

    def ping(self) -> bool:
        return True

    def cpu_threads(self) -> int:
        return torch.get_num_threads()

    def listen(self, authkey: bytes, join_timeout_s: float) -> tuple[str, int]:
        """Where the target connects: this node's IP and a port the draft serves rounds on,
        one target connection at a time, for the actor's life (the first call starts it)."""
        if self._server is None:
            self._server = DraftServer(self.draft, self.device, authkey, self.fingerprint,
                                       host=ray.util.get_node_ip_address(), join_timeout_s=join_timeout_s)
            self._server.start()
            log.info("draft worker listening on %s:%d", *self._server.address)
        return self._server.address

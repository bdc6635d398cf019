"""DraftWorker: the draft model in its own Ray actor (bundle 1 of its TargetWorker's
placement group), answering rounds over torch.distributed. It holds the target's token
embedding and the draft weights, nothing per request."""

from __future__ import annotations

import logging
import socket

import ray
import torch

from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import load_embedding
from dlite_ray.serve.cpu_threads import use_cpu_threads
from dlite_ray.serve.dist_transport import DRAFT_RANK, init_pair, serve_draft

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@ray.remote(max_concurrency=2)  # serve() runs for the actor's life; ping() must still answer
class DraftWorker:
    def __init__(self, target_path: str, draft_path: str, num_target_layers: int, dtype: str, device: str,
                 cpu_threads: int):
        self.device = torch.device("cuda:0" if device == "cuda" else "cpu")  # each actor sees its GPU as cuda:0
        if device == "cpu":
            use_cpu_threads(cpu_threads)
        embedding = load_embedding(target_path, DTYPES[dtype])
        self.draft = DLiteDraftModel.load(draft_path, embedding, num_target_layers, DTYPES[dtype], self.device)
        self.draft.embed_tokens.to(self.device)

    def ping(self) -> bool:
        return True

    def cpu_threads(self) -> int:
        return torch.get_num_threads()

    def serve(self, address: str, backend: str, timeout_s: float) -> None:
        """Join the pair as rank 1 and answer rounds until told to stop."""
        init_pair(address, DRAFT_RANK, backend, timeout_s)
        log.info("draft worker joined %s (%s)", address, backend)
        serve_draft(self.draft, self.device)


def free_address() -> str:
    """tcp://<this node's IP>:<free port> for rank 0 to listen on."""
    ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"tcp://{ip}:{s.getsockname()[1]}"

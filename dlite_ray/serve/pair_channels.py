"""The two channels between a target and its draft process (Ray-free).

- Control: a TCP socket (multiprocessing.connection framing, HMAC challenge on both sides
  before anything is unpickled) carrying small typed messages. It may sit idle forever:
  nothing waits on it but the draft's `recv` of the next message, which has no deadline.
- Payload: a round's tensors (features to the draft; tokens, prob ids, probs back), posted
  only while both sides are inside a round, so no NCCL/gloo operation is ever pending
  while the pair is idle (their timeouts would kill it). `DistPayload` runs them over a
  torch.distributed process group of two (NCCL on CUDA, gloo on CPU); `HostPayload` stages
  them through host memory on the control socket (one GPU shared by both processes, where
  NCCL refuses two ranks, or CPU without a process group).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Literal, Protocol

import torch
import torch.distributed as dist

from dlite_ray.engine.draft_transport import DraftInfo

PayloadKind = Literal["dist", "host"]
TensorSpec = tuple[tuple[int, ...], torch.dtype]
NONCE_BYTES = 32
TARGET_RANK, DRAFT_RANK = 0, 1


# -- control messages (pickled over the authenticated socket; lists, never tensors: torch's
#    pickler would share tensors through shared memory, which an unrelated process cannot open)
@dataclass(slots=True)
class Join:
    """Target -> draft, first message of a connection: how round payloads travel."""

    payload: PayloadKind
    backend: str | None  # "nccl" | "gloo" for a "dist" payload
    store_host: str
    store_port: int
    group_timeout_s: float  # bounds each payload operation on the draft side


@dataclass(slots=True)
class Joined:
    """Draft -> target: who answers."""

    info: DraftInfo
    vocab_size: int  # rows of the target embedding the draft holds
    cpu_threads: int


@dataclass(slots=True)
class Round:
    """Target -> draft, per round: the header and the small per-row inputs. Features
    [N, S, D] bf16 follow on the payload channel when `feature_shape` is set."""

    num_tokens: int  # K
    token_groups: list[list[int]]  # [N, G]
    feature_shape: tuple[int, ...] | None  # (N, S, D)
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    draft_greedy: list[bool]
    seeds: list[int]
    sampled: bool  # any row drafts by sampling: probs come back
    vocab_size: int  # the target's


@dataclass(slots=True)
class RoundDone:
    """Draft -> target: the payload follows: tokens int64 [N, K]; if the round sampled,
    prob ids int64 [W] when W < vocab, then probs fp32 [N, K, W]."""

    width: int  # W (0 when nothing sampled)


@dataclass(slots=True)
class Ping:
    pass


@dataclass(slots=True)
class Pong:
    pass


@dataclass(slots=True)
class Shutdown:
    pass


# -- control socket ----------------------------------------------------------------------------
def open_control(sock: socket.socket, send_timeout_s: float) -> Connection:
    """Wrap a connected socket. A send that cannot drain within `send_timeout_s` (a peer
    alive but not reading) fails instead of blocking a round forever. No Nagle: a round is
    a few small messages each way, and waiting to coalesce them cost ~40 ms per round."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sec = int(send_timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", sec, int((send_timeout_s - sec) * 1e6)))
    return Connection(sock.detach())


def authenticate(conn: Connection, authkey: bytes, deadline: float) -> None:
    """Mutual HMAC challenge (both sides run the same steps); raises on a wrong key or a
    silent peer. Nothing is unpickled before it passes."""
    nonce = os.urandom(NONCE_BYTES)
    conn.send_bytes(nonce)
    theirs = _recv_bytes(conn, deadline, NONCE_BYTES)
    conn.send_bytes(hmac.new(authkey, theirs, hashlib.sha256).digest())
    answer = _recv_bytes(conn, deadline, 64)
    if not hmac.compare_digest(answer, hmac.new(authkey, nonce, hashlib.sha256).digest()):
        raise ConnectionError("the peer of the draft pair failed authentication")


def recv_message(conn: Connection, deadline: float | None = None):
    """The next control message; with a deadline, TimeoutError when none came by then."""
    if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError("no control message from the peer in time")
    return conn.recv()


def _recv_bytes(conn: Connection, deadline: float, maxlength: int) -> bytes:
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError("the peer did not answer the challenge in time")
    return conn.recv_bytes(maxlength)


# -- payload channels --------------------------------------------------------------------------
class Payload(Protocol):
    """A round's tensors between the pair; the same round code runs over either kind."""

    def send(self, tensors: list[torch.Tensor]) -> None:
        """Post sends (may return before the peer has them)."""

    def recv(self, specs: list[TensorSpec], deadline: float) -> list[torch.Tensor]:
        """Tensors of these shapes and dtypes, in order, on this side's device."""

    def wait_sent(self, deadline: float) -> None:
        """Block until posted sends are delivered."""

    def close(self) -> None:
        """Abort anything still posted and release the channel."""


class HostPayload:
    """Tensors as raw bytes on the control socket (no pickling), staged through host memory."""

    def __init__(self, conn: Connection, device: torch.device):
        self.conn, self.device = conn, device

    def send(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            # the array's memoryview: numpy types its buffer protocol only for Python >= 3.12
            self.conn.send_bytes(_as_bytes(t.detach().to("cpu").contiguous()).numpy().data)

    def recv(self, specs: list[TensorSpec], deadline: float) -> list[torch.Tensor]:
        out = []
        for shape, dtype in specs:
            t = torch.empty(shape, dtype=dtype)
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError("the round's payload did not arrive in time")
            buf = _as_bytes(t).numpy()
            if self.conn.recv_bytes_into(buf) != buf.nbytes:
                raise ConnectionError(f"payload of the wrong size for {tuple(shape)} {dtype}")
            out.append(t.to(self.device))
        return out

    def wait_sent(self, deadline: float) -> None:
        pass  # send_bytes returns once the socket holds the bytes

    def close(self) -> None:
        pass  # the control socket is closed by its owner


class DistPayload:
    """Tensors over a process group of two built for this connection (not the default
    group, so one process may hold several pairs and abort one without the others)."""

    def __init__(self, group, backend: str, device: torch.device, peer: int, store: dist.Store):
        self.group, self.backend, self.device, self.peer = group, backend, device, peer
        self._store = store  # NCCL reads it again for each communicator it builds
        self._sent: list[tuple[object, torch.Tensor]] = []  # (work, tensor kept alive until sent)

    @classmethod
    def join(cls, store: dist.Store, rank: int, backend: str, host: str, device: torch.device,
             timeout_s: float) -> DistPayload:
        """Build the group (blocks until both ranks join)."""
        group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL
        if backend == "gloo":
            # torch's stubs lack the private _Options (the only options that take devices)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timedelta(seconds=timeout_s)
            group = dist.ProcessGroupGloo(store, rank, 2, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(seconds=timeout_s)  # the watchdog's; rounds abort long before
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
            group = dist.ProcessGroupNCCL(store, rank, 2, opts)
        return cls(group, backend, device, 1 - rank, store)

    def send(self, tensors: list[torch.Tensor]) -> None:
        for tag, t in enumerate(tensors):
            t = t.to(self.device).contiguous()
            self._sent.append((self.group.send([t], self.peer, tag), t))

    def recv(self, specs: list[TensorSpec], deadline: float) -> list[torch.Tensor]:
        out = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
        works = [self.group.recv([t], self.peer, tag) for tag, t in enumerate(out)]
        for work in works:
            self._wait(work, deadline)
        return out

    def wait_sent(self, deadline: float) -> None:
        for work, _ in self._sent:
            self._wait(work, deadline)
        self._sent.clear()

    def _wait(self, work, deadline: float) -> None:
        if self.backend == "gloo":  # raises RuntimeError on timeout or a dead peer
            work.wait(timedelta(seconds=max(1e-3, deadline - time.monotonic())))
            return
        # NCCL completes on the GPU stream: poll its event from the host so that a dead or
        # stuck peer costs this round's deadline, never a hang in a later host sync
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError("the round's payload did not complete in time")
            time.sleep(5e-5)
        work.wait()

    def close(self) -> None:
        group, self.group = self.group, None
        self._sent.clear()
        if group is not None:
            try:
                group.abort()  # nothing stays posted on a dead pair
            except RuntimeError:
                pass


def make_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free port of `host` (read it back from `.port`)."""
    return dist.TCPStore(host, 0, 2, True, timedelta(seconds=timeout_s), wait_for_workers=False)


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, 2, False, timedelta(seconds=timeout_s))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8)

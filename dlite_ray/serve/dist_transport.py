"""A draft round between two processes, both sides (Ray-free): `PairTransport` is the
target's DraftTransport over one connection, `DraftServer` answers on the draft's side.

Per round (see pair_channels for the two channels):
  target -> draft  control: Round (K, token groups [N, G], sampling knobs, seeds)
                   payload: features bf16 [N, S, D]
  draft -> target  control: RoundDone (W, the width of the distributions that follow)
                   payload: tokens int64 [N, K]; if any row sampled: prob ids int64 [W]
                            when W < V, probs fp32 [N, K, W]
The target waits for RoundDone with a poll timeout before it posts its payload receives,
and every round has one host-side deadline (`timeout_s`): a draft that is dead, killed
mid-round or slower makes `propose` raise DraftUnavailable by then, and the transport
closes itself (aborting its process group, so nothing stays posted). The draft holds no
per-request state between rounds (history-free), so a fresh connection needs no resync.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import socket
import threading
import time
from multiprocessing.connection import Connection

import torch

from dlite_ray.engine.draft_graphs import DraftRoundGraphs
from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest, DraftUnavailable
from dlite_ray.engine.graph_runner import DEFAULT_GRAPH_ROWS
from dlite_ray.runtime.draft_model import DLiteDraftModel, DraftProposal
from dlite_ray.runtime.sampling import RowSampling
from dlite_ray.serve.pair_channels import (
    DRAFT_RANK,
    TARGET_RANK,
    DistPayload,
    HostPayload,
    Join,
    Joined,
    Payload,
    PayloadKind,
    Ping,
    Pong,
    Round,
    RoundDone,
    Shutdown,
    TensorSpec,
    authenticate,
    join_store,
    make_store,
    open_control,
    recv_message,
)

log = logging.getLogger(__name__)

# what a broken pair raises: sockets, gloo/NCCL (RuntimeError), deadlines, garbage
PAIR_ERRORS = (OSError, EOFError, TimeoutError, RuntimeError, pickle.UnpicklingError)


class PairTransport:
    """Target side of one connection to a draft. Healthy until a round or ping fails; then
    closed for good (a DraftLink makes a new one)."""

    def __init__(self, conn: Connection, payload: Payload, joined: Joined, vocab_size: int, timeout_s: float):
        if joined.vocab_size != vocab_size:
            raise ConnectionError(f"the draft holds a {joined.vocab_size}-token embedding, the target {vocab_size}")
        self.info: DraftInfo = joined.info
        self.cpu_threads = joined.cpu_threads  # what the draft process runs on
        self.vocab_size, self.timeout_s = vocab_size, timeout_s
        self.comm_time = 0.0  # seconds of rounds, draft compute included, summed
        self.healthy = True
        self._conn, self._payload = conn, payload
        self._lock = threading.Lock()  # one round or ping at a time on the socket

    @classmethod
    def connect(cls, address: tuple[str, int], authkey: bytes, *, vocab_size: int, payload: PayloadKind,
                device: torch.device, timeout_s: float, group_timeout_s: float,
                join_timeout_s: float = 60.0) -> PairTransport:
        """Join the draft listening at `address`: authenticate, build the payload channel
        and warm it (one tiny send and receive each way, so that NCCL builds its
        communicator here and not inside a request)."""
        deadline = time.monotonic() + join_timeout_s
        sock = socket.create_connection(address, timeout=join_timeout_s)
        host = sock.getsockname()[0]  # this side's address as the draft reaches it
        conn = open_control(sock, timeout_s)
        channel: Payload | None = None
        try:
            authenticate(conn, authkey, deadline)
            if payload == "dist":
                backend = "nccl" if device.type == "cuda" else "gloo"
                store = make_store(host, join_timeout_s)
                conn.send(Join("dist", backend, host, store.port, group_timeout_s))
                channel = DistPayload.join(store, TARGET_RANK, backend, host, device, group_timeout_s)
            else:
                conn.send(Join("host", None, "", 0, group_timeout_s))
                channel = HostPayload(conn, device)
            joined = recv_message(conn, deadline)
            if not isinstance(joined, Joined):
                raise ConnectionError(f"the draft answered the join with {type(joined).__name__}")
            channel.send([torch.ones(1, dtype=torch.int64)])
            channel.recv([((1,), torch.int64)], deadline)
            channel.wait_sent(deadline)
            return cls(conn, channel, joined, vocab_size, timeout_s)
        except BaseException:
            if channel is not None:
                channel.close()
            conn.close()
            raise

    def propose(self, request: DraftRequest) -> DraftProposal:
        with self._lock:
            if not self.healthy:
                raise DraftUnavailable("the draft pair is closed")
            start = time.perf_counter()
            try:
                proposal = self._round(request, time.monotonic() + self.timeout_s)
            except PAIR_ERRORS as exc:
                self._fail()
                raise DraftUnavailable(f"draft round failed: {exc}") from exc
            self.comm_time += time.perf_counter() - start
            return proposal

    def _round(self, request: DraftRequest, deadline: float) -> DraftProposal:
        n, _ = request.token_groups.shape
        k, rs = request.num_tokens, request.sampling
        greedy = request.draft_greedy.tolist()
        sampled = not all(greedy)
        feats = None if request.features is None else request.features.to(torch.bfloat16)
        self._conn.send(Round(k, request.token_groups.tolist(), None if feats is None else tuple(feats.shape),
                              rs.temperature.tolist(), rs.top_k.tolist(), rs.top_p.tolist(), greedy,
                              _seeds(rs, n), sampled, self.vocab_size))
        if feats is not None:
            self._payload.send([feats])
        done = recv_message(self._conn, deadline)  # the draft's compute happens behind this
        if not isinstance(done, RoundDone):
            raise ConnectionError(f"the draft answered a round with {type(done).__name__}")
        specs: list[TensorSpec] = [((n, 2, k), torch.int64)]  # the drafted tokens and, under them, their runners-up
        w = done.width
        if sampled:
            if not 0 < w <= self.vocab_size:
                raise ConnectionError(f"the draft sent distributions {w} wide for a vocabulary of {self.vocab_size}")
            if w < self.vocab_size:
                specs.append(((w,), torch.int64))
            specs.append(((n, k, w), torch.float32))
        got = self._payload.recv(specs, deadline)
        self._payload.wait_sent(deadline)
        tokens, runners_up = got[0][:, 0], got[0][:, 1]
        if not sampled:
            return DraftProposal(tokens, None, runners_up=runners_up)
        return DraftProposal(tokens, got[-1], got[1] if len(got) == 3 else None, runners_up)

    def ping(self) -> bool:
        """Heartbeat: whether the draft answers a Ping within the round deadline. A round in
        progress is its own heartbeat (no wait for it)."""
        if not self._lock.acquire(blocking=False):
            return self.healthy
        try:
            if not self.healthy:
                return False
            try:
                self._conn.send(Ping())
                if isinstance(recv_message(self._conn, time.monotonic() + self.timeout_s), Pong):
                    return True
            except PAIR_ERRORS as exc:
                log.warning("draft heartbeat failed: %s", exc)
            self._fail()
            return False
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            if self.healthy:
                with contextlib.suppress(OSError):
                    self._conn.send(Shutdown())
            self._fail()

    def _fail(self) -> None:
        self.healthy = False
        self._payload.close()
        with contextlib.suppress(OSError):
            self._conn.close()


def _seeds(rs: RowSampling, n: int) -> list[int]:
    """One draw from each row's generator seeds the draft's (unseeded rows: fresh seeds)."""
    gens = [gen for gen in rs.generators if gen is not None]
    if len(gens) == len(rs.generators):
        return [int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device)) for gen in gens]
    return torch.randint(0, 2**62, (n,)).tolist()


class DraftServer:
    """Draft side: listens on `address` and answers one target connection at a time, round
    by round. When a connection ends (target closed it, a round failed) it listens again, so
    the target may reconnect without the draft reloading."""

    def __init__(self, draft: DLiteDraftModel, device: torch.device, authkey: bytes, fingerprint: str,
                 host: str = "127.0.0.1", join_timeout_s: float = 60.0):
        self.info = DraftInfo.of(fingerprint, draft.cfg)
        self.draft, self.device, self._authkey, self._join_timeout = draft, device, authkey, join_timeout_s
        # A CUDA draft's greedy rounds from CUDA graphs, kept across connections (a shape whose
        # capture fails runs eagerly; a wrong draft could only cost acceptance, never output)
        self.round_graphs = DraftRoundGraphs(draft, DEFAULT_GRAPH_ROWS) if device.type == "cuda" else None
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="draft-server", daemon=True)
        thread.start()
        return thread

    def serve_forever(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:  # closed
                return
            try:
                self._serve_connection(sock)
            except PAIR_ERRORS as exc:
                log.warning("draft pair connection ended: %s", exc)
            except Exception:  # a bad round ends its connection, never the server
                log.exception("draft round failed")

    def close(self) -> None:
        self._sock.close()

    def _serve_connection(self, sock: socket.socket) -> None:
        host = sock.getsockname()[0]
        conn = open_control(sock, self._join_timeout)
        channel: Payload | None = None
        try:
            deadline = time.monotonic() + self._join_timeout
            authenticate(conn, self._authkey, deadline)
            join = recv_message(conn, deadline)
            if not isinstance(join, Join):
                raise ConnectionError(f"the target opened with {type(join).__name__}")
            if join.payload == "dist":
                assert join.backend is not None  # PairTransport.connect names one with every dist join
                store = join_store(join.store_host, join.store_port, self._join_timeout)
                channel = DistPayload.join(store, DRAFT_RANK, join.backend, host, self.device, join.group_timeout_s)
            else:
                channel = HostPayload(conn, self.device)
            conn.send(Joined(self.info, self.draft.embed_tokens.num_embeddings, torch.get_num_threads()))
            channel.send(channel.recv([((1,), torch.int64)], deadline))
            channel.wait_sent(deadline)
            log.info("draft pair joined (%s payload)", join.payload)
            serve_rounds(self.draft, conn, channel, self.device, join.group_timeout_s, self.round_graphs)
        finally:
            if channel is not None:
                channel.close()
            conn.close()


def serve_rounds(draft: DLiteDraftModel, conn: Connection, payload: Payload, device: torch.device,
                 timeout_s: float, round_graphs: DraftRoundGraphs | None = None) -> None:
    """Answer rounds until the target says stop or goes away (EOFError). Waiting for the
    next round has no deadline; each round's payload has `timeout_s`. Greedy rounds go
    through `round_graphs` where given."""
    dtype = next(draft.parameters()).dtype
    while True:
        msg = conn.recv()
        if isinstance(msg, Ping):
            conn.send(Pong())
            continue
        if isinstance(msg, Shutdown):
            return
        if not isinstance(msg, Round):
            raise ConnectionError(f"unexpected {type(msg).__name__} between rounds")
        deadline = time.monotonic() + timeout_s
        if msg.feature_shape is None:  # as InProcessDraftTransport: only drafts that read no target layers get none
            raise ValueError("a DLite draft reads target features; the round has none")
        feats = payload.recv([(msg.feature_shape, torch.bfloat16)], deadline)[0].to(device, dtype)
        groups = torch.tensor(msg.token_groups, dtype=torch.long, device=device)
        if round_graphs is not None and round_graphs.serves(feats, not msg.sampled):
            proposal = round_graphs.propose(feats, groups, msg.num_tokens)
        else:
            proposal = draft.propose(feats, groups, msg.num_tokens, _row_sampling(msg, device),
                                     torch.tensor(msg.draft_greedy, dtype=torch.bool, device=device),
                                     all_greedy=not msg.sampled)  # known from the header: no read of the device
        assert proposal.runners_up is not None  # a DLite draft names them in every round
        out, width = [torch.stack([proposal.tokens, proposal.runners_up], 1).long()], 0
        if msg.sampled:
            assert proposal.probs is not None  # a round that samples returns its distributions
            probs = proposal.probs.float()
            width = probs.shape[-1]
            if width < msg.vocab_size:
                assert proposal.prob_ids is not None  # narrower than the vocabulary: a subset head's ids
                out.append(proposal.prob_ids.long())
            out.append(probs)
        conn.send(RoundDone(width))
        payload.send(out)
        payload.wait_sent(time.monotonic() + timeout_s)


def _row_sampling(msg: Round, device: torch.device) -> RowSampling:
    """The round's sampling parameters; its rows' generators, seeded from the target's, only
    where a row samples (a greedy round draws nothing: no generator is made for it)."""
    gens: list[torch.Generator | None] = [None] * len(msg.seeds)
    if msg.sampled:
        gens = [torch.Generator(device=device).manual_seed(seed) for seed in msg.seeds]
    return RowSampling.build(msg.temperature, msg.top_k, msg.top_p, gens, device)

"""A draft in another process, without Ray: `PairLink` keeps a target connected to a draft
process (any launcher: a Ray actor in draft_link.py, a local child process here), and
`start_local_pair` runs the draft in a child of this process, e.g. on a one-GPU box.

A PairLink is the engine's DraftTransport. Until the pair has joined, and whenever a round
or heartbeat fails, `propose` raises DraftUnavailable (the engine decodes plainly for that
step, with the same greedy output) while a background thread reconnects: to the same
draft if it still answers, else to a fresh one from the launcher.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Protocol, TypedDict

import torch

from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest, DraftUnavailable
from dlite_ray.engine.engine_config import torch_dtype
from dlite_ray.runtime.draft_model import DLiteDraftModel, DraftProposal
from dlite_ray.serve.dist_transport import DraftServer, PairTransport
from dlite_ray.serve.pair_channels import PayloadKind

log = logging.getLogger(__name__)
# failed joins in a row before a pair reports itself degraded (a cold draft actor may take
# one join timeout to load; three rule out a slow start)
DEFAULT_MAX_JOIN_FAILURES = 3
DraftFactory = Callable[[torch.device], DLiteDraftModel]


class _ConnectArgs(TypedDict):
    """PairTransport.connect's keyword arguments, the same for every join of a link."""

    vocab_size: int
    payload: PayloadKind
    device: torch.device
    timeout_s: float
    group_timeout_s: float
    join_timeout_s: float


class DraftLauncher(Protocol):
    def address(self, authkey: bytes) -> tuple[str, int]:
        """(host, port) where a running draft listens with this key, starting one if none runs."""

    def restart(self) -> None:
        """Stop the current draft (dead, stuck or slow); the next `address` starts a fresh one."""

    def kill(self) -> None:
        """Fault injection: kill the draft as a crash would (the link starts another)."""

    def close(self) -> None: ...


class PairLink:
    """DraftTransport to a draft process that restarts and reconnects behind the scenes.

    `connected` is true only while the last round or heartbeat succeeded; `restarts`
    counts reconnections after a failure, `join_failures` the attempts to join a draft that
    failed, `rounds_without_draft` the rounds it could not serve (what GetStats and
    /metrics report). After `max_join_failures` failed attempts in a row the pair is
    `degraded_reason`: it decodes without speculation until a draft joins, and says so."""

    def __init__(self, info: DraftInfo, vocab_size: int, launcher: DraftLauncher, *,
                 device: torch.device | str = "cpu", payload: PayloadKind = "dist", timeout_s: float = 30.0,
                 group_timeout_s: float | None = None, join_timeout_s: float = 60.0, heartbeat_s: float = 5.0,
                 retry_s: float = 5.0, authkey: bytes | None = None,
                 max_join_failures: int = DEFAULT_MAX_JOIN_FAILURES):
        self.info, self.vocab_size = info, vocab_size
        self.restarts = 0
        self.join_failures = 0  # every failed attempt to join a draft
        self.rounds_without_draft = 0  # rounds `propose` could not serve (the engine decoded them plainly)
        self.max_join_failures = max_join_failures
        self._failed_in_a_row = 0  # since the last join
        self._last_join_error = ""
        self.cpu_threads: int | None = None  # what the connected draft process runs on
        self._launcher = launcher
        self._connect_kwargs = _ConnectArgs(vocab_size=vocab_size, payload=payload, device=torch.device(device),
                                            timeout_s=timeout_s, group_timeout_s=group_timeout_s or 2 * timeout_s,
                                            join_timeout_s=join_timeout_s)
        self._authkey = authkey or os.urandom(32)  # what the launcher's drafts must answer to
        self._retry_s = retry_s
        self._transport: PairTransport | None = None
        self._past_comm_time = 0.0
        self._lock = threading.Lock()
        self._connecting = False
        self._closed = threading.Event()
        threading.Thread(target=self._heartbeat, args=(heartbeat_s,), name="draft-heartbeat", daemon=True).start()
        self.connect_async()

    @property
    def connected(self) -> bool:
        transport = self._transport
        return transport is not None and transport.healthy

    @property
    def comm_time(self) -> float:
        transport = self._transport
        return self._past_comm_time + (transport.comm_time if transport else 0.0)

    @property
    def degraded_reason(self) -> str | None:
        """Why this pair cannot speculate, once no draft has joined `max_join_failures`
        times in a row; None while connected or still within the bound."""
        failed = self._failed_in_a_row
        if self.connected or failed < self.max_join_failures:
            return None
        return f"no draft has joined in {failed} attempts in a row; decoding without speculation"

    @property
    def last_join_error(self) -> str:
        """Why the last attempt to join failed (operators only: it may name hosts)."""
        return self._last_join_error

    def propose(self, request: DraftRequest) -> DraftProposal:
        transport = self._transport
        if transport is None or not transport.healthy:
            self.rounds_without_draft += 1
            raise DraftUnavailable("draft process not connected (yet)")
        try:
            return transport.propose(request)
        except DraftUnavailable:
            self.rounds_without_draft += 1
            self._lost(transport)
            raise

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until the pair has joined (or `timeout_s` passed); whether it has."""
        deadline = time.monotonic() + timeout_s
        while not self.connected and time.monotonic() < deadline and not self._closed.wait(0.05):
            pass
        return self.connected

    def kill_draft(self) -> None:
        """Fault injection for tests and drills."""
        self._launcher.kill()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()
        self._launcher.close()

    # -- connection management ---------------------------------------------------------------
    def connect_async(self) -> None:
        with self._lock:
            if self._connecting or self._closed.is_set():
                return
            self._connecting = True
        threading.Thread(target=self._connect, name="draft-link", daemon=True).start()

    def _lost(self, transport: PairTransport) -> None:
        with self._lock:
            if self._transport is not transport:  # already handled (round and heartbeat both saw it)
                return
            self._transport = None
            self._past_comm_time += transport.comm_time
            self.restarts += 1
        log.warning("draft pair lost: plain decoding while it reconnects")
        self.connect_async()

    def _connect(self) -> None:
        fresh = False  # first try the draft we had: a slow round does not cost a reload
        try:
            while not self._closed.is_set():
                if fresh:
                    self._launcher.restart()
                try:
                    transport: PairTransport | None = self._join()
                except Exception as exc:  # noqa: BLE001 - keep serving plainly; a fresh draft next
                    self._join_failed(exc)
                    if fresh:
                        self._closed.wait(self._retry_s)
                    fresh = True
                    continue
                with self._lock:
                    if not self._closed.is_set():
                        self._transport, transport = transport, None
                        self._failed_in_a_row = 0
                if transport is not None:  # closed meanwhile
                    transport.close()
                return
        finally:
            with self._lock:
                self._connecting = False
            if self._closed.is_set():
                self._launcher.close()  # a draft this thread started while the link closed

    def _join_failed(self, exc: Exception) -> None:
        self.join_failures += 1
        self._failed_in_a_row += 1
        self._last_join_error = f"{type(exc).__name__}: {exc}"[:200]
        if self._failed_in_a_row == self.max_join_failures:
            log.error("draft pair degraded: %s (last: %s)", self.degraded_reason, self._last_join_error)
        else:
            log.warning("could not connect the draft process: %s", exc)

    def _join(self) -> PairTransport:
        address = self._launcher.address(self._authkey)
        transport = PairTransport.connect(address, self._authkey, **self._connect_kwargs)
        if transport.info.fingerprint != self.info.fingerprint:
            transport.close()
            raise ConnectionError(f"draft {transport.info.fingerprint} answered instead of {self.info.fingerprint}")
        self.cpu_threads = transport.cpu_threads
        log.info("draft process connected at %s:%d (%s payload)", *address, self._connect_kwargs["payload"])
        return transport

    def _heartbeat(self, period_s: float) -> None:
        """A draft that dies while idle is found here, not by the next request."""
        while not self._closed.wait(period_s):
            transport = self._transport
            if transport is not None and not transport.ping():
                self._lost(transport)


# -- the draft in a local child process ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DraftSource:
    """What the child builds: a checkpoint directory with its target (HF directory or .gguf,
    for the token embedding), or a picklable factory(device) -> DLiteDraftModel."""

    draft: str | DraftFactory
    target: str | None = None
    dtype: str = "float32"
    fingerprint: str | None = None

    def build(self, device: torch.device) -> tuple[DLiteDraftModel, str]:
        from dlite_ray.runtime.loading import checkpoint_fingerprint

        if callable(self.draft):
            name = getattr(self.draft, "__qualname__", type(self.draft).__name__)
            return self.draft(device), self.fingerprint or f"factory:{name}"
        if self.target is None:
            raise ValueError("a draft checkpoint needs its target (for the token embedding)")
        embedding, num_layers = _target_embedding(Path(self.target), torch_dtype(self.dtype))
        draft = DLiteDraftModel.load(self.draft, embedding, num_layers, torch_dtype(self.dtype), device)
        draft.embed_tokens.to(device)
        return draft, self.fingerprint or checkpoint_fingerprint(self.draft)


def _target_embedding(target: Path, dtype: torch.dtype) -> tuple[torch.nn.Embedding, int]:
    """The target's token embedding and layer count, reading only the embedding where the
    target is a Hugging Face directory."""
    import json

    from dlite_ray.runtime.loading import load_embedding, load_target

    if target.is_dir():
        return load_embedding(target, dtype), int(json.loads((target / "config.json").read_text())["num_hidden_layers"])
    model = load_target(target, dtype)
    return torch.nn.Embedding.from_pretrained(model.embed_tokens.weight.detach(), freeze=True), model.cfg.num_layers


class LocalDraftProcess:
    """DraftLauncher: the draft in a spawned child process listening on 127.0.0.1."""

    def __init__(self, source: DraftSource, device: str, cpu_threads: int | None, startup_timeout_s: float):
        self.source, self.device, self.cpu_threads = source, device, cpu_threads
        self.startup_timeout_s = startup_timeout_s
        self.info: DraftInfo | None = None  # known once a child has started
        self.vocab_size: int | None = None
        self._proc: BaseProcess | None = None
        self._pipe: Connection | None = None  # the child exits when this closes (and when this process dies)
        self._address: tuple[str, int] | None = None
        self._authkey: bytes | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def address(self, authkey: bytes) -> tuple[str, int]:
        if not self.alive or authkey != self._authkey:
            self.restart()
            self._start(authkey)
        assert self._address is not None  # set by the _start of the child that is alive
        return self._address

    def _start(self, authkey: bytes) -> None:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_child_main, name="dlite-draft", daemon=True,
                           args=(self.source, self.device, self.cpu_threads, authkey, child))
        proc.start()
        child.close()
        try:
            if not parent.poll(self.startup_timeout_s):
                raise TimeoutError(f"the draft process did not start within {self.startup_timeout_s} s")
            status, *rest = parent.recv()
        except (EOFError, TimeoutError):
            proc.kill()
            raise
        if status != "ready":
            proc.join()
            raise RuntimeError(f"the draft process failed to start:\n{rest[0]}")
        self._address, self.info, self.vocab_size = rest
        self._proc, self._pipe, self._authkey = proc, parent, authkey

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()

    def restart(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.join(timeout=30)
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None

    close = restart


def _child_main(source: DraftSource, device: str, cpu_threads: int | None, authkey: bytes, pipe) -> None:
    try:
        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        dev = torch.device(device)
        draft, fingerprint = source.build(dev)
        server = DraftServer(draft, dev, authkey, fingerprint)
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        pipe.send(("error", traceback.format_exc()))
        return
    pipe.send(("ready", server.address, server.info, draft.embed_tokens.num_embeddings))
    server.start()
    with contextlib.suppress(EOFError, OSError):
        pipe.recv()  # returns (EOF) when the parent closes the pipe or dies
    os._exit(0)  # the server thread may be inside a round


@dataclass(slots=True)
class LocalDraftHandle:
    """The child process behind a local pair: `kill()` crashes the current draft (the link
    starts another), `close()` closes the link and stops the child."""

    link: PairLink
    process: LocalDraftProcess

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def kill(self) -> None:
        self.process.kill()

    def close(self) -> None:
        self.link.close()


def start_local_pair(draft: str | Path | DraftFactory, *, target: str | Path | None = None,
                     device: str = "cpu", target_device: str | None = None, dtype: str = "float32",
                     payload: PayloadKind = "host", timeout_s: float = 30.0, group_timeout_s: float | None = None,
                     join_timeout_s: float = 60.0, startup_timeout_s: float = 300.0, heartbeat_s: float = 5.0,
                     cpu_threads: int | None = 1, fingerprint: str | None = None) -> tuple[PairLink, LocalDraftHandle]:
    """Run the draft in a child process of this one and connect to it (no Ray).

    draft: a draft checkpoint directory (then `target`, the target's Hugging Face directory
        or .gguf, gives the token embedding), or a picklable `factory(device) ->
        DLiteDraftModel` (a module-level function or functools.partial) run in the child.
    device: the draft's device ("cpu", "cuda", "cuda:1"). target_device: where this
        process's tensors live, proposals included (default: `device`, one GPU shared).
    payload: "host" stages round tensors through host memory on the control socket (one GPU
        shared by both processes, where NCCL refuses two ranks; or CPU); "dist" uses a
        process group of two (NCCL on CUDA, gloo on CPU): on CUDA it needs two devices.
    timeout_s: each round's deadline; a dead, killed or slower draft makes `propose` raise
        DraftUnavailable by then. group_timeout_s: bounds payload operations on the draft
        side and the NCCL watchdog (default 2 x timeout_s). join_timeout_s: joining a running
        draft (after a failed round the link gives the old draft this long to answer before
        it starts a fresh one). startup_timeout_s: a child's start, model load included.
        heartbeat_s: the idle ping period.
    cpu_threads: torch threads of the child (None: torch's default). fingerprint: the
        draft's identity in DraftInfo (default: the checkpoint's hash, or "factory:NAME").

    Returns (link, handle) once the pair has joined: `link` is the engine's DraftTransport
    (`info`, `propose`, `close`; `connected`, `restarts`, `comm_time`, `cpu_threads`),
    `handle.kill()` crashes the draft (the link restarts it), `handle.close()` ends both.
    Raises ValueError for a "dist" payload on one GPU, RuntimeError/TimeoutError when the
    child cannot start or join."""
    own = _cuda_index(target_device or device)
    if payload == "dist" and own is not None and own == _cuda_index(device):
        raise ValueError(f"NCCL refuses two ranks on one GPU ({device}): use payload='host' or two devices")
    source = DraftSource(draft if callable(draft) else str(draft), None if target is None else str(target), dtype,
                         fingerprint)
    process = LocalDraftProcess(source, device, cpu_threads, startup_timeout_s)
    authkey = os.urandom(32)
    process.address(authkey)  # start one child now: its DraftInfo and vocabulary are the link's
    assert process.info is not None and process.vocab_size is not None  # set by that start
    link = PairLink(process.info, process.vocab_size, process, device=_indexed(target_device or device),
                    payload=payload, timeout_s=timeout_s, group_timeout_s=group_timeout_s,
                    join_timeout_s=join_timeout_s, heartbeat_s=heartbeat_s, authkey=authkey)
    if not link.wait_connected(startup_timeout_s):
        link.close()
        raise TimeoutError(f"the draft process did not join within {startup_timeout_s} s")
    return link, LocalDraftHandle(link, process)


def _cuda_index(device: str) -> int | None:
    dev = torch.device(device)
    return None if dev.type != "cuda" else (dev.index or 0)


def _indexed(device: str) -> torch.device:
    """A device with its index: bare "cuda" is this process's current GPU."""
    dev = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev

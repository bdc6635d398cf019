"""Scheduler: a request's whole life in the engine, and the only owner of its KV.

Plain Python, no tensors. It builds and holds the BlockManager and the BoundaryStore and is the only
caller of their allocation, reuse and release: admission (a stored boundary, else the
prefix cache), waiting / running queues with chunked prefill, KV reserved when a row is
scheduled (so one step's admissions never overcommit the pool), preemption by
recompute, the crop of what a round did not keep, and finishing (a boundary saved,
pinned under the conversation's lease until released).

Each step's batch is a ragged mix of prefill chunks and decode rows; a decode row needs
room for its anchor plus up to `lookahead - 1` drafted tokens. Its KV is reserved for all of
them, but the step's token budget counts its anchor only: the prefill chunks come first, and
the rows verify what the budget has left (`Schedule.spare_tokens`). Budgeting each row's
whole lookahead starved prefill in a batch where few rows speculate: 32 decoding rows held
512 of 1,024 tokens, and the last of 32 requests started 0.8 s later than without a draft.
The model runner only reads each row's block table and applies the schedule's block copies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dlite_ray.engine.block_manager import BlockManager, prefix_seed
from dlite_ray.engine.boundary_store import BoundaryStore
from dlite_ray.engine.sequence import FINISH_ABORT, InvalidRequest, Sequence, Status


@dataclass(slots=True)
class SchedulerConfig:
    """The scheduler's knobs, each with its default and description (EngineConfig's list takes them in)."""

    max_num_seqs: int = field(default=64, metadata={
        "help": "most requests running at once: the rows of one step's batch; more wait their turn"})
    max_batch_tokens: int = field(default=1024, metadata={
        "help": "new tokens per forward: prefill chunks and verify rows together"})

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_num_seqs and max_batch_tokens must be >= 1")


@dataclass(slots=True)
class KVReuse:
    """What a new sequence may reuse. Boundaries are stamped with the weights' fingerprints;
    one resumes (no recompute) only where a draft continues from its features. A draft
    that reads target layers needs the pivot's features, which the prefix cache lacks."""

    target_fingerprint: str = ""
    draft_fingerprint: str = "none"
    resume_boundaries: bool = False
    recompute_pivot: bool = False


@dataclass(slots=True)
class Schedule:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) KV blocks to copy before the forward
    # Tokens the decode rows may verify beyond their anchors, all together, within the step's
    # token budget (None: no bound).
    spare_tokens: int | None = None

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, num_blocks: int, block_size: int, lookahead: int,
                 reuse: KVReuse | None = None, *, prefix_cache: bool, boundary_capacity: int):
        """Builds the KV pool's BlockManager (num_blocks of block_size positions, the model
        runner's cache) and, with the prefix cache, the BoundaryStore on it: used through this
        scheduler only. lookahead: positions a decode row may write."""
        self.cfg, self.lookahead = cfg, lookahead
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache)
        self.boundaries = BoundaryStore(self.blocks, boundary_capacity) if prefix_cache else None
        self.reuse = reuse or KVReuse()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._lease_of: dict[str, str] = {}  # request id -> the conversation lease it ends under

    # -- a request's life ---------------------------------------------------------------------
    def add(self, seq: Sequence, lease: str | None = None) -> None:
        """Queue a request (refused if its id is taken or it could never fit the pool). With
        `lease`, its KV and boundary stay pinned after it finishes, until `release_lease`."""
        if seq.request_id in self._by_id:
            raise InvalidRequest(f"request id {seq.request_id!r} is already running")
        worst = len(seq.token_ids) + seq.params.max_new_tokens + self.lookahead
        if self.blocks.blocks_needed(worst) > self.blocks.num_blocks:
            raise InvalidRequest(f"request needs up to {worst} KV positions; the pool holds "
                                 f"{self.blocks.num_blocks * self.blocks.block_size} (raise max_kv_tokens)")
        self._by_id[seq.request_id] = seq
        if lease is not None:
            self._lease_of[seq.request_id] = lease
        self.waiting.append(seq)

    def _admit(self, seq: Sequence) -> None:
        """First KV for a sequence: a stored boundary (no recompute), else the prefix cache."""
        reuse = self.reuse
        if self.boundaries is not None and reuse.resume_boundaries:
            b = self.boundaries.take(seq.token_ids, reuse.target_fingerprint, reuse.draft_fingerprint, seq.namespace)
            if b is not None:
                seq.block_table, seq.block_hashes = list(b.blocks), list(b.block_hashes)
                seq.num_computed, seq.pivot_features = len(b.tokens), b.pivot_features
                seq.stats.resumed_from_boundary = True
                return
        need = len(seq.token_ids) - 1
        seq.block_table, seq.block_hashes = self.blocks.match_prefix(seq.token_ids, need, prefix_seed(seq.namespace))
        seq.num_computed = len(seq.block_table) * self.blocks.block_size
        if seq.num_computed == need and need > 0 and reuse.recompute_pivot:
            seq.num_computed -= 1  # recompute the pivot: its features are not cached
        seq.stats.cached_prompt_tokens = seq.num_computed

    def postprocess(self, schedule: Schedule) -> None:
        """After the step ran: each row's KV is cropped to what it kept (`num_computed`) and
        its full blocks are published; finished requests are finished."""
        for seq in [s for s, _ in schedule.prefills] + schedule.decodes:
            self.blocks.commit(seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed,
                               prefix_seed(seq.namespace))
            if seq.is_finished:
                self._finish(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.finish(FINISH_ABORT)
                    self._finish(seq)
                    return seq
        return None

    def _finish(self, seq: Sequence) -> None:
        """A finished request leaves; its KV is kept as a boundary (pinned under its lease)."""
        if seq in self.running:
            self.running.remove(seq)
        self._by_id.pop(seq.request_id, None)
        lease = self._lease_of.pop(seq.request_id, None)
        if self.boundaries is not None and seq.finish_reason != FINISH_ABORT:
            if seq.num_computed > len(seq.token_ids) - 1:
                # stopped inside a round: drop the KV of drafts after the stop; the pivot
                # features were for a later position, so the boundary keeps KV only
                seq.num_computed = len(seq.token_ids) - 1
                self.blocks.commit(seq.block_table, seq.block_hashes, seq.token_ids, seq.num_computed,
                                   prefix_seed(seq.namespace))
                seq.pivot_features = None
            self.boundaries.save(seq.token_ids, seq.num_computed, seq.pivot_features, seq.block_table,
                                 seq.block_hashes, self.reuse.target_fingerprint, self.reuse.draft_fingerprint, lease,
                                 seq.namespace)
        self._free(seq)

    def _free(self, seq: Sequence) -> None:
        """Free a sequence's KV (its committed full blocks stay in the prefix cache)."""
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed = 0
        seq.pivot_features = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- conversation leases ------------------------------------------------------------------
    def release_lease(self, lease: str) -> bool:
        """A conversation's lease ended: its KV becomes ordinary, evictable prefix cache."""
        return self.boundaries is not None and self.boundaries.release_lease(lease)

    @property
    def held_leases(self) -> list[str]:
        return self.boundaries.leases if self.boundaries is not None else []

    def take_evicted_leases(self) -> list[str]:
        """Leases whose KV was given up under memory pressure since the last call."""
        return self.boundaries.take_evicted_leases() if self.boundaries is not None else []

    # -- one step's batch ---------------------------------------------------------------------
    def schedule(self) -> Schedule:
        out = Schedule()
        budget = self.cfg.max_batch_tokens
        # 1. decode rows first (they hold KV already); preempt the newest when blocks run out
        for seq in sorted((s for s in self.running if s.num_to_prefill == 0), key=lambda s: s.arrival):
            if seq not in self.running:
                continue  # preempted below for an older sequence
            need = seq.num_computed + self.lookahead
            while not self.blocks.can_hold(seq.block_table, need) and self._make_room(seq, out):
                pass
            if seq in self.running and self.blocks.can_hold(seq.block_table, need):
                self._reserve(seq, need)
                out.decodes.append(seq)
                budget -= 1  # its anchor: what it verifies beyond comes out of what prefill leaves
        # 2. prefill chunks: running sequences mid-prefill, then admissions
        for seq in [s for s in self.running if s.num_to_prefill > 0]:
            budget = self._plan_prefill(seq, budget, out)
        while self.waiting and len(self.running) < self.cfg.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if seq.num_computed == 0 and not seq.block_table:
                self._admit(seq)
            if seq.num_to_prefill == 0:
                if not self.blocks.can_hold(seq.block_table, seq.num_computed + self.lookahead):
                    break
                self._reserve(seq, seq.num_computed + self.lookahead)
                self._start(seq)
                out.decodes.append(seq)
                budget -= 1
                continue
            chunk = min(seq.num_to_prefill, budget)
            if not self.blocks.can_hold(seq.block_table, seq.num_computed + chunk):
                if not self._evict():
                    break
                continue
            self._reserve(seq, seq.num_computed + chunk)
            self._start(seq)
            out.prefills.append((seq, chunk))
            budget -= chunk
        out.copies = self.blocks.take_copies()
        out.spare_tokens = max(0, budget)
        return out

    def _start(self, seq: Sequence) -> None:
        self.waiting.popleft()
        seq.status = Status.RUNNING
        self.running.append(seq)

    def _reserve(self, seq: Sequence, num_tokens: int) -> None:
        """KV for the positions this step writes, reserved now (a shared block is copied first)."""
        self.blocks.prepare_write(seq.block_table, seq.num_computed, num_tokens)

    def _plan_prefill(self, seq: Sequence, budget: int, out: Schedule) -> int:
        if seq not in self.running:
            return budget  # preempted earlier in this step
        chunk = min(seq.num_to_prefill, budget)
        # The next chunk may need memory that idle cache holds; it does not preempt (running
        # requests free memory as they finish, and preempting here could hit a sequence
        # already planned in this step).
        while chunk > 0 and not self.blocks.can_hold(seq.block_table, seq.num_computed + chunk) and self._evict():
            pass
        if chunk > 0 and self.blocks.can_hold(seq.block_table, seq.num_computed + chunk):
            self._reserve(seq, seq.num_computed + chunk)
            out.prefills.append((seq, chunk))
            budget -= chunk
        return budget

    def _evict(self) -> bool:
        """Free cached-but-idle memory (a stored boundary); False when nothing is left."""
        return self.boundaries is not None and self.boundaries.evict_oldest()

    def _make_room(self, needy: Sequence, out: Schedule) -> bool:
        if self._evict():
            return True
        victims = sorted((s for s in self.running if s is not needy and s not in out.decodes),
                         key=lambda s: s.arrival, reverse=True)
        if not victims:
            victims = [needy]
        victim = victims[0]
        self.running.remove(victim)
        self._free(victim)
        victim.status = Status.WAITING
        out.preempted.append(victim)
        self.waiting.appendleft(victim)
        return victim is not needy

"""Scheduler: waiting / running queues, admission by free KV blocks, chunked prefill,
preemption by recompute. Plain Python, no tensors.

Each step's batch is a ragged mix of prefill chunks and decode rows; a decode row needs
room for its anchor plus up to `lookahead - 1` drafted tokens. Blocks are reserved when
a row is scheduled, so one step's admissions never overcommit the pool; the rows' commit
crops what the round did not keep.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dlite_ray.engine.block_manager import BlockManager
from dlite_ray.engine.sequence import FINISH_ABORT, Sequence, Status


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_batch_tokens: int = 1024  # new tokens per forward (prefill chunks + verify rows)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_num_seqs and max_batch_tokens must be >= 1")


@dataclass(slots=True)
class Schedule:
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk length)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, lookahead: int, admit=None, evict=None,
                 release=None):
        """admit(seq): called when a sequence first gets KV (prefix cache / boundary lookup);
        evict(): frees cached-but-idle memory, False when nothing is left;
        release(seq): frees a preempted sequence's KV (it will be recomputed)."""
        self.cfg, self.blocks, self.lookahead = cfg, blocks, lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admit = admit or (lambda seq: None)
        self._evict = evict or (lambda: False)
        self._release = release or (lambda seq: self.blocks.free(seq.block_table))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    seq.finish(FINISH_ABORT)
                    return seq
        return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
                self.blocks.ensure_capacity(seq.block_table, need)  # reserve now, for this step
                out.decodes.append(seq)
                budget -= min(self.lookahead, need - seq.num_computed)
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
                self.blocks.ensure_capacity(seq.block_table, seq.num_computed + self.lookahead)
                self.waiting.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                out.decodes.append(seq)
                budget -= 1
                continue
            chunk = min(seq.num_to_prefill, budget)
            if not self.blocks.can_hold(seq.block_table, seq.num_computed + chunk):
                if not self._evict():
                    break
                continue
            self.blocks.ensure_capacity(seq.block_table, seq.num_computed + chunk)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.prefills.append((seq, chunk))
            budget -= chunk
        return out

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
            self.blocks.ensure_capacity(seq.block_table, seq.num_computed + chunk)
            out.prefills.append((seq, chunk))
            budget -= chunk
        return budget

    def _make_room(self, needy: Sequence, out: Schedule) -> bool:
        if self._evict():
            return True
        victims = sorted((s for s in self.running if s is not needy and s not in out.decodes),
                         key=lambda s: s.arrival, reverse=True)
        if not victims:
            victims = [needy]
        victim = victims[0]
        self.running.remove(victim)
        self._release(victim)
        victim.status = Status.WAITING
        out.preempted.append(victim)
        self.waiting.appendleft(victim)
        return victim is not needy

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)

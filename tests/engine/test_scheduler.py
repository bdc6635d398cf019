"""Scheduler without a model: admission, chunked prefill, preemption, abort."""

from __future__ import annotations

from dlite_ray.engine.scheduler import Scheduler, SchedulerConfig
from dlite_ray.engine.sequence import SamplingParams, Sequence, Status


def seq(n: int) -> Sequence:
    # one new token: the scheduler refuses a request that could never fit the pool; these
    # tests decode past it, as the engine would with a longer budget and a larger pool
    return Sequence(list(range(1, n + 1)), SamplingParams(max_new_tokens=1))


def _scheduler(cfg: SchedulerConfig, num_blocks: int, lookahead: int) -> Scheduler:
    """A pool of `num_blocks` blocks of 4 positions, prefix cache on, no boundaries kept."""
    return Scheduler(cfg, num_blocks, 4, lookahead, prefix_cache=True, boundary_capacity=0)


def run_schedule(sched: Scheduler):
    """Pretend the model ran: prefill chunks and decode rows (lookahead tokens) get computed."""
    out = sched.schedule()
    for s, n in out.prefills:
        assert len(s.block_table) * 4 >= s.num_computed + n  # reserved by the scheduler
        s.num_computed += n
    for s in out.decodes:
        s.token_ids.append(7)
        s.num_computed += 1
        sched.blocks.crop(s.block_table, s.num_computed)
    return out


def test_chunked_prefill_within_the_token_budget():
    sched = _scheduler(SchedulerConfig(max_batch_tokens=10), 64, lookahead=4)
    a, b = seq(25), seq(5)
    sched.add(a)
    sched.add(b)
    first = run_schedule(sched)
    assert [(s, n) for s, n in first.prefills] == [(a, 10)]
    second = run_schedule(sched)
    assert [(s, n) for s, n in second.prefills] == [(a, 10)]
    third = run_schedule(sched)
    assert [(s, n) for s, n in third.prefills] == [(a, 4), (b, 4)]
    fourth = run_schedule(sched)
    assert fourth.decodes == [a, b]


def test_admission_waits_for_free_blocks():
    sched = _scheduler(SchedulerConfig(max_batch_tokens=100), 4, lookahead=2)
    a, b = seq(13), seq(8)
    sched.add(a)
    sched.add(b)
    out = run_schedule(sched)
    assert [s for s, _ in out.prefills] == [a]  # b does not fit beside a
    assert b.status is Status.WAITING


def test_preemption_by_recompute_frees_the_newest():
    sched = _scheduler(SchedulerConfig(max_batch_tokens=100), 4, lookahead=4)
    a, b = seq(5), seq(5)
    sched.add(a)
    sched.add(b)
    run_schedule(sched)  # both prefilled (4 tokens each, 1 block each)
    for _ in range(6):
        out = run_schedule(sched)
        if out.preempted:
            break
    assert out.preempted == [b]
    assert b.status is Status.WAITING and b.block_table == [] and sched.waiting[0] is b
    assert a in out.decodes


def test_abort_removes_a_waiting_or_running_request():
    sched = _scheduler(SchedulerConfig(), 16, lookahead=2)
    a, b = seq(5), seq(5)
    sched.add(a)
    sched.add(b)
    run_schedule(sched)
    assert sched.abort(a.request_id) is a and a.finish_reason == "abort"
    assert sched.abort("nope") is None
    assert sched.running == [b]


def test_decode_rows_hold_their_anchor_of_the_budget_and_verify_what_prefill_leaves():
    """A decode row reserves KV for its whole lookahead, but only its anchor counts against the
    step's token budget: prefill chunks come first, and the rows share what is left."""
    sched = _scheduler(SchedulerConfig(max_batch_tokens=12), 64, lookahead=8)
    a, b = seq(3), seq(30)
    sched.add(a)
    run_schedule(sched)  # a's prefill
    sched.add(b)
    step = run_schedule(sched)
    assert step.decodes == [a] and [(s, n) for s, n in step.prefills] == [(b, 11)]
    assert step.spare_tokens == 0
    later = sched.schedule()
    assert [(s, n) for s, n in later.prefills] == [(b, 11)] and later.spare_tokens == 0
    assert len(a.block_table) * 4 >= a.num_computed + 8  # KV for its whole lookahead

"""Prometheus metrics of the serving path (a private registry per ingress replica)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.serve.errors import ServeError
from dlite_ray.serve.worker_messages import WorkerStats


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dlite_requests", "finished requests", registry=r)
        self.errors = Counter("dlite_errors", "failed requests by kind", ["kind"], registry=r)
        self.tokens = Counter("dlite_generated_tokens", "generated tokens", registry=r)
        self.accept = Histogram("dlite_accept_length", "tokens committed per round (A + 1)",
                                buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16), registry=r)
        self.position = Counter("dlite_position_accepts", "accepted drafts by block position", ["position"], registry=r)
        self.draft_time = Counter("dlite_draft_seconds", "time in draft calls", registry=r)
        self.verify_time = Counter("dlite_verify_seconds", "time in target forwards", registry=r)
        self.latency = Histogram("dlite_request_latency_seconds", "request latency", registry=r)
        self.kv_used = Gauge("dlite_kv_blocks_used", "KV blocks in use", registry=r)
        self.kv_total = Gauge("dlite_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.running = Gauge("dlite_running_requests", "requests in the running batch", registry=r)
        self.comm_time = Gauge("dlite_draft_comm_seconds", "target<->draft communication time", registry=r)
        # per replica: a probe reaches one replica at a time, and one pair without its draft
        # must not read as the whole app's
        self.draft_connected = Gauge("dlite_draft_connected", "1 while the draft answered its last round or heartbeat",
                                     ["replica"], registry=r)
        self.draft_restarts = Gauge("dlite_draft_restarts", "reconnections of the draft after a failure", ["replica"],
                                    registry=r)
        self.draft_join_failures = Gauge("dlite_draft_join_failures", "failed attempts to join a draft (cumulative)",
                                         ["replica"], registry=r)
        self.rounds_without_draft = Gauge("dlite_rounds_without_draft",
                                          "rounds decoded plainly because the draft could not serve them (cumulative)",
                                          ["replica"], registry=r)
        self.degraded = Gauge("dlite_replica_degraded", "1 while the replica cannot speculate (its draft never "
                              "joined or stays gone)", ["replica"], registry=r)
        self.reply_cache_tokens = Gauge("dlite_reply_cache_tokens",
                                        "tokens of earlier replies held for copying (every tenant)", registry=r)
        self.reply_cache_replies = Gauge("dlite_reply_cache_replies", "earlier replies held for copying", registry=r)
        self.reply_corpus_tokens = Gauge("dlite_reply_corpus_tokens",
                                         "tokens of the draft's reply corpus copied from (0: none or off)", registry=r)

    def finished(self, stats: RequestStats | None, latency: float) -> None:
        self.requests.inc()
        self.latency.observe(latency)
        if stats is None:
            return
        self.tokens.inc(stats.num_output_tokens)
        for a in stats.accept_lengths:
            self.accept.observe(a)
        for k, n in enumerate(stats.position_accepts):
            self.position.labels(str(k + 1)).inc(n)
        self.draft_time.inc(stats.draft_time)
        self.verify_time.inc(stats.verify_time)

    def error(self, err: ServeError) -> None:
        self.errors.labels(type(err).__name__).inc()

    def set_worker_stats(self, stats: WorkerStats) -> None:
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.running.set(stats.running)
        self.comm_time.set(stats.draft_comm_time_s)
        replica = stats.replica
        self.draft_connected.labels(replica).set(1 if stats.draft_connected else 0)
        self.draft_restarts.labels(replica).set(stats.draft_restarts)
        self.draft_join_failures.labels(replica).set(stats.draft_join_failures)
        self.rounds_without_draft.labels(replica).set(stats.rounds_without_draft)
        self.degraded.labels(replica).set(0 if stats.degraded is None else 1)
        self.reply_cache_tokens.set(stats.reply_cache_tokens)
        self.reply_cache_replies.set(stats.reply_cache_replies)
        self.reply_corpus_tokens.set(stats.reply_corpus_tokens)

    def snapshot(self) -> dict:
        return {"requests": self.requests._value.get(), "tokens": self.tokens._value.get()}

    def render(self) -> bytes:
        return generate_latest(self.registry)

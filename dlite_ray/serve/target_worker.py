"""TargetWorker: one replica = the engine (target, paged KV, scheduler) on its device,
plus its DraftWorker on the second bundle of the replica's placement group."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import torch
from ray import serve

from dlite_ray.engine.async_engine import AsyncEngine, Chunk
from dlite_ray.engine.engine import DLiteEngine, Prompt
from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.engine.stream_text import TextStream
from dlite_ray.serve.config import AppArgs, EngineArgs
from dlite_ray.serve.cpu_threads import target_thread_policy
from dlite_ray.serve.engine_factory import engine_from_args
from dlite_ray.serve.logprobs import LogprobEntry, TokenRenderer
from dlite_ray.serve.step_gate import StepGate
from dlite_ray.serve.worker_messages import GenerateChunk, WorkerStats

log = logging.getLogger(__name__)


class TargetWorker:
    """Serve deployment body (decorated in app.py so YAML options apply)."""

    def __init__(self, args: AppArgs, engine_factory: Callable[[EngineArgs], DLiteEngine] = engine_from_args):
        """engine_factory: builds the engine to serve from `args.engine` (tests inject one
        that returns a small engine)."""
        self.args = args
        self.engine = engine_factory(args.engine)
        threads = target_thread_policy(args.engine.device, args.engine.cpu_threads, self.engine.target)
        self.step_gate = StepGate()

        def before_step(load: int) -> None:
            self.step_gate.pass_through()
            if threads is not None:
                threads(load)

        self.async_engine = AsyncEngine(self.engine, before_step=before_step)
        self.renderer = TokenRenderer(self.engine.tokenizer)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests constructing it directly)
            self.replica_id = "local"
        log.info("target worker ready (draft: %s)", type(self.engine.draft).__name__ if self.engine.draft else "none")

    async def generate(self, prompt: Prompt, params: SamplingParams, route_to: str | None = None,
                       conversation: str | None = None, prefix_key: str | None = None,
                       tenant: str | None = None) -> AsyncIterator[GenerateChunk]:
        """Stream one request's `GenerateChunk`s. The prompt is tokenized and the request
        validated here, on the replica that runs it: a request the engine refuses raises
        InvalidRequest before the first chunk. The reply may copy from the tenant's earlier
        replies on this replica, and is kept for its later ones (the engine's reply cache).

        route_to / conversation / prefix_key steer the ConversationAffinityRouter; a
        conversation's KV stays pinned here after the reply (its lease), until
        `release_lease`. The last chunk names this replica and any conversations whose
        KV it had to give up under memory pressure."""
        text = TextStream(self.engine.decode_output, params.stop)
        async for chunk in self.async_engine.generate(prompt, params, lease=conversation, namespace=tenant):
            out = GenerateChunk(chunk.token_ids, text.push(chunk.token_ids, chunk.finished), chunk.finished,
                                chunk.finish_reason, self._visible_logprobs(chunk), chunk.error, chunk.stats)
            if chunk.finished:
                out.replica, out.evicted = self.replica_id, self.async_engine.take_evicted_leases()
            yield out

    def _visible_logprobs(self, chunk: Chunk) -> list[LogprobEntry] | None:
        """Logprob entries of the chunk's tokens, less end-of-sequence tokens (not text). A
        stream may send an entry before the text it stands for (held back by `TextStream`),
        and the tokens that complete a stop string keep their entries though their text is cut."""
        if chunk.logprobs is None:
            return None
        return self.renderer.chat_entries([lp for lp in chunk.logprobs if lp.token_id not in self.engine.eos_ids])

    async def release_lease(self, conversation: str, route_to: str | None = None, strict: bool = True) -> str:
        """Unpin a conversation's KV here (lease ended or conversation deleted); harmless
        on a replica that does not hold it. Meant for `route_to` only: where that replica is
        gone (drained, dead), Serve hands the call to another, which must not unpin its own
        copy (a turn that moved here from the drained replica pinned its reply here)."""
        if route_to is None or route_to == self.replica_id:
            self.async_engine.release_lease(conversation)
        return self.replica_id

    def record_routing_stats(self) -> dict:
        """Published to the ConversationAffinityRouter every few seconds (Serve's routing
        stats are a dict: the router reads `kv_free_fraction`, `running` and `leases`)."""
        load = self.async_engine.stats()
        return {"kv_free_fraction": 1 - load.kv_blocks_used / max(1, load.kv_blocks_total),
                "running": load.running + load.waiting, "leases": list(self.async_engine.held_leases)}

    async def stats(self, route_to: str | None = None) -> WorkerStats:
        """This replica's figures (`route_to` asks for a given replica)."""
        load = self.async_engine.stats()
        draft = self.engine.draft
        return WorkerStats(replica=self.replica_id, running=load.running, waiting=load.waiting,
                           kv_blocks_used=load.kv_blocks_used, kv_blocks_total=load.kv_blocks_total,
                           held_leases=load.held_leases, reply_cache_tokens=load.reply_cache_tokens,
                           reply_cache_replies=load.reply_cache_replies, reply_corpus_tokens=load.reply_corpus_tokens,
                           draft_connected=bool(getattr(draft, "connected", draft is not None)),
                           draft_restarts=getattr(draft, "restarts", 0),
                           draft_comm_time_s=getattr(draft, "comm_time", 0.0),
                           cpu_threads=torch.get_num_threads(),
                           draft_cpu_threads=getattr(draft, "cpu_threads", None),
                           draft_join_failures=getattr(draft, "join_failures", 0),
                           rounds_without_draft=getattr(draft, "rounds_without_draft", 0),
                           degraded=self.degraded_reason())

    def degraded_reason(self) -> str | None:
        """Why this replica cannot speculate (a draft that never joined or stays gone), or None."""
        return getattr(self.engine.draft, "degraded_reason", None)

    async def kill_draft(self) -> bool:
        """Fault drill: kill this replica's draft actor (the replica keeps serving)."""
        draft = self.engine.draft
        if draft is not None and hasattr(draft, "kill_actor"):
            draft.kill_actor()
            return True
        return False

    async def allow_steps(self, steps: int | None) -> None:
        """Fault drill: the engine runs `steps` more steps, then waits until this is called
        again (None: no limit, as it starts). A drill acts on a reply still in progress."""
        self.step_gate.allow(steps)

    def check_health(self) -> None:
        if not self.async_engine.is_alive():
            raise RuntimeError("engine loop died")
        reason = self.degraded_reason() if self.args.require_draft else None
        if reason is not None:  # not ready: Serve routes nothing here (require_draft)
            raise RuntimeError(f"require_draft: {reason}")


TargetWorkerDeployment = serve.deployment(name="TargetWorker")(TargetWorker)

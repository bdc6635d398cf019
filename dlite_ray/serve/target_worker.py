"""TargetWorker: one replica = the engine (target, paged KV, scheduler) on its device,
plus its DraftWorker on the second bundle of the replica's placement group."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from ray import serve

from dlite_ray.engine.async_engine import AsyncEngine, Chunk
from dlite_ray.engine.draft_transport import DraftInfo
from dlite_ray.engine.engine import DTYPES, DLiteEngine, default_draft_dir
from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.engine.stream_text import TextStream
from dlite_ray.runtime.draft_config import DraftConfig
from dlite_ray.runtime.loading import checkpoint_fingerprint, load_target
from dlite_ray.serve.config import AppArgs, EngineArgs
from dlite_ray.serve.cpu_threads import use_cpu_threads
from dlite_ray.serve.draft_link import DraftLink
from dlite_ray.serve.logprobs import TokenRenderer

log = logging.getLogger(__name__)


def build_engine(args: EngineArgs) -> DLiteEngine:
    """The replica's engine: the draft in-process, or behind a DraftLink to its own actor."""
    from transformers import AutoTokenizer

    from dlite_ray.runtime.model_store import default_model_dir

    device = "cuda:0" if args.device == "cuda" else "cpu"
    if args.device == "cpu":
        use_cpu_threads(args.cpu_threads)
    target_path = Path(args.target) if args.target else default_model_dir()
    draft_path = {"none": None, "default": default_draft_dir() if not args.target else None}.get(args.draft, args.draft)
    kwargs = {"num_draft_tokens": args.num_draft_tokens, "adaptive_draft_length": args.adaptive_draft_length,
              "lookup_tokens": args.lookup_tokens, "max_kv_tokens": args.max_kv_tokens,
              "attention_backend": args.attention_backend}
    if draft_path is None or not args.disaggregated_draft:
        return DLiteEngine.from_pretrained(target_path, draft_path, device=device, dtype=args.dtype, **kwargs)
    target = load_target(target_path, DTYPES[args.dtype], device)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    cfg = DraftConfig.from_dict(json.loads((Path(draft_path) / "config.json").read_text()))
    info = DraftInfo.of(checkpoint_fingerprint(draft_path), cfg)  # the draft's conventions (last tap normed or not)
    link = DraftLink(info, target.cfg.vocab_size, str(target_path), str(draft_path), target.cfg.num_layers,
                     args.dtype, args.device, args.draft_timeout_s, args.draft_cpu_threads, args.draft_payload)
    return DLiteEngine(target, tokenizer, link, **kwargs)


class TargetWorker:
    """Serve deployment body (decorated in app.py so YAML options apply)."""

    def __init__(self, args: AppArgs, engine: DLiteEngine | None = None):
        """engine: the one to serve (tests inject a small one); by default `build_engine(args.engine)`."""
        self.args = args
        self.engine = engine if engine is not None else build_engine(args.engine)
        self.async_engine = AsyncEngine(self.engine)
        self.renderer = TokenRenderer(self.engine.tokenizer)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve (tests constructing it directly)
            self.replica_id = "local"
        log.info("target worker ready (draft: %s)", type(self.engine.draft).__name__ if self.engine.draft else "none")

    async def generate(self, prompt, params: dict, route_to: str | None = None, conversation: str | None = None,
                       prefix_key: str | None = None) -> AsyncIterator[dict]:
        """Stream {token_ids, text, logprobs, finished, finish_reason, error, stats} chunks for
        one request; `logprobs` (when params ask) has an OpenAI chat entry per visible token.
        `error` is None except on the last chunk of a request that could not go on
        (finish_reason "error": its grammar failed mid-reply), where it says why.
        Unknown sampling parameters are refused (InvalidRequest names them).

        route_to / conversation / prefix_key steer the ConversationAffinityRouter; a
        conversation's KV stays pinned here after the reply (its lease), until
        `release_lease`. The last chunk names this replica and any conversations whose
        KV it had to give up under memory pressure."""
        sampling = SamplingParams.from_dict(params)
        text = TextStream(self.engine.decode_output, sampling.stop)
        async for chunk in self.async_engine.generate(prompt, sampling, lease=conversation):
            out = {"token_ids": chunk.token_ids, "text": text.push(chunk.token_ids, chunk.finished),
                   "logprobs": self._visible_logprobs(chunk), "finished": chunk.finished,
                   "finish_reason": chunk.finish_reason, "error": chunk.error, "stats": chunk.stats, "replica": None}
            if chunk.finished:
                out.update(replica=self.replica_id, evicted=self.async_engine.take_evicted_leases())
            yield out

    def _visible_logprobs(self, chunk: Chunk) -> list[dict] | None:
        """Logprob entries of the chunk's tokens, less end-of-sequence tokens (not text). A
        stream may send an entry before the text it stands for (held back by `TextStream`),
        and the tokens that complete a stop string keep their entries though their text is cut."""
        if chunk.logprobs is None:
            return None
        return self.renderer.chat_entries([lp for lp in chunk.logprobs if lp.token_id not in self.engine.eos_ids])

    async def release_lease(self, conversation: str, route_to: str | None = None, strict: bool = True) -> str:
        """Unpin a conversation's KV here (lease ended or conversation deleted); harmless
        on a replica that does not hold it."""
        self.async_engine.release_lease(conversation)
        return self.replica_id

    def record_routing_stats(self) -> dict:
        """Published to the ConversationAffinityRouter every few seconds."""
        stats = self.async_engine.stats()
        return {"kv_free_fraction": 1 - stats["kv_blocks_used"] / max(1, stats["kv_blocks_total"]),
                "running": stats["running"] + stats["waiting"], "leases": list(self.async_engine.held_leases)}

    async def encode(self, prompt) -> list[int]:
        return await asyncio.to_thread(self.engine.encode, prompt)  # off the loop that streams replies

    async def stats(self, route_to: str | None = None) -> dict:
        """This replica's engine figures (`route_to` asks for a given replica)."""
        out = self.async_engine.stats()
        out["replica"] = self.replica_id
        draft = self.engine.draft
        out["draft_connected"] = bool(getattr(draft, "connected", draft is not None))
        out["draft_restarts"] = getattr(draft, "restarts", 0)
        out["draft_comm_time_s"] = getattr(draft, "comm_time", 0.0)
        out["cpu_threads"] = torch.get_num_threads()
        out["draft_cpu_threads"] = getattr(draft, "cpu_threads", None)  # a draft in its own actor
        return out

    async def kill_draft(self) -> bool:
        """Fault drill: kill this replica's draft actor (the replica keeps serving)."""
        if hasattr(self.engine.draft, "kill_actor"):
            self.engine.draft.kill_actor()
            return True
        return False

    def check_health(self) -> None:
        if not self.async_engine._thread.is_alive():
            raise RuntimeError("engine loop died")


TargetWorkerDeployment = serve.deployment(TargetWorker, name="TargetWorker")

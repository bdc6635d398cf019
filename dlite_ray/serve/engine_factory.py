"""The replica's engine, built from its Serve config (EngineArgs)."""

from __future__ import annotations

from pathlib import Path

from dlite_ray.engine.draft_transport import DraftInfo
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.engine_config import EngineConfig
from dlite_ray.runtime.target_model import TargetModel
from dlite_ray.serve.config import EngineArgs
from dlite_ray.serve.cpu_threads import use_cpu_threads
from dlite_ray.serve.draft_link import DraftLink


def engine_config(args: EngineArgs) -> EngineConfig:
    """The engine knobs of a replica's Serve config."""
    return EngineConfig(target=args.target or None, draft=args.draft, device=args.device, dtype=args.dtype,
                        attention_backend=args.attention_backend, num_draft_tokens=args.num_draft_tokens,
                        adaptive_draft_length=args.adaptive_draft_length, lookup_tokens=args.lookup_tokens,
                        reply_cache_tokens=args.reply_cache_tokens, reply_corpus=args.reply_corpus,
                        tree_tokens=args.tree_tokens,
                        max_kv_tokens=args.max_kv_tokens)


def engine_from_args(args: EngineArgs) -> DLiteEngine:
    """The replica's engine: the draft in-process, or behind a DraftLink to its own actor."""
    if args.device == "cpu":
        use_cpu_threads(args.cpu_threads)
    return DLiteEngine.from_config(engine_config(args), _draft_link(args) if args.disaggregated_draft else None)


def _draft_link(args: EngineArgs):
    """A DraftFactory: the draft in its own actor (bundle 1 of the replica's placement group)."""

    def make(draft_path: Path, info: DraftInfo, target: TargetModel, target_path: Path,
             config: EngineConfig) -> DraftLink:
        return DraftLink(info, target.cfg.vocab_size, str(target_path), str(draft_path), target.cfg.num_layers,
                         config.dtype, args.device, args.draft_timeout_s, args.draft_cpu_threads, args.draft_payload,
                         max_join_failures=args.draft_max_join_failures)

    return make

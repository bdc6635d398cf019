"""The replica's engine, built from its Serve config (EngineArgs)."""

from __future__ import annotations

from pathlib import Path

from dlite_ray.engine.draft_transport import DraftInfo
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.engine_config import EngineConfig, config_from_knobs, knob_fields
from dlite_ray.runtime.target_model import TargetModel
from dlite_ray.serve.config import EngineArgs
from dlite_ray.serve.cpu_threads import use_cpu_threads
from dlite_ray.serve.draft_link import DraftLink


def engine_config(args: EngineArgs) -> EngineConfig:
    """The engine knobs of a replica's Serve config (EngineArgs offers every one)."""
    return config_from_knobs({name: getattr(args, name) for name in knob_fields()})


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

"""The replica's engine, built from its Serve config (EngineArgs)."""

from __future__ import annotations

import json
from pathlib import Path

from dlite_ray.engine.draft_transport import DraftInfo
from dlite_ray.engine.engine import DTYPES, DLiteEngine, default_draft_dir
from dlite_ray.runtime.draft_config import DraftConfig
from dlite_ray.runtime.loading import checkpoint_fingerprint, load_target
from dlite_ray.serve.config import EngineArgs
from dlite_ray.serve.cpu_threads import use_cpu_threads
from dlite_ray.serve.draft_link import DraftLink


def engine_from_args(args: EngineArgs) -> DLiteEngine:
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

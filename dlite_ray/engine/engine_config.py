"""EngineConfig: every knob of an engine and of its loading, checked once.

Also the one dtype-name mapping and device normalisation the rest of the package uses,
and the checks that fit a draft to the engine (taps, verify lengths).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from dlite_ray.constants import (
    DEFAULT_LOOKUP_TOKENS,
    DEFAULT_MAX_KV_TOKENS,
    DEFAULT_NUM_DRAFT_TOKENS,
    DEFAULT_REPLY_CACHE_TOKENS,
    DEFAULT_TREE_TOKENS,
    KV_BLOCK_SIZE,
)
from dlite_ray.engine.draft_transport import DraftTransport
from dlite_ray.engine.scheduler import SchedulerConfig
from dlite_ray.runtime.attention import MAX_POSITIONED_TOKENS
from dlite_ray.runtime.cpu_features import has_bf16_math

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BOUNDARY_CAPACITY = 64  # stored boundaries kept outside leases (engine/boundary_store.py)


def normalize_device(device: str) -> str:
    """A torch device string, with a bare "cuda" pinned to "cuda:0" (each Ray actor sees its GPU as 0)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device {device!r} is not a torch device (e.g. 'cpu', 'cuda', 'cuda:1')") from exc
    if parsed.type == "cuda" and parsed.index is None:
        return "cuda:0"
    return str(parsed)


def resolve_dtype(name: str, device: str) -> str:
    """A dtype name, with "auto" settled for `device`: bfloat16 on an accelerator and on a CPU
    with AVX-512 BF16 or AMX, float32 on other CPUs (where bf16 arithmetic is emulated and
    slower). Greedy output equals plain decoding's in either."""
    if name != "auto":
        torch_dtype(name)
        return name
    if torch.device(device).type != "cpu" or has_bf16_math():
        return "bfloat16"
    return "float32"


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(slots=True)
class EngineConfig:
    """target: HF directory or .gguf (None: the embedded SmolLM2-135M-Instruct);
    draft: checkpoint directory, "default" (the shipped draft, for the embedded target
    only) or None / "none" (plain decoding); lookup_tokens: most tokens copied from the
    context per round (None: 15 with a draft, 0 without, so no draft is plain decoding);
    reply_cache_tokens: tokens of earlier replies kept per namespace and copied where the
    context has no match (engine/reply_cache.py; 0 = off; copies only where lookup_tokens > 0);
    reply_corpus: copy from the target's own replies that trained the draft, shipped in the
    draft's directory, where neither the context nor the reply cache has a match
    (engine/reply_corpus.py; off by default: it gains on tool calls and code and loses at long
    context, docs/design.md; only where lookup_tokens > 0 and the draft ships one);
    tree_tokens: tokens of other branches (the draft's runners-up, other continuations from
    the context) verified next to a round's main proposal, as a tree (engine/candidate_tree.py;
    0 = off, the default; only where lookup_tokens > 0);
    tap_layers / normed_last_tap: target layers each forward returns and whether the last
    one is final-normed (None: the draft's own; none without a draft);
    cuda_graphs: decode and verify steps replayed from CUDA graphs per padded batch bucket
    (engine/graph_runner.py); only on CUDA with an attention backend that is graph-safe,
    elsewhere the flag is ignored (logged)."""

    target: str | Path | None = None
    draft: str | Path | None = "default"
    device: str = "cpu"
    dtype: str = "auto"  # settled by resolve_dtype: bfloat16 where the hardware does bf16 math
    attention_backend: str = "auto"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS
    verify_block_size: int | None = None
    adaptive_draft_length: bool = True
    lookup_tokens: int | None = None
    reply_cache_tokens: int = DEFAULT_REPLY_CACHE_TOKENS
    reply_corpus: bool = False
    tree_tokens: int = DEFAULT_TREE_TOKENS
    max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS
    block_size: int = KV_BLOCK_SIZE
    enable_prefix_cache: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    boundary_capacity: int = DEFAULT_BOUNDARY_CAPACITY
    tap_layers: tuple[int, ...] | None = None
    normed_last_tap: bool | None = None
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        self.device = normalize_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        if self.draft == "none":
            self.draft = None
        if self.scheduler is None:
            self.scheduler = SchedulerConfig()
        if self.max_kv_tokens < 1 or self.block_size < 1:
            raise ValueError(f"max_kv_tokens={self.max_kv_tokens} and block_size={self.block_size} must be >= 1")
        if self.reply_cache_tokens < 0:
            raise ValueError(f"reply_cache_tokens={self.reply_cache_tokens} must be >= 0")
        if self.tree_tokens < 0:
            raise ValueError(f"tree_tokens={self.tree_tokens} must be >= 0")
        if self.boundary_capacity < 0:
            raise ValueError(f"boundary_capacity={self.boundary_capacity} must be >= 0")
        if self.tap_layers is not None:
            self.tap_layers = tuple(self.tap_layers)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


# -- fitting a draft to the engine -------------------------------------------------------------
def verify_lengths(draft: DraftTransport | None, cfg: EngineConfig) -> tuple[int, int]:
    """(tokens drafted, tokens copied) at most per round, checked: a verify row is the anchor
    and those tokens, and only rows of up to MAX_POSITIONED_TOKENS are attended so that each
    token rounds as plain decoding would (longer ones could change a bf16 greedy token)."""
    k = min(cfg.num_draft_tokens, draft.info.max_draft_tokens) if draft else 0
    lookup_tokens = cfg.lookup_tokens
    if lookup_tokens is None:  # copy with a draft; without one, plain decoding stays plain
        lookup_tokens = DEFAULT_LOOKUP_TOKENS if draft is not None else 0
    if cfg.verify_block_size is not None:
        if cfg.verify_block_size < 1:
            raise ValueError(f"verify_block_size={cfg.verify_block_size} must be >= 1")
        k = min(k, cfg.verify_block_size - 1)  # never draft what the verify window would drop
        lookup_tokens = min(lookup_tokens, cfg.verify_block_size - 1)
    for name, n in (("num_draft_tokens", k), ("lookup_tokens", lookup_tokens)):
        if not 0 <= n < MAX_POSITIONED_TOKENS:
            raise ValueError(f"{name}={n} must lie in [0, {MAX_POSITIONED_TOKENS - 1}]")
    return k, lookup_tokens


def tap_layers(draft: DraftTransport | None, asked: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
    """The target layers to tap: the draft reads its own, so others are refused with one."""
    own = tuple(draft.info.target_layer_ids) if draft else ()
    if asked is None:
        return own
    asked = tuple(asked)
    if draft is not None and asked != own:
        raise ValueError(f"tap_layers {asked} differ from the draft's {own}")
    if any(not 0 <= i < num_layers for i in asked):
        raise ValueError(f"tap_layers {asked} must lie in [0, {num_layers})")
    return asked


def normed_last_tap(draft: DraftTransport | None, asked: bool | None) -> bool:
    """Whether the last layer's tap is final-normed: as the draft reads it; others are refused."""
    own = draft.info.normed_last_tap if draft else False
    if asked is None:
        return own
    if draft is not None and asked != own:
        raise ValueError(f"normed_last_tap={asked} differs from the draft's convention ({own})")
    return asked

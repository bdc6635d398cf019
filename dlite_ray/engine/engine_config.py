"""EngineConfig: every knob of an engine and of its loading, checked once.

Also the one dtype-name mapping and device normalisation the rest of the package uses,
and the checks that fit a draft to the engine (taps, verify lengths).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast, get_type_hints

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

DtypeName = Literal["float32", "bfloat16", "float16"]
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


def resolve_dtype(name: str, device: str) -> DtypeName:
    """A dtype name, with "auto" settled for `device`: bfloat16 on an accelerator and on a CPU
    with AVX-512 BF16 or AMX, float32 on other CPUs (where bf16 arithmetic is emulated and
    slower). Greedy output equals plain decoding's in either."""
    if name != "auto":
        torch_dtype(name)
        return cast(DtypeName, name)
    if torch.device(device).type != "cpu" or has_bf16_math():
        return "bfloat16"
    return "float32"


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(slots=True)
class EngineConfig:
    """Every knob of an engine, each with its default and its one-line description
    (`metadata["help"]`). It is the one list: Serve's EngineArgs offers each knob with this
    default and description (a test holds them equal), and `dlite-ray generate` makes its
    flags from it; `knob_fields` lists them, the scheduler's in place of `scheduler`."""

    target: str | Path | None = field(default=None, metadata={
        "help": "HF directory or .gguf of the target; null = the embedded SmolLM2-135M-Instruct"})
    draft: str | Path | None = field(default="default", metadata={
        "help": "draft checkpoint directory, 'default' (the shipped draft, for the embedded target only) or "
                "'none' (plain decoding)"})
    device: str = field(default="cpu", metadata={
        "help": "torch device of the target (and of a draft in the same process)"})
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata={
        "help": "weights and activations dtype; auto = bfloat16 on an accelerator and on CPUs with AVX-512 BF16 "
                "or AMX, float32 on other CPUs (where bf16 arithmetic is emulated and slower)"})
    attention_backend: Literal["auto", "sdpa", "flash_attn", "triton"] = field(default="auto", metadata={
        "help": "target attention kernel: auto = flash_attn where installed on CUDA, else triton on CUDA, "
                "else sdpa"})
    num_draft_tokens: int = field(default=DEFAULT_NUM_DRAFT_TOKENS, metadata={
        "help": "K: most tokens drafted per round"})
    verify_block_size: int | None = field(default=None, metadata={
        "help": "most tokens of a verify row (its anchor and the tokens it checks): drafts and copies are cut "
                "to one less; null = no cut beyond num_draft_tokens and lookup_tokens"})
    adaptive_draft_length: bool = field(default=True, metadata={
        "help": "choose K per request and step from measured costs"})
    lookup_tokens: int | None = field(default=None, metadata={
        "help": "most tokens copied from the context per round instead of drafted; null = 15 with a draft, "
                "0 without (so no draft is plain decoding); 0 = off"})
    reply_cache_tokens: int = field(default=DEFAULT_REPLY_CACHE_TOKENS, metadata={
        "help": "tokens of earlier replies kept per tenant and copied where a request's context has no match "
                "(engine/reply_cache.py; only where lookup_tokens > 0); 0 = off, the default (8192 holds ~70 "
                "replies)"})
    reply_corpus: bool = field(default=False, metadata={
        "help": "copy from the target's training replies shipped with the draft (reply_corpus.safetensors) "
                "where neither the context nor the reply cache has a match (engine/reply_corpus.py; only where "
                "lookup_tokens > 0); shared by every tenant, it holds no user data. Off by default: it gains on "
                "tool calls and code and loses at long context (docs/design.md)"})
    tree_tokens: int = field(default=DEFAULT_TREE_TOKENS, metadata={
        "help": "most tokens of other branches (the draft's runners-up, other continuations from the context) "
                "verified next to a round's draft or copy, as a tree (engine/candidate_tree.py; only where "
                "lookup_tokens > 0, and while the policy measures they pay); 0 = off, the default: on CPUs "
                "verify rows cost more than they gain"})
    max_kv_tokens: int = field(default=DEFAULT_MAX_KV_TOKENS, metadata={
        "help": "paged KV pool size, in tokens"})
    block_size: int = field(default=KV_BLOCK_SIZE, metadata={
        "help": "tokens per KV block: the unit the pool allocates and the prefix cache reuses"})
    enable_prefix_cache: bool = field(default=True, metadata={
        "help": "reuse the KV of the full blocks an earlier request of the tenant computed for the same tokens, "
                "and resume follow-up turns from stored boundaries; false = every prompt is computed whole"})
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # its knobs: scheduler.py
    boundary_capacity: int = field(default=DEFAULT_BOUNDARY_CAPACITY, metadata={
        "help": "finished requests' boundaries (KV, anchor and draft features: a follow-up turn resumes "
                "without recompute) kept outside conversation leases, the least recently used going first"})
    tap_layers: tuple[int, ...] | None = field(default=None, metadata={
        "help": "target layers each forward returns for the draft; null = the draft's own (none without a "
                "draft); other layers are refused with a draft"})
    normed_last_tap: bool | None = field(default=None, metadata={
        "help": "whether the last tapped layer is final-normed; null = as the draft reads it"})
    cuda_graphs: bool = field(default=False, metadata={
        "help": "replay decode and verify steps from CUDA graphs per padded batch bucket "
                "(engine/graph_runner.py); only on CUDA with a graph-safe attention backend, elsewhere "
                "ignored (logged)"})

    def __post_init__(self) -> None:
        self.device = normalize_device(self.device)
        self.dtype = resolve_dtype(self.dtype, self.device)
        if not self.target:  # "" as null: a deployment may leave the path empty
            self.target = None
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


# -- the knobs, flat ------------------------------------------------------------------------------
def knob_fields() -> dict[str, Field]:
    """Every knob a user sets, by name: EngineConfig's fields with SchedulerConfig's in place of
    `scheduler`. Serve's EngineArgs and the CLI's engine flags offer each of them."""
    engine = {f.name: f for f in fields(EngineConfig) if f.name != "scheduler"}
    scheduler = {f.name: f for f in fields(SchedulerConfig)}
    assert not engine.keys() & scheduler.keys(), "a scheduler knob shadows an engine knob"
    return engine | scheduler


def knob_types() -> dict[str, Any]:
    """Each knob's type (the annotations, resolved)."""
    hints = get_type_hints(EngineConfig) | get_type_hints(SchedulerConfig)
    return {name: hints[name] for name in knob_fields()}


def config_from_knobs(knobs: Mapping[str, Any]) -> EngineConfig:
    """An EngineConfig from flat knob values (Serve's EngineArgs, the CLI's flags): the scheduler's
    go to its SchedulerConfig; a knob not named keeps its default; an unknown name is a TypeError."""
    scheduler_names = {f.name for f in fields(SchedulerConfig)}
    scheduler = SchedulerConfig(**{k: v for k, v in knobs.items() if k in scheduler_names})
    return EngineConfig(**{k: v for k, v in knobs.items() if k not in scheduler_names}, scheduler=scheduler)


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

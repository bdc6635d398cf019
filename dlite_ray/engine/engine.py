"""DLiteEngine: the library API (`from_pretrained(...).generate(...)`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dlite_ray.constants import DEFAULT_LOOKUP_TOKENS, DEFAULT_MAX_KV_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, KV_BLOCK_SIZE
from dlite_ray.engine.block_manager import OutOfBlocks
from dlite_ray.engine.boundary_store import BoundaryStore
from dlite_ray.engine.context_lookup import ContextLookup
from dlite_ray.engine.draft_transport import DraftTransport, InProcessDraftTransport
from dlite_ray.engine.logprobs import TokenLogprob
from dlite_ray.engine.model_runner import ModelRunner
from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.engine.scheduler import Scheduler, SchedulerConfig
from dlite_ray.engine.sequence import FINISH_ABORT, InvalidRequest, SamplingParams, Sequence
from dlite_ray.engine.spec_decode import SpecDecoder
from dlite_ray.engine.speculation_policy import SpeculationPolicy
from dlite_ray.engine.stop_strings import StopStrings, text_before_stop
from dlite_ray.engine.structured_output import GrammarTokenizer, grammar_for_schema
from dlite_ray.engine.trace import Trace
from dlite_ray.runtime.attention import MAX_POSITIONED_TOKENS
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import checkpoint_fingerprint, load_target
from dlite_ray.runtime.target_model import TargetModel

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
Prompt = str | Messages | list[int]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", or "error" (then `error` says why)
    stats: RequestStats = field(default_factory=RequestStats)
    trace: Trace | None = None  # with trace_top_k > 0
    logprobs: list[TokenLogprob] | None = None  # with logprobs set: one entry per token of token_ids
    error: str | None = None  # with finish_reason "error": why the reply could not go on (its grammar failed)


@dataclass(slots=True)
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]

    @property
    def finished(self) -> bool:
        return self.seq.is_finished


def load_draft(path: str | Path, target: TargetModel, dtype: str = "float32",
               device: str = "cpu") -> InProcessDraftTransport:
    """A draft checkpoint for `target`, drafting in this process."""
    drafter = DLiteDraftModel.load(path, target.embed_tokens, target.cfg.num_layers, DTYPES[dtype], device)
    return InProcessDraftTransport(drafter, checkpoint_fingerprint(path))


def _verify_lengths(draft: DraftTransport | None, num_draft_tokens: int, verify_block_size: int | None,
                    lookup_tokens: int | None) -> tuple[int, int]:
    """(tokens drafted, tokens copied) at most per round, checked: a verify row is the anchor
    and those tokens, and only rows of up to MAX_POSITIONED_TOKENS are attended so that each
    token rounds as plain decoding would (longer ones could change a bf16 greedy token)."""
    k = min(num_draft_tokens, draft.info.max_draft_tokens) if draft else 0
    if lookup_tokens is None:  # copy with a draft; without one, plain decoding stays plain
        lookup_tokens = DEFAULT_LOOKUP_TOKENS if draft is not None else 0
    if verify_block_size is not None:
        if verify_block_size < 1:
            raise ValueError(f"verify_block_size={verify_block_size} must be >= 1")
        k = min(k, verify_block_size - 1)  # never draft what the verify window would drop
        lookup_tokens = min(lookup_tokens, verify_block_size - 1)
    for name, n in (("num_draft_tokens", k), ("lookup_tokens", lookup_tokens)):
        if not 0 <= n < MAX_POSITIONED_TOKENS:
            raise ValueError(f"{name}={n} must lie in [0, {MAX_POSITIONED_TOKENS - 1}]")
    return k, lookup_tokens


class DLiteEngine:
    """Target + paged KV + scheduler + draft transport. `add_request` / `step` / `abort`
    drive it one ragged forward at a time (the server's API); `generate` runs a batch."""

    def __init__(self, target: TargetModel, tokenizer, draft: DraftTransport | None, *,
                 num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS, verify_block_size: int | None = None,
                 adaptive_draft_length: bool = True, lookup_tokens: int | None = None,
                 max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
                 block_size: int = KV_BLOCK_SIZE, attention_backend: str = "auto", enable_prefix_cache: bool = True,
                 scheduler: SchedulerConfig | None = None, boundary_capacity: int = 64,
                 tap_layers: tuple[int, ...] | None = None, normed_last_tap: bool | None = None):
        """tap_layers: target layers whose hidden states each forward returns (for the
        draft's pivot features and request traces); the draft's, none without a draft.
        normed_last_tap: the last layer's tap after the final norm; the draft's convention."""
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        tap_layers = _tap_layers(draft, tap_layers, target.cfg.num_layers)
        self.runner = ModelRunner(target, tap_layers, max_kv_tokens, block_size, attention_backend,
                                  enable_prefix_cache, _normed_last_tap(draft, normed_last_tap))
        self.eos_ids = _eos_ids(target, tokenizer)
        k, lookup_tokens = _verify_lengths(draft, num_draft_tokens, verify_block_size, lookup_tokens)
        self.policy = SpeculationPolicy(k, adaptive=adaptive_draft_length)
        self.decoder = SpecDecoder(self.runner, draft, self.eos_ids, self.policy, ContextLookup(lookup_tokens))
        self.target_fingerprint = target.fingerprint()
        self.draft_fingerprint = draft.info.fingerprint if draft else "none"
        self.boundaries = BoundaryStore(self.runner.blocks, boundary_capacity) if enable_prefix_cache else None
        self.scheduler = Scheduler(scheduler or SchedulerConfig(), self.runner.blocks, lookahead=max(k, lookup_tokens) + 1,
                                   admit=self._admit, evict=self._evict_cached, release=self.runner.release)
        self._by_id: dict[str, Sequence] = {}
        self._lease_of: dict[str, str] = {}  # request id -> the conversation lease it ends under
        self._grammar_tok: GrammarTokenizer | None = None

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = "default", *,
                        device: str = "cpu", dtype: str = "float32", attention_backend: str = "auto",
                        lookup_tokens: int | None = None, **engine_kwargs) -> DLiteEngine:
        """target: HF directory or .gguf (None = embedded SmolLM2-135M-Instruct);
        draft: checkpoint directory, "default" (the shipped draft) or None (plain decoding);
        lookup_tokens: most tokens copied from the context per round (None: 15 with a
        draft, 0 without, so draft=None is plain decoding)."""
        from transformers import AutoTokenizer  # heavy

        from dlite_ray.runtime.model_store import default_model_dir

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        target_path = Path(target) if target is not None else default_model_dir()
        model = load_target(target_path, DTYPES[dtype], device)
        if target_path.suffix == ".gguf":
            tokenizer = AutoTokenizer.from_pretrained(target_path.parent, gguf_file=target_path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(target_path)
        draft_path = draft
        if draft == "default":
            draft_path = default_draft_dir() if target is None else None
            if target is not None:
                log.info("no default draft for a custom target: plain decoding (pass draft=PATH)")
        transport = None if draft_path is None else load_draft(draft_path, model, dtype, device)
        return cls(model, tokenizer, transport, attention_backend=attention_backend, lookup_tokens=lookup_tokens,
                   **engine_kwargs)

    @property
    def lookup_tokens(self) -> int:
        """Most tokens a round copies from the context (0: copying is off)."""
        return self.decoder.lookup.max_tokens

    # -- prompts --------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._chat_ids(prompt)
        else:
            raise InvalidRequest("a prompt must be a non-empty string, token-id list or list of chat messages")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        vocab = self.target.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequest(f"token ids must lie in [0, {vocab})")
        limit = self.runner.max_context
        if len(ids) >= limit:
            raise InvalidRequest(f"prompt of {len(ids)} tokens does not fit the model context of {limit}")
        return ids

    def _chat_ids(self, messages: Messages) -> list[int]:
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequest("each chat message needs string 'role' and 'content'")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    # -- the serving API ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    lease: str | None = None) -> Sequence:
        """Queue a request. With `lease` (a conversation's name), its KV and boundary
        features stay pinned after it finishes, until `release_lease(lease)`."""
        seq = Sequence(self.encode(prompt), params)
        vocab = self.target.cfg.vocab_size
        if params.trace_top_k > vocab:
            raise InvalidRequest(f"trace_top_k={params.trace_top_k} exceeds the vocabulary ({vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise InvalidRequest(f"logprobs={params.logprobs} exceeds the vocabulary ({vocab})")
        if params.stop:
            seq.stop_strings = StopStrings(params.stop, self.decode_output)
        if params.grammar is not None:
            seq.grammar = self._grammar_tokenizer().matcher(params.grammar)
        if request_id is not None:
            if request_id in self._by_id:
                raise InvalidRequest(f"request id {request_id!r} is already running")
            seq.request_id = request_id
        budget = self.runner.max_context - len(seq.token_ids)
        seq.params.max_new_tokens = min(seq.params.max_new_tokens, budget)
        blocks = self.runner.blocks
        worst = len(seq.token_ids) + seq.params.max_new_tokens + self.scheduler.lookahead
        if blocks.blocks_needed(worst) > blocks.num_blocks:
            raise InvalidRequest(f"request needs up to {worst} KV positions; the pool holds "
                                 f"{blocks.num_blocks * blocks.block_size} (raise max_kv_tokens)")
        self._by_id[seq.request_id] = seq
        if lease is not None:
            self._lease_of[seq.request_id] = lease
        self.scheduler.add(seq)
        return seq

    def _grammar_tokenizer(self) -> GrammarTokenizer:
        """Built on the first structured request (it reads the whole vocabulary once)."""
        if self._grammar_tok is None:
            self._grammar_tok = GrammarTokenizer(self.tokenizer, self.target.cfg.vocab_size, self.eos_ids)
        return self._grammar_tok

    def step(self) -> list[StepOutput]:
        """One scheduled forward: prefill chunks and speculation rounds together."""
        schedule = self.scheduler.schedule()
        if schedule.is_empty:
            if self.scheduler.has_work():
                raise OutOfBlocks("the KV pool cannot hold even one waiting request; raise max_kv_tokens")
            return []
        emitted = self.decoder.step(schedule)
        outputs = [StepOutput(seq, toks) for seq, toks in emitted.items()]
        for seq in emitted:
            if seq.is_finished:
                self._finish(seq)
        return outputs

    def abort(self, request_id: str) -> bool:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return False
        self._finish(seq)
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _admit(self, seq: Sequence) -> None:
        """First KV for a sequence: a stored boundary (no recompute), else the prefix cache."""
        if self.boundaries is not None and self.draft is not None:
            b = self.boundaries.take(seq.token_ids, self.target_fingerprint, self.draft_fingerprint)
            if b is not None:
                seq.block_table, seq.block_hashes = list(b.blocks), list(b.block_hashes)
                seq.num_computed, seq.pivot_features = len(b.tokens), b.pivot_features
                seq.stats.resumed_from_boundary = True
                return
        need = len(seq.token_ids) - 1
        blocks, hashes = self.runner.blocks.match_prefix(seq.token_ids, need)
        seq.block_table, seq.block_hashes = blocks, hashes
        seq.num_computed = len(blocks) * self.runner.blocks.block_size
        if seq.num_computed == need and need > 0 and self.draft is not None and self.runner.tap_layers:
            seq.num_computed -= 1  # recompute the pivot: its features are not cached
        seq.stats.cached_prompt_tokens = seq.num_computed

    def _evict_cached(self) -> bool:
        return self.boundaries is not None and self.boundaries.evict_oldest()

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._by_id.pop(seq.request_id, None)
        lease = self._lease_of.pop(seq.request_id, None)
        if self.boundaries is not None and seq.finish_reason != FINISH_ABORT:
            if seq.num_computed > len(seq.token_ids) - 1:
                # stopped inside a round: drop the KV of drafts after the stop; the pivot
                # features were for a later position, so the boundary keeps KV only
                self.runner.commit(seq, len(seq.token_ids) - 1)
                seq.pivot_features = None
            self.boundaries.save(seq.token_ids, seq.num_computed, seq.pivot_features, seq.block_table,
                                 seq.block_hashes, self.target_fingerprint, self.draft_fingerprint, lease)
        self.runner.release(seq)

    # -- conversation leases --------------------------------------------------------------------
    def release_lease(self, lease: str) -> bool:
        """A conversation's lease ended: its KV becomes ordinary, evictable prefix cache."""
        return self.boundaries is not None and self.boundaries.release_lease(lease)

    @property
    def held_leases(self) -> list[str]:
        return self.boundaries.leases if self.boundaries is not None else []

    def take_evicted_leases(self) -> list[str]:
        """Leases whose KV was given up under memory pressure since the last call."""
        if self.boundaries is None:
            return []
        return self.boundaries.take_evicted_leases()

    # -- the library API ----------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, verify_mode: str | None = None,
                 stop_token_ids: tuple[int, ...] = (), stop: str | tuple[str, ...] = (), ignore_eos: bool = False,
                 trace_top_k: int = 0, logprobs: int | None = None, json_schema: str | None = None,
                 callback: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a batch; each request advances by its own acceptance.

        A prompt is a string, a list of chat messages ({"role", "content"}) or token ids.
        `callback(request_index, new_token_ids)` streams tokens as they are committed. `stop`
        strings end a request with the token that completes one; its text ends before it.
        `trace_top_k` > 0 returns each result's `Trace` (the engine's tap features and the
        target's top-k distribution at every output position). `logprobs` = n returns each
        output token's logprob and the n most likely tokens' (`engine/logprobs.py`).
        `json_schema` (a schema as JSON text) constrains every reply to JSON it accepts
        (`engine/structured_output.py`); a reply whose grammar fails midway (a parser limit)
        ends with finish_reason "error" and `GenerationResult.error` saying why.
        """
        batch = prompts if _is_batch(prompts) else [prompts]
        encoded = [self.encode(p) for p in batch]  # validate everything before queueing anything
        grammar = None if json_schema is None else grammar_for_schema(json_schema)
        seqs = []
        for i, ids in enumerate(encoded):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=None if seed is None else seed + i, verify_mode=verify_mode,
                                    stop_token_ids=tuple(stop_token_ids), stop=stop, ignore_eos=ignore_eos,
                                    trace_top_k=trace_top_k, logprobs=logprobs, grammar=grammar)
            seqs.append(self.add_request(ids, params))
        index = {s: i for i, s in enumerate(seqs)}
        try:
            while any(not s.is_finished for s in seqs):
                for out in self.step():
                    if callback is not None and out.seq in index and out.new_token_ids:
                        callback(index[out.seq], out.new_token_ids)
        finally:
            for s in seqs:
                if not s.is_finished:
                    self.abort(s.request_id)
        return [self.result(s) for s in seqs]

    def result(self, seq: Sequence) -> GenerationResult:
        text = text_before_stop(self.decode_output(seq.output_ids), seq.params.stop)
        return GenerationResult(text, seq.output_ids, seq.finish_reason, RequestStats.of(seq), seq.trace, seq.logprobs,
                                seq.error)

    def decode_output(self, ids: list[int]) -> str:
        """The text of output tokens (end-of-sequence tokens are not text)."""
        return self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=True)


def default_draft_dir() -> Path | None:
    path = Path(__file__).resolve().parent.parent / "default_draft"
    if (path / "config.json").exists():
        return path
    log.warning("no default draft shipped at %s: plain decoding", path)
    return None


def _tap_layers(draft: DraftTransport | None, asked: tuple[int, ...] | None, num_layers: int) -> tuple[int, ...]:
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


def _normed_last_tap(draft: DraftTransport | None, asked: bool | None) -> bool:
    """Whether the last layer's tap is final-normed: as the draft reads it; others are refused."""
    own = draft.info.normed_last_tap if draft else False
    if asked is None:
        return own
    if draft is not None and asked != own:
        raise ValueError(f"normed_last_tap={asked} differs from the draft's convention ({own})")
    return asked


def _is_batch(prompts) -> bool:
    if isinstance(prompts, str) or not isinstance(prompts, list) or not prompts:
        return False
    return isinstance(prompts[0], (str, list))  # several strings, message lists or id lists


def _eos_ids(target: TargetModel, tokenizer) -> tuple[int, ...]:
    ids = set(target.cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

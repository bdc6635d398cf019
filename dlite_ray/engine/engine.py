"""DLiteEngine: the library API (`from_pretrained(...).generate(...)`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from dlite_ray.constants import DEFAULT_REPLY_CACHE_NAMESPACES
from dlite_ray.engine.block_manager import OutOfBlocks
from dlite_ray.engine.context_lookup import ContextLookup
from dlite_ray.engine.copy_sources import copy_sources
from dlite_ray.engine.draft_transport import DraftTransport, InProcessDraftTransport
from dlite_ray.engine.engine_config import DTYPES, EngineConfig, normed_last_tap, tap_layers, verify_lengths
from dlite_ray.engine.graph_runner import GraphConfig
from dlite_ray.engine.loading import DraftFactory, default_draft_dir, load_corpus, load_draft, load_parts
from dlite_ray.engine.logprobs import TokenLogprob
from dlite_ray.engine.model_runner import ModelRunner
from dlite_ray.engine.prompts import Messages, Prompt, PromptBatch, PromptEncoder, is_batch
from dlite_ray.engine.reply_cache import ReplyCache
from dlite_ray.engine.reply_corpus import ReplyCorpus
from dlite_ray.engine.request_stats import RequestStats
from dlite_ray.engine.scheduler import KVReuse, Scheduler
from dlite_ray.engine.sequence import InvalidRequest, SamplingParams, Sequence
from dlite_ray.engine.spec_decode import SpecDecoder
from dlite_ray.engine.speculation_policy import SpeculationPolicy
from dlite_ray.engine.stop_strings import StopStrings, text_before_stop
from dlite_ray.engine.structured_output import GrammarTokenizer, grammar_for_schema
from dlite_ray.engine.trace import Trace
from dlite_ray.runtime.target_model import TargetModel

# importable from here as before
__all__ = ["DTYPES", "DLiteEngine", "EngineConfig", "GenerationResult", "Messages", "Prompt", "StepOutput",
           "default_draft_dir", "load_draft"]


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


class DLiteEngine:
    """Target + paged KV + scheduler + draft transport. `add_request` / `step` / `abort`
    drive it one ragged forward at a time (the server's API); `generate` runs a batch."""

    def __init__(self, target: TargetModel, tokenizer, draft: DraftTransport | None,
                 config: EngineConfig | None = None, corpus: ReplyCorpus | None = None, **knobs):
        """The low-level constructor, on a loaded target (`from_config` loads one): `config`,
        or its fields as keywords (num_draft_tokens, max_kv_tokens, scheduler, tap_layers,
        ...; its target / draft / device / dtype only matter to `from_config`); `corpus`: the
        draft's reply corpus, copied from where config.reply_corpus (and copying) is on."""
        cfg = config if config is not None else EngineConfig(**knobs)
        self.config = cfg
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        taps = tap_layers(draft, cfg.tap_layers, target.cfg.num_layers)
        k, lookup_tokens = verify_lengths(draft, cfg)
        graphs = GraphConfig(query_lens=(1, k + 1) if k else (1,)) if cfg.cuda_graphs else None
        if graphs is not None and isinstance(draft, InProcessDraftTransport) and draft.device.type == "cuda":
            draft.use_round_graphs(graphs.max_rows)  # the draft's greedy rounds too
        self.runner = ModelRunner(target, taps, cfg.max_kv_tokens, cfg.block_size, cfg.attention_backend,
                                  normed_last_tap=normed_last_tap(draft, cfg.normed_last_tap), graphs=graphs)
        self.eos_ids = _eos_ids(target, tokenizer)
        self.prompts = PromptEncoder(tokenizer, target.cfg.vocab_size, self.runner.max_context)
        self.policy = SpeculationPolicy(k, adaptive=cfg.adaptive_draft_length)
        # earlier replies are copied within the lookup's limit: none where copying is off
        self.reply_cache = (ReplyCache(cfg.reply_cache_tokens, DEFAULT_REPLY_CACHE_NAMESPACES)
                            if cfg.reply_cache_tokens and lookup_tokens else None)
        self.corpus = corpus if cfg.reply_corpus and lookup_tokens else None
        tree_tokens = cfg.tree_tokens if lookup_tokens else 0  # branches are copies from the context
        lookup = ContextLookup(lookup_tokens, alternatives=bool(tree_tokens))
        self.decoder = SpecDecoder(self.runner, draft, self.eos_ids, self.policy, lookup,
                                   copy_sources(lookup, self.reply_cache, self.corpus), tree_tokens)
        reuse = KVReuse(target.fingerprint(), draft.info.fingerprint if draft else "none",
                        resume_boundaries=draft is not None, recompute_pivot=draft is not None and bool(taps))
        lookahead = max(k, lookup_tokens) + 1 + tree_tokens  # a row's anchor, main proposal and branches
        self.scheduler = Scheduler(cfg.scheduler, self.runner.num_blocks, self.runner.block_size, lookahead, reuse,
                                   prefix_cache=cfg.enable_prefix_cache, boundary_capacity=cfg.boundary_capacity)
        self._grammar_tok: GrammarTokenizer | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, make_draft: DraftFactory | None = None) -> DLiteEngine:
        """Load the target, its tokenizer and the draft `config` names and build the engine;
        `make_draft` makes the draft's transport (default: the draft in this process)."""
        target, tokenizer, draft = load_parts(config, make_draft)
        return cls(target, tokenizer, draft, config, corpus=load_corpus(config))

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = "default",
                        **kwargs) -> DLiteEngine:
        """target: HF directory or .gguf (None = embedded SmolLM2-135M-Instruct);
        draft: checkpoint directory, "default" (the shipped draft) or None (plain decoding);
        other keywords: EngineConfig's (device, dtype, lookup_tokens, ...)."""
        return cls.from_config(EngineConfig(target=target, draft=draft, **kwargs))

    @property
    def lookup_tokens(self) -> int:
        """Most tokens a round copies from the context (0: copying is off)."""
        return self.decoder.lookup.max_tokens

    # -- prompts --------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids, checked (InvalidRequest)."""
        return self.prompts.encode(prompt)

    # -- the serving API ----------------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None,
                    lease: str | None = None, namespace: str | None = None) -> Sequence:
        """Queue a request. With `lease` (a conversation's name), its KV and boundary
        features stay pinned after it finishes, until `release_lease(lease)`. `namespace`
        (a tenant; None: the engine-wide default) is whose earlier replies it may copy
        from, and where its own reply is kept (`reply_cache.py`)."""
        seq = Sequence(self.encode(prompt), params, namespace=namespace)
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
            seq.request_id = request_id
        budget = self.runner.max_context - len(seq.token_ids)
        seq.params.max_new_tokens = min(seq.params.max_new_tokens, budget)
        self.scheduler.add(seq, lease)
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
        self.scheduler.postprocess(schedule)
        if self.reply_cache is not None:
            for seq in emitted:  # a request finishes only in a round it emits in (aborts are not kept)
                if seq.is_finished:
                    self.reply_cache.add(seq.namespace, seq.prompt_ids, seq.output_ids)
        return [StepOutput(seq, toks) for seq, toks in emitted.items()]

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- conversation leases --------------------------------------------------------------------
    def release_lease(self, lease: str) -> bool:
        """A conversation's lease ended: its KV becomes ordinary, evictable prefix cache."""
        return self.scheduler.release_lease(lease)

    @property
    def held_leases(self) -> list[str]:
        return self.scheduler.held_leases

    def take_evicted_leases(self) -> list[str]:
        """Leases whose KV was given up under memory pressure since the last call."""
        return self.scheduler.take_evicted_leases()

    # -- the library API ----------------------------------------------------------------------
    def generate(self, prompts: Prompt | PromptBatch, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, verify_mode: str | None = None,
                 stop_token_ids: tuple[int, ...] = (), stop: str | tuple[str, ...] = (), ignore_eos: bool = False,
                 trace_top_k: int = 0, logprobs: int | None = None, json_schema: str | None = None,
                 grammar: str | None = None,
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
        ends with finish_reason "error" and `GenerationResult.error` saying why. `grammar` is
        a grammar's text, as `grammar_for_schema` or `grammar_for_calls` (a forced tool call) make it.
        """
        if json_schema is not None and grammar is not None:
            raise InvalidRequest("give json_schema or grammar, not both")
        batch = prompts if is_batch(prompts) else [cast(Prompt, prompts)]  # not a batch: one prompt
        encoded = [self.encode(p) for p in batch]  # validate everything before queueing anything
        grammar = grammar if json_schema is None else grammar_for_schema(json_schema)
        seqs = []
        for i, ids in enumerate(encoded):
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                    seed=None if seed is None else seed + i, verify_mode=verify_mode,
                                    stop_token_ids=tuple(stop_token_ids),
                                    stop=(stop,) if isinstance(stop, str) else stop, ignore_eos=ignore_eos,
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


def _eos_ids(target: TargetModel, tokenizer) -> tuple[int, ...]:
    ids = set(target.cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

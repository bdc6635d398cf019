"""DLiteEngine: the library API (`from_pretrained(...).generate(...)`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from dlite_ray.constants import DEFAULT_MAX_KV_TOKENS, DEFAULT_NUM_DRAFT_TOKENS, KV_BLOCK_SIZE
from dlite_ray.engine.draft_transport import DraftTransport, InProcessDraftTransport
from dlite_ray.engine.model_runner import ModelRunner
from dlite_ray.engine.sequence import InvalidRequest, SamplingParams, Sequence
from dlite_ray.engine.spec_decode import SpecDecoder
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import load_target, weights_fingerprint
from dlite_ray.runtime.target_model import TargetModel

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
Prompt = str | Messages | list[int]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict[str, Any] = field(default_factory=dict)


class DLiteEngine:
    def __init__(self, target: TargetModel, tokenizer, draft: DraftTransport | None, *,
                 num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS, verify_block_size: int | None = None,
                 max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS, block_size: int = KV_BLOCK_SIZE,
                 attention_backend: str = "auto"):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        tap_layers = draft.info.target_layer_ids if draft else ()
        self.runner = ModelRunner(target, tap_layers, max_kv_tokens, block_size, attention_backend)
        self.eos_ids = _eos_ids(target, tokenizer)
        self.decoder = SpecDecoder(self.runner, draft, self.eos_ids, num_draft_tokens, verify_block_size)

    @classmethod
    def from_pretrained(cls, target: str | Path | None = None, draft: str | Path | None = "default", *,
                        device: str = "cpu", dtype: str = "float32", attention_backend: str = "auto",
                        **engine_kwargs) -> "DLiteEngine":
        """target: HF directory or .gguf (None = embedded SmolLM2-135M-Instruct);
        draft: checkpoint directory, "default" (the shipped draft) or None (plain decoding)."""
        from transformers import AutoTokenizer  # noqa: PLC0415 - heavy

        from dlite_ray.runtime.model_store import default_model_dir  # noqa: PLC0415

        if dtype not in DTYPES:
            raise InvalidRequest(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        target_path = Path(target) if target is not None else default_model_dir()
        model = load_target(target_path, DTYPES[dtype], device)
        if target_path.suffix == ".gguf":
            tokenizer = AutoTokenizer.from_pretrained(target_path.parent, gguf_file=target_path.name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(target_path)
        transport = None
        draft_path = default_draft_dir() if draft == "default" and target is None else draft
        if draft == "default" and target is not None:
            draft_path = None
            log.info("no default draft for a custom target: plain decoding (pass draft=PATH)")
        if draft_path is not None:
            drafter = DLiteDraftModel.load(draft_path, model.embed_tokens, model.cfg.num_layers, DTYPES[dtype], device)
            transport = InProcessDraftTransport(drafter, weights_fingerprint(drafter))
        return cls(model, tokenizer, transport, attention_backend=attention_backend, **engine_kwargs)

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

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompts: Prompt | list[Prompt], max_new_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None, verify_mode: str | None = None,
                 stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
                 callback: Callable[[int, list[int]], None] | None = None) -> list[GenerationResult]:
        """Generate for one prompt or a batch; each request advances by its own acceptance.

        A prompt is a string, a list of chat messages ({"role", "content"}) or token ids.
        `callback(request_index, new_token_ids)` streams tokens as they are committed.
        """
        seqs = self.make_sequences(prompts, max_new_tokens, temperature, top_k, top_p, seed, verify_mode,
                                   stop_token_ids, ignore_eos)
        for index, tokens in self.stream(seqs):
            if callback is not None:
                callback(index, tokens)
        return [self.result(s) for s in seqs]

    def make_sequences(self, prompts, max_new_tokens=128, temperature=0.0, top_k=0, top_p=1.0, seed=None,
                       verify_mode=None, stop_token_ids=(), ignore_eos=False) -> list[Sequence]:
        batch = prompts if _is_batch(prompts) else [prompts]
        seqs = []
        for i, prompt in enumerate(batch):
            params = SamplingParams(max_new_tokens, temperature, top_k, top_p,
                                    None if seed is None else seed + i, verify_mode, tuple(stop_token_ids),
                                    ignore_eos)
            seqs.append(Sequence(self.encode(prompt), params))
        return seqs

    def stream(self, seqs: list[Sequence]) -> Iterator[tuple[int, list[int]]]:
        """Run sequences to completion, yielding (index, newly committed token ids)."""
        index = {s: i for i, s in enumerate(seqs)}
        try:
            for seq, toks in self.decoder.prefill(seqs).items():
                yield index[seq], toks
            running = [s for s in seqs if not s.is_finished]
            while running:
                for seq, toks in self.decoder.step(running).items():
                    if toks:
                        yield index[seq], toks
                running = [s for s in running if not s.is_finished]
        finally:
            for s in seqs:
                self.runner.release(s)

    def result(self, seq: Sequence) -> GenerationResult:
        ids = [t for t in seq.output_ids if t not in self.eos_ids]
        return GenerationResult(self.tokenizer.decode(ids, skip_special_tokens=True), seq.output_ids,
                                seq.finish_reason, stats_dict(seq))


def stats_dict(seq: Sequence) -> dict[str, Any]:
    st = seq.stats
    after_first = len(seq.output_ids) - 1
    tps = after_first / st.decode_wall_time if st.decode_wall_time > 0 else 0.0
    return {
        "accept_lengths": st.accept_lengths,
        "mean_accept_length": st.mean_accept_length,
        "position_accepts": st.position_accepts,
        "position_trials": st.position_trials,
        "prefill_time": st.prefill_time,
        "decode_wall_time": st.decode_wall_time,
        "draft_time": st.draft_time,
        "verify_time": st.verify_time,
        "decode_tokens_per_second": tps,
        "num_prompt_tokens": len(seq.prompt_ids),
        "num_output_tokens": len(seq.output_ids),
    }


def default_draft_dir() -> Path | None:
    path = Path(__file__).resolve().parent.parent / "default_draft"
    if (path / "config.json").exists():
        return path
    log.warning("no default draft shipped at %s: plain decoding", path)
    return None


def _is_batch(prompts) -> bool:
    if isinstance(prompts, str) or not isinstance(prompts, list) or not prompts:
        return False
    return isinstance(prompts[0], (str, list))  # several strings, message lists or id lists


def _eos_ids(target: TargetModel, tokenizer) -> tuple[int, ...]:
    ids = set(target.cfg.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))

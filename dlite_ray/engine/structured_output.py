"""Structured output (`SamplingParams.json_schema`, OpenAI's `response_format`): the reply
must be JSON that a schema accepts.

The grammar masks the target's logits, never the draft's. Verify row m of a round holds the
target's logits after [anchor, d_1..d_m]; it is masked to the tokens the grammar allows
after the reply so far plus d_1..d_m. Greedy and rejection verification then run on the
masked distribution exactly as on an unmasked one, so the output is what plain decoding
under the same mask would give (greedy: token for token; sampled: in distribution). A
drafted token the grammar refuses has probability 0 under its row, so it is always
rejected; the rows after it are never read and stay unmasked.

The matcher is llguidance's (an Earley parser over the tokenizer's byte trie; a mask
takes microseconds). Separators are fixed to ", " and ": " with no other whitespace: with
free whitespace a small model can pad a reply with blanks until its token budget runs out.
"""

from __future__ import annotations

import json
import logging

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from dlite_ray.engine.sequence import InvalidRequest

ANY_JSON_OBJECT = '{"type": "object"}'
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)

log = logging.getLogger(__name__)


def grammar_for_schema(schema: str) -> str:
    """A JSON schema (as JSON text) -> the llguidance grammar; InvalidRequest names what is wrong."""
    try:
        parsed = json.loads(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("json_schema must be a JSON object (a schema)")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(parsed, defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequest(f"json_schema is not usable: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequest(f"json_schema is not usable: {error}")
    return grammar


class GrammarTokenizer:
    """The tokenizer as llguidance reads it (built once per engine: ~0.4 s for 49K tokens)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))

    def matcher(self, schema: str) -> OutputGrammar:
        matcher = llguidance.LLMatcher(self.ll, grammar_for_schema(schema), log_level=0)
        return OutputGrammar(matcher, self.vocab_size, self.eos_ids)


class OutputGrammar:
    """One request's grammar state: it follows the committed reply and masks verify rows."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: tuple[int, ...]):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids
        self._bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def allowed_rows(self, proposed: list[int]) -> torch.Tensor:
        """[m, V] bool for verify rows 0..m-1: what may follow the reply plus proposed[:row].
        m stops after the first proposed token the grammar refuses (later rows are never read)."""
        rows = [self._allowed_now()]
        consumed = 0
        for tok in proposed:
            if not self.matcher.try_consume_tokens([tok]):
                break
            consumed += 1
            rows.append(self._allowed_now())
        self.matcher.rollback(consumed)
        return torch.stack(rows)

    def advance(self, tokens: list[int]) -> None:
        """Follow committed tokens (each was drawn from a masked row, so the grammar takes it)."""
        for tok in tokens:
            if self.matcher.is_stopped():  # complete: only end-of-sequence was allowed, and the reply ends
                return
            if not self.matcher.consume_token(tok):
                log.warning("a committed token left the grammar: %s", self.matcher.get_error())
                return

    def _allowed_now(self) -> torch.Tensor:
        llguidance.torch.fill_next_token_bitmask(self.matcher, self._bitmask)
        allowed = unpack_bitmask(self._bitmask[0], self.vocab_size)
        if not allowed.any():  # the matcher failed (a parser resource limit): end this reply, not the batch
            log.warning("the grammar allows no token (%s): the reply ends", self.matcher.get_error())
            allowed[list(self.eos_ids)] = True
        return allowed


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed mask (int32 words, bit j of word w = token 32w + j) -> [V] bool."""
    return ((words[:, None] >> _BITS) & 1).bool().flatten()[:vocab_size]


def mask_rows(logits: torch.Tensor, allowed: torch.Tensor) -> None:
    """Set the logits of refused tokens to -inf in place: logits [>= m, V], allowed [m, V]."""
    rows = logits[:allowed.shape[0]]
    rows.masked_fill_(~allowed.to(rows.device), float("-inf"))

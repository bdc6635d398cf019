"""Structured output: the reply must match a grammar (`SamplingParams.grammar`): JSON a
schema accepts (OpenAI's `response_format`), or one call to one of a request's tools
(`tool_choice` naming a function, or "required").

The grammar masks the target's logits, never the draft's. Verify row m of a round holds the
target's logits after [anchor, d_1..d_m]; it is masked to the tokens the grammar allows
after the reply so far plus d_1..d_m. Greedy and rejection verification then run on the
masked distribution exactly as on an unmasked one, so the output is what plain decoding
under the same mask would give (greedy: token for token; sampled: in distribution). A
drafted token the grammar refuses has probability 0 under its row, so it is always
rejected; the rows after it are never read and stay unmasked.

The matcher is llguidance's (an Earley parser over the tokenizer's byte trie; a mask
takes microseconds). Grammars travel as llguidance's serialised text. JSON separators are
fixed to ", " and ": " with no other whitespace: with free whitespace a small model can pad
a reply with blanks until its token budget runs out.

A grammar can compile and still be one the matcher cannot follow: a $ref recursion that must
go on forever, a pattern like ^a{1000000}$ whose lexer is too large to build, meet
llguidance's parser and lexer limits once the reply reaches them. Most meet them on the
reply's first token, so a request's grammar takes one token it allows on a copy of its
matcher before the request is admitted, and one that fails there is refused
(InvalidRequest). One that fails later ends its reply with finish_reason "error" and the
reason in `Sequence.error`: never "stop", which promises a reply the grammar accepts.
"""

from __future__ import annotations

import json
import keyword
import logging
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import torch

from dlite_ray.engine.sequence import InvalidRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of its stubs only

ANY_JSON_OBJECT = '{"type": "object"}'
_JSON_OPTIONS: JsonCompileOptions = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_BITS = torch.arange(32, dtype=torch.int32)
# default limits; errors name the limit met, without the parser's state or the grammar
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
_MAX_REASON = 200  # characters of a matcher's error that a client is told

log = logging.getLogger(__name__)


def grammar_for_schema(schema: str) -> str:
    """A JSON schema (as JSON text) -> the grammar of JSON it accepts; InvalidRequest names what is wrong."""
    try:
        parsed = json.loads(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise InvalidRequest("json_schema must be a JSON object (a schema)")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(parsed, overrides=_JSON_OPTIONS)
    except ValueError as exc:
        raise InvalidRequest(f"json_schema is not usable: {exc}") from None
    return checked(grammar, "json_schema")


def grammar_for_calls(functions: list[dict]) -> str:
    """One call to one of `functions` (OpenAI function objects: name, parameters), written
    as the tools prompt asks, `name(arg=value, ...)`: each value is JSON its property's
    schema accepts; required arguments come first, in the schema's order, then any of the
    optional ones, in order."""
    rules = ["start: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, fn in enumerate(functions):
        rules += _call_rules(i, fn["name"], fn.get("parameters") or {})
    return checked(llguidance.LLMatcher.grammar_from_lark("\n".join(rules)), "tools")


def _call_rules(i: int, name: str, parameters: dict) -> list[str]:
    if not all(_is_python_name(part) for part in name.split(".")):
        raise InvalidRequest(f"tool {name!r} is not a Python name (dotted or not), so no call to it can be forced")
    properties = parameters.get("properties") or {}
    required = parameters.get("required") or []
    if not isinstance(required, list) or not all(isinstance(r, str) and r in properties for r in required):
        raise InvalidRequest(f"tool {name!r}: 'required' must list names of its parameters' properties")
    # each argument's schema compiles alone, so it carries the definitions its $refs point to
    definitions = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    rules, args = [], {}
    for j, (arg, schema) in enumerate(properties.items()):
        if not _is_python_name(arg):
            raise InvalidRequest(f"tool {name!r}: argument {arg!r} is not a Python name, so no call can be forced")
        if not isinstance(schema, dict):
            raise InvalidRequest(f"tool {name!r}: the schema of argument {arg!r} must be an object")
        rules.append(f"value_{i}_{j}: %json {json.dumps(definitions | schema | {'x-guidance': _JSON_OPTIONS})}")
        args[arg] = f"{_lark_string(arg + '=')} value_{i}_{j}"
    listed = _argument_list([args[p] for p in properties if p in required],
                            [args[p] for p in properties if p not in required])
    return [f"call_{i}: {_lark_string(name + '(')} {listed} \")\"", *rules]


def _is_python_name(text: str) -> bool:
    """What a call can be written with: an identifier that is not a keyword (`from=` does not parse)."""
    return text.isidentifier() and not keyword.iskeyword(text)


def _argument_list(required: list[str], optional: list[str]) -> str:
    """Lark for: every required argument, then any of the optional ones, in order, ", " between."""
    def tail(items: list[str]) -> str:
        return " ".join(f'(", " {item})?' for item in items)

    if required:
        return " ".join([' ", " '.join(required), tail(optional)])
    if not optional:
        return ""
    starts = [f"{item} {tail(optional[k + 1:])}" for k, item in enumerate(optional)]
    return "(" + " | ".join(f"({s})" for s in starts) + ")?"


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def checked(grammar: str, what: str) -> str:
    """`grammar`, once llguidance has compiled it; InvalidRequest with its error otherwise."""
    error = llguidance.LLMatcher.validate_grammar(grammar, limits=_LIMITS)
    if error:
        raise InvalidRequest(f"{what} is not usable: {error}")
    return grammar


def _token_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32, every bit set: llguidance's mask layout. llguidance.torch's
    own helpers are not imported: that module runs a torch.compile decorator on import, which
    loads torch._dynamo and torch._inductor (~3-5 s of every process start, every replica's)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def _fill_bitmask(matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of `bitmask` (on the host, contiguous): what the matcher allows next."""
    v = bitmask[row]
    matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())


class GrammarTokenizer:
    """The tokenizer as llguidance reads it (built once per engine: ~0.4 s for 49K tokens)."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.vocab_size, self.eos_ids = vocab_size, eos_ids
        self.ll = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))

    def matcher(self, grammar: str) -> OutputGrammar:
        """A request's grammar state; InvalidRequest when the grammar does not compile or
        fails on the reply's first token (see the module docstring)."""
        matcher = llguidance.LLMatcher(self.ll, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise InvalidRequest(f"the grammar is not usable: {_reason(matcher)}")
        out = OutputGrammar(matcher, self.vocab_size, self.eos_ids)
        failure = out.first_token_failure()
        if failure is not None:
            raise InvalidRequest(f"the grammar cannot be followed (simplify the schema): {failure}")
        return out


class OutputGrammar:
    """One request's grammar state: it follows the committed reply and masks verify rows."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, eos_ids: tuple[int, ...]):
        self.matcher, self.vocab_size, self.eos_ids = matcher, vocab_size, eos_ids

    @property
    def error(self) -> str | None:
        """Why the grammar failed on the committed reply (a parser or lexer limit), or None."""
        return _reason(self.matcher) if self.matcher.is_error() else None

    def first_token_failure(self) -> str | None:
        """Why the grammar fails on the first token it allows, tried on a copy, or None.
        Limits such as an endless forced recursion or an unbuildable lexeme are met on any
        first token, so this is the request's admission check (a few ms at worst)."""
        probe = self.matcher.deep_copy()
        if probe.is_stopped():
            return None
        bitmask = _token_bitmask(1, self.vocab_size)
        _fill_bitmask(probe, bitmask, 0)
        allowed = unpack_bitmask(bitmask[0], self.vocab_size)
        allowed[list(self.eos_ids)] = False
        first = allowed.nonzero().flatten()[:1].tolist()
        if first:
            probe.consume_token(first[0])
        return _reason(probe) if probe.is_error() else None

    def allowed_rows(self, proposed: list[int]) -> torch.Tensor:
        """[m, V] bool for verify rows 0..m-1: what may follow the reply plus proposed[:row].
        m stops after the first proposed token the grammar refuses (later rows are never read);
        once the grammar has stopped (complete, or failed), it takes no more tokens, so every
        later row is masked as the last one, as plain decoding would mask it."""
        bitmask = _token_bitmask(len(proposed) + 1, self.vocab_size)
        before = self.matcher.deep_copy()  # a try that fails leaves the matcher failed for good
        _fill_bitmask(self.matcher, bitmask, 0)
        filled = 0
        for tok in proposed:
            if self.matcher.is_stopped():
                break
            if not self.matcher.try_consume_tokens([tok]) and not self.matcher.is_error():
                break  # refused: verification rejects it
            filled += 1  # taken, or failed on it (a parser limit): the next row reads that state
            _fill_bitmask(self.matcher, bitmask, filled)
        rows = filled + 1
        if self.matcher.is_stopped():
            bitmask[rows:] = bitmask[filled]
            rows = len(proposed) + 1
        if self.matcher.is_error():
            self.matcher = before  # advance() meets the failure again if the token is kept
        else:
            self.matcher.rollback(filled)
        allowed = unpack_bitmask(bitmask[:rows], self.vocab_size)
        for row in (~allowed.any(dim=1)).nonzero().flatten().tolist():
            # never seen (llguidance allows EOS when it stops); guards the batch
            allowed[row, list(self.eos_ids)] = True
        return allowed

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (a JSON key, the call's name): a
        proposal for the round that the target nearly always accepts."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def advance(self, tokens: list[int]) -> None:
        """Follow committed tokens. Each was drawn from a masked row, so the grammar takes
        it, unless taking it meets a parser limit: then `error` says so, and the reply ends."""
        for tok in tokens:
            if self.matcher.is_stopped():  # complete: only end-of-sequence was allowed, and the reply ends
                return
            if not self.matcher.consume_token(tok):
                log.info("a reply's grammar failed: %s", self.error)
                return


def _reason(matcher: llguidance.LLMatcher) -> str:
    """The first line of a matcher's error: what failed, not the parser's state."""
    return matcher.get_error().strip().split("\n", 1)[0][:_MAX_REASON]


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """llguidance's packed masks ([..., W] int32, bit j of word w = token 32w + j) -> [..., V] bool."""
    return ((words[..., None] >> _BITS) & 1).bool().flatten(-2)[..., :vocab_size]


def mask_rows(logits: torch.Tensor, allowed: torch.Tensor) -> None:
    """Set the logits of refused tokens to -inf in place: logits [>= m, V], allowed [m, V]."""
    rows = logits[:allowed.shape[0]]
    rows.masked_fill_(~allowed.to(rows.device), float("-inf"))

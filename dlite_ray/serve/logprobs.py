"""Token logprobs in the OpenAI response shapes.

Chat completions carry `logprobs.content`: per token its text, its UTF-8 bytes, its
logprob and the most likely alternatives. Legacy completions carry parallel lists
(`tokens`, `token_logprobs`, `top_logprobs` as {text: logprob}, `text_offset`). A token
can hold part of a multi-byte character, so `bytes` is the exact form; its text shows
such a part as U+FFFD, as OpenAI's does.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TypedDict

from dlite_ray.engine.logprobs import TokenLogprob


class TopLogprob(TypedDict):
    """One token in OpenAI's chat logprobs: its text, logprob and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(TopLogprob):
    """A `choices[].logprobs.content` item: the chosen token and the likeliest alternatives."""

    top_logprobs: list[TopLogprob]


class TokenRenderer:
    """The bytes and text each token id stands for, with the replica's tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_of = _byte_level_alphabet() if _is_byte_level(tokenizer) else None
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))  # stored as plain text

    def token_bytes(self, token_id: int) -> bytes:
        if self._byte_of is None:  # not byte-level BPE: the decoded text is the best available
            return self.tokenizer.decode([token_id]).encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id the model's (padded) vocabulary has and the tokenizer lacks
            return b""
        if token_id in self._added or not all(c in self._byte_of for c in piece):
            return piece.encode("utf-8")
        return bytes(self._byte_of[c] for c in piece)

    def _token(self, token_id: int, logprob: float) -> TopLogprob:
        raw = self.token_bytes(token_id)
        return TopLogprob(token=raw.decode("utf-8", errors="replace"), logprob=logprob, bytes=list(raw))

    def chat_entries(self, logprobs: list[TokenLogprob]) -> list[LogprobEntry]:
        """`choices[].logprobs.content` items, one per token."""
        return [LogprobEntry(**self._token(lp.token_id, lp.logprob),
                             top_logprobs=[self._token(t, v) for t, v in lp.top]) for lp in logprobs]


def completion_logprobs(entries: list[LogprobEntry], text_offset: int = 0) -> tuple[dict, int]:
    """The legacy completions shape of chat `entries`, and the offset after them. Offsets
    count the characters of the tokens' texts from `text_offset` (a stream's later chunks
    go on from where the last ended), as vLLM does: they drift from the completion text
    where a token holds part of a character. Each `top_logprobs` dict also holds the
    chosen token, as OpenAI's does."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e["token"])
    top = [{t["token"]: t["logprob"] for t in e["top_logprobs"]} | {e["token"]: e["logprob"]} for e in entries]
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": top, "text_offset": offsets}, text_offset


def _is_byte_level(tokenizer) -> bool:
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    return isinstance(getattr(backend, "decoder", None), decoders.ByteLevel)


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1 bytes
    as themselves, the others as code points from 256 up, in byte order (GPT-2's scheme)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    alphabet, extra = {}, 0
    for b in range(256):
        if b in printable:
            alphabet[chr(b)] = b
        else:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet

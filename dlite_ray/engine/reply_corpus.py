"""Reply corpus: copy what followed a sequence's last tokens in the target's own replies
to the prompts its draft was trained on (retrieval-based drafting, as in REST).

A small target answers alike across requests: the same JSON shape of a tool call, the
same opening of a code answer, the same phrases around a function. Those replies were
recorded anyway to train the draft (`dlite-ray train`), so the draft's directory ships
them (`reply_corpus.safetensors`, ~1.7 MB for 417K tokens), and with `reply_corpus` on every
request may copy from them where its own context has no match. The target verifies a copy
like any other, so the output is unchanged; the speculation policy tracks how often such
copies pass, per request, and gives the round back to the draft where they pass less often
than its drafts. It is off by default: it gains on tool calls and code and loses at long
context, where it takes rounds the draft would have kept as well (docs/design.md).

Unlike the reply cache (`reply_cache.py`, one tenant's own earlier replies), the corpus
holds no user data: it is fixed at load, read-only, and shared by every namespace.

Index: for each n-gram size, the sorted 64-bit hashes of every n-gram followed by a token
of the same reply, and for each hash the occurrence to copy from: one whose next token is
the most frequent after that n-gram in the corpus (the latest such). A lookup hashes the
sequence's last n tokens, binary-searches, and checks the tokens themselves, so a hash
collision proposes nothing. About 40 bytes per corpus token, against ~280 for a dict of
tuples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

REPLY_CORPUS_FILE = "reply_corpus.safetensors"
# Longest first, as for the reply cache: a match across unrelated replies needs more
# context than one within a request's own.
CORPUS_NGRAM_SIZES = (8, 6, 4)
PROMPT_TAIL_TOKENS = max(CORPUS_NGRAM_SIZES)  # stored before each reply: how replies begin
SEPARATOR = -1  # between replies; no n-gram or copy crosses it
_MASK = (1 << 64) - 1
_BASE = 0x9E3779B97F4A7C15  # odd, so the hash is a bijection on each token step


class ReplyCorpus:
    """Fixed replies (token ids, SEPARATOR between them), proposed as copies."""

    def __init__(self, tokens: np.ndarray, ngram_sizes: tuple[int, ...] = CORPUS_NGRAM_SIZES):
        if tokens.ndim != 1 or (tokens < SEPARATOR).any():
            raise ValueError("corpus tokens must be one row of token ids (>= 0) and separators (-1)")
        if not ngram_sizes or min(ngram_sizes) < 1 or list(ngram_sizes) != sorted(ngram_sizes, reverse=True):
            raise ValueError(f"ngram_sizes must be positive and longest first, got {ngram_sizes}")
        self.tokens = tokens.astype(np.int64)
        self.ngram_sizes = tuple(ngram_sizes)
        self.num_tokens = int((self.tokens != SEPARATOR).sum())  # prompt tails included, separators not
        self._index = {n: _index(self.tokens, n) for n in self.ngram_sizes}

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `tokens` (n in
        ngram_sizes) in the corpus; [] when none occurred."""
        if limit <= 0:
            return []
        for n in self.ngram_sizes:
            if len(tokens) < n:
                continue
            tail = tokens[-n:]
            keys, ends = self._index[n]
            h = np.uint64(_hash(tail))
            i = int(np.searchsorted(keys, h))
            if i == len(keys) or keys[i] != h:
                continue
            end = int(ends[i])
            if self.tokens[end + 1 - n:end + 1].tolist() != list(tail):  # a hash collision
                continue
            following = self.tokens[end + 1:end + 1 + limit]
            stop = np.flatnonzero(following == SEPARATOR)
            return following[:stop[0] if len(stop) else len(following)].tolist()
        return []

    @classmethod
    def of_replies(cls, replies: list[list[int]], **kwargs) -> ReplyCorpus:
        return cls(join_replies(replies), **kwargs)

    @classmethod
    def load(cls, directory: str | Path) -> ReplyCorpus | None:
        """The corpus next to a draft checkpoint, or None where it ships none."""
        path = Path(directory) / REPLY_CORPUS_FILE
        if not path.exists():
            return None
        return cls(load_file(path)["tokens"].numpy())


def join_replies(replies: list[list[int]]) -> np.ndarray:
    """Replies in one row, each followed by SEPARATOR."""
    parts = [np.asarray(list(r) + [SEPARATOR], dtype=np.int64) for r in replies if len(r)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def save_reply_corpus(directory: str | Path, replies: list[list[int]]) -> Path:
    """Write `replies` (prompt tail + reply each) next to a draft checkpoint."""
    path = Path(directory) / REPLY_CORPUS_FILE
    save_file({"tokens": torch.from_numpy(join_replies(replies).astype(np.int32))}, str(path))
    return path


def _hash(tokens) -> int:
    h = 0
    for t in tokens:
        h = (h * _BASE + int(t)) & _MASK
    return h


def _index(tokens: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted hashes of the n-grams followed by a token of the same reply, for each the
    end of the occurrence to copy from)."""
    length = len(tokens)
    if length <= n:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.int64)
    ends = np.arange(n - 1, length - 1)  # an n-gram ends at e; the token after it is e + 1
    values = tokens.astype(np.uint64)  # separators wrap to 2^64 - 1; n-grams holding one are dropped below
    keys: np.ndarray = np.zeros(len(ends), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(n):
            keys = keys * np.uint64(_BASE) + values[i:i + len(ends)]
    separators = np.concatenate([[0], np.cumsum(tokens == SEPARATOR)])  # separators before each index
    clean = (separators[ends + 2] - separators[ends + 1 - n]) == 0  # none in the n-gram or the next token
    keys, ends = keys[clean], ends[clean]
    if not len(keys):
        return keys, ends
    following = tokens[ends + 1]
    # group the occurrences by (n-gram, next token); per n-gram, keep the most frequent next
    # token's latest occurrence
    order = np.lexsort((ends, following, keys))
    keys, following, ends = keys[order], following[order], ends[order]
    new_group = np.ones(len(keys), dtype=bool)
    new_group[1:] = (keys[1:] != keys[:-1]) | (following[1:] != following[:-1])
    starts = np.flatnonzero(new_group)
    last = np.append(starts[1:], len(keys)) - 1
    counts = last - starts + 1
    group_keys, group_ends = keys[last], ends[last]
    best = np.lexsort((group_ends, counts, group_keys))  # per n-gram: the most counted, then the latest, last
    group_keys, group_ends = group_keys[best], group_ends[best]
    is_last = np.ones(len(group_keys), dtype=bool)
    is_last[:-1] = group_keys[1:] != group_keys[:-1]
    return group_keys[is_last], group_ends[is_last]

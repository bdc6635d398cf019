"""Reply cache: draft by copying what followed a sequence's last tokens in an earlier reply.

Agent loops repeat themselves across conversations: the same tool names, argument
shapes, file paths and JSON keys, the same opening of a reply. The context lookup
(`context_lookup.py`) copies only from a request's own context; this cache keeps the
token ids of recently finished replies, per namespace (a tenant), and proposes what
followed the longest match of the sequence's last tokens in the most recent reply that
holds it, for rounds where the context has no match. The target verifies the copy like
any other (suffix decoding, as in vLLM / ArcticInference, with an n-gram index instead
of a suffix tree); the speculation policy tracks how often such copies pass and gives
the round back to the draft while they pass less often than its drafts.

Each reply is stored with the last few tokens of its prompt (the chat template's
assistant header, the end of a tool result), so that the first round of a reply, whose
last tokens are that prompt tail, can match how earlier replies began.

A namespace's replies never reach another namespace: one tenant's replies are never
proposed to another (the output would not change, since the target verifies, but how
many tokens a round accepts would tell). Bounded in tokens per namespace (the oldest
replies go first) and in namespaces (the least recently used goes).
"""

from __future__ import annotations

from collections import OrderedDict

# Longest first. A match across unrelated replies is weaker evidence than one within a
# context (NGRAM_SIZES go down to 2). Replaying 12 agentic turns (scripts/reply_cache_bench.py,
# greedy, where the context had no match): (4, 3, 2) copied in 19 rounds keeping 1.42 tokens
# each (the first token right in 26%), (6, 5, 4, 3) 12 rounds at 1.50 (33%), (8, 6, 4) 9 at
# 1.56 (33%), (12, 10, 8) 5 at 1.80 (40%), (16, 12) none. Longer is surer and rarer.
REPLY_NGRAM_SIZES = (8, 6, 4)
PROMPT_TAIL_TOKENS = max(REPLY_NGRAM_SIZES)  # enough for the longest n-gram to end at a reply's start


class _Namespace:
    """One namespace's replies, oldest first, and where each n-gram last ended with a token after it."""

    def __init__(self) -> None:
        self.replies: OrderedDict[int, list[int]] = OrderedDict()  # serial -> prompt tail + reply
        self.last_end: dict[tuple[int, ...], tuple[int, int]] = {}  # n-gram -> (serial, index of its last token)
        self.num_tokens = 0


class ReplyCache:
    """Finished replies per namespace (None: the engine-wide default), proposed as copies."""

    def __init__(self, max_tokens: int, max_namespaces: int, ngram_sizes: tuple[int, ...] = REPLY_NGRAM_SIZES,
                 prompt_tail: int = PROMPT_TAIL_TOKENS):
        """max_tokens: tokens kept per namespace (prompt tails included); max_namespaces:
        namespaces kept; ngram_sizes: the suffix lengths looked up, longest first."""
        if max_tokens < 1 or max_namespaces < 1:
            raise ValueError(f"max_tokens={max_tokens} and max_namespaces={max_namespaces} must be >= 1")
        if not ngram_sizes or min(ngram_sizes) < 1 or list(ngram_sizes) != sorted(ngram_sizes, reverse=True):
            raise ValueError(f"ngram_sizes must be positive and longest first, got {ngram_sizes}")
        if prompt_tail < 0:
            raise ValueError(f"prompt_tail={prompt_tail} must be >= 0")
        self.max_tokens, self.max_namespaces = max_tokens, max_namespaces
        self.ngram_sizes, self.prompt_tail = tuple(ngram_sizes), prompt_tail
        self._namespaces: OrderedDict[str | None, _Namespace] = OrderedDict()  # least recently used first
        self._serial = 0
        # running totals, so that another thread reads the size without walking the dicts
        self._size_tokens = 0
        self._num_replies = 0

    @property
    def size_tokens(self) -> int:
        """Tokens held, over every namespace (prompt tails included)."""
        return self._size_tokens

    @property
    def num_replies(self) -> int:
        return self._num_replies

    @property
    def num_namespaces(self) -> int:
        return len(self._namespaces)

    def add(self, namespace: str | None, prompt_ids: list[int], reply_ids: list[int]) -> None:
        """Keep a finished reply (after the last `prompt_tail` tokens of its prompt); the
        namespace's oldest replies, and the least recently used namespace, make room."""
        if not reply_ids:
            return
        tokens = (prompt_ids[-self.prompt_tail:] if self.prompt_tail else []) + list(reply_ids)
        tokens = tokens[-self.max_tokens:]
        ns = self._namespaces.get(namespace)
        if ns is None:
            if len(self._namespaces) >= self.max_namespaces:
                self._drop_namespace()
            ns = self._namespaces[namespace] = _Namespace()
        self._namespaces.move_to_end(namespace)
        while ns.replies and ns.num_tokens + len(tokens) > self.max_tokens:
            self._drop_oldest(ns)
        serial = self._serial = self._serial + 1
        ns.replies[serial] = tokens
        ns.num_tokens += len(tokens)
        self._size_tokens += len(tokens)
        self._num_replies += 1
        for end in range(len(tokens) - 1):  # only n-grams with a token after them
            for n in self.ngram_sizes:
                if end + 1 >= n:
                    ns.last_end[tuple(tokens[end + 1 - n:end + 1])] = (serial, end)

    def propose(self, namespace: str | None, tokens: list[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the longest suffix of `tokens` (n in
        ngram_sizes) in the latest reply of `namespace` that holds it; [] when none does."""
        ns = self._namespaces.get(namespace)
        if ns is None or limit <= 0:
            return []
        for n in self.ngram_sizes:
            if len(tokens) < n:
                continue
            hit = ns.last_end.get(tuple(tokens[-n:]))
            if hit is not None:
                serial, end = hit
                self._namespaces.move_to_end(namespace)
                return ns.replies[serial][end + 1:end + 1 + limit]
        return []

    def clear(self) -> None:
        """Forget every reply."""
        self._namespaces.clear()
        self._size_tokens = self._num_replies = 0

    def _drop_oldest(self, ns: _Namespace) -> None:
        # An n-gram pointing into the oldest reply occurs in no later one (a later occurrence
        # would have replaced it), so dropping those entries loses nothing still held.
        serial, tokens = ns.replies.popitem(last=False)
        for end in range(len(tokens) - 1):
            for n in self.ngram_sizes:
                if end + 1 >= n:
                    key = tuple(tokens[end + 1 - n:end + 1])
                    if ns.last_end.get(key, (None,))[0] == serial:
                        del ns.last_end[key]
        ns.num_tokens -= len(tokens)
        self._size_tokens -= len(tokens)
        self._num_replies -= 1

    def _drop_namespace(self) -> None:
        _, ns = self._namespaces.popitem(last=False)
        self._size_tokens -= ns.num_tokens
        self._num_replies -= len(ns.replies)

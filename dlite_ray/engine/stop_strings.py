"""Stop strings (`SamplingParams.stop`, OpenAI's `stop`): a request ends with the token that
completes one of them in its output text, and its text ends where the first one begins.

The check runs after every committed token, so a drafted round that runs past a stop
keeps exactly the tokens plain decoding keeps. It runs on the engine thread for every
request with stops, so it is kept cheap: most tokens are dismissed by their own text (a
new occurrence ends in the newest token, so that token must hold a stop's last
character), and the rest decode only the output's tail, since an occurrence found there
is new (an earlier one would have ended the request already).
"""

from __future__ import annotations

from collections.abc import Callable

TAIL_SLACK_TOKENS = 8  # tokens that decode to nothing (special ones) or shift a leading space


class StopStrings:
    def __init__(self, stops: tuple[str, ...], decode: Callable[[list[int]], str]):
        self.stops, self.decode = stops, decode
        # every token holds at least one byte, so a stop spans at most its UTF-8 length in tokens
        self.tail_tokens = max(len(s.encode("utf-8")) for s in stops) + TAIL_SLACK_TOKENS
        # a token decoded alone may lose a leading space (SentencePiece) or hold part of a
        # character: stops ending in whitespace, and such tokens, always take the full check
        self._last_chars = {s[-1] for s in stops}
        self._always_check = any(c.isspace() for c in self._last_chars)

    def completed_by_last(self, token_ids: list[int], output_start: int = 0) -> bool:
        """Whether the newest token completed a stop string in the output, which begins at
        `output_start` (only the tail is sliced: no copy of the whole output per token)."""
        if not self._always_check:
            newest = self.decode(token_ids[-1:])
            if "\ufffd" not in newest and not any(c in newest for c in self._last_chars):
                return False
        tail = self.decode(token_ids[max(output_start, len(token_ids) - self.tail_tokens):])
        return any(s in tail for s in self.stops)


def text_before_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string in it (all of it when there is none)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(found)] if found else text


def stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could begin a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest

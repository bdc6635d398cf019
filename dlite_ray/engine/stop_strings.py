"""Stop strings (`SamplingParams.stop`, OpenAI's `stop`): a request ends with the token that
completes one of them in its output text, and its text ends where the first one begins.

The check runs after every committed token, so a drafted round that runs past a stop
keeps exactly the tokens plain decoding keeps. It decodes only the output's tail: an
occurrence found there ends in the newest token, since an earlier one would have ended
the request already.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_CHAR_TOKENS = 4  # a character is at most 4 UTF-8 bytes, and every token holds at least one byte
TAIL_SLACK_TOKENS = 8  # tokens that decode to nothing (special ones) or shift a leading space


class StopStrings:
    def __init__(self, stops: tuple[str, ...], decode: Callable[[list[int]], str]):
        self.stops, self.decode = stops, decode
        self.tail_tokens = MAX_CHAR_TOKENS * max(len(s) for s in stops) + TAIL_SLACK_TOKENS

    def completed_by_last(self, output_ids: list[int]) -> bool:
        """Whether the newest output token completed a stop string."""
        tail = self.decode(output_ids[-self.tail_tokens:])
        return any(s in tail for s in self.stops)


def text_before_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to the first stop string in it (all of it when there is none)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(found)] if found else text


def text_to_send(text: str, stops: tuple[str, ...], finished: bool) -> str:
    """What a stream may show of a reply's decoded text so far: up to any stop string and,
    while the reply runs, less the tail that could still change: a character whose bytes
    have not all come (decoded as U+FFFD) and characters that could begin a stop string."""
    text = text_before_stop(text, stops)
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[:len(text) - stop_prefix_length(text, stops)]


def stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """How many of `text`'s last characters could begin a stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest

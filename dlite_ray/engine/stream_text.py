"""What a stream may send of a reply's text so far.

Streams send text, not tokens, and must never send what they would later take back: a
character whose bytes have not all come yet decodes as U+FFFD, and the first characters
of a stop string are not part of the reply once the stop completes. Both stay held back
until the next tokens decide; the reply's last chunk sends the rest.
"""

from __future__ import annotations

from collections.abc import Callable

from dlite_ray.engine.stop_strings import stop_prefix_length, text_before_stop


class TextStream:
    """One reply's stream: takes its tokens as they come, gives the text not sent yet."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.sent = 0  # characters of the reply's text sent so far

    def push(self, new_tokens: list[int], finished: bool) -> str:
        self.tokens += new_tokens
        text = text_to_send(self.decode(self.tokens), self.stops, finished)
        out = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return out


def text_to_send(text: str, stops: tuple[str, ...], finished: bool) -> str:
    """The part of the decoded reply `text` a stream may have sent by now."""
    text = text_before_stop(text, stops)
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[:len(text) - stop_prefix_length(text, stops)]

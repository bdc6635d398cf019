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
    """One reply's stream: takes its tokens as they come, gives the text not sent yet.

    Decodes only a window of recent tokens per push, not the whole reply: `tokens[prefix:]`,
    whose first part (`tokens[prefix:read]`, decoded before) gives the context a tokenizer
    may need to decode the new tokens as they read in place (a SentencePiece word's
    leading space), and the difference is the new text. A window whose text ends in an
    incomplete character (U+FFFD) waits for the next tokens."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...]):
        self.decode, self.stops = decode, stops
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # tokens[:read] are decoded into `text`; the window starts at `prefix`
        self.text = ""  # the text of tokens[:read], each character complete
        self.sent = 0  # characters of the reply's text sent so far
        self.longest_stop = max((len(s) for s in stops), default=0)

    def push(self, new_tokens: list[int], finished: bool) -> str:
        self.tokens += new_tokens
        self._decode_window(finished)
        # what was sent holds no stop and no stop's first characters, so a stop ends past
        # `sent`: the search needs only the text from a stop's length before it
        start = max(0, self.sent - self.longest_stop)
        text = text_to_send(self.text[start:], self.stops, finished)
        out = text[self.sent - start:]
        self.sent = max(self.sent, start + len(text))
        return out

    def _decode_window(self, finished: bool) -> None:
        if self.read == len(self.tokens):
            return
        known = self.decode(self.tokens[self.prefix:self.read])
        window = self.decode(self.tokens[self.prefix:])
        if window.endswith("\ufffd") and not finished:
            return  # a character whose bytes have not all come: decode it with the next tokens
        self.text += window[len(known):]
        self.prefix, self.read = self.read, len(self.tokens)


def text_to_send(text: str, stops: tuple[str, ...], finished: bool) -> str:
    """The part of the decoded reply `text` a stream may have sent by now."""
    text = text_before_stop(text, stops)
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[:len(text) - stop_prefix_length(text, stops)]

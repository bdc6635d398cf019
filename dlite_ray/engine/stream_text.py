"""What a stream may send of a reply's text so far.

Streams send text, not tokens, and must never send what they would later take back: a
character whose bytes have not all come yet decodes as U+FFFD, and the first characters
of a stop string are not part of the reply once the stop completes. Both stay held back
until the next tokens decide; the reply's last chunk sends the rest.
"""

from __future__ import annotations

from dlite_ray.engine.stop_strings import stop_prefix_length, text_before_stop


def text_to_send(text: str, stops: tuple[str, ...], finished: bool) -> str:
    """The part of the decoded reply `text` a stream may have sent by now."""
    text = text_before_stop(text, stops)
    if finished:
        return text
    text = text.rstrip("\ufffd")
    return text[:len(text) - stop_prefix_length(text, stops)]

"""Prompts: what a request may send (text, chat messages, token ids) turned into checked token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard, cast

from dlite_ray.engine.sequence import InvalidRequest

Messages = list[dict[str, str]]
Prompt = str | Messages | list[int]
PromptBatch = Sequence[Prompt]  # a list or a tuple of prompts


class PromptEncoder:
    """Token ids of a prompt, refused (InvalidRequest) when empty, outside the vocabulary or
    too long for the model's context."""

    def __init__(self, tokenizer, vocab_size: int, max_context: int):
        self.tokenizer, self.vocab_size, self.max_context = tokenizer, vocab_size, max_context

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._chat_ids(cast(Messages, prompt))  # dicts; _chat_ids checks their fields
        else:
            raise InvalidRequest("a prompt must be a non-empty string, token-id list or list of chat messages")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in ids):
            raise InvalidRequest(f"token ids must lie in [0, {self.vocab_size})")
        if len(ids) >= self.max_context:
            raise InvalidRequest(f"prompt of {len(ids)} tokens does not fit the model context of {self.max_context}")
        return ids

    def _chat_ids(self, messages: Messages) -> list[int]:
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequest("each chat message needs string 'role' and 'content'")
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)


def is_batch(prompts: Prompt | PromptBatch) -> TypeGuard[PromptBatch]:
    """Whether `prompts` is several prompts (strings, message lists or id lists, in a list or
    a tuple) rather than one."""
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or not prompts:
        return False
    return isinstance(prompts[0], (str, list))

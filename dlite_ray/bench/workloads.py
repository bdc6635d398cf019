"""Benchmark workloads, all from offline sources and held out from draft training.

- dev:          the training pipeline's held-out dev split (mixed kinds)
- chat:         general instructions the draft never saw
- code:         the dev split's code tasks (explain a standard-library function)
- tool-use:     single-turn tool calls with schemas (BFCL_v4_multiple: not a training file)
- agentic:      multi-turn tool loops replayed turn by turn (BFCL_v4_multi_turn_long_context's
                first 21 of a seeded draw; no training conversation shares a user turn with
                them): each turn appends a tool result and the next request
- long-context: prompts of ~2K / 4K / 7K tokens over Python standard-library source
- structured, forced-tools: replies under a grammar (`constrained.py`)
- any JSONL file: {"id", "messages"} or {"id", "prompt"} per line
"""

from __future__ import annotations

import functools
import json
import logging
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

from dlite_ray.bench.constrained import forced_tool_requests, structured_requests
from dlite_ray.training.prompts import (
    _bfcl_single_turn,
    agent_eval_rows,
    bfcl_conversation,
    bfcl_data_dir,
    build_prompt_set,
    class_docs,
)

log = logging.getLogger(__name__)

WORKLOADS = ("dev", "chat", "code", "tool-use", "agentic", "long-context", "structured", "forced-tools")
HELD_OUT_CHAT = [
    "Explain the difference between a stack and a queue.",
    "Write a Python function that counts the vowels in a string.",
    "What is the purpose of a context manager in Python?",
    "Describe how garbage collection works in Python.",
    "Write a short story about a robot learning to paint, in three sentences.",
    "What are the advantages of using a database index?",
    "Explain what a closure is with an example.",
    "Give me five tips for a productive morning.",
]


@dataclass(slots=True)
class Item:
    id: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    later_turns: list[str] = field(default_factory=list)  # agentic: replayed after each reply
    tag: str = ""  # e.g. the context-length bucket
    grammar: str | None = None  # every reply is decoded under it (structured output, a forced call)

    @property
    def payload(self):
        return self.messages if self.messages is not None else self.prompt


def load_workload(name: str, limit: int, seed: int = 0) -> list[Item]:
    rng = random.Random(seed)
    if name == "dev":
        return [Item(s.id, s.messages, tag=s.kind) for s in build_prompt_set().dev[:limit]]
    if name == "code":
        return [Item(s.id, s.messages, tag="code") for s in build_prompt_set().dev if s.kind == "code"][:limit]
    if name == "structured":
        return [Item(i, m, tag="json", grammar=g) for i, m, g in structured_requests(limit)]
    if name == "forced-tools":
        return [Item(i, m, tag="call", grammar=g) for i, m, g in forced_tool_requests(limit)]
    if name == "chat":
        return [Item(f"chat-{i}", [{"role": "user", "content": t}]) for i, t in enumerate(HELD_OUT_CHAT[:limit])]
    if name == "tool-use":
        rows = _bfcl_single_turn(bfcl_data_dir() / "BFCL_v4_multiple.json")
        return [Item(s.id, s.messages, tag="tool") for s in rng.sample(rows, limit)]
    if name == "agentic":
        return _agentic(limit, seed)
    if name == "long-context":
        return _long_context(limit)
    path = Path(name)
    if path.suffix == ".jsonl" and path.exists():
        return [_from_json(json.loads(line)) for line in path.read_text().splitlines() if line.strip()][:limit]
    raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)} or a .jsonl file")


def _from_json(row: dict) -> Item:
    if "messages" in row:
        return Item(str(row["id"]), messages=row["messages"])
    if "prompt" in row:
        return Item(str(row["id"]), prompt=row["prompt"])
    raise ValueError(f"workload line {row.get('id')!r} has neither 'messages' nor 'prompt'")


def _agentic(limit: int, seed: int) -> list[Item]:
    """Conversations of at least 3 turns from the pool that no training set shares a turn with."""
    docs = class_docs(bfcl_data_dir())
    items = []
    for row in agent_eval_rows(seed):
        conversation = bfcl_conversation(row, docs, max_turns=3)
        if conversation is not None and len(conversation.later_turns) == 2:
            items.append(Item(conversation.id, conversation.messages, later_turns=conversation.later_turns,
                              tag="turn-1"))
        if len(items) == limit:
            return items
    log.warning("the agentic workload holds %d conversations; asked for %d", len(items), limit)
    return items


def _long_context(limit: int) -> list[Item]:
    items = []
    for tokens in (2000, 4000, 7000)[: max(1, limit)]:
        text = long_context_text(tokens * 3)  # ~3 characters per token for Python source with this tokenizer
        content = (f"Here is some Python code:\n```python\n{text}\n```\n"
                   "Summarise what the last function above does.")
        items.append(Item(f"long-{tokens}", [{"role": "user", "content": content}], tag=f"{tokens // 1000}K"))
    return items


def long_context_text(chars: int) -> str:
    """The first `chars` characters of some standard-library source (~370K in all)."""
    return _stdlib_source()[:chars]


@functools.cache
def _stdlib_source() -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = ("textwrap.py", "shlex.py", "fractions.py", "argparse.py", "difflib.py", "inspect.py")
    return "".join((root / f).read_text() for f in files)

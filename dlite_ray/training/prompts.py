"""Offline training prompts: BFCL tool-use chats (from the bfcl-eval wheel, read, never
installed), code tasks over Python's own standard library, and general instructions.

Every sample is a chat (list of {role, content}); multi-turn BFCL samples also carry the
later user turns, which data generation answers one after another so that the history
grows to thousands of tokens (the agentic, long-context regime). Agent loops
(`agent_loops`) replay whole BFCL multi-turn conversations, every user turn after a tool
result, from files the agentic benchmark does not read; a conversation that shares a user
turn with the benchmark's pool (`agent_eval_rows`) or with the dev split is left out.
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import logging
import random
import re
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from dlite_ray.runtime.model_store import cache_root

log = logging.getLogger(__name__)

BFCL_PACKAGE = "bfcl-eval==2026.3.23"
BFCL_FILES = ("BFCL_v4_live_simple", "BFCL_v4_live_multiple", "BFCL_v4_simple_python", "BFCL_v4_parallel")
BFCL_MULTI_TURN = "BFCL_v4_multi_turn_base"
# agent loops for training: the same tool-using sessions in three variants (a function or a
# parameter missing), so the same user turns meet other schemas and other replies
BFCL_AGENT_LOOPS = (BFCL_MULTI_TURN, "BFCL_v4_multi_turn_miss_func", "BFCL_v4_multi_turn_miss_param")
MAX_AGENT_TURNS = 6
# The agentic benchmark's conversations: the first AGENT_EVAL_POOL of a seeded draw from this
# file. Its user turns are BFCL_MULTI_TURN's (long_context only lengthens the tool state), so
# training leaves out every conversation that shares a turn with the pool. 21 is the largest
# draw random.sample makes one pick at a time, so the pool begins with the conversations the
# benchmark took when it drew 3 per item (`agentic:2`..`agentic:7`).
AGENT_EVAL_FILE = "BFCL_v4_multi_turn_long_context"
AGENT_EVAL_POOL = 21
TOOL_RESULT = '{"status": "ok", "result": "done"}'  # what every replayed tool call returned
# standard-library packages whose code is not library source: test suites, applications, data
STDLIB_PACKAGES_SKIPPED = {"test", "tests", "idlelib", "lib2to3", "encodings", "site-packages", "turtledemo"}
# multi-turn classes -> their schema file in multi_turn_func_doc/
CLASS_DOCS = {
    "GorillaFileSystem": "gorilla_file_system", "MathAPI": "math_api", "MessageAPI": "message_api",
    "TwitterAPI": "posting_api", "TicketAPI": "ticket_api", "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking", "VehicleControlAPI": "vehicle_control",
}
TOOL_SYSTEM = ("You are an assistant that can call tools. When a tool is needed, answer with a call like "
               "func_name(arg=value). Available tools (JSON schemas):\n")

GENERAL_INSTRUCTIONS = [
    "Explain the difference between a list and a tuple in Python.",
    "Write a short email asking a colleague to review a pull request.",
    "What are the main causes of the seasons on Earth?",
    "Give three tips for writing readable code.",
    "Summarise what a hash map is and when to use one.",
    "Write a haiku about debugging at night.",
    "How does HTTP differ from HTTPS?",
    "Describe the steps to make a cup of tea.",
    "What is recursion? Give a simple example.",
    "Explain what a unit test is to a new programmer.",
    "List the planets of the solar system in order.",
    "Write a Python function that returns the factorial of n.",
    "What is the capital of France, and what is it known for?",
    "Explain big-O notation in two paragraphs.",
    "Write a SQL query that counts orders per customer.",
    "Give me a short plan for learning a new programming language.",
    "What does the git rebase command do?",
    "Explain the difference between a process and a thread.",
    "Write a bash one-liner that counts lines in all .py files.",
    "What are the benefits of type hints in Python?",
    "Describe how a binary search works.",
    "Write a polite reply declining a meeting invitation.",
    "What is a REST API?",
    "Explain what JSON is and show a small example.",
    "How do you reverse a linked list?",
    "Write a Python class representing a bank account with deposit and withdraw.",
    "What is the difference between TCP and UDP?",
    "Explain the purpose of a virtual environment in Python.",
    "Give an example of a list comprehension that filters even numbers.",
    "Describe the water cycle briefly.",
    "What is a race condition and how can it be avoided?",
    "Write a regular expression that matches an email address and explain it.",
    "Explain how a for loop works in Python.",
    "What is the purpose of the __init__ method?",
    "Write a function that merges two sorted lists.",
    "What is memoization?",
    "Explain what an exception is and how try/except works.",
    "Describe three common sorting algorithms.",
    "Write a Python script that reads a CSV file and prints the first row.",
    "What is the difference between == and is in Python?",
]


@dataclass(slots=True)
class PromptSample:
    id: str
    kind: str  # chat | tool | multi_turn | agent_loop | code
    messages: list[dict[str, str]]
    later_turns: list[str] = field(default_factory=list)


@dataclass(slots=True)
class PromptSet:
    train: list[PromptSample]
    dev: list[PromptSample]


BASE_PER_SOURCE, BASE_MULTI_TURN = 40, 12


def build_prompt_set(seed: int = 0, per_source: int = BASE_PER_SOURCE, dev_fraction: float = 0.15,
                     multi_turn: int = BASE_MULTI_TURN, code_tasks: int | None = None,
                     agent_loops: int = 0) -> PromptSet:
    """The dev split is always `dev_fraction` of the base set (the seed's sample at the
    default sizes), whatever sizes are asked for: drafts trained on larger sets are measured
    on the same held-out prompts, and no set trains on them. The train split is the asked-for
    sample minus those prompts and any conversation sharing a turn with the agentic
    benchmark's pool, plus `agent_loops` whole BFCL conversations (`select_agent_loops`)."""
    base = _sample(seed, BASE_PER_SOURCE, BASE_MULTI_TURN, None)
    dev = base[:max(4, int(len(base) * dev_fraction))]
    is_base = (per_source, multi_turn, code_tasks) == (BASE_PER_SOURCE, BASE_MULTI_TURN, None)
    sample = base if is_base else _sample(seed, per_source, multi_turn, code_tasks)
    held_out = {_key(s) for s in dev}
    # multi_turn_long_context repeats multi_turn_base's conversations, and with the same tool
    # result replayed their prompts are the same tokens: such a sample would train on the benchmark
    benchmark = agent_eval_turns()
    train = [s for s in sample if _key(s) not in held_out and not benchmark & turns_of([s])]
    if agent_loops:
        train += select_agent_loops(random.Random(seed), agent_loops, held_out_turns=turns_of(dev))
    return PromptSet(train=train, dev=dev)


def select_agent_loops(rng: random.Random, count: int,
                       held_out_turns: Iterable[str] = frozenset()) -> list[PromptSample]:
    """`count` distinct BFCL conversations of up to MAX_AGENT_TURNS user turns each, none
    sharing a turn with the agentic benchmark's pool or with `held_out_turns`."""
    data = bfcl_data_dir()
    held_out = set(held_out_turns) | agent_eval_turns()
    loops, seen = [], set()
    for name in BFCL_AGENT_LOOPS:
        for sample in _bfcl_multi_turn(data, name, MAX_AGENT_TURNS):
            key = _key(sample)
            if key not in seen and not held_out & turns_of([sample]):
                seen.add(key)
                loops.append(replace(sample, kind="agent_loop"))
    if count > len(loops):
        log.warning("asked for %d agent loops; only %d share no turn with the benchmark's pool or the dev split",
                    count, len(loops))
    return rng.sample(loops, min(count, len(loops)))


def agent_eval_rows(seed: int = 0) -> list[dict]:
    """The agentic benchmark's conversations, in the order it takes them (`AGENT_EVAL_POOL`)."""
    rows = _read_jsonl(bfcl_data_dir() / f"{AGENT_EVAL_FILE}.json")
    return random.Random(seed).sample(rows, AGENT_EVAL_POOL)


@functools.cache
def agent_eval_turns() -> frozenset[str]:
    """Every user turn of the agentic benchmark's pool: no training prompt may hold one."""
    return frozenset(text for row in agent_eval_rows() for text in _user_turns(row))


def tool_turn(text: str) -> dict:
    """The user message of a replayed loop's later turn: the tool's result, then the next request."""
    return {"role": "user", "content": f"Tool result: {TOOL_RESULT}\n\n{text}"}


def _user_turns(row: dict) -> list[str]:
    return [t[0]["content"] for t in row["question"] if t]


def turns_of(samples: list[PromptSample]) -> set[str]:
    """The user turns of `samples` (the first turn is the last message of a sample's chat)."""
    return {text for s in samples for text in (s.messages[-1]["content"], *s.later_turns)}


def _sample(seed: int, per_source: int, multi_turn: int, code_tasks: int | None) -> list[PromptSample]:
    rng = random.Random(seed)
    data = bfcl_data_dir()
    samples = [PromptSample(f"chat-{i}", "chat", [{"role": "user", "content": t}])
               for i, t in enumerate(GENERAL_INSTRUCTIONS)]
    for name in BFCL_FILES:
        rows = _bfcl_single_turn(data / f"{name}.json")
        samples += rng.sample(rows, min(per_source, len(rows)))
    samples += rng.sample(_bfcl_multi_turn(data), multi_turn)
    samples += stdlib_code_tasks(rng, per_source * 2 if code_tasks is None else code_tasks)
    rng.shuffle(samples)
    return samples


def _key(sample: PromptSample) -> str:
    # code-task ids are numbered by place in one sample, so they may name another prompt in another
    return json.dumps([sample.messages, sample.later_turns])


def bfcl_data_dir() -> Path:
    """bfcl_eval/data from the wheel, extracted once into the cache (never pip-installed)."""
    target = cache_root() / "data" / "bfcl_eval"
    if (target / "data" / f"{BFCL_MULTI_TURN}.json").exists():
        return target / "data"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, BFCL_PACKAGE]
        result = subprocess.run(cmd, check=False, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {BFCL_PACKAGE}: {result.stderr.strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as wheel:
            for name in wheel.namelist():
                if name.startswith("bfcl_eval/data/") and name.endswith(".json"):
                    wheel.extract(name, target.parent)
    return target / "data"


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tool_system(functions: list[dict], max_chars: int = 14000) -> dict[str, str]:
    """Schemas without their response specs, as many as fit in max_chars (~4K tokens)."""
    text = ""
    for f in functions:
        entry = json.dumps({k: v for k, v in f.items() if k != "response"}) + "\n"
        if len(text) + len(entry) > max_chars:
            break
        text += entry
    return {"role": "system", "content": TOOL_SYSTEM + text}


def _bfcl_single_turn(path: Path) -> list[PromptSample]:
    out = []
    for row in _read_jsonl(path):
        turn = row["question"][0]
        out.append(PromptSample(row["id"], "tool", [_tool_system(row["function"]), *turn]))
    return out


def _bfcl_multi_turn(data: Path, name: str = BFCL_MULTI_TURN, max_turns: int = 3) -> list[PromptSample]:
    """Conversations of `name` with their first `max_turns` user turns, under their classes' schemas."""
    docs = class_docs(data)
    conversations = (bfcl_conversation(row, docs, max_turns) for row in _read_jsonl(data / f"{name}.json"))
    return [c for c in conversations if c is not None]


def class_docs(data: Path) -> dict[str, list[dict]]:
    """The function schemas of each multi-turn class."""
    return {cls: _read_jsonl(data / "multi_turn_func_doc" / f"{stem}.json") for cls, stem in CLASS_DOCS.items()}


def bfcl_conversation(row: dict, docs: dict[str, list[dict]], max_turns: int) -> PromptSample | None:
    """A multi-turn BFCL row as a chat under its classes' schemas with its first `max_turns`
    user turns; None without schemas or a second turn."""
    functions = [f for cls in row.get("involved_classes", []) for f in docs.get(cls, [])]
    turns = _user_turns(row)
    if not functions or len(turns) < 2:
        return None
    first = [_tool_system(functions), {"role": "user", "content": turns[0]}]
    return PromptSample(row["id"], "multi_turn", first, later_turns=turns[1:max_turns])


def stdlib_code_tasks(rng: random.Random, count: int) -> list[PromptSample]:
    """Explain / complete / test / fix-a-planted-bug tasks over standard-library functions."""
    functions = _stdlib_functions(rng, count * 3)
    tasks = []
    for i, (module, src) in enumerate(functions[:count]):
        kind = i % 4
        if kind == 0:
            text = f"Explain what this function from the `{module}` module does:\n\n```python\n{src}\n```"
        elif kind == 1:
            lines = src.splitlines()
            head = "\n".join(lines[: max(2, len(lines) // 2)])
            text = "Complete this Python function:\n\n```python\n" + head + "\n```"
        elif kind == 2:
            text = f"Write a pytest unit test for this function:\n\n```python\n{src}\n```"
        else:
            text = f"This function has a bug. Find it and fix it:\n\n```python\n{_plant_bug(src)}\n```"
        tasks.append(PromptSample(f"code-{module}-{i}", "code", [{"role": "user", "content": text}]))
    return tasks


def _stdlib_functions(rng: random.Random, count: int) -> list[tuple[str, str]]:
    """`count` (module, source) pairs of 6-30-line functions. The base sample's draw (up to 3
    functions from each shuffled top-level module) comes first and is what it always was, so
    the dev split stays put; larger samples go on into the packages (`email`, `json`,
    `asyncio`, ...) and then take up to 6 functions a module."""
    root = Path(sysconfig.get_paths()["stdlib"])
    modules = sorted(p for p in root.glob("*.py") if not p.name.startswith("_"))
    rng.shuffle(modules)
    found = _functions_in(modules, count, skip=0, per_file=3)
    if len(found) < count:
        packaged = sorted(p for p in root.glob("*/**/*.py") if _is_library_source(p.relative_to(root)))
        random.Random(len(packaged)).shuffle(packaged)  # not `rng`: the base sample's later draws stay as they were
        found += _functions_in(packaged, count - len(found), skip=0, per_file=3)
        found += _functions_in(modules + packaged, count - len(found), skip=3, per_file=3)
    return found[:count]


def _is_library_source(relative: Path) -> bool:
    """A module of a standard-library package, not a test suite, an application or private."""
    return not any(part.startswith("_") or part in STDLIB_PACKAGES_SKIPPED for part in relative.parts)


def _functions_in(paths: list[Path], count: int, skip: int, per_file: int) -> list[tuple[str, str]]:
    """Up to `per_file` functions of each file after its first `skip`, until `count`."""
    found: list[tuple[str, str]] = []
    for path in paths:
        if len(found) >= count:
            break
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError):
            continue
        fitting = (node for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef) and node.end_lineno is not None
                   and 6 <= node.end_lineno - node.lineno <= 30)
        for node in itertools.islice(fitting, skip, skip + per_file):
            text = ast.get_source_segment(source, node)
            if text:
                found.append((path.stem, text))
    return found


def _plant_bug(src: str) -> str:
    for old, new in ((" < ", " <= "), (" + 1", " - 1"), (" == ", " != "), (" and ", " or ")):
        if old in src:
            return src.replace(old, new, 1)
    return re.sub(r"return (\w+)", r"return not \1", src, count=1)

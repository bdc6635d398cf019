"""Agent loops in the training data: whole BFCL conversations that share no turn with the
agentic benchmark or the dev split, answered turn by turn in waves."""

from __future__ import annotations

from types import SimpleNamespace

from dlite_ray.bench.workloads import load_workload
from dlite_ray.training import data, prompts
from dlite_ray.training.prompts import PromptSample, build_prompt_set, tool_turn


def _benchmark_turns() -> set[str]:
    return prompts.agent_eval_turns()


def test_agent_loops_share_no_turn_with_the_benchmark_or_the_dev_split():
    prompt_set = build_prompt_set(agent_loops=60)
    loops = [s for s in prompt_set.train if s.kind == "agent_loop"]
    assert len(loops) == 60 and len({prompts._key(s) for s in loops}) == 60
    assert max(len(s.later_turns) for s in loops) == prompts.MAX_AGENT_TURNS - 1  # whole loops, not 3 turns
    held_out = _benchmark_turns() | prompts.turns_of(prompt_set.dev)
    assert not held_out & prompts.turns_of(loops)
    unfiltered = prompts._bfcl_multi_turn(prompts.bfcl_data_dir(), prompts.BFCL_MULTI_TURN, prompts.MAX_AGENT_TURNS)
    assert _benchmark_turns() & prompts.turns_of(unfiltered)  # the training files do repeat the benchmark's turns


def test_no_training_prompt_shares_a_turn_with_the_benchmark():
    # The base set's three-turn conversations come from multi_turn_base, whose turns the
    # benchmark's multi_turn_long_context repeats: before they were filtered, 3 of the
    # benchmark's 19 conversations were training prompts token for token.
    sampled = prompts._sample(0, prompts.BASE_PER_SOURCE, prompts.BASE_MULTI_TURN, None)
    assert _benchmark_turns() & prompts.turns_of(sampled)  # the sample itself holds some
    for prompt_set in (build_prompt_set(), build_prompt_set(per_source=120, multi_turn=24, agent_loops=20)):
        assert not _benchmark_turns() & prompts.turns_of(prompt_set.train)


def test_the_agentic_benchmark_draws_from_the_held_out_pool(caplog):
    items = load_workload("agentic", 7)
    assert len(items) == 7
    asked = {text for item in items for text in (item.messages[-1]["content"], *item.later_turns)}
    assert asked <= _benchmark_turns()
    assert len(load_workload("agentic", 50)) < 50 and "holds" in caplog.text  # the pool's end is said


class _MessageEngine:
    """Stands in for the engine: a prompt is its chat's list of message texts (one "token" a
    message) and each reply says how long its prompt was."""

    def __init__(self, max_context: int):
        self.runner = SimpleNamespace(max_context=max_context)
        self.waves = []

    def encode(self, messages):
        return [m["content"] for m in messages]

    def generate(self, prompts, max_new_tokens, trace_top_k):
        self.waves.append(len(prompts))
        return [SimpleNamespace(text=f"reply to {len(p)}") for p in prompts]


def test_conversations_are_answered_turn_by_turn_in_waves(monkeypatch):
    monkeypatch.setattr(data, "record_of", lambda prompt, reply: prompt)
    user = lambda text: {"role": "user", "content": text}  # noqa: E731
    long_loop = PromptSample("a", "agent_loop", [user("a0")], later_turns=["a1", "a2", "a3"])
    short_loop = PromptSample("b", "agent_loop", [user("b0")], later_turns=["b1"])
    wide_loop = PromptSample("c", "agent_loop", [{"role": "system", "content": "tools"}, user("c0")],
                             later_turns=["c1", "c2", "c3"])
    engine = _MessageEngine(max_context=7)  # a prompt of 6 messages plus the reply's token no longer fits
    records = data._answer_conversations(engine, [long_loop, short_loop, wide_loop], max_new_tokens=1)
    assert engine.waves == [3, 3, 1]  # one generate call a turn, each holding every live conversation
    by_first = {}
    for prompt in records:
        by_first.setdefault(prompt[0], []).append(prompt)
    assert [len(p) for p in by_first["a0"]] == [1, 3, 5]
    assert [len(p) for p in by_first["b0"]] == [1, 3]
    assert [len(p) for p in by_first["tools"]] == [2, 4]  # out of context at its third turn
    assert by_first["a0"][2] == ["a0", "reply to 1", tool_turn("a1")["content"], "reply to 3",
                                 tool_turn("a2")["content"]]

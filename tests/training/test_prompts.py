"""The prompt set's dev split stays put when the training set grows."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

from dlite_ray.training import prompts
from dlite_ray.training.prompts import PromptSample, build_prompt_set


def _fake_sample(seed, per_source, multi_turn, code_tasks):
    # like the real one: a larger sample holds other draws of the same sources, overlapping the base
    n = per_source * 5 + multi_turn + (code_tasks or 0)
    step = 1 if per_source == prompts.BASE_PER_SOURCE else 3
    return [PromptSample(f"p{i}", "chat", [{"role": "user", "content": f"prompt {i}"}])
            for i in range(0, n * step, step)]


def test_dev_split_is_the_base_sets_whatever_the_sizes(monkeypatch):
    monkeypatch.setattr(prompts, "_sample", _fake_sample)
    base = build_prompt_set()
    bigger = build_prompt_set(per_source=200, code_tasks=400)
    assert [s.id for s in bigger.dev] == [s.id for s in base.dev]
    assert len(base.dev) == int(len(base.train + base.dev) * 0.15)
    dev_ids = {s.id for s in base.dev}
    assert not dev_ids & {s.id for s in bigger.train}  # held out of every training set
    overlap = dev_ids & {s.id for s in _fake_sample(0, 200, 12, 400)}
    assert overlap and len(bigger.train) == len(_fake_sample(0, 200, 12, 400)) - len(overlap)


def test_larger_code_samples_extend_the_base_draw_without_moving_it():
    small_rng, large_rng = random.Random(0), random.Random(0)
    small = prompts._stdlib_functions(small_rng, 240)
    large = prompts._stdlib_functions(large_rng, 1000)
    assert len(large) == 1000 and large[:240] == small  # the base sample's functions come first
    assert small_rng.random() == large_rng.random()  # and its later draws are the same
    top_level = {p.stem for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py")}
    assert {module for module, _ in large} - top_level  # packages: the top-level modules give 396
    assert not {module for module, _ in large} & {"test_grammar", "pyshell"}  # test suites, IDLE left out

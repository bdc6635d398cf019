"""Temperatures below MIN_TEMPERATURE are greedy: a tiny positive temperature (1e-45 is a
float32 denormal, 1e-300 rounds to 0 in float32) once divided the logits into inf / NaN and
replied with garbage; now it gives the greedy reply, and the processed distribution is never
NaN. Just above the floor, a request still samples."""

from __future__ import annotations

import math

import pytest
import torch

from dlite_ray.engine.sequence import InvalidRequest, SamplingParams
from dlite_ray.runtime.loading import load_target
from dlite_ray.runtime.sampling import GREEDY, MIN_TEMPERATURE, REJECTION, RowSampling, probabilities, sample
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft

TINY = [1e-45, 1e-300, 1e-30, MIN_TEMPERATURE / 2]
PROMPTS = [[5, 9, 11, 40], [7, 7, 30, 31, 32, 12]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("tf") / "llama", "llama")
    target = load_target(d)
    return target, random_draft(target, read_config(d))


@pytest.mark.parametrize("temperature", TINY)
def test_a_temperature_below_the_floor_is_greedy(temperature):
    params = SamplingParams(temperature=temperature, verify_mode="rejection")
    assert params.temperature == 0.0 and params.mode == GREEDY


def test_the_floor_and_above_sample():
    for t in (MIN_TEMPERATURE, MIN_TEMPERATURE * 10, 0.7):
        params = SamplingParams(temperature=t)
        assert params.temperature == t and params.mode == REJECTION


@pytest.mark.parametrize("temperature", [math.nan, math.inf, -1e-45])
def test_a_temperature_that_is_not_a_number_or_negative_is_refused(temperature):
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 0.0])
def test_probabilities_are_never_nan(temperature):
    """A row that reaches the sampler with a temperature under the floor (a direct caller)
    is processed at the floor: peaked, finite, summing to one."""
    logits = torch.tensor([[[3.0, 2.5, -1.0, 40.0]]])
    p = probabilities(logits, RowSampling.build([temperature], [0], [1.0], [None]))
    assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(1))
    assert p.argmax().item() == 3


def test_a_near_tie_at_ten_times_the_floor_still_samples_both_tokens():
    t = MIN_TEMPERATURE * 10
    logits = torch.tensor([[[5.0, 5.0 + t / 2, -3.0]]])  # a gap of T / 2: p ~ (0.38, 0.62, 0)
    p = probabilities(logits, RowSampling.build([t], [0], [1.0], [None]))
    assert torch.isfinite(p).all() and 0.3 < p[0, 0, 0] < 0.45
    gens = [torch.Generator().manual_seed(s) for s in range(400)]
    drawn = sample(p.expand(400, -1, -1), gens).flatten().tolist()
    assert {0, 1} == set(drawn)


@pytest.mark.parametrize("temperature", [1e-45, 1e-300, 1e-30])
def test_the_engine_replies_greedily_at_a_tiny_temperature(tiny, temperature):
    target, draft = tiny
    greedy = [r.token_ids for r in make_engine(target, draft).generate(PROMPTS, max_new_tokens=12)]
    for engine in (make_engine(target), make_engine(target, draft)):
        out = engine.generate(PROMPTS, max_new_tokens=12, temperature=temperature, seed=0, verify_mode="rejection")
        assert [r.token_ids for r in out] == greedy

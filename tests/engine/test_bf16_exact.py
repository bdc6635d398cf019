"""bf16 on CPU: a verify step computes every row bit for bit as plain decoding would, so
greedy speculative output equals greedy plain decoding exactly, not just up to rounding
(bf16 rounding flips near-tied greedy tokens otherwise: 4 of 8 replies differed on the
default model before the attention and linears were made row-exact)."""

from __future__ import annotations

import random

import pytest
import torch

from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.attention import WINDOW
from dlite_ray.runtime.frozen_linear import can_pack
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="row-exact bf16 linears need oneDNN packing")

# Long enough that decoding crosses a window boundary of the positioned attention (every
# WINDOW positions) and a chunk boundary of our decode kernel (every 256).
PROMPTS = [[random.Random(40 + i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((9, WINDOW - 20, 236))]
NEW = 40


@pytest.fixture(scope="module", params=[16, 64], ids=["head_dim16", "head_dim64"])
def target_dir(request, tiny_target_dir, tmp_path_factory):
    """Head dim 16: the flash kernel's position-exact calls; 64: our decode attention kernel
    where the CPU has AVX-512 BF16 (`fused_ops.decode_attention`)."""
    if request.param == 16:
        return tiny_target_dir
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "llama64", "llama", head_dim=64)


@pytest.fixture(scope="module")
def bf16_target(target_dir):
    return load_target(target_dir, torch.bfloat16)


@pytest.fixture(scope="module")
def plain(bf16_target):
    ar = make_engine(bf16_target, enable_prefix_cache=False)
    return [ar.generate(p, max_new_tokens=NEW, ignore_eos=True)[0].token_ids for p in PROMPTS]


def test_random_draft_mostly_rejected(bf16_target, target_dir, plain):
    draft = random_draft(bf16_target, read_config(target_dir)).to(torch.bfloat16)
    spec = make_engine(bf16_target, draft, num_draft_tokens=5, enable_prefix_cache=False)
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        assert spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0].token_ids == expected


def test_exact_with_the_small_operations_eager(bf16_target, target_dir, monkeypatch):
    """Where the fused kernels do not build, the eager operations keep a row's bits too."""
    monkeypatch.setattr(fused_ops, "_fused", lambda x: None)
    ar = make_engine(bf16_target, enable_prefix_cache=False)
    draft = random_draft(bf16_target, read_config(target_dir)).to(torch.bfloat16)
    spec = make_engine(bf16_target, draft, num_draft_tokens=5, enable_prefix_cache=False)
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0].token_ids
        assert spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0].token_ids == expected


def test_head_dim_64_is_served_by_our_decode_kernel(bf16_target, target_dir, monkeypatch):
    if read_config(target_dir).get("head_dim") != 64:
        pytest.skip("the flash kernel's case")
    with torch.inference_mode():
        if not fused_ops.attends_decode_rows(torch.zeros(1, 4, 64, dtype=torch.bfloat16)):
            pytest.skip("no AVX-512 BF16 decode kernel on this CPU")
    calls = []
    real = fused_ops.decode_attention
    monkeypatch.setattr(fused_ops, "decode_attention", lambda *a: calls.append(1) or real(*a))
    make_engine(bf16_target, enable_prefix_cache=False).generate(PROMPTS[0], max_new_tokens=4, ignore_eos=True)
    assert calls


def test_oracle_draft_always_accepted(bf16_target, plain):
    oracle = OracleDraftTransport([p + a for p, a in zip(PROMPTS, plain, strict=True)])
    spec = make_engine(bf16_target, oracle, num_draft_tokens=7, enable_prefix_cache=False)
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        out = spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0]
        assert out.token_ids == expected and out.stats["mean_accept_length"] > 4


def test_copied_rows_of_sixteen_tokens_stay_exact(bf16_target):
    """Context lookup verifies up to 16 tokens a row: still the position-exact path."""
    prompts = [p + p[:len(p) // 2] for p in PROMPTS]  # the first round copies 15 tokens
    plain = make_engine(bf16_target, enable_prefix_cache=False)
    spec = make_engine(bf16_target, lookup_tokens=15, enable_prefix_cache=False)
    for prompt in prompts:
        expected = plain.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0].token_ids
        out = spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0]
        assert out.token_ids == expected
        assert out.stats["copied_rounds"][0]

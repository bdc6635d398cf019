"""Our target runtime against transformers, and the paged-KV behaviours the engine relies on."""

from __future__ import annotations

import random

import pytest
import torch

from dlite_ray.runtime.config import UnsupportedModelError
from dlite_ray.runtime.loading import CheckpointError, load_target
from tests.conftest import TINY_ARCHS, make_tiny_checkpoint
from tests.helpers import forward_all, hf_logits, new_runner, new_seq

IDS = [random.Random(0).randrange(3, 128) for _ in range(37)]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_match_transformers_fp32(tiny_dirs, arch):
    model = load_target(tiny_dirs[arch])
    ours = forward_all(new_runner(model), new_seq(IDS), IDS).logits
    ref = hf_logits(tiny_dirs[arch], IDS).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_transformers_bf16(tiny_dirs, arch):
    model = load_target(tiny_dirs[arch], dtype=torch.bfloat16)
    ours = forward_all(new_runner(model), new_seq(IDS), IDS).logits
    ref = hf_logits(tiny_dirs[arch], IDS).logits[0]
    # bf16 keeps ~3 significant digits; errors compound over layers.
    assert (ours - ref).abs().max() < 0.15 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_ragged_batch_equals_one_at_a_time(tiny_dirs, arch):
    from dlite_ray.engine.model_runner import RowInput

    model = load_target(tiny_dirs[arch])
    prompts = [IDS[:5], IDS[:23], IDS[3:20]]
    alone = [forward_all(new_runner(model), new_seq(p), p).logits for p in prompts]
    runner = new_runner(model)
    seqs = [new_seq(p) for p in prompts]
    # interleave allocations so block tables are not consecutive (exercises the gather path)
    for s, p in zip(seqs, prompts):
        runner.forward([RowInput(s, p[:1])])
        runner.commit(s, 1)
    outs = runner.forward([RowInput(s, p[1:], num_outputs=len(p) - 1) for s, p in zip(seqs, prompts)])
    for out, ref in zip(outs, alone):
        torch.testing.assert_close(out.logits, ref[1:], atol=1e-5, rtol=1e-5)


def test_mixed_prefill_and_decode_rows(tiny_dirs):
    from dlite_ray.engine.model_runner import RowInput

    model = load_target(tiny_dirs["llama"])
    runner = new_runner(model)
    a, b = new_seq(IDS[:10]), new_seq(IDS[:30])
    forward_all(runner, a, IDS[:9])
    out = runner.forward([RowInput(a, IDS[9:10]), RowInput(b, IDS[:30])])
    ref_a = forward_all(new_runner(model), new_seq(IDS), IDS[:10]).logits[-1]
    ref_b = forward_all(new_runner(model), new_seq(IDS), IDS[:30]).logits[-1]
    torch.testing.assert_close(out[0].logits[0], ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].logits[0], ref_b, atol=1e-5, rtol=1e-5)


def test_crop_then_reforward_equals_fresh(tiny_dirs):
    model = load_target(tiny_dirs["qwen3"])
    runner = new_runner(model, block_size=4)
    seq = new_seq(IDS)
    forward_all(runner, seq, IDS[:20])
    forward_all(runner, seq, [5, 6, 7, 8, 9, 10, 11])  # a rejected "verify block"
    runner.commit(seq, 20)  # roll back the last 7 positions
    assert len(seq.block_table) == 5
    again = forward_all(runner, seq, IDS[20:])
    fresh = forward_all(new_runner(model), new_seq(IDS), IDS).logits[20:]
    torch.testing.assert_close(again.logits, fresh, atol=1e-5, rtol=1e-5)


def test_taps_equal_transformers_hidden_states(tiny_dirs):
    model = load_target(tiny_dirs["llama"])
    layers = (0, 2)
    out = forward_all(new_runner(model, tap_layers=layers), new_seq(IDS), IDS)
    ref = hf_logits(tiny_dirs["llama"], IDS, hidden=True).hidden_states
    for slot, layer in enumerate(layers):
        # HF's hidden_states[i + 1] is the output of layer i (the last one is normed: not compared)
        torch.testing.assert_close(out.taps[:, slot], ref[layer + 1][0], atol=1e-4, rtol=1e-4)


def test_unknown_architecture_is_a_clear_error(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "m", "llama")
    cfg = (d / "config.json").read_text().replace('"llama"', '"gpt2"')
    (d / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedModelError, match="unknown architecture 'gpt2'"):
        load_target(d)


def test_missing_weights_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    d = make_tiny_checkpoint(tmp_path / "m", "llama")
    state = load_file(d / "model.safetensors")
    state.pop("model.layers.1.mlp.down_proj.weight")
    save_file(state, d / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 1 weights"):
        load_target(d)
    with pytest.raises(CheckpointError, match="no model at"):
        load_target(tmp_path / "nowhere")

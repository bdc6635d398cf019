"""The decoder layers in one C++ call (LayerLoop): every bit of a decode or verify forward
(logits, layer taps, the keys and values it writes) equals the layer-by-layer path's, and
it steps aside where it does not serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dlite_ray.engine.model_runner import RowInput
from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.attention.metadata import MAX_POSITIONED_TOKENS
from dlite_ray.runtime.config import ModelConfig
from dlite_ray.runtime.frozen_linear import FrozenLinear
from dlite_ray.runtime.layer_loop import LayerLoop
from dlite_ray.runtime.layers import DecoderLayer, add_frozen_layers, row_linears
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint
from tests.helpers import forward_all, new_runner, new_seq

DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def head_dim_64(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints whose head dim our decode kernel attends (qwen2: q/k/v biases)."""
    root = tmp_path_factory.mktemp("head64")
    return {arch: make_tiny_checkpoint(root / arch, arch, head_dim=64) for arch in ("llama", "qwen2", "qwen3")}


def _target(directory, dtype):
    model = load_target(directory, dtype)
    if model.layer_loop is None and not all(fused_ops.decode_kernel_serves(64, d) for d in DTYPES):
        pytest.skip("our decode kernel needs AVX-512 (float32) and AVX-512 BF16 (bf16)")
    return model


def _both_ways(model, runner, rows):
    """The same forward through the loop and layer by layer: (outputs, cache) of each."""
    results = []
    loop = model.layer_loop
    for way in (loop, None):
        model.layer_loop = way
        out = runner.run(rows)
        results.append(([(o.logits, o.taps) for o in out], runner.cache.k.clone(), runner.cache.v.clone()))
    model.layer_loop = loop
    return results


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_decode_and_verify_rows_have_the_layer_by_layer_bits(head_dim_64, arch, dtype):
    model = _target(head_dim_64[arch], dtype)
    assert model.layer_loop is not None
    runner = new_runner(model, tap_layers=(0, 2, 3))
    seqs = [new_seq(list(range(3 + i, 40 + 17 * i))) for i in range(3)]
    for seq in seqs:
        forward_all(runner, seq, seq.token_ids)
    # One decode row, a verify block, and a block of the longest position-exact length.
    rows = [RowInput(seqs[0], [5]), RowInput(seqs[1], [7, 8, 9, 10, 11], 5),
            RowInput(seqs[2], list(range(20, 20 + MAX_POSITIONED_TOKENS)), MAX_POSITIONED_TOKENS)]
    for seq, row in zip(seqs, rows):
        runner.blocks.prepare_write(seq.block_table, seq.num_computed, seq.num_computed + len(row.tokens))
    (loop_out, loop_k, loop_v), (eager_out, eager_k, eager_v) = _both_ways(model, runner, rows)
    for (logits, taps), (eager_logits, eager_taps) in zip(loop_out, eager_out):
        assert torch.equal(logits, eager_logits) and torch.equal(taps, eager_taps)
    assert torch.equal(loop_k, eager_k) and torch.equal(loop_v, eager_v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_decoded_alone_equals_the_same_row_verified_in_a_block(head_dim_64, dtype):
    """What exact speculative decoding rests on, through the loop."""
    model = _target(head_dim_64["llama"], dtype)
    runner = new_runner(model)
    prompt, block = list(range(3, 50)), [9, 4, 17, 30, 2, 11]
    alone, together = new_seq(prompt), new_seq(prompt)
    for seq in (alone, together):
        forward_all(runner, seq, seq.token_ids)
    decoded = torch.cat([forward_all(runner, alone, [t]).logits for t in block])
    assert torch.equal(decoded, forward_all(runner, together, block).logits)


def test_the_loop_steps_aside_for_prefill_and_where_it_does_not_serve(head_dim_64, monkeypatch):
    model = _target(head_dim_64["llama"], torch.float32)
    runner = new_runner(model)
    seq = new_seq(list(range(3, 3 + MAX_POSITIONED_TOKENS + 1)))
    calls = []
    monkeypatch.setattr(LayerLoop, "run", lambda *a: calls.append(a))
    forward_all(runner, seq, seq.token_ids)  # a prefill chunk: layer by layer
    assert calls == []
    assert load_target(head_dim_64["qwen3"], torch.float32).layer_loop is None  # q/k norms
    monkeypatch.setenv("DLITE_LAYER_LOOP", "0")
    assert load_target(head_dim_64["llama"], torch.float32).layer_loop is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prompt_prefilled_in_one_chunk_equals_it_decoded_token_by_token(head_dim_64, dtype):
    """Where our kernels serve every operation (prefill chunks attend through the decode kernel
    too), a row's bits do not depend on how the prompt was cut: one chunk, or one token a step."""
    model = _target(head_dim_64["llama"], dtype)
    runner = new_runner(model)
    prompt = list(range(3, 3 + 3 * MAX_POSITIONED_TOKENS))  # a chunk too long for the position-exact way
    whole, stepwise = new_seq(prompt), new_seq(prompt)
    prefilled = forward_all(runner, whole, prompt).logits
    decoded = torch.cat([forward_all(runner, stepwise, [t]).logits for t in prompt])
    assert torch.equal(prefilled, decoded)


def test_row_linears_are_a_frozen_layers_four_linears_in_the_kernels_order(monkeypatch):
    """What both loops hand their kernels, found on any CPU: RowLinear's packing is plain torch."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    layer = DecoderLayer(cfg)
    assert row_linears(layer) is None  # not frozen
    monkeypatch.setattr(fused_ops, "row_linear_serves", lambda weight: True)
    layer.self_attn.freeze()
    layer.mlp.freeze()
    attn, mlp = layer.self_attn, layer.mlp
    expected = (attn.qkv, attn.o_proj.forward, mlp.gate_up, mlp.down_proj.forward)
    found = row_linears(layer)
    assert found is not None and all(a is b for a, b in zip(found, expected, strict=True))

    class Stack:  # a C++ layer stack's add_layer, recorded
        def __init__(self):
            self.calls = []

        def add_layer(self, *args):
            self.calls.append(args)

    stack = Stack()
    add_frozen_layers(stack, nn.ModuleList([layer, layer]))
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    fed = (norms[0], attn.qkv.packed, attn.qkv.bias, expected[1].packed, norms[1], mlp.gate_up.packed,
           expected[3].packed)
    assert len(stack.calls) == 2 and all(a is b or torch.equal(a, b) for a, b in zip(stack.calls[0], fed, strict=True))
    mlp.down_proj.forward = FrozenLinear(mlp.down_proj.weight)  # one linear the kernels cannot read
    assert row_linears(layer) is None
    with pytest.raises(ValueError, match="not all RowLinear"):
        add_frozen_layers(Stack(), nn.ModuleList([layer]))

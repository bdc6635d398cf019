"""The graph runner's bucketing and padding, run eagerly on the CPU: a decode or verify step
padded up to its bucket gives every real row the bits of the unpadded forward (logits and
taps), and its padding rows write no KV anywhere a sequence owns."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dlite_ray.engine.graph_runner import GraphConfig, bucket_for, graph_buckets
from dlite_ray.engine.model_runner import ModelRunner, RowInput
from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.runtime.frozen_linear import EXACT_ROWS, FrozenLinear, cover_row_counts, probed_linear
from tests.helpers import prefilled, step_rows

TAPS = (0, 2)
MAX_ROWS = 32
VERIFY = 4  # tokens per verify row


def _runner(target, graphs: GraphConfig | None) -> ModelRunner:
    return ModelRunner(target, TAPS, 4096, 16, "sdpa", graphs=graphs)


@pytest.mark.parametrize("q", [1, VERIFY], ids=["decode", "verify"])
@pytest.mark.parametrize("n", [1, 3, 5, 9, 17], ids=lambda n: f"{n}rows")
def test_a_padded_step_gives_the_real_rows_the_unpadded_bits(tiny_target, q, n):
    assert bucket_for(n, graph_buckets(MAX_ROWS)) > n or n == 1  # padding rows present (but for 1 row)
    plain = _runner(tiny_target, None)
    padded = _runner(tiny_target, GraphConfig(MAX_ROWS, (1, VERIFY), capture=False))
    want = step_rows(plain, prefilled(plain, n), q)
    got = step_rows(padded, prefilled(padded, n), q)
    assert padded.graphs.stats.padded_eager == 1  # the step went through the bucketing, not around it
    assert len(got) == n
    for w, g in zip(want, got):
        assert torch.equal(g.logits, w.logits)
        assert torch.equal(g.taps, w.taps)
    slots = plain.cache.num_slots  # the padded runner's cache has one scratch block more
    assert padded.cache.num_slots == slots + 16
    assert torch.equal(padded.cache.k[:, :, :slots], plain.cache.k)  # padding rows wrote nowhere real
    assert torch.equal(padded.cache.v[:, :, :slots], plain.cache.v)


def test_other_steps_stay_unpadded(tiny_target):
    runner = _runner(tiny_target, GraphConfig(MAX_ROWS, (1, VERIFY), capture=False))
    seqs = prefilled(runner, 3)
    runner.forward([RowInput(seqs[0], [5]), RowInput(seqs[1], [6, 7], num_outputs=2)])  # unequal rows
    runner.forward([RowInput(seqs[2], [5, 6, 7], num_outputs=3)])  # a length graphs are not made for
    runner.forward([RowInput(s, [5] * VERIFY, num_outputs=VERIFY) for s in seqs]
                   + [RowInput(Sequence([4] * 20, SamplingParams()), [4] * 20)])  # a prefill chunk beside them
    assert runner.graphs.stats.padded_eager == 0


def test_buckets_are_the_smallest_that_hold_the_rows():
    buckets = graph_buckets(64)
    assert buckets == (1, 2, 4, 8, 16, 32, 48, 64)
    assert graph_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    for rows in range(1, 65):
        b = bucket_for(rows, buckets)
        assert b >= rows and all(smaller < rows for smaller in buckets if smaller < b)
    with pytest.raises(ValueError):
        bucket_for(65, buckets)


class _SplitsAt512(FrozenLinear):
    """A kernel that rounds every row differently in calls of exactly 512 rows, a count the
    load-time probes (1-32, 33, 100, 1024 rows) never make."""

    def _linear(self, flat: torch.Tensor) -> torch.Tensor:
        out = super()._linear(flat)
        return out * (1 + 2**-20) if len(flat) == 512 else out


def test_the_probes_cover_every_bucket_size():
    torch.manual_seed(0)
    module = nn.Linear(32, 48, bias=False)
    module.forward = probed_linear(_SplitsAt512, module.weight.detach())
    assert module.forward.max_rows > EXACT_ROWS  # the load-time probes saw nothing wrong
    assert cover_row_counts(module, (64, 256)) == 0
    assert cover_row_counts(module, (64, 512)) == 1
    assert module.forward.max_rows == EXACT_ROWS  # now called in 32-row pieces, whose rows agree


@pytest.mark.parametrize("q", [1, VERIFY], ids=["decode", "verify"])
def test_the_flash_backend_through_padded_buckets_gives_the_unpadded_bits(tiny_target, q, monkeypatch):
    """flash-attn's backend (a reference with flash_attn_with_kvcache's documented semantics
    injected for the kernel, its pages of 256 tokens) is graph-safe: a padded step plans its
    rows on the device from the static buffers (`DeviceRows`) and gives each real row the
    unpadded step's bits; its padding rows write no KV a sequence owns."""
    from dlite_ray.engine import model_runner
    from dlite_ray.runtime.attention.flash import FlashAttnBackend
    from tests.runtime.test_accelerator_attention import ReferenceFlash

    kernel = ReferenceFlash()
    monkeypatch.setattr(model_runner, "make_backend", lambda name, device, dtype: FlashAttnBackend(kernel=kernel))
    plain = ModelRunner(tiny_target, TAPS, 4096, 16, "flash_attn")
    padded = ModelRunner(tiny_target, TAPS, 4096, 16, "flash_attn", graphs=GraphConfig(8, (1, VERIFY), capture=False))
    assert padded.backend.graph_safe and padded.block_size == 256
    want = step_rows(plain, prefilled(plain, 3), q)
    seqs = prefilled(padded, 3)
    kernel.calls.clear()
    got = step_rows(padded, seqs, q)
    assert padded.graphs.stats.padded_eager == 1
    step_calls = [c for c in kernel.calls if c.q_len == 1]
    assert step_calls and all(c.table.shape[0] == 4 * q for c in step_calls)  # the bucket of 4, padding row included
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g.logits, w.logits)
        assert torch.equal(g.taps, w.taps)
    blocks = plain.cache.num_blocks
    assert padded.cache.num_blocks == blocks + 1  # the scratch block
    assert torch.equal(padded.cache.k[:, :blocks], plain.cache.k)
    assert torch.equal(padded.cache.v[:, :blocks], plain.cache.v)

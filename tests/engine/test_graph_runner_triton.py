"""The graph runner over the triton backend, run eagerly (capture=False) on the CPU under
Triton's interpreter: the padded decode and verify steps go through the backend's graph
metadata (rows derived on the device from the static buffers, the grid bounded by the
table's width) and give the real rows the bits of the unpadded forward on the same backend.

Tiny shapes (2 layers): the interpreter runs every program in numpy."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend's tests need the triton package (extra 'triton')")

from dlite_ray.engine.graph_runner import GraphConfig, bucket_for, graph_buckets  # noqa: E402
from dlite_ray.engine.model_runner import ModelRunner  # noqa: E402
from dlite_ray.runtime.attention.paged_triton import interpreting  # noqa: E402
from dlite_ray.runtime.loading import load_target  # noqa: E402
from tests.conftest import make_tiny_checkpoint  # noqa: E402
from tests.helpers import prefilled, step_rows  # noqa: E402

if not torch.cuda.is_available() and not interpreting():
    pytest.skip("without CUDA these tests run under TRITON_INTERPRET=1 (tests/conftest.py)", allow_module_level=True)

TAPS = (0, 1)
MAX_ROWS = 8
VERIFY = 4  # tokens per verify row
ROWS = 3  # in a bucket of 4: one padding row


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(make_tiny_checkpoint(tmp_path_factory.mktemp("graph_triton") / "llama", "llama", layers=2))


def _runner(target, graphs: GraphConfig | None) -> ModelRunner:
    return ModelRunner(target, TAPS, 1024, 16, "triton", graphs=graphs)


@pytest.mark.parametrize("q", [1, VERIFY], ids=["decode", "verify"])
def test_a_padded_step_on_graph_metadata_gives_the_unpadded_bits(target, q):
    assert bucket_for(ROWS, graph_buckets(MAX_ROWS)) > ROWS  # a padding row is present
    plain = _runner(target, None)
    padded = _runner(target, GraphConfig(MAX_ROWS, (1, VERIFY), capture=False))
    backend = padded.backend
    assert backend.graph_safe
    made = []
    graph_metadata = backend.graph_metadata

    def counted(*args):
        made.append(graph_metadata(*args))
        return made[-1]

    backend.graph_metadata = counted  # the real method, counted
    want = step_rows(plain, prefilled(plain, ROWS), q)
    got = step_rows(padded, prefilled(padded, ROWS), q)
    assert padded.graphs.stats.padded_eager == 1
    assert len(made) == 1 and made[0].device_rows is not None  # the step planned its rows on the device
    assert made[0].device_rows.max_seqlen == padded.graphs.table_width * 16  # the graph's fixed grid bound
    assert len(got) == ROWS
    for w, g in zip(want, got):
        assert torch.equal(g.logits, w.logits)
        assert torch.equal(g.taps, w.taps)
    blocks = plain.cache.num_blocks  # the cache block-major: [layers, blocks, block_size, Hkv, Dh]
    assert padded.cache.num_blocks == blocks + 1  # the scratch block
    assert torch.equal(padded.cache.k[:, :blocks], plain.cache.k)  # padding rows wrote nowhere real
    assert torch.equal(padded.cache.v[:, :blocks], plain.cache.v)

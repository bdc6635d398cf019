"""Tree rows (tree verification): every token of a tree of candidates gets the bits of its
branch decoded as a plain sequence, whichever way the forward goes (our kernels in one
C++ loop, layer by layer, the accelerators' batched windows run on CPU), and once the
accepted branch is kept, the sequence goes on exactly as if it had verified that branch alone."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.engine.model_runner import RowInput
from dlite_ray.runtime.attention.metadata import build_attention_metadata, tree_positions
from dlite_ray.runtime.attention.sdpa import SdpaBackend
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint
from tests.helpers import forward_all, new_runner, new_seq

# Crosses windows (64) so chains read keys past a window's end, and chunks of our decode
# kernel (256), so their shared whole chunks are read once for the whole tree.
PROMPT = [3 + i % 120 for i in range(300)]
# anchor 5; branch 5-6-7-8; branch 5-9-10 from the anchor; branch 5-6-11 from the second token
TOKENS = [5, 6, 7, 8, 9, 10, 11]
PARENTS = [-1, 0, 1, 2, 0, 4, 1]
BRANCHES = [[0, 1, 2, 3], [0, 4, 5], [0, 1, 6]]  # root to leaf, as indices into TOKENS


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tree") / "llama", "llama", head_dim=64)


WAYS = ["loop", "layers", "windows"]


def _runner(checkpoint, dtype, way):
    model = load_target(checkpoint, dtype)
    if way != "loop":
        model.layer_loop = None
    runner = new_runner(model, tap_layers=(0, 2))
    if way == "windows":
        runner.backend = SdpaBackend(batched_windows=True)
    return runner


def _tree_forward(runner, seq):
    runner.blocks.prepare_write(seq.block_table, seq.num_computed, seq.num_computed + len(TOKENS))
    return runner.run([RowInput(seq, TOKENS, len(TOKENS), PARENTS)])[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("way", WAYS)
def test_each_tree_token_has_the_bits_of_its_branch_decoded_alone(checkpoint, dtype, way):
    runner = _runner(checkpoint, dtype, way)
    tree = new_seq(PROMPT)
    forward_all(runner, tree, PROMPT)
    out = _tree_forward(runner, tree)
    for branch in BRANCHES:
        chain = new_seq(PROMPT)
        forward_all(runner, chain, PROMPT)
        alone = forward_all(runner, chain, [TOKENS[j] for j in branch])
        assert torch.equal(out.logits[branch], alone.logits), branch
        assert torch.equal(out.taps[branch], alone.taps), branch


@pytest.mark.parametrize("way", WAYS)
def test_a_kept_branch_continues_like_the_branch_verified_alone(checkpoint, way):
    runner = _runner(checkpoint, torch.bfloat16, way)
    for branch in BRANCHES:
        tree, chain = new_seq(PROMPT), new_seq(PROMPT)
        forward_all(runner, tree, PROMPT)
        forward_all(runner, chain, PROMPT)
        _tree_forward(runner, tree)
        runner.keep_branch(tree, branch)
        runner.commit(tree, tree.num_computed + len(branch))
        forward_all(runner, chain, [TOKENS[j] for j in branch])
        assert torch.equal(forward_all(runner, tree, [40, 41]).logits, forward_all(runner, chain, [40, 41]).logits)


def test_a_tree_becomes_one_span_per_chain_over_its_ancestors_keys():
    table = [3, 0]  # positions 0-3 in block 3, 4-7 in block 0
    meta = build_attention_metadata([4], [6], [table], 4, torch.device("cpu"), [[-1, 0, 1, 0]])
    # stored at positions 2..5: slots 14, 15, 0, 1; the context is positions 0-1: slots 12, 13
    assert meta.slot_mapping.tolist() == [14, 15, 0, 1]
    (trunk, side) = meta.spans
    assert (trunk.q_start, trunk.q_len, trunk.ctx_len) == (0, 3, 5)
    assert trunk.kv_slots.tolist() == [12, 13, 14, 15, 0]
    assert (side.q_start, side.q_len, side.ctx_len) == (3, 1, 4)
    assert side.kv_slots.tolist() == [12, 13, 14, 1]
    assert side.kv_runs == [slice(12, 15), slice(1, 2)]


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 0, 3, 0], [-1, -1]])
def test_a_malformed_tree_is_refused(parents):
    with pytest.raises(ValueError, match="tree"):
        tree_positions(parents)

"""A draft loaded onto a target other than the one it was trained for is refused at load,
with a clear error, instead of decoding at tau ~1; its own target passes in any dtype."""

from __future__ import annotations

import json

import pytest
import torch

from dlite_ray.runtime.draft_config import DraftConfigError
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import load_target
from dlite_ray.runtime.target_probe import TargetMismatch, check_probe, probe_of
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import random_draft


def _load(draft_dir, target):
    return DLiteDraftModel.load(draft_dir, target.embed_tokens, target.cfg.num_layers)


def test_a_draft_is_refused_by_a_target_of_the_same_shape_that_it_was_not_trained_for(tmp_path):
    mine_dir = make_tiny_checkpoint(tmp_path / "mine", "llama", seed=0)
    other_dir = make_tiny_checkpoint(tmp_path / "other", "llama", seed=1)  # same shapes, other weights
    mine, other = load_target(mine_dir), load_target(other_dir)
    random_draft(mine, read_config(mine_dir)).save(tmp_path / "draft")
    assert json.loads((tmp_path / "draft" / "config.json").read_text())["dlite_config"]["target_probe"]
    _load(tmp_path / "draft", mine)
    with pytest.raises(TargetMismatch, match="trained for another target"):
        _load(tmp_path / "draft", other)
    assert issubclass(TargetMismatch, DraftConfigError)  # what loaders already report as a bad draft


def test_the_probe_survives_the_targets_dtype_and_8_bit_rounding():
    torch.manual_seed(0)
    embedding = torch.randn(500, 64) * 0.05
    probe = probe_of(embedding)
    check_probe(probe, embedding.to(torch.bfloat16), "d")
    scale = embedding.abs().amax(dim=1, keepdim=True) / 127  # per-row 8-bit quantisation, as GGUF Q8_0 blocks
    check_probe(probe, (embedding / scale).round() * scale, "d")
    with pytest.raises(TargetMismatch):
        check_probe(probe, embedding + 0.02 * torch.randn(500, 64), "d")  # another fine-tune, far enough apart


def test_a_public_draft_without_a_probe_is_loaded_unchecked_and_a_malformed_one_is_refused(tmp_path):
    target_dir = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(target_dir)
    random_draft(target, read_config(target_dir)).save(tmp_path / "draft")
    config_path = tmp_path / "draft" / "config.json"
    config = json.loads(config_path.read_text())
    del config["dlite_config"]["target_probe"]
    config_path.write_text(json.dumps(config))
    _load(tmp_path / "draft", load_target(make_tiny_checkpoint(tmp_path / "o", "llama", seed=3)))  # unchecked
    config["dlite_config"]["target_probe"] = {"token_ids": [1]}
    config_path.write_text(json.dumps(config))
    with pytest.raises(TargetMismatch, match="malformed"):
        _load(tmp_path / "draft", target)


def test_the_shipped_draft_records_the_default_target():
    from dlite_ray.engine.loading import default_draft_dir

    config = json.loads((default_draft_dir() / "config.json").read_text())
    assert len(config["dlite_config"]["target_probe"]["token_ids"]) == 8

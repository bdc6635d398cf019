"""The CLI's engine flags are EngineConfig's knobs, with its defaults (no second list)."""

from __future__ import annotations

from dlite_ray.cli import build_parser, engine_config
from dlite_ray.engine.engine_config import EngineConfig, knob_fields
from dlite_ray.engine.scheduler import SchedulerConfig


def test_generate_offers_every_engine_knob_with_its_default():
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    for name, knob in knob_fields().items():
        assert getattr(args, name) == knob.default, name
    assert engine_config(args) == EngineConfig()


def test_engine_flags_reach_the_engine_config():
    args = build_parser().parse_args([
        "generate", "--prompt", "x", "--draft", "none", "--max-num-seqs", "4", "--max-batch-tokens", "256",
        "--no-enable-prefix-cache", "--block-size", "8", "--tap-layers", "0", "1", "--attention-backend", "sdpa",
        "--no-adaptive-draft-length", "--verify-block-size", "5", "--normed-last-tap"])
    cfg = engine_config(args)
    assert cfg.scheduler == SchedulerConfig(max_num_seqs=4, max_batch_tokens=256)
    assert (cfg.draft, cfg.enable_prefix_cache, cfg.block_size, cfg.tap_layers) == (None, False, 8, (0, 1))
    assert (cfg.attention_backend, cfg.adaptive_draft_length, cfg.verify_block_size) == ("sdpa", False, 5)
    assert cfg.normed_last_tap is True

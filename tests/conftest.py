"""Shared fixtures: tiny random-weight Llama-family checkpoints, and the default model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

# Triton kernels (the triton attention backend) run under Triton's interpreter where there is
# no CUDA; it must be set before triton is first imported (torch._dynamo imports it early).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def tiny_hf_config(arch: str, vocab: int = 128, layers: int = 4, head_dim: int | None = None) -> dict:
    cfg = {
        "model_type": arch, "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": arch in ("qwen2", "qwen3"), "bos_token_id": 1, "eos_token_id": 2,
    }
    if arch == "qwen3" or head_dim:
        cfg["head_dim"] = head_dim or 16
    if arch == "mistral":
        cfg["sliding_window"] = None
    return cfg


def make_tiny_checkpoint(directory: Path, arch: str, seed: int = 0, **kw) -> Path:
    """A random-weight transformers model saved as a HF directory (config.json + safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_cfg = tiny_hf_config(arch, **kw)
    config = AutoConfig.for_model(**hf_cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default init so that logits are not all near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_checkpoint(root / arch, arch) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from dlite_ray.runtime.model_store import default_model_dir as fetch

    return fetch()


def read_config(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())

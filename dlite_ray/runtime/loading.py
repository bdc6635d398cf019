"""Load a target from a Hugging Face directory (config.json + safetensors) or a GGUF file."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from dlite_ray.runtime.config import ModelConfig
from dlite_ray.runtime.layers import Rotary
from dlite_ray.runtime.target_model import TargetModel

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete or does not match its config."""


def load_target(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> TargetModel:
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        hf_config, state = _read_gguf(path)
    elif path.is_dir():
        hf_config, state = _read_hf_dir(path)
    else:
        raise CheckpointError(f"no model at {path}: expected a Hugging Face directory or a .gguf file")
    return build_target(ModelConfig.from_hf(hf_config), state, dtype, device)


def build_target(cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str | torch.device) -> TargetModel:
    """Put HF-named weights into a TargetModel without a random init first."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    with torch.device("meta"):
        model = TargetModel(cfg)
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing, unexpected = expected - set(state), set(state) - expected
    unexpected = {k for k in unexpected if not k.endswith("rotary_emb.inv_freq")}
    if missing:
        raise CheckpointError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    if unexpected:
        raise CheckpointError(f"checkpoint has {len(unexpected)} unknown weights, e.g. {sorted(unexpected)[:3]}")
    for name, tensor in model.state_dict().items():
        if name in state and state[name].shape != tensor.shape:
            raise CheckpointError(
                f"{name}: checkpoint shape {tuple(state[name].shape)} != config shape {tuple(tensor.shape)}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items() if k in expected}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
    model = model.to(device).eval()
    model.freeze()
    return model


def _read_hf_dir(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{path} has no config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return json.loads(config_file.read_text()), state


def _read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Dequantise through transformers' GGUF reader (needs `gguf`), then take its weights."""
    from transformers import AutoModelForCausalLM  # heavy, only for GGUF

    log.info("reading GGUF %s through transformers (dequantises to float32)", path)
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    hf_config = hf_model.config.to_dict()
    hf_config.pop("quantization_config", None)
    return hf_config, dict(hf_model.state_dict())


def load_embedding(path: str | Path, dtype: torch.dtype = torch.float32) -> nn.Embedding:
    """Only the target's token embedding (what a draft process needs), without the rest."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(f, framework="pt") as st:
                for key in ("model.embed_tokens.weight", "embed_tokens.weight"):
                    if key in st.keys():  # noqa: SIM118 - safe_open has no __contains__
                        return nn.Embedding.from_pretrained(st.get_tensor(key).to(dtype), freeze=True)
        raise CheckpointError(f"{path} has no embed_tokens weight")
    return nn.Embedding.from_pretrained(load_target(path, dtype).embed_tokens.weight.detach(), freeze=True)


def checkpoint_fingerprint(directory: str | Path) -> str:
    """Hash of a checkpoint directory's config and weights files: the same on every process."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).glob("*")):
        if f.suffix in (".json", ".safetensors"):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def weights_fingerprint(model: nn.Module) -> str:
    """Hash of shapes plus a strided sample of every tensor: stable, cheap, weight-sensitive."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().flatten()
        sample = flat[:: max(1, flat.numel() // 64)][:64].float().cpu()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]

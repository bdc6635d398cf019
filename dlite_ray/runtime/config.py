"""Target architecture config: one dataclass for the Llama family, flags for the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> (attention bias on q/k/v, per-head q/k RMSNorm)
_ARCH_FLAGS: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
SUPPORTED_ARCHITECTURES = tuple(_ARCH_FLAGS)


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Llama-family decoder this runtime can run."""


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for RoPE")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face config.json dict; a clear error for anything else."""
        model_type = hf.get("model_type")
        if model_type not in _ARCH_FLAGS:
            raise UnsupportedModelError(
                f"unknown architecture {model_type!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _check_rope(hf)
        bias, qk_norm = _ARCH_FLAGS[model_type]
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", bias)),
            qk_norm=qk_norm,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    return hf.get("rope_parameters") or hf.get("rope_scaling") or {}


def _check_rope(hf: dict[str, Any]) -> None:
    rope_type = _rope_params(hf).get("rope_type", _rope_params(hf).get("type", "default"))
    if rope_type not in ("default", None):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported (only 'default')")


def _rope_theta(hf: dict[str, Any]) -> float:
    return float(_rope_params(hf).get("rope_theta") or hf.get("rope_theta") or 10000.0)

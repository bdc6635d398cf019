"""Random-weight targets and drafts of real shapes, built on the device without a download.

The GPU check needs a target the size of what users run (Qwen3-8B) and a draft of the
paper's depth, but the device machine cannot reach a model hub: weights are drawn on the
device itself. Exactness and step times depend on the shapes and the dtype, not on what
the weights say.
"""

from __future__ import annotations

from typing import Any, TypedDict

import torch

from dlite_ray.runtime.config import ModelConfig
from dlite_ray.runtime.draft_config import PUBLIC_CONVENTIONS, DraftConfig
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.target_model import TargetModel

# Qwen3-8B's config.json, the fields our runtime reads.
QWEN3_8B: dict[str, Any] = {
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "attention_bias": False,
}
# The same architecture, small enough for a CPU test run (`--small`).
QWEN3_SMALL: dict[str, Any] = dict(
    QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)


class DraftDims(TypedDict):
    """random_draft's shape arguments."""

    num_layers: int
    num_slots: int
    rank: int


# The paper's draft for an 8B target: 5 layers, 7 target layers read, head rank 512.
DRAFT_8B: DraftDims = {"num_layers": 5, "num_slots": 7, "rank": 512}
DRAFT_SMALL: DraftDims = {"num_layers": 2, "num_slots": 3, "rank": 16}

WEIGHT_STD = 0.02  # the usual init scale: activations stay finite through 36 layers


def _fill_random(module: torch.nn.Module, seed: int, skip: tuple[torch.Tensor, ...] = ()) -> None:
    """Matrices ~ N(0, WEIGHT_STD^2), biases zero, norms ones: a function of the seed alone
    (a draft process rebuilds the same weights)."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(p is s for s in skip):
                continue
            if p.dim() >= 2:
                p.normal_(0.0, WEIGHT_STD, generator=gen)
            elif name.endswith("bias"):
                p.zero_()


def _built_on(device: torch.device, dtype: torch.dtype, build):
    """Construct straight on the device in the dtype (no float32 copy of 8B weights on the host)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return build()
    finally:
        torch.set_default_dtype(previous)


def random_target(hf: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> TargetModel:
    model = _built_on(device, dtype, lambda: TargetModel(ModelConfig.from_hf(hf)))
    _fill_random(model, seed)  # the embedding first: `random_embedding` draws the same table
    model.eval()
    model.freeze()
    return model


def random_embedding(hf: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Embedding:
    """`random_target(hf, dtype, device, seed)`'s token embedding alone (what a draft in
    another process needs), drawn as the target draws it."""
    embedding = _built_on(device, dtype, lambda: torch.nn.Embedding(hf["vocab_size"], hf["hidden_size"]))
    _fill_random(embedding, seed)
    return embedding.requires_grad_(False)


def random_draft(target: TargetModel | None, hf: dict[str, Any], num_layers: int, num_slots: int, rank: int,
                 seed: int = 1, embedding: torch.nn.Embedding | None = None) -> DLiteDraftModel:
    """A draft reading `target` (or its `embedding` alone, in another process), with the
    public release's conventions: what a Qwen3-8B deployment loads (its last tap final-normed,
    every round's backbone over B - 1 masks)."""
    cfg = DraftConfig.for_target(hf, num_layers, num_slots, rank, mask_token_id=0, conventions=PUBLIC_CONVENTIONS)
    if embedding is None:
        if target is None:
            raise ValueError("random_draft needs the target or its embedding")
        embedding = target.embed_tokens
    draft = _built_on(embedding.weight.device, embedding.weight.dtype, lambda: DLiteDraftModel(cfg, embedding))
    _fill_random(draft, seed, skip=(embedding.weight,))  # the target's, shared
    draft.eval()
    draft.freeze()
    return draft


def draft_in_child(hf: dict[str, Any], draft_dims: DraftDims, dtype: str, device: torch.device) -> DLiteDraftModel:
    """The draft `random_draft` builds beside `random_target`, rebuilt in a draft process
    (a picklable factory: functools.partial over the first three arguments)."""
    embedding = random_embedding(hf, getattr(torch, dtype), device)
    return random_draft(None, hf, **draft_dims, embedding=embedding)

"""DLite draft config in the public checkpoint layout (REFERENCE.md section 3).

config.json = the target's HF config with `num_hidden_layers` = draft depth, plus
`num_target_layers`, `block_size` and a `dlite_config` dict. `dlite_config.conventions`
(ours; a public checkpoint never has it) records how the draft reads its inputs.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from typing import Any

from dlite_ray.runtime.config import ModelConfig

log = logging.getLogger(__name__)

_GROUP_SIZE_BY_VERSION = {"dlite_v1": 1, "dlite_v2": 2}


class DraftConfigError(ValueError):
    """A draft config that cannot be resolved without guessing."""


@dataclass(slots=True, frozen=True)
class DraftConventions:
    """How a draft reads its inputs. The weights only make sense under the conventions they
    were trained with: each one changes every output of the draft."""

    # Each draft layer's input_layernorm also normalises the context slots before its k/v
    # projections. Public: no, k_proj / v_proj read context_norm's output directly.
    context_layernorm: bool
    # The slot of the target's last layer holds that layer's output after the target's
    # final norm (Hugging Face `hidden_states[L]`). Public: yes; ours read the raw residual.
    last_layer_final_norm: bool
    # The backbone always runs B - 1 mask queries, however few tokens are drafted (attention
    # is bidirectional, so fewer masks change every output). Public: yes; ours ran K.
    always_full_block: bool

    @classmethod
    def from_dict(cls, recorded: dict[str, Any]) -> DraftConventions:
        """A config's `conventions` block; a field it leaves out takes the public value."""
        if not isinstance(recorded, dict):
            raise DraftConfigError(f"dlite_config.conventions must be a dict, got {recorded!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(recorded) - names)
        if unknown:
            raise DraftConfigError(f"dlite_config.conventions has unknown fields {unknown}; known: {sorted(names)}")
        for name, value in recorded.items():
            if not isinstance(value, bool):
                raise DraftConfigError(f"dlite_config.conventions.{name} must be true or false, got {value!r}")
        return cls(**{**asdict(PUBLIC_CONVENTIONS), **recorded})

    def to_dict(self) -> dict[str, bool]:
        return asdict(self)

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self).items())


# The public release and its training code: what a config without a `conventions` block means.
PUBLIC_CONVENTIONS = DraftConventions(context_layernorm=False, last_layer_final_norm=True, always_full_block=True)
# What dlite-ray's own drafts (the shipped one included) were trained with.
DLITE_RAY_CONVENTIONS = DraftConventions(context_layernorm=True, last_layer_final_norm=False, always_full_block=False)


def select_target_layers(num_target_layers: int, num_slots: int) -> list[int]:
    """Always 0 and L-1, plus 1 + round(i * (L - 3) / (S - 3)) for i = 0..S-3; one inner
    layer (S = 3) sits in the middle, 1 + round((L - 3) / 2), as the public release picks it."""
    if num_slots < 2 or num_slots > num_target_layers:
        raise DraftConfigError(f"chs_num_layers={num_slots} must be in [2, {num_target_layers}]")
    span = num_target_layers - 3
    if num_slots == 3:
        inner = [1 + round(span / 2)]
    else:
        inner = [1 + round(i * span / (num_slots - 3)) for i in range(num_slots - 2)]
    return sorted({0, num_target_layers - 1, *inner})


@dataclass(slots=True)
class DraftConfig:
    layers: ModelConfig  # the draft backbone's decoder layers (target width)
    num_target_layers: int
    block_size: int  # B = K + 1, counts the anchor
    architecture_version: str
    anchor_group_size: int  # G
    target_layer_ids: list[int]  # S of them
    sequential_rank: int  # R
    mask_token_id: int
    hf_config: dict[str, Any]
    conventions: DraftConventions = PUBLIC_CONVENTIONS
    conventions_recorded: bool = False  # False: the config has no `conventions` block (public defaults)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise DraftConfigError(f"block_size={self.block_size} must be >= 2")
        if self.anchor_group_size < 1:
            raise DraftConfigError(f"anchor_group_size={self.anchor_group_size} must be >= 1")
        if not self.target_layer_ids or max(self.target_layer_ids) >= self.num_target_layers:
            raise DraftConfigError(f"target_layer_ids {self.target_layer_ids} out of range for "
                                   f"{self.num_target_layers} target layers")
        if not 0 <= self.mask_token_id < self.layers.vocab_size:
            raise DraftConfigError(f"mask_token_id={self.mask_token_id} outside the vocabulary")
        if self.sequential_rank < 1:
            raise DraftConfigError(f"sequential_rank={self.sequential_rank} must be >= 1")

    @property
    def num_slots(self) -> int:
        return len(self.target_layer_ids)

    @property
    def max_draft_tokens(self) -> int:
        return self.block_size - 1

    @property
    def normed_last_tap(self) -> bool:
        """Whether the target must hand over its last layer's tap after its final norm."""
        return self.conventions.last_layer_final_norm and self.num_target_layers - 1 in self.target_layer_ids

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> DraftConfig:
        dc = hf.get("dlite_config")
        if not isinstance(dc, dict):
            raise DraftConfigError("draft config.json has no 'dlite_config' dict")
        version = dc.get("architecture_version")
        group = dc.get("anchor_group_size")
        if group is None:
            if version not in _GROUP_SIZE_BY_VERSION:
                raise DraftConfigError(
                    "dlite_config has no 'anchor_group_size' and no known 'architecture_version' "
                    f"(got {version!r}; expected one of {sorted(_GROUP_SIZE_BY_VERSION)})"
                )
            group = _GROUP_SIZE_BY_VERSION[version]
            log.info("dlite_config lacks anchor_group_size; derived %d from architecture_version=%s", group, version)
        for key in ("target_layer_ids", "sequential_rank", "mask_token_id"):
            if key not in dc:
                raise DraftConfigError(f"dlite_config lacks {key!r}")
        if dc.get("sequential_head", "rnn") != "rnn":
            raise DraftConfigError(f"sequential_head={dc['sequential_head']!r} is not supported (only 'rnn')")
        num_target_layers = hf.get("num_target_layers")
        if num_target_layers is None:
            raise DraftConfigError("draft config.json lacks 'num_target_layers'")
        recorded = "conventions" in dc
        conventions = DraftConventions.from_dict(dc["conventions"]) if recorded else PUBLIC_CONVENTIONS
        return cls(
            layers=ModelConfig.from_hf(hf), num_target_layers=num_target_layers,
            block_size=hf.get("block_size", 8), architecture_version=version or "dlite_v1",
            anchor_group_size=int(group), target_layer_ids=list(dc["target_layer_ids"]),
            sequential_rank=int(dc["sequential_rank"]), mask_token_id=int(dc["mask_token_id"]), hf_config=hf,
            conventions=conventions, conventions_recorded=recorded,
        )

    @classmethod
    def for_target(cls, target_hf: dict[str, Any], num_layers: int, num_slots: int, rank: int,
                   mask_token_id: int, block_size: int = 8, anchor_group_size: int = 1,
                   conventions: DraftConventions = DLITE_RAY_CONVENTIONS) -> DraftConfig:
        """A fresh draft config for a target (layers chosen by the public formula), recording
        the conventions it will be trained under (dlite-ray's own unless told otherwise)."""
        num_target_layers = target_hf["num_hidden_layers"]
        hf = dict(target_hf)
        hf.pop("quantization_config", None)
        hf.update(num_hidden_layers=num_layers, num_target_layers=num_target_layers, block_size=block_size)
        hf["dlite_config"] = {
            "architecture_version": "dlite_v2" if anchor_group_size == 2 else "dlite_v1",
            "model_role": "pivot_q_student",
            "anchor_group_size": anchor_group_size,
            "chs_num_layers": num_slots,
            "target_layer_ids": select_target_layers(num_target_layers, num_slots),
            "sequential_head": "rnn",
            "sequential_rank": rank,
            "mask_token_id": mask_token_id,
            "conventions": conventions.to_dict(),
        }
        return cls.from_dict(hf)

    def to_dict(self) -> dict[str, Any]:
        """The config to save: every resolved value recorded, conventions included."""
        hf = dict(self.hf_config)
        hf["dlite_config"] = dict(hf["dlite_config"], anchor_group_size=self.anchor_group_size,
                                  conventions=self.conventions.to_dict())
        return hf

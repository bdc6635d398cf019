"""Loading an engine's parts from an EngineConfig: the target, its tokenizer and the draft.

The one place that resolves the "default" draft, picks a GGUF target's tokenizer and
reads a draft's conventions (DraftInfo); how the draft is reached (in this process, or
an actor behind a link) is the caller's `make_draft`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

from dlite_ray.engine.draft_transport import DraftInfo, DraftTransport, InProcessDraftTransport
from dlite_ray.engine.engine_config import EngineConfig, torch_dtype
from dlite_ray.engine.reply_corpus import ReplyCorpus
from dlite_ray.runtime.draft_config import DraftConfig
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import checkpoint_fingerprint, load_target
from dlite_ray.runtime.target_model import TargetModel

log = logging.getLogger(__name__)


class DraftFactory(Protocol):
    """Makes the transport an engine drafts through, from what any transport needs."""

    def __call__(self, draft_path: Path, info: DraftInfo, target: TargetModel, target_path: Path,
                 config: EngineConfig) -> DraftTransport: ...


def load_draft(path: str | Path, target: TargetModel, dtype: str = "float32",
               device: str = "cpu") -> InProcessDraftTransport:
    """A draft checkpoint for `target`, drafting in this process."""
    drafter = DLiteDraftModel.load(path, target.embed_tokens, target.cfg.num_layers, torch_dtype(dtype), device)
    return InProcessDraftTransport(drafter, checkpoint_fingerprint(path))


def default_draft_dir() -> Path | None:
    path = Path(__file__).resolve().parent.parent / "default_draft"
    if (path / "config.json").exists():
        return path
    log.warning("no default draft shipped at %s: plain decoding", path)
    return None


def target_path(config: EngineConfig) -> Path:
    from dlite_ray.runtime.model_store import default_model_dir

    return Path(config.target) if config.target is not None else default_model_dir()


def draft_path(config: EngineConfig) -> Path | None:
    """The draft checkpoint to load: "default" is the shipped one, for the embedded target only."""
    if config.draft != "default":
        return None if config.draft is None else Path(config.draft)
    if config.target is not None:
        log.info("no default draft for a custom target: plain decoding (pass draft=PATH)")
        return None
    return default_draft_dir()


def load_tokenizer(path: Path):
    """The target's tokenizer: from its HF directory, or read out of a .gguf file."""
    from transformers import AutoTokenizer  # heavy

    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path)


def draft_info(path: Path) -> DraftInfo:
    """A draft's conventions (K, its taps, last tap normed or not) without loading its weights."""
    cfg = DraftConfig.from_dict(json.loads((path / "config.json").read_text()))
    return DraftInfo.of(checkpoint_fingerprint(path), cfg)


def load_corpus(config: EngineConfig) -> ReplyCorpus | None:
    """The reply corpus shipped with the config's draft, where it ships one and the config copies from it."""
    path = draft_path(config) if config.reply_corpus else None
    corpus = ReplyCorpus.load(path) if path is not None else None
    if corpus is not None:
        log.info("reply corpus: %d tokens of the target's replies (%s)", corpus.num_tokens, path)
    return corpus


def load_parts(config: EngineConfig, make_draft: DraftFactory | None = None):
    """(target model, tokenizer, draft transport or None) for an engine built from `config`."""
    path = target_path(config)
    target = load_target(path, config.torch_dtype, config.device)
    tokenizer = load_tokenizer(path)
    draft = draft_path(config)
    if draft is None:
        return target, tokenizer, None
    if make_draft is None:
        return target, tokenizer, load_draft(draft, target, config.dtype, config.device)
    return target, tokenizer, make_draft(draft, draft_info(draft), target, path, config)

"""Tiny target + draft engines for the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.engine.draft_transport import InProcessDraftTransport
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.runtime.draft_config import DLITE_RAY_CONVENTIONS, DraftConfig, DraftConventions
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.test_requests import CharTokenizer


def random_draft(target, hf_config: dict, seed: int = 1, layers: int = 1, slots: int = 3, rank: int = 8,
                 block_size: int = 8, anchor_group_size: int = 1,
                 conventions: DraftConventions = DLITE_RAY_CONVENTIONS) -> DLiteDraftModel:
    cfg = DraftConfig.for_target(hf_config, layers, slots, rank, mask_token_id=0, block_size=block_size,
                                 anchor_group_size=anchor_group_size, conventions=conventions)
    torch.manual_seed(seed)
    draft = DLiteDraftModel(cfg, target.embed_tokens)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2 and p is not draft.embed_tokens.weight:
                p.normal_(0, 0.3)
    return draft.eval()


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "llama", "llama")


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    return load_target(tiny_target_dir)


def make_engine(target, draft=None, **kw) -> DLiteEngine:
    """Fixed draft length and no context lookup unless asked: tests want every round to
    draft (and reject)."""
    transport = draft if draft is None or hasattr(draft, "info") else InProcessDraftTransport(draft, "test")
    kw.setdefault("adaptive_draft_length", False)
    kw.setdefault("lookup_tokens", 0)
    return DLiteEngine(target, CharTokenizer(), transport, **kw)


@pytest.fixture(scope="session")
def tiny_draft(tiny_target, tiny_target_dir):
    return random_draft(tiny_target, read_config(tiny_target_dir))

"""The draft backbone's layers in one C++ call (DraftLayerLoop): its output has every bit of
the eager backbone's, for both conventions of reading the context, and it steps aside where
it does not serve."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.draft_config import DLITE_RAY_CONVENTIONS, PUBLIC_CONVENTIONS
from dlite_ray.runtime.draft_model import DLiteDraftModel, HistoryWindow
from dlite_ray.runtime.loading import load_target
from tests.conftest import read_config
from tests.engine.conftest import random_draft


def _loaded_draft(tiny_dirs, tmp_path, arch: str, dtype: torch.dtype, conventions=DLITE_RAY_CONVENTIONS):
    """A random two-layer draft for the tiny `arch` target, saved and loaded (frozen) in `dtype`."""
    if dtype not in fused_ops.kernel_dtypes():
        pytest.skip(f"the compiled kernels do not compute {dtype} on this machine")
    target = load_target(tiny_dirs[arch])
    draft = random_draft(target, read_config(tiny_dirs[arch]), layers=2, anchor_group_size=2,
                         conventions=conventions)
    draft.save(tmp_path / "draft", dtype=torch.float32)
    loaded = DLiteDraftModel.load(tmp_path / "draft", target.embed_tokens, target.cfg.num_layers, dtype=dtype)
    return loaded, target.cfg


def _inputs(draft, hidden: int, rows: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(rows, draft.cfg.num_slots, hidden, generator=gen).to(dtype)
    groups = torch.randint(1, draft.cfg.layers.vocab_size, (rows, draft.cfg.anchor_group_size), generator=gen)
    return features, groups


def _eager(draft, *args, **kwargs):
    loop, draft.layer_loop = draft.layer_loop, None
    try:
        return draft.backbone(*args, **kwargs)
    finally:
        draft.layer_loop = loop


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("conventions", [DLITE_RAY_CONVENTIONS, PUBLIC_CONVENTIONS], ids=["ours", "public"])
def test_the_loop_gives_the_eager_backbones_bits(tiny_dirs, tmp_path, arch, dtype, conventions):
    draft, cfg = _loaded_draft(tiny_dirs, tmp_path, arch, dtype, conventions)
    assert draft.layer_loop is not None  # the loop's path, not the eager one
    with torch.inference_mode():
        for rows, masks in ((1, 7), (3, 2), (16, 5)):
            features, groups = _inputs(draft, cfg.hidden_size, rows, dtype, seed=rows)
            out = draft.backbone(features, groups, masks)
            assert out.shape == (rows, masks, cfg.hidden_size) and out.dtype == dtype
            assert torch.equal(out, _eager(draft, features, groups, masks))


def test_the_conventions_change_the_loops_output(tiny_dirs, tmp_path):
    """The flag reaches the kernel: the same weights read the context with and without each
    layer's input norm, and so give other outputs."""
    ours, cfg = _loaded_draft(tiny_dirs, tmp_path / "ours", "llama", torch.float32)
    public, _ = _loaded_draft(tiny_dirs, tmp_path / "public", "llama", torch.float32, PUBLIC_CONVENTIONS)
    features, groups = _inputs(ours, cfg.hidden_size, 2, torch.float32)
    with torch.inference_mode():
        assert not torch.equal(ours.backbone(features, groups, 4), public.backbone(features, groups, 4))


def test_the_loop_steps_aside_where_it_does_not_serve(tiny_dirs, tmp_path, monkeypatch):
    draft, cfg = _loaded_draft(tiny_dirs, tmp_path, "llama", torch.float32)
    calls = []
    monkeypatch.setattr(draft.layer_loop, "run", lambda *args: calls.append(args))
    features, groups = _inputs(draft, cfg.hidden_size, 2, torch.float32)
    history = HistoryWindow(torch.randn(2, 3, cfg.hidden_size), torch.arange(3, 0, -1),
                            torch.ones(2, 3, dtype=torch.bool))
    with torch.inference_mode():
        draft.backbone(features, groups, 3, history)  # a teacher's window: eager only
    draft.backbone(features, groups, 3)  # gradients on (training)
    assert calls == []


def test_no_loop_for_qk_norm_drafts_or_with_the_loop_switched_off(tiny_dirs, tmp_path, monkeypatch):
    qwen3, _ = _loaded_draft(tiny_dirs, tmp_path / "qwen3", "qwen3", torch.float32)
    assert qwen3.layer_loop is None
    monkeypatch.setenv("DLITE_LAYER_LOOP", "0")
    llama, _ = _loaded_draft(tiny_dirs, tmp_path / "llama", "llama", torch.float32)
    assert llama.layer_loop is None

"""DLite draft: public checkpoint layout, config resolution, clear errors, local positions."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlite_ray.runtime.draft_config import DraftConfig, DraftConfigError, select_target_layers
from dlite_ray.runtime.draft_model import DLiteDraftModel, build_block_position_ids
from dlite_ray.runtime.sampling import RowSampling, probabilities, sample
from tests.conftest import read_config
from tests.engine.conftest import random_draft

PUBLIC_PREFIXES = ("layers.0.self_attn.q_proj", "layers.0.self_attn.o_proj", "layers.0.mlp.gate_proj",
                   "layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm.weight",
                   "layer_depth_embedding", "context_norm", "sequential_head.prev_token_embedding",
                   "sequential_head.state_proj", "sequential_head.state_hidden_mlp", "sequential_head.output_proj")


def test_target_layer_formula_matches_the_reference():
    assert select_target_layers(36, 7) == [0, 1, 9, 17, 26, 34, 35]
    assert select_target_layers(30, 5) == [0, 1, 15, 28, 29]


def test_local_positions():
    assert build_block_position_ids(1, 7, 3).tolist() == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert build_block_position_ids(2, 3, 2).tolist() == [0, 0, 0, 1, 2, 3, 4]
    assert build_block_position_ids(3, 2, 1).tolist() == [1, 0, 1, 2, 3, 4]


@pytest.fixture
def saved_draft(tiny_dirs, tmp_path):
    from dlite_ray.runtime.loading import load_target

    target = load_target(tiny_dirs["qwen3"])
    draft = random_draft(target, read_config(tiny_dirs["qwen3"]))
    draft.save(tmp_path / "draft", dtype=torch.float32)
    return target, draft, tmp_path / "draft"


def _propose(draft, target, seed=0):
    torch.manual_seed(seed)
    feats = torch.randn(2, draft.cfg.num_slots, target.cfg.hidden_size)
    groups = torch.tensor([[5], [9]])
    s = RowSampling.build([0.0, 0.0], [0, 0], [1.0, 1.0], [None, None])
    return draft.propose(feats, groups, 5, s, torch.tensor([True, True]))


def test_roundtrip_in_public_layout(saved_draft):
    target, draft, path = saved_draft
    keys = load_file(path / "model.safetensors").keys()
    for prefix in PUBLIC_PREFIXES:
        assert any(k.startswith(prefix) for k in keys), prefix
    assert not any(k.startswith("embed_tokens") for k in keys)  # the target's, not shipped
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dlite_config"]["sequential_head"] == "rnn" and cfg["num_target_layers"] == 4
    loaded = DLiteDraftModel.load(path, target.embed_tokens, target.cfg.num_layers)
    assert torch.equal(_propose(draft, target).tokens, _propose(loaded, target).tokens)


def test_a_bf16_draft_drafts_through_a_float32_head(saved_draft):
    """Loaded for inference in bf16, the backbone stays bf16 and the sequential head runs in
    float32 (cheaper per call on CPU); sampled rows still get distributions that sum to 1."""
    target, _, path = saved_draft
    loaded = DLiteDraftModel.load(path, target.embed_tokens, target.cfg.num_layers, dtype=torch.bfloat16)
    assert loaded.layers[0].self_attn.qkv is not None and loaded.layers[0].mlp.gate_up is not None  # fused
    assert loaded.norm.weight.dtype == torch.bfloat16
    assert loaded.sequential_head.state_proj.weight.dtype == torch.float32
    feats = torch.randn(2, loaded.cfg.num_slots, target.cfg.hidden_size, dtype=torch.bfloat16)
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    s = RowSampling.build([0.8, 0.0], [0, 0], [1.0, 1.0], gens)
    out = loaded.propose(feats, torch.tensor([[5], [9]]), 5, s, torch.tensor([False, True]))
    assert out.tokens.shape == (2, 5) and out.probs.dtype == torch.float32
    torch.testing.assert_close(out.probs.sum(-1), torch.ones(2, 5))
    assert (out.probs[0].gather(-1, out.tokens[0, :, None]) > 0).all()  # drawn where q is positive


@torch.inference_mode()
def _drafted_position_by_position(draft, feats, groups, k, s, greedy):
    """The round as the draft ran it before its draws were taken at once: each position's
    uniforms drawn from the rows' generators when it is reached."""
    head = draft.sequential_head
    num_masks = draft.cfg.max_draft_tokens if draft.cfg.conventions.always_full_block else k
    u = draft.backbone(feats, groups, num_masks)[:, :k].to(head.state_proj.weight.dtype)
    state, token, tokens = head.initial_state(u.shape[0], u, None), groups[:, -1], []
    t = torch.where(s.temperature > 0, s.temperature, torch.ones_like(s.temperature))
    for j in range(k):
        state = head.advance(state, token)
        logits = head.draft_logits(state, u[:, j]).float()
        q = probabilities(logits[:, None], RowSampling(t, s.top_k, s.top_p, s.generators))
        token = head.to_token_ids(torch.where(greedy, logits.argmax(dim=-1), sample(q, s.generators)[:, 0]))
        tokens.append(token)
    return torch.stack(tokens, dim=1)


def test_a_seeded_round_drafts_what_position_by_position_draws_gave(saved_draft):
    """The round's uniforms are drawn at once: a seed's drafted tokens stay what they were."""
    target, draft, _ = saved_draft
    feats, groups = torch.randn(3, draft.cfg.num_slots, target.cfg.hidden_size), torch.tensor([[5], [9], [17]])
    greedy = torch.tensor([False, True, False])

    def sampling():
        return RowSampling.build([0.9, 0.0, 1.3], [0, 0, 20], [1.0, 1.0, 0.9],
                                 [torch.Generator().manual_seed(40 + i) for i in range(3)])

    want = _drafted_position_by_position(draft, feats, groups, 5, sampling(), greedy)
    assert torch.equal(draft.propose(feats, groups, 5, sampling(), greedy, all_greedy=False).tokens, want)


def test_a_round_known_greedy_reads_nothing_from_the_device(saved_draft):
    """all_greedy comes from the requests' params: the flags tensor is not read (on the meta
    device, any read of it raises)."""
    target, draft, _ = saved_draft
    feats = torch.randn(2, draft.cfg.num_slots, target.cfg.hidden_size)
    s = RowSampling.build([0.0, 0.0], [0, 0], [1.0, 1.0], [None, None])
    unreadable = torch.ones(2, dtype=torch.bool, device="meta")
    out = draft.propose(feats, torch.tensor([[5], [9]]), 5, s, unreadable, all_greedy=True)
    read = draft.propose(feats, torch.tensor([[5], [9]]), 5, s, torch.ones(2, dtype=torch.bool))
    assert torch.equal(out.tokens, read.tokens)


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("version, group", [("dlite_v1", 1), ("dlite_v2", 2)])
def test_group_size_derived_from_version(saved_draft, version, group, caplog):
    _, _, path = saved_draft

    def edit(cfg):
        del cfg["dlite_config"]["anchor_group_size"]
        cfg["dlite_config"]["architecture_version"] = version

    _edit_config(path, edit)
    with caplog.at_level("INFO"):
        cfg = DraftConfig.from_dict(json.loads((path / "config.json").read_text()))
    assert cfg.anchor_group_size == group
    assert "derived" in caplog.text


def test_unresolvable_group_size_is_an_error(saved_draft):
    _, _, path = saved_draft

    def edit(cfg):
        del cfg["dlite_config"]["anchor_group_size"]
        del cfg["dlite_config"]["architecture_version"]

    _edit_config(path, edit)
    with pytest.raises(DraftConfigError, match="no 'anchor_group_size'"):
        DraftConfig.from_dict(json.loads((path / "config.json").read_text()))


def test_mismatched_width_vocab_and_missing_keys(saved_draft, tiny_dirs):

    target, _, path = saved_draft
    with pytest.raises(DraftConfigError, match="draft width 64 != target width 32"):
        DLiteDraftModel.load(path, torch.nn.Embedding(128, 32), 4)
    with pytest.raises(DraftConfigError, match="vocabulary 128 != target vocabulary 99"):
        DLiteDraftModel.load(path, torch.nn.Embedding(99, 64), 4)
    with pytest.raises(DraftConfigError, match="made for 4 target layers"):
        DLiteDraftModel.load(path, target.embed_tokens, 30)
    state = load_file(path / "model.safetensors")
    state.pop("sequential_head.output_proj.weight")
    save_file(state, path / "model.safetensors")
    with pytest.raises(DraftConfigError, match="lacks 1 weights"):
        DLiteDraftModel.load(path, target.embed_tokens, 4)


def test_corrupt_shape_is_an_error(saved_draft):
    target, _, path = saved_draft
    state = load_file(path / "model.safetensors")
    state["context_norm.weight"] = torch.ones(7)
    save_file(state, path / "model.safetensors")
    with pytest.raises(DraftConfigError, match="context_norm.weight: shape"):
        DLiteDraftModel.load(path, target.embed_tokens, 4)


def _loaded_head(saved_draft):
    from dlite_ray.runtime import fused_ops

    if torch.float32 not in fused_ops.kernel_dtypes():
        pytest.skip("the compiled kernels do not compute float32 on this machine")
    target, _, path = saved_draft
    head = DLiteDraftModel.load(path, target.embed_tokens, target.cfg.num_layers).sequential_head
    assert head._row_linears() is not None  # the kernel's path, not the eager one
    return head, target.cfg.hidden_size


@pytest.mark.parametrize("subset", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_the_greedy_head_kernel_gives_the_eager_loops_bits(saved_draft, subset, rows):
    head, hidden = _loaded_head(saved_draft)
    if subset:
        head.restrict_vocabulary(torch.arange(3, 120, 2))
    torch.manual_seed(rows)
    u, state = torch.randn(rows, 7, hidden), torch.randn(rows, head.rank)
    token = torch.randint(0, head.prev_token_embedding.num_embeddings, (rows,))
    tokens, runners_up = head.greedy_block(u, state, token)
    eager_tokens, eager_runners_up = head._greedy_steps(u, state, token)
    assert torch.equal(tokens, eager_tokens) and torch.equal(runners_up, eager_runners_up)
    assert not torch.equal(tokens, runners_up)
    if subset:
        assert torch.isin(tokens, head.drafted_ids).all() and torch.isin(runners_up, head.drafted_ids).all()


def test_the_greedy_head_kernel_breaks_ties_as_argmax_does(saved_draft):
    """Every logit equal: the first token is the best, the second the runner-up, as argmax
    and argmax with the best masked out give them."""
    head, hidden = _loaded_head(saved_draft)
    with torch.no_grad():
        head.output_proj.weight.copy_(head.output_proj.weight[:1].expand_as(head.output_proj.weight))
    head.restrict_vocabulary(torch.tensor([4, 9, 30, 31]))
    u, state, token = torch.randn(2, 5, hidden), torch.randn(2, head.rank), torch.tensor([1, 2])
    tokens, runners_up = head.greedy_block(u, state, token)
    assert tokens.unique().tolist() == [4] and runners_up.unique().tolist() == [9]
    assert all(torch.equal(a, b) for a, b in zip((tokens, runners_up), head._greedy_steps(u, state, token)))

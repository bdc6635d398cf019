"""A public DLite checkpoint loads and drafts exactly as the public release does.

The draft is written the way the public release and its training code write one: the
target's Qwen3 config with the draft's depth, a `dlite_config` without our `conventions`
block (dlite_v1 with `anchor_group_size`, dlite_v2 without it, as its training code saves
it), and weights under the public module names. Our target + loader + draft must then
propose what an independent reference, written here in plain torch from the public
equations, proposes from transformers' own `hidden_states` (entry i + 1 for layer i, the
last one after the final norm):

  context  = context_norm(h + e_depth[layer])           k/v read it without input_layernorm
  queries  = embeddings of [G real tokens ; B-1 MASKs]   always all B - 1 masks
  attention: bidirectional over [context ; queries], Qwen3 q/k norms, local RoPE positions
  head     = the rank-R gated RNN, seeded with the token before the anchor when G = 2
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dlite_ray.engine.draft_transport import InProcessDraftTransport
from dlite_ray.engine.engine import DLiteEngine, default_draft_dir
from dlite_ray.engine.model_runner import RowInput
from dlite_ray.runtime.draft_config import (
    DLITE_RAY_CONVENTIONS,
    PUBLIC_CONVENTIONS,
    DraftConfig,
    DraftConfigError,
    DraftConventions,
    select_target_layers,
)
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import load_target
from dlite_ray.runtime.sampling import RowSampling
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import random_draft
from tests.engine.test_requests import CharTokenizer
from tests.helpers import new_seq

TARGET_LAYERS = 5
SLOTS = 3  # layers [0, 2, 4]: the first, the middle, the last (the one a final norm changes)
DRAFT_LAYERS = 2
BLOCK = 6  # B: 5 masks
RANK = 8
MASK_ID = 127
PROMPT = [5, 17, 42, 9, 88, 23, 64, 11, 30, 71, 50, 6, 99, 14]


# -- the public checkpoint, written as the public code writes it ---------------------------------
def write_public_draft(directory, target_hf: dict, version: str, seed: int = 0):
    """config.json + model.safetensors (bf16) in the public layout; no `conventions` block."""
    d, heads, kv_heads, dh = (target_hf["hidden_size"], target_hf["num_attention_heads"],
                              target_hf["num_key_value_heads"], target_hf["head_dim"])
    inter, vocab, depth = target_hf["intermediate_size"], target_hf["vocab_size"], target_hf["num_hidden_layers"]
    gen = torch.Generator().manual_seed(seed)

    def linear(rows, cols):
        return torch.randn(rows, cols, generator=gen) * (1.0 / math.sqrt(cols))

    def norm(n):  # far from 1, so a missing or extra norm shows
        return 1.0 + 0.5 * torch.randn(n, generator=gen)

    state = {}
    for i in range(DRAFT_LAYERS):
        p = f"layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": linear(heads * dh, d),
            p + "self_attn.k_proj.weight": linear(kv_heads * dh, d),
            p + "self_attn.v_proj.weight": linear(kv_heads * dh, d),
            p + "self_attn.o_proj.weight": linear(d, heads * dh),
            p + "self_attn.q_norm.weight": norm(dh), p + "self_attn.k_norm.weight": norm(dh),
            p + "mlp.gate_proj.weight": linear(inter, d), p + "mlp.up_proj.weight": linear(inter, d),
            p + "mlp.down_proj.weight": linear(d, inter),
            p + "input_layernorm.weight": norm(d), p + "post_attention_layernorm.weight": norm(d),
        })
    state.update({
        "norm.weight": norm(d), "context_norm.weight": norm(d),
        "layer_depth_embedding.weight": torch.randn(depth, d, generator=gen),
        "sequential_head.prev_token_embedding.weight": torch.randn(vocab, RANK, generator=gen),
        "sequential_head.state_proj.weight": linear(2 * RANK, 2 * RANK),
        "sequential_head.state_proj.bias": 0.1 * torch.randn(2 * RANK, generator=gen),
        "sequential_head.state_hidden_mlp.weight": linear(RANK, RANK + d),
        "sequential_head.state_hidden_mlp.bias": 0.1 * torch.randn(RANK, generator=gen),
        "sequential_head.output_proj.weight": 3.0 * linear(vocab, RANK),
    })
    dlite = {"architecture_version": version, "model_role": "pivot_q_student", "chs_num_layers": SLOTS,
             "target_layer_ids": [0, 2, 4], "sequential_head": "rnn", "sequential_rank": RANK,
             "mask_token_id": MASK_ID}
    if version == "dlite_v1":
        dlite["anchor_group_size"] = 1  # the inference release requires it; v2 training configs lack it
    config = dict(target_hf, num_hidden_layers=DRAFT_LAYERS, num_target_layers=depth, block_size=BLOCK,
                  dlite_config=dlite)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, directory / "model.safetensors")
    return directory


# -- the reference: the public equations in plain torch ------------------------------------------
def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x, positions, theta):
    """x [T, h, d] rotated at `positions` [T] (rotate-half, as Hugging Face's Qwen3)."""
    dh = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float32) / dh)
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    rotated = torch.cat([-x[..., dh // 2:], x[..., :dh // 2]], dim=-1)
    return x * angles.cos() + rotated * angles.sin()


def reference_backbone(w, cfg, embed, feats, group):
    """feats [S, D] (HF hidden_states at the pivot), group [G] -> u [B-1, D] at the masks."""
    eps = cfg["rms_norm_eps"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg["rope_theta"]  # transformers 5 / 4
    heads, kv_heads, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    layer_ids = torch.tensor(cfg["dlite_config"]["target_layer_ids"])
    g, s = len(group), len(feats)
    ctx = rms(feats + w["layer_depth_embedding.weight"][layer_ids], w["context_norm.weight"], eps)
    x = embed[torch.cat([group, torch.full((BLOCK - 1,), MASK_ID)])]
    t = len(x)
    # Local positions from the first real token (anchor - G + 1); the pivot is anchor - 1.
    q_pos = torch.arange(t)
    kv_pos = torch.cat([torch.full((s,), max(g - 2, 0)), q_pos])
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        kv_in = torch.cat([ctx, h])  # the context slots as context_norm left them
        q = rms((h @ w[p + "self_attn.q_proj.weight"].T).view(t, heads, dh), w[p + "self_attn.q_norm.weight"], eps)
        k = rms((kv_in @ w[p + "self_attn.k_proj.weight"].T).view(s + t, kv_heads, dh),
                w[p + "self_attn.k_norm.weight"], eps)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(s + t, kv_heads, dh)
        q, k = rope(q, q_pos, theta), rope(k, kv_pos, theta)
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dh)  # no mask: bidirectional
        attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, heads * dh)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"], eps)[g:]


def reference_head(w, u, group, forced=None):
    """The RNN head over u [B-1, D]: (greedy tokens, logits [K, V]); with `forced` [K] it
    reads those tokens as the previous ones instead of its own choices."""
    table = w["sequential_head.prev_token_embedding.weight"]
    ws, bs = w["sequential_head.state_proj.weight"], w["sequential_head.state_proj.bias"]
    wh, bh = w["sequential_head.state_hidden_mlp.weight"], w["sequential_head.state_hidden_mlp.bias"]
    wo = w["sequential_head.output_proj.weight"]

    def step(state, token):
        gate, cand = (torch.cat([state, table[token]]) @ ws.T + bs).chunk(2)
        z = torch.sigmoid(gate)
        return z * state + (1 - z) * torch.tanh(cand)

    state = torch.zeros(RANK)
    if len(group) > 1:
        state = step(state, group[-2])
    prev, tokens, logits = group[-1], [], []
    for k in range(len(u) if forced is None else len(forced)):
        state = step(state, prev)
        row = (torch.cat([state, u[k]]) @ wh.T + bh) @ wo.T
        tokens.append(row.argmax())
        logits.append(row)
        prev = tokens[-1] if forced is None else forced[k]
    return torch.stack(tokens), torch.stack(logits)


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("public") / "qwen3", "qwen3", layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def hf_hidden_states(target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [h[0] for h in model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states]


@pytest.fixture(scope="module", params=["dlite_v1", "dlite_v2"])
def public_draft(request, tmp_path_factory, target_dir):
    return write_public_draft(tmp_path_factory.mktemp(request.param) / "draft", read_config(target_dir),
                              request.param)


def _engine(target, draft: DLiteDraftModel) -> DLiteEngine:
    return DLiteEngine(target, CharTokenizer(), InProcessDraftTransport(draft, "public"),
                       adaptive_draft_length=False, lookup_tokens=0)


def _rows(group_size: int):
    """(pivots, token groups): every pivot p with a full group ending at the anchor p + 1."""
    pivots = list(range(max(group_size - 2, 0), len(PROMPT) - 1))
    groups = torch.tensor([PROMPT[p + 2 - group_size:p + 2] for p in pivots])
    return pivots, groups


def _our_features(engine: DLiteEngine):
    """The engine's own taps over the prompt (its runner follows the draft's convention)."""
    out = engine.runner.forward([RowInput(new_seq(PROMPT), PROMPT, num_outputs=len(PROMPT))])[0]
    return out.taps  # [n, S, D]


# -- the parity tests -----------------------------------------------------------------------------
def test_the_layer_selection_matches_the_public_release():
    assert select_target_layers(TARGET_LAYERS, SLOTS) == [0, 2, 4]
    assert select_target_layers(30, 3) == [0, 15, 29]  # one inner layer: the middle one
    assert select_target_layers(36, 7) == [0, 1, 9, 17, 26, 34, 35]


def test_a_public_config_reads_with_the_public_conventions(public_draft, target, caplog):
    hf = json.loads((public_draft / "config.json").read_text())
    cfg = DraftConfig.from_dict(hf)
    assert cfg.conventions == PUBLIC_CONVENTIONS and not cfg.conventions_recorded
    assert cfg.anchor_group_size == (2 if hf["dlite_config"]["architecture_version"] == "dlite_v2" else 1)
    assert cfg.normed_last_tap
    with caplog.at_level("INFO", logger="dlite_ray.runtime.draft_model"):
        DLiteDraftModel.load(public_draft, target.embed_tokens, target.cfg.num_layers)
    assert "none recorded: the public release's" in caplog.text and "context_layernorm=False" in caplog.text


def test_the_target_hands_over_hf_hidden_states(public_draft, target, hf_hidden_states):
    """Layer i's tap is HF's hidden_states[i + 1]; for the last layer that is after the final norm."""
    draft = DLiteDraftModel.load(public_draft, target.embed_tokens, target.cfg.num_layers)
    engine = _engine(target, draft)
    assert engine.runner.normed_last_tap
    taps = _our_features(engine)
    for slot, layer in enumerate(draft.cfg.target_layer_ids):
        torch.testing.assert_close(taps[:, slot], hf_hidden_states[layer + 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 3, BLOCK - 1])
def test_greedy_proposals_equal_the_public_equations(public_draft, target, target_dir, hf_hidden_states, num_tokens):
    draft = DLiteDraftModel.load(public_draft, target.embed_tokens, target.cfg.num_layers)
    cfg, w = read_config(public_draft), {k: v.float() for k, v in load_file(public_draft / "model.safetensors").items()}
    embed = target.embed_tokens.weight.detach()
    pivots, groups = _rows(draft.cfg.anchor_group_size)
    feats = _our_features(_engine(target, draft))[pivots]
    greedy = RowSampling.build([0.0] * len(pivots), [0] * len(pivots), [1.0] * len(pivots), [None] * len(pivots))
    ours = draft.propose(feats, groups, num_tokens, greedy, torch.ones(len(pivots), dtype=torch.bool))

    layer_ids = cfg["dlite_config"]["target_layer_ids"]
    for row, (p, group) in enumerate(zip(pivots, groups)):
        hf_feats = torch.stack([hf_hidden_states[layer + 1][p] for layer in layer_ids])
        u = reference_backbone(w, cfg, embed, hf_feats, group)
        tokens, logits = reference_head(w, u, group)
        top2 = logits[:num_tokens].topk(2).values
        assert bool((top2[:, 0] - top2[:, 1] > 1e-3).all()), "a near tie: pick another seed"
        assert ours.tokens[row].tolist() == tokens[:num_tokens].tolist(), f"row {row} (pivot {p})"


@pytest.mark.parametrize("num_tokens", [2, BLOCK - 1])
def test_sampled_distributions_equal_the_public_equations(public_draft, target, hf_hidden_states, num_tokens):
    """The head's distributions, each along the tokens our draft actually sampled."""
    draft = DLiteDraftModel.load(public_draft, target.embed_tokens, target.cfg.num_layers)
    cfg, w = read_config(public_draft), {k: v.float() for k, v in load_file(public_draft / "model.safetensors").items()}
    embed = target.embed_tokens.weight.detach()
    pivots, groups = _rows(draft.cfg.anchor_group_size)
    n, temperature = len(pivots), 0.7
    feats = _our_features(_engine(target, draft))[pivots]
    gens = [torch.Generator().manual_seed(i) for i in range(n)]
    sampled = RowSampling.build([temperature] * n, [0] * n, [1.0] * n, gens)
    ours = draft.propose(feats, groups, num_tokens, sampled, torch.zeros(n, dtype=torch.bool))

    layer_ids = cfg["dlite_config"]["target_layer_ids"]
    for row, (p, group) in enumerate(zip(pivots, groups)):
        hf_feats = torch.stack([hf_hidden_states[layer + 1][p] for layer in layer_ids])
        u = reference_backbone(w, cfg, embed, hf_feats, group)
        _, logits = reference_head(w, u, group, forced=ours.tokens[row])
        torch.testing.assert_close(ours.probs[row], torch.softmax(logits / temperature, dim=-1),
                                   atol=2e-5, rtol=1e-4)


def test_a_public_draft_speculates_exactly(public_draft, target):
    """Through the whole engine (taps, token groups, full blocks): greedy output is the target's."""
    draft = DLiteDraftModel.load(public_draft, target.embed_tokens, target.cfg.num_layers)
    plain = DLiteEngine(target, CharTokenizer(), None).generate([PROMPT], max_new_tokens=24)
    spec = _engine(target, draft).generate([PROMPT], max_new_tokens=24)
    assert spec[0].token_ids == plain[0].token_ids


# -- our own drafts record theirs -----------------------------------------------------------------
def test_the_shipped_draft_records_dlite_ray_conventions():
    cfg = DraftConfig.from_dict(json.loads((default_draft_dir() / "config.json").read_text()))
    assert cfg.conventions == DLITE_RAY_CONVENTIONS and cfg.conventions_recorded
    assert not cfg.normed_last_tap


def test_new_drafts_record_and_save_their_conventions(target, target_dir, tmp_path):
    draft = random_draft(target, read_config(target_dir))
    assert draft.cfg.conventions == DLITE_RAY_CONVENTIONS  # what `dlite-ray train` makes
    draft.save(tmp_path / "ours", dtype=torch.float32)
    saved = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert saved["dlite_config"]["conventions"] == DLITE_RAY_CONVENTIONS.to_dict()
    loaded = DLiteDraftModel.load(tmp_path / "ours", target.embed_tokens, target.cfg.num_layers)
    assert loaded.cfg.conventions == DLITE_RAY_CONVENTIONS and not _engine(target, loaded).runner.normed_last_tap


def test_training_features_follow_the_draft_being_trained(public_draft, tmp_path):
    from dlite_ray.training.pipeline import draft_conventions

    assert draft_conventions(None) == DLITE_RAY_CONVENTIONS
    assert draft_conventions(str(public_draft)) == PUBLIC_CONVENTIONS  # --init-from a public draft


def test_a_draftless_engine_taps_as_asked_and_a_mismatch_is_refused(target, public_draft):
    engine = DLiteEngine(target, CharTokenizer(), None, tap_layers=(0, 4), normed_last_tap=True)
    assert engine.runner.normed_last_tap
    draft = DLiteDraftModel.load(public_draft, target.embed_tokens, target.cfg.num_layers)
    with pytest.raises(ValueError, match="normed_last_tap=False differs"):
        DLiteEngine(target, CharTokenizer(), InProcessDraftTransport(draft, "x"), normed_last_tap=False)


@pytest.mark.parametrize("conventions, message", [
    ({"context_layer_norm": True}, "unknown fields"),
    ({"always_full_block": "yes"}, "must be true or false"),
    ([True, False, True], "must be a dict"),
])
def test_bad_conventions_are_refused(target_dir, conventions, message):
    hf = DraftConfig.for_target(read_config(target_dir), 1, 3, 8, mask_token_id=0).to_dict()
    hf["dlite_config"]["conventions"] = conventions
    with pytest.raises(DraftConfigError, match=message):
        DraftConfig.from_dict(hf)


def test_a_partial_block_takes_the_public_values_for_the_rest(target_dir):
    hf = DraftConfig.for_target(read_config(target_dir), 1, 3, 8, mask_token_id=0).to_dict()
    hf["dlite_config"]["conventions"] = {"context_layernorm": True}
    cfg = DraftConfig.from_dict(hf)
    assert cfg.conventions == DraftConventions(context_layernorm=True, last_layer_final_norm=True,
                                               always_full_block=True)

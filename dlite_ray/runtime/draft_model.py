"""DLiteDraftModel: a history-free draft that reads S target layers at the pivot.

One round for N requests (REFERENCE.md section 1):
  context  = context_norm(pivot features [N, S, D] + e_depth[layer_id])   (S separate slots)
  queries  = target embeddings of the G real tokens ending at the anchor, then K MASK rows
  backbone = decoder layers; queries attend bidirectionally to [context ; queries]
  head     = DLiteSequentialHead turns the K mask outputs into K tokens, one after another
Positions are local (they never grow with the history); nothing survives the round.
The config's conventions (`DraftConventions`) say whether the context slots also pass each
layer's input_layernorm and whether the backbone runs K masks or always B - 1.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.draft_config import DraftConfig, DraftConfigError
from dlite_ray.runtime.draft_layer_loop import DraftLayerLoop
from dlite_ray.runtime.draft_vocab import DRAFT_VOCAB_FILE, load_draft_vocab
from dlite_ray.runtime.frozen_linear import freeze_linears
from dlite_ray.runtime.layers import DecoderLayer, RMSNorm, Rotary, apply_rotary, decoder_layers
from dlite_ray.runtime.sampling import RowSampling, probabilities, race, uniforms
from dlite_ray.runtime.sequential_head import DLiteSequentialHead
from dlite_ray.runtime.target_probe import check_probe, probe_of

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HistoryWindow:
    """Keys/values-only entries before the pivot: the stage-0 teacher's sliding window
    (training only; the shipped draft never sees history)."""

    states: torch.Tensor  # [N, W, D] at draft width
    distances: torch.Tensor  # [W] how many positions each entry lies before the pivot (>= 1)
    valid: torch.Tensor  # [N, W] bool; False where a row's history is shorter than W


@dataclass(slots=True)
class DraftProposal:
    tokens: torch.Tensor  # [N, K]
    probs: torch.Tensor | None  # [N, K, W] the distributions the tokens were drawn from; None if all greedy
    prob_ids: torch.Tensor | None = None  # [W] the token id of each column of probs; None: all V, in order
    # [N, K] at each position the draft's likeliest token other than the one drafted (the
    # engine verifies it as a branch where a tree pays); None: the draft gives none
    runners_up: torch.Tensor | None = None

    def vocabulary_probs(self, vocab_size: int) -> torch.Tensor | None:
        """[N, K, V]: probs over every token, zero outside prob_ids (what verification reads).
        A draft with a vocabulary subset keeps its distributions W wide until here, so a
        transport carries W / V of the bytes."""
        if self.probs is None or self.prob_ids is None:
            return self.probs
        full = self.probs.new_zeros(*self.probs.shape[:-1], vocab_size)
        return full.index_copy_(-1, self.prob_ids, self.probs)


def build_block_position_ids(group_size: int, num_masks: int, num_slots: int, device=None) -> torch.Tensor:
    """Local positions of [context slots ; G real tokens ; masks], counted from the first real
    token: slots at the pivot (one before the anchor), max(G - 2, 0); real tokens 0..G-1;
    masks G..G+num_masks-1."""
    # made on the device: a copy from the host would sync it, which a CUDA graph's capture refuses
    slots = torch.full((num_slots,), max(group_size - 2, 0), dtype=torch.long, device=device)
    queries = torch.arange(group_size + num_masks, dtype=torch.long, device=device)
    return torch.cat([slots, queries])


class DLiteDraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig, target_embedding: nn.Embedding):
        super().__init__()
        self.cfg = cfg
        lc = cfg.layers
        self.embed_tokens = target_embedding  # the target's, frozen; not part of the checkpoint
        self.layers = nn.ModuleList(DecoderLayer(lc) for _ in range(lc.num_layers))
        self.norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.layer_depth_embedding = nn.Embedding(cfg.num_target_layers, lc.hidden_size)
        self.context_norm = RMSNorm(lc.hidden_size, lc.rms_norm_eps)
        self.sequential_head = DLiteSequentialHead(lc.hidden_size, cfg.sequential_rank, lc.vocab_size)
        self.rotary = Rotary(lc.head_dim, lc.rope_theta)
        self.register_buffer("layer_ids", torch.tensor(cfg.target_layer_ids), persistent=False)
        self.layer_loop: DraftLayerLoop | None = None  # set by freeze() where the kernels serve

    # -- backbone ---------------------------------------------------------------------
    def backbone(self, features: torch.Tensor, token_groups: torch.Tensor, num_masks: int,
                 history: HistoryWindow | None = None) -> torch.Tensor:
        """features [N, S, D], token_groups [N, G] -> backbone outputs at the masks [N, num_masks, D].

        `history` (teacher only) adds keys/values before the pivot, at local positions
        pivot - distance, masked where a row has fewer entries."""
        n, s, _ = features.shape
        g = token_groups.shape[1]
        ctx = self.context_norm(features + self.layer_depth_embedding(self.layer_ids).to(features.dtype))
        masks = torch.full((n, num_masks), self.cfg.mask_token_id, dtype=torch.long, device=features.device)
        x = self.embed_tokens(torch.cat([token_groups, masks], dim=1)).to(features.dtype)  # [N, G+M, D]
        pos = build_block_position_ids(g, num_masks, s, features.device)
        cos, sin = self.rotary.cos_sin(pos, x.dtype)
        ctx_cos, ctx_sin, q_cos, q_sin = cos[:s], sin[:s], cos[s:], sin[s:]
        if history is None and self.layer_loop is not None and fused_ops.serves(x):
            return self.layer_loop.run(x, ctx, q_cos, q_sin, ctx_cos, ctx_sin, g)
        mask = None
        if history is not None:
            h_cos, h_sin = self.rotary.cos_sin(pos[0] - history.distances, x.dtype)
            seen = torch.ones(n, s + x.shape[1], dtype=torch.bool, device=x.device)
            mask = torch.cat([history.valid, seen], dim=1)[:, None, None, :]

        # The public convention: k/v read the context slots as context_norm leaves them; our
        # own drafts were trained with each layer's input_layernorm on them too.
        kv_norm = self.cfg.conventions.context_layernorm
        for layer in decoder_layers(self.layers):
            ctx_kv_in = layer.input_layernorm(ctx) if kv_norm else ctx
            hist_kv_in = None
            if history is not None:
                hist_kv_in = layer.input_layernorm(history.states) if kv_norm else history.states

            def attend(q, k, v, layer=layer, ctx_kv_in=ctx_kv_in, hist_kv_in=hist_kv_in):
                # Context slots (and history) are keys/values only: this layer's k/v project them.
                ck, cv = _project_context(layer.self_attn, ctx_kv_in, ctx_cos, ctx_sin)
                keys, values = [ck, k], [cv, v]
                if hist_kv_in is not None:
                    hk, hv = _project_context(layer.self_attn, hist_kv_in, h_cos, h_sin)
                    keys, values = [hk, *keys], [hv, *values]
                keys, values = torch.cat(keys, dim=1), torch.cat(values, dim=1)  # [N, (W+)S+G+M, Hkv, Dh]
                out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2),
                                                     values.transpose(1, 2), attn_mask=mask, enable_gqa=True)
                return out.transpose(1, 2)

            x = layer(x, q_cos, q_sin, attend)
        return self.norm(x[:, g:])

    # -- inference --------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, features: torch.Tensor, token_groups: torch.Tensor, num_tokens: int,
                sampling: RowSampling, draft_greedy: torch.Tensor, all_greedy: bool | None = None) -> DraftProposal:
        """Draft `num_tokens` (<= B - 1) tokens per row; sampling happens inside the head's loop.

        draft_greedy [N] bool: rows that draft by argmax (greedy verification, match mode).
        all_greedy: whether every row does, as the caller knows from the requests' params;
        None reads it from draft_greedy (a host sync on an accelerator, before the round).
        """
        if not 1 <= num_tokens <= self.cfg.max_draft_tokens:
            raise ValueError(f"num_tokens={num_tokens} outside [1, {self.cfg.max_draft_tokens}]")
        head = self.sequential_head
        # Bidirectional attention: the number of masks changes every output, so a draft
        # trained on full blocks always runs B - 1 of them and uses the first K.
        num_masks = self.cfg.max_draft_tokens if self.cfg.conventions.always_full_block else num_tokens
        u = self.backbone(features, token_groups, num_masks)[:, :num_tokens]
        u = u.to(head.state_proj.weight.dtype)  # the head's dtype
        prev = token_groups[:, -2] if token_groups.shape[1] > 1 else None
        state = head.initial_state(u.shape[0], u, prev)
        token = token_groups[:, -1]
        if all_greedy is None:
            all_greedy = bool(draft_greedy.all())
        if all_greedy:
            block, block_runners_up = head.greedy_block(u, state, token)
            return DraftProposal(block, None, runners_up=block_runners_up)
        tokens, probs, runners_up = [], [], []
        noise = None  # [N, K, W]: the round's uniforms, drawn at once (the same streams as K draws)
        for k in range(num_tokens):
            state = head.advance(state, token)
            logits = head.draft_logits(state, u[:, k]).float()
            if noise is None:
                noise = uniforms((num_tokens, logits.shape[-1]), sampling.generators, logits.device)
            q = probabilities(logits[:, None], _safe_temperature(sampling))
            index = torch.where(draft_greedy, logits.argmax(dim=-1), race(q[:, 0], noise[:, k]))
            probs.append(q[:, 0])
            runners_up.append(head.to_token_ids(logits.scatter(-1, index[:, None], -torch.inf).argmax(dim=-1)))
            token = head.to_token_ids(index)
            tokens.append(token)
        return DraftProposal(torch.stack(tokens, 1), torch.stack(probs, 1), head.drafted_ids,
                             torch.stack(runners_up, 1))

    def freeze(self) -> None:
        """Inference only (loaded drafts only draft; training builds its own): the backbone's
        q/k/v and gate/up fused like the target's, and the sequential head in float32.

        The head runs K times a round on a batch of a few rows, so its cost is per call,
        not per weight byte: on CPU a bf16 linear of this size costs ~55 us a call, a float32
        one ~12 us (the R -> V projection ~95 vs ~60 us). Its V x R tables then take ~13 MB
        more, next to a target of hundreds of MB."""
        for layer in decoder_layers(self.layers):
            layer.self_attn.freeze()
            layer.mlp.freeze()
        self.sequential_head.float()
        freeze_linears(self)
        self.layer_loop = DraftLayerLoop.for_model(self)

    # -- checkpoint (public layout) ---------------------------------------------------
    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}

    def save(self, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.cfg.to_dict()
        # which target it was trained for, checked at load (target_probe.py)
        config["dlite_config"]["target_probe"] = probe_of(self.embed_tokens.weight)
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in self.checkpoint_state().items()}
        save_file(state, directory / "model.safetensors")

    @classmethod
    def load(cls, directory: str | Path, target_embedding: nn.Embedding, num_target_layers: int,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DLiteDraftModel:
        directory = Path(directory)
        if not (directory / "config.json").exists() or not (directory / "model.safetensors").exists():
            raise DraftConfigError(f"{directory} is not a draft checkpoint (needs config.json + model.safetensors)")
        cfg = DraftConfig.from_dict(json.loads((directory / "config.json").read_text()))
        _check_compatible(cfg, target_embedding, num_target_layers)
        check_probe(cfg.hf_config["dlite_config"].get("target_probe"), target_embedding.weight, str(directory))
        log.info("draft %s (%s, G=%d): conventions %s (%s)", directory, cfg.architecture_version,
                 cfg.anchor_group_size, cfg.conventions.describe(),
                 "recorded in its config" if cfg.conventions_recorded else "none recorded: the public release's")
        with torch.device("meta"):
            model = cls(cfg, nn.Embedding(1, 1))
        state = load_file(directory / "model.safetensors")
        expected = model.checkpoint_state()
        missing = sorted(set(expected) - set(state))
        if missing:
            raise DraftConfigError(f"draft checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
        for name, ref in expected.items():
            if tuple(state[name].shape) != tuple(ref.shape):
                raise DraftConfigError(f"draft weight {name}: shape {tuple(state[name].shape)} != {tuple(ref.shape)}")
        model.load_state_dict({k: state[k].to(dtype) for k in expected}, strict=False, assign=True)
        model.embed_tokens = target_embedding
        model.rotary = Rotary(cfg.layers.head_dim, cfg.layers.rope_theta)
        model.layer_ids = torch.tensor(cfg.target_layer_ids)
        model = model.to(device).eval()
        model.freeze()
        vocab_ids = load_draft_vocab(directory, cfg.layers.vocab_size)
        if vocab_ids is not None:
            model.sequential_head.restrict_vocabulary(vocab_ids)
            log.info("the draft proposes %d of %d tokens (%s)", vocab_ids.numel(), cfg.layers.vocab_size,
                     DRAFT_VOCAB_FILE)
        return model


def _project_context(attn, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    lead = ctx.shape[:-1]
    k, v = attn.project_kv(ctx)
    k = k.view(*lead, attn.num_kv_heads, attn.head_dim)
    v = v.view(*lead, attn.num_kv_heads, attn.head_dim)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return apply_rotary(k, cos, sin), v


def _safe_temperature(s: RowSampling) -> RowSampling:
    # Greedy rows are masked out afterwards; give them T = 1 so nothing divides by zero.
    t = torch.where(s.temperature > 0, s.temperature, torch.ones_like(s.temperature))
    return RowSampling(t, s.top_k, s.top_p, s.generators)


def _check_compatible(cfg: DraftConfig, target_embedding: nn.Embedding, num_target_layers: int) -> None:
    vocab, width = target_embedding.weight.shape
    lc = cfg.layers
    if lc.hidden_size != width:
        raise DraftConfigError(f"draft width {lc.hidden_size} != target width {width}")
    if lc.vocab_size != vocab:
        raise DraftConfigError(f"draft vocabulary {lc.vocab_size} != target vocabulary {vocab}")
    if cfg.num_target_layers != num_target_layers:
        raise DraftConfigError(
            f"draft was made for {cfg.num_target_layers} target layers, target has {num_target_layers}")

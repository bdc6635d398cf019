"""The disaggregated layout on one device: the draft in its own process on the target's
GPU (round tensors staged through host memory, since NCCL refuses two ranks on one
GPU), its proposals against the in-process draft's, and a draft killed mid-generation."""

from __future__ import annotations

import functools
import time
from typing import Any

import torch

from dlite_ray.engine.draft_transport import DraftRequest, DraftTransport, InProcessDraftTransport
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.gpu_check.exactness import IdTokenizer, mean_accept_length, ragged_prompts
from dlite_ray.gpu_check.random_models import DraftDims, draft_in_child
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.sampling import RowSampling
from dlite_ray.runtime.target_model import TargetModel
from dlite_ray.serve.draft_process import start_local_pair

ROUND_TIMEOUT_S = 10.0
RECONNECT_WAIT_S = 120.0


def one_device_pair(target: TargetModel, draft: DLiteDraftModel, hf: dict[str, Any], draft_dims: DraftDims,
                    prompt_lengths: list[int], new_tokens: int) -> dict:
    device = next(target.parameters()).device
    dtype = str(next(target.parameters()).dtype).removeprefix("torch.")
    factory = functools.partial(draft_in_child, hf, draft_dims, dtype)
    started = time.perf_counter()
    link, handle = start_local_pair(factory, device=str(device), dtype=dtype, payload="host", timeout_s=ROUND_TIMEOUT_S,
                                    fingerprint="random")
    report: dict[str, Any] = {"join_s": time.perf_counter() - started}
    try:
        request = _request(draft, batch=8)
        local = InProcessDraftTransport(draft, "random").propose(request).tokens
        report["proposals_equal"] = torch.equal(link.propose(request).tokens.to(local.device), local)
        report.update(_killed_draft_drill(target, link, handle, prompt_lengths, new_tokens))
    finally:
        handle.close()
    return report


def _killed_draft_drill(target, link, handle, prompt_lengths: list[int], new_tokens: int) -> dict:
    """Greedy generation through the pair, the draft killed after a few steps: the engine
    decodes plainly while the link brings a fresh draft up; the reply is plain decoding's."""
    prompts = list(ragged_prompts(4, prompt_lengths, target.cfg.vocab_size, seed=99))

    def make_engine(draft: DraftTransport | None) -> DLiteEngine:
        return DLiteEngine(target, IdTokenizer(), draft, max_kv_tokens=32768, lookup_tokens=0,
                           adaptive_draft_length=False)

    plain = make_engine(None).generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    engine = make_engine(link)
    steps = {"n": 0}

    def kill_after_three(index: int, tokens: list[int]) -> None:
        steps["n"] += 1
        if steps["n"] == 3:
            handle.kill()

    started = time.perf_counter()
    paired = engine.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, callback=kill_after_three)
    generated = time.perf_counter()
    reconnected = link.wait_connected(RECONNECT_WAIT_S)  # a fresh draft process, model load included
    return {"killed_draft_greedy_equal": all(a.token_ids == b.token_ids for a, b in zip(plain, paired)),
            "drill_s": generated - started, "restarts": link.restarts, "reconnected": reconnected,
            "reconnect_s": time.perf_counter() - started,
            "round_timeout_s": ROUND_TIMEOUT_S, "mean_accept_length": mean_accept_length(paired)}


def _request(draft: DLiteDraftModel, batch: int) -> DraftRequest:
    param = next(draft.parameters())
    gen = torch.Generator(device=param.device).manual_seed(5)
    features = torch.randn(batch, draft.cfg.num_slots, draft.cfg.layers.hidden_size, generator=gen,
                           device=param.device).to(param.dtype)
    groups = torch.randint(0, draft.cfg.layers.vocab_size, (batch, draft.cfg.anchor_group_size), generator=gen,
                           device=param.device)
    sampling = RowSampling.build([0.0] * batch, [0] * batch, [1.0] * batch, [None] * batch, param.device)
    return DraftRequest(groups, features, draft.cfg.max_draft_tokens, sampling,
                        torch.ones(batch, dtype=torch.bool, device=param.device))

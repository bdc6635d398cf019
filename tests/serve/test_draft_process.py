"""A draft process that dies or stalls: `propose` raises DraftUnavailable within the round
deadline, the link brings drafting back, and an engine keeps the greedy output of plain
decoding throughout."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
import torch

from dlite_ray.engine.draft_transport import DraftRequest, DraftUnavailable, InProcessDraftTransport
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.loading import load_embedding
from dlite_ray.runtime.sampling import RowSampling
from dlite_ray.serve.draft_process import start_local_pair
from tests.conftest import read_config
from tests.engine.conftest import make_engine

PROMPTS = [[5, 9, 17, 3, 8, 11], [40, 41, 42, 7]]
NEW = 24


def _stalling_draft(draft_dir: str, target_dir: str, marker: str, device: torch.device) -> DLiteDraftModel:
    """Built in the child: the draft, stalling inside `propose` for as many seconds as the
    marker file says while it exists."""
    layers = read_config(Path(target_dir))["num_hidden_layers"]
    draft = DLiteDraftModel.load(draft_dir, load_embedding(target_dir), layers)
    inner = draft.propose

    def propose(*args, **kwargs):
        if Path(marker).exists():
            time.sleep(float(Path(marker).read_text()))
        return inner(*args, **kwargs)

    draft.propose = propose
    return draft


@pytest.fixture(scope="module")
def tiny(tiny_pair):
    target_dir, target, draft_dir = tiny_pair
    local = DLiteDraftModel.load(draft_dir, target.embed_tokens, target.cfg.num_layers)
    return target_dir, target, draft_dir, InProcessDraftTransport(local, "x")


def _greedy_request(local: InProcessDraftTransport, hidden: int) -> DraftRequest:
    torch.manual_seed(0)
    feats = torch.randn(2, local.draft.cfg.num_slots, hidden).to(torch.bfloat16).float()
    sampling = RowSampling.build([1.0] * 2, [0] * 2, [1.0] * 2, [None] * 2)
    return DraftRequest(torch.tensor([[5], [9]]), feats, 4, sampling, torch.tensor([True, True]))


@pytest.mark.parametrize("fault", ["killed", "slow"])
def test_a_draft_killed_or_slow_mid_round_fails_within_the_deadline_and_comes_back(tiny, tmp_path, fault):
    target_dir, target, draft_dir, local = tiny
    marker = tmp_path / "stall"
    timeout_s = 3.0
    factory = functools.partial(_stalling_draft, str(draft_dir), str(target_dir), str(marker))
    link, handle = start_local_pair(factory, payload="host", timeout_s=timeout_s, join_timeout_s=10)
    try:
        request = functools.partial(_greedy_request, local, target.cfg.hidden_size)
        want = local.propose(request()).tokens
        assert torch.equal(link.propose(request()).tokens, want)
        marker.write_text("30" if fault == "killed" else "5")
        if fault == "killed":
            threading.Timer(0.5, handle.kill).start()
        # the stalled draft would answer (after 5 or 30 s): the call raising at all shows the
        # link gave up at its deadline or on the death, not that it waited the draft out
        with pytest.raises(DraftUnavailable):
            link.propose(request())
        assert not link.connected
        marker.unlink()
        assert link.wait_connected(120)
        assert torch.equal(link.propose(request()).tokens, want)
        assert link.restarts == 1 and link.connected
    finally:
        handle.close()


def test_an_engine_whose_draft_dies_keeps_plain_decodings_greedy_output(tiny):
    target_dir, target, draft_dir, _ = tiny
    plain = [r.token_ids for r in make_engine(target).generate(PROMPTS, max_new_tokens=NEW)]
    link, handle = start_local_pair(draft_dir, target=target_dir, payload="host", timeout_s=10, heartbeat_s=0.5)
    try:
        engine = make_engine(target, link)
        committed = []

        def kill_midway(i: int, new: list[int]) -> None:
            committed.extend(new)
            if len(committed) >= NEW // 2 and link.restarts == 0 and handle.process.alive:
                handle.kill()

        drafted = link.comm_time
        assert [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=NEW, callback=kill_midway)] == plain
        assert link.comm_time > drafted  # rounds went through the draft before it died
        assert link.wait_connected(120) and link.restarts == 1  # found dead by a round or the heartbeat
        drafted = link.comm_time
        assert [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=NEW)] == plain
        assert link.comm_time > drafted  # drafting again through the new draft process
    finally:
        handle.close()

"""The draft transport over torch.distributed (gloo), without Ray: a draft process answers
rounds exactly as the draft would in process, and a draft with a vocabulary subset sends
its distributions at the subset's width."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch

from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.draft_vocab import save_draft_vocab
from dlite_ray.runtime.loading import load_embedding, load_target
from dlite_ray.runtime.sampling import RowSampling
from dlite_ray.serve.dist_transport import DRAFT_RANK, TARGET_RANK, DistributedDraftTransport, init_pair, serve_draft
from tests.conftest import read_config
from tests.engine.conftest import random_draft

VOCAB = 128


def _draft_process(address: str, target_dir: str, draft_dir: str, num_layers: int) -> None:
    draft = DLiteDraftModel.load(draft_dir, load_embedding(target_dir), num_layers)
    init_pair(address, DRAFT_RANK, "gloo")
    serve_draft(draft, torch.device("cpu"))


def _free_address() -> str:
    """A loopback address (draft_worker.free_address takes Ray's node IP when Ray runs, as it
    does in this test session)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _seeded_copies(generators: list[torch.Generator]) -> list[torch.Generator]:
    """Generators seeded as the transport seeds the draft's (one draw from each)."""
    copies = []
    for gen in generators:
        clone = torch.Generator()
        clone.set_state(gen.get_state())
        copies.append(torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=clone))))
    return copies


@pytest.mark.parametrize("subset", [True, False], ids=["vocabulary subset", "whole vocabulary"])
def test_a_draft_process_answers_as_the_draft_in_process(tiny_dirs, tmp_path, subset):
    target_dir = tiny_dirs["llama"]
    target = load_target(target_dir)
    draft_dir = tmp_path / "draft"
    random_draft(target, read_config(target_dir)).save(draft_dir, dtype=torch.float32)
    keep = torch.arange(2, VOCAB, 3)
    if subset:
        save_draft_vocab(draft_dir, keep)
    local = DLiteDraftModel.load(draft_dir, target.embed_tokens, target.cfg.num_layers)

    address = _free_address()
    child = multiprocessing.get_context("spawn").Process(
        target=_draft_process, args=(address, str(target_dir), str(draft_dir), target.cfg.num_layers))
    child.start()
    try:
        init_pair(address, TARGET_RANK, "gloo")
        info = DraftInfo("test", 1, local.cfg.max_draft_tokens, tuple(local.cfg.target_layer_ids))
        transport = DistributedDraftTransport(info, VOCAB, torch.device("cpu"))
        torch.manual_seed(0)
        # features travel as bf16: the reference reads the same rounded values
        feats = torch.randn(3, local.cfg.num_slots, target.cfg.hidden_size).to(torch.bfloat16).float()
        groups = torch.tensor([[5], [9], [17]])
        greedy = torch.tensor([False, True, False])  # a mixed batch: one row drafts by argmax
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        want = local.propose(feats, groups, 5, RowSampling.build([0.8] * 3, [0] * 3, [1.0] * 3, _seeded_copies(gens)),
                             greedy)
        got = transport.propose(DraftRequest(groups, feats, 5, RowSampling.build([0.8] * 3, [0] * 3, [1.0] * 3, gens),
                                             greedy))
        transport.close()
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert torch.equal(got.tokens, want.tokens)
    assert got.probs.shape == (3, 5, len(keep) if subset else VOCAB)  # what crossed the wire
    assert (got.prob_ids is not None) == subset and (not subset or torch.equal(got.prob_ids, keep))
    torch.testing.assert_close(got.vocabulary_probs(VOCAB), want.vocabulary_probs(VOCAB))

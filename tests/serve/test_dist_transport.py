"""The draft pair without Ray: a draft process answers rounds exactly as the draft would in
process, over either payload channel (gloo, or host memory on the control socket); a draft
with a vocabulary subset sends its distributions at the subset's width; an idle pair stays
joined past its group timeout; a wrong key is refused before anything is unpickled."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe

import pytest
import torch

from dlite_ray.engine.draft_graphs import DraftRoundGraphs
from dlite_ray.engine.draft_transport import DraftInfo, DraftRequest, InProcessDraftTransport
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.draft_vocab import save_draft_vocab
from dlite_ray.runtime.sampling import RowSampling
from dlite_ray.serve.dist_transport import DraftServer, PairTransport, serve_rounds
from dlite_ray.serve.draft_process import start_local_pair
from dlite_ray.serve.pair_channels import HostPayload, Round, Shutdown

VOCAB = 128
CPU = torch.device("cpu")


def _seeded_copies(generators: list[torch.Generator]) -> list[torch.Generator]:
    """Generators seeded as the transport seeds the draft's (one draw from each)."""
    copies = []
    for gen in generators:
        clone = torch.Generator()
        clone.set_state(gen.get_state())
        copies.append(torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=clone))))
    return copies


def _request(local: DLiteDraftModel, hidden: int, generators: list[torch.Generator]) -> DraftRequest:
    torch.manual_seed(0)
    # features travel as bf16: the reference reads the same rounded values
    feats = torch.randn(3, local.cfg.num_slots, hidden).to(torch.bfloat16).float()
    greedy = torch.tensor([False, True, False])  # a mixed batch: one row drafts by argmax
    return DraftRequest(torch.tensor([[5], [9], [17]]), feats, 5,
                        RowSampling.build([0.8] * 3, [0] * 3, [1.0] * 3, generators), greedy)


@pytest.mark.parametrize("payload", ["host", "dist"])
@pytest.mark.parametrize("subset", [True, False], ids=["vocabulary subset", "whole vocabulary"])
def test_a_draft_process_answers_as_the_draft_in_process(tiny_pair, tmp_path, payload, subset):
    target_dir, target, draft_dir = tiny_pair
    keep = torch.arange(2, VOCAB, 3)
    if subset:
        draft_dir = tmp_path / "draft"
        DLiteDraftModel.load(tiny_pair[2], target.embed_tokens, target.cfg.num_layers).save(draft_dir, torch.float32)
        save_draft_vocab(draft_dir, keep)
    local = InProcessDraftTransport(DLiteDraftModel.load(draft_dir, target.embed_tokens, target.cfg.num_layers), "x")

    link, handle = start_local_pair(draft_dir, target=target_dir, payload=payload, timeout_s=30)
    try:
        assert link.info.target_layer_ids == local.info.target_layer_ids
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        want = local.propose(_request(local.draft, target.cfg.hidden_size, _seeded_copies(gens)))
        got = link.propose(_request(local.draft, target.cfg.hidden_size, gens))
        assert link.connected and link.restarts == 0
    finally:
        handle.close()
    assert torch.equal(got.tokens, want.tokens)
    assert torch.equal(got.runners_up, want.runners_up)  # the branches a tree may verify
    assert got.probs.shape == (3, 5, len(keep) if subset else VOCAB)  # what crossed the wire
    assert (got.prob_ids is not None) == subset and (not subset or torch.equal(got.prob_ids, keep))
    torch.testing.assert_close(got.vocabulary_probs(VOCAB), want.vocabulary_probs(VOCAB))


def test_an_idle_pair_outlives_its_group_timeout(tiny_pair):
    """Nothing is posted on the process group between rounds: idling for twice its timeout
    leaves the pair joined, and the next round is drafted (the old transport kept a receive
    posted while idle, and the draft died with its timeout)."""
    target_dir, target, draft_dir = tiny_pair
    local = InProcessDraftTransport(DLiteDraftModel.load(draft_dir, target.embed_tokens, target.cfg.num_layers), "x")
    link, handle = start_local_pair(draft_dir, target=target_dir, payload="dist", timeout_s=2, group_timeout_s=3,
                                    heartbeat_s=1)
    try:
        link.propose(_request(local.draft, target.cfg.hidden_size, [None] * 3))
        time.sleep(6.5)
        assert link.connected
        got = link.propose(_request(local.draft, target.cfg.hidden_size, [None] * 3))
        assert link.restarts == 0
    finally:
        handle.close()
    want = local.propose(_request(local.draft, target.cfg.hidden_size, [None] * 3))
    assert torch.equal(got.tokens[1], want.tokens[1])  # the greedy row


def test_a_wrong_key_is_refused(tiny_pair):
    _, target, draft_dir = tiny_pair
    draft = DLiteDraftModel.load(draft_dir, target.embed_tokens, target.cfg.num_layers)
    server = DraftServer(draft, CPU, b"right key", "x", join_timeout_s=5)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises((ConnectionError, EOFError)):
            PairTransport.connect(server.address, b"wrong key", vocab_size=VOCAB, payload="host", device=CPU,
                                  timeout_s=5, group_timeout_s=5, join_timeout_s=5)
        pair = PairTransport.connect(server.address, b"right key", vocab_size=VOCAB, payload="host", device=CPU,
                                     timeout_s=5, group_timeout_s=5, join_timeout_s=5)
        assert pair.info == DraftInfo.of("x", draft.cfg) and pair.ping()
        pair.close()
    finally:
        server.close()


def test_a_dist_payload_on_one_gpu_is_refused_before_anything_starts(tiny_pair):
    """NCCL refuses two ranks on one GPU; the host payload is the one-GPU pair."""
    _, _, draft_dir = tiny_pair
    with pytest.raises(ValueError, match="payload='host'"):
        start_local_pair(draft_dir, device="cuda", payload="dist")


@pytest.mark.parametrize("greedy", [[True, True, True], [False, True, False]], ids=["greedy", "mixed"])
@pytest.mark.parametrize("with_graphs", [False, True], ids=["eager", "round graphs"])
def test_the_draft_side_takes_greediness_from_the_header(tiny_pair, greedy, with_graphs):
    """A round whose rows all draft by argmax tells `propose` so (else it reads draft_greedy
    back from the device: a host sync on a GPU) and makes no generators, or goes through the
    round graphs where the server has them; a round with a sampled row gets a generator per
    row from the draft itself; each answers as the draft in process."""
    _, target, draft_dir = tiny_pair
    local = InProcessDraftTransport(DLiteDraftModel.load(draft_dir, target.embed_tokens, target.cfg.num_layers), "x")
    calls: list[tuple[list, bool | None]] = []

    class Spy:
        def parameters(self):
            return local.draft.parameters()

        def propose(self, *args, all_greedy=None):
            calls.append((args[3].generators, all_greedy))
            return local.draft.propose(*args, all_greedy=all_greedy)

    graphs = DraftRoundGraphs(local.draft, 4, capture=False) if with_graphs else None
    target_end, draft_end = Pipe()
    server = threading.Thread(target=serve_rounds,
                              args=(Spy(), draft_end, HostPayload(draft_end, CPU), CPU, 30, graphs))
    server.start()
    request = _request(local.draft, target.cfg.hidden_size, [torch.Generator().manual_seed(i) for i in range(3)])
    request.draft_greedy = torch.tensor(greedy)
    sampled = not all(greedy)
    feats = request.features.to(torch.bfloat16)
    target_end.send(Round(5, request.token_groups.tolist(), tuple(feats.shape), [0.8] * 3, [0] * 3, [1.0] * 3,
                          greedy, [11, 12, 13], sampled, VOCAB))
    HostPayload(target_end, CPU).send([feats])
    done = target_end.recv()
    tokens = HostPayload(target_end, CPU).recv([((3, 2, 5), torch.int64)], time.monotonic() + 30)[0][:, 0]
    if sampled:
        HostPayload(target_end, CPU).recv([((3, 5, done.width), torch.float32)], time.monotonic() + 30)
    target_end.send(Shutdown())
    server.join(30)
    if graphs is not None and not sampled:
        assert not calls and graphs.stats.padded_eager == 1  # the round graphs answered it
    else:
        (generators, all_greedy), = calls
        assert all_greedy is (not sampled)
        assert all(g is None for g in generators) if not sampled else all(g is not None for g in generators)
    seeded = [torch.Generator().manual_seed(s) for s in (11, 12, 13)]
    request.sampling = RowSampling.build([0.8] * 3, [0] * 3, [1.0] * 3, seeded)
    assert torch.equal(tokens, local.propose(request).tokens)

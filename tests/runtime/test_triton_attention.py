"""The triton backend's paged decode / verify kernel (runtime/attention/paged_triton.py),
run on CPU under Triton's interpreter: against softmax attention in plain torch, and row
exactness (a row's bits whatever step, span or batch it is computed in).

Tiny shapes: the interpreter runs every program in numpy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton", reason="the triton backend's tests need the triton package (extra 'triton')")

from dlite_ray.runtime import attention  # noqa: E402
from dlite_ray.runtime.attention import make_backend  # noqa: E402
from dlite_ray.runtime.attention.metadata import build_attention_metadata  # noqa: E402
from dlite_ray.runtime.attention.paged_triton import (  # noqa: E402
    combine_chunk_partials,
    interpreting,
    paged_attention,
)
from dlite_ray.runtime.attention.triton_backend import TritonPagedBackend  # noqa: E402
from dlite_ray.runtime.kv_cache import PagedKVCache  # noqa: E402

HKV, GROUP, DH, BLOCK = 2, 2, 16, 16
CHUNK, TILE = 64, 16  # small, so a few hundred positions span several chunks
CPU = torch.device("cpu")


if not torch.cuda.is_available() and not interpreting():
    pytest.skip("without CUDA these tests run under TRITON_INTERPRET=1, set before triton is imported "
                "(tests/conftest.py)", allow_module_level=True)


def _backend() -> TritonPagedBackend:
    return TritonPagedBackend(chunk=CHUNK, tile=TILE)


class Sequences:
    """Random keys, values and queries per (sequence, position), fixed by a seed: the same
    sequence has the same tensors in every step and batch it is placed in."""

    def __init__(self, lengths: list[int], seed: int = 0, dtype: torch.dtype = torch.float32):
        gen = torch.Generator().manual_seed(seed)
        self.k = [torch.randn(n, HKV, DH, generator=gen).to(dtype) for n in lengths]
        self.v = [torch.randn(n, HKV, DH, generator=gen).to(dtype) for n in lengths]
        self.q = [torch.randn(n, HKV * GROUP, DH, generator=gen).to(dtype) for n in lengths]
        self.dtype = dtype

    def step(self, rows: list[tuple[int, int, int]], tables: list[list[int]], num_blocks: int = 64,
             backend=None) -> torch.Tensor:
        """rows: (sequence, first new position, new tokens); its earlier positions are cached
        in the blocks of its table. One forward's attention -> [T, Hq, Dh]."""
        cfg = SimpleNamespace(num_kv_heads=HKV, head_dim=DH, num_layers=1)
        cache = PagedKVCache(cfg, num_blocks, BLOCK, self.dtype, CPU, block_major=True)
        for (s, first, _), table in zip(rows, tables, strict=True):
            cache.write(0, _slots(table, 0, first), self.k[s][:first], self.v[s][:first])
        meta = build_attention_metadata([n for _, _, n in rows], [f + n for _, f, n in rows], tables, BLOCK, CPU)
        q, k, v = (torch.cat([t[s][f:f + n] for s, f, n in rows]) for t in (self.q, self.k, self.v))
        return (backend or _backend()).attend(cache, 0, meta, q, k, v)

    def reference(self, rows: list[tuple[int, int, int]]) -> torch.Tensor:
        """Softmax attention in float32, each query over its own sequence's keys up to it."""
        outs = []
        for s, first, n in rows:
            for p in range(first, first + n):
                q = self.q[s][p].float().view(HKV, GROUP, DH)
                k, v = self.k[s][:p + 1].float(), self.v[s][:p + 1].float()
                scores = torch.einsum("hgd,phd->hgp", q, k) * DH ** -0.5
                outs.append(torch.einsum("hgp,phd->hgd", scores.softmax(-1), v).reshape(-1, DH))
        return torch.stack(outs)


def _slots(table: list[int], start: int, stop: int) -> torch.Tensor:
    return torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, stop)], dtype=torch.long)


def _scattered_tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint, non-consecutive blocks for each sequence."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(order[:need])
        order = order[need:]
    return tables


def test_ragged_step_equals_softmax_attention():
    """Decode rows, a verify span of 8 rows across a chunk boundary, contexts of 1-5 chunks
    and a prefill chunk (through SDPA) in one step, over scattered blocks."""
    lengths = [300, 140, 70, 40, 9]
    seqs = Sequences(lengths)
    rows = [(0, 299, 1), (1, 60, 8), (2, 69, 1), (3, 0, 40), (4, 3, 6)]
    out = seqs.step(rows, _scattered_tables(lengths, 64, seed=1))
    torch.testing.assert_close(out, seqs.reference(rows), atol=2e-6, rtol=2e-5)


def test_bfloat16_cache_close_to_float32_attention():
    lengths = [200, 20]
    seqs = Sequences(lengths, seed=3, dtype=torch.bfloat16)
    rows = [(0, 192, 8), (1, 19, 1)]
    out = seqs.step(rows, _scattered_tables(lengths, 64, seed=2))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), seqs.reference(rows), atol=2e-2, rtol=2e-2)


def test_a_row_has_the_same_bits_alone_in_a_verify_span_and_in_any_batch():
    """Position 150 of sequence 0 (3 chunks: [0, 64), [64, 128), [128, 151)): decoded alone,
    row 3 of a verify span starting at 147, and decoded next to a 5-chunk sequence and a
    verify span, over other blocks. Fails if the chunks were cut from the span's start or
    sized by the batch's longest row, or if a row's sums depended on its neighbours."""
    lengths = [200, 320, 50]
    seqs = Sequences(lengths, seed=5)
    tables = _scattered_tables(lengths, 64, seed=4)
    alone = seqs.step([(0, 150, 1)], tables[:1])[0]
    in_span = seqs.step([(0, 147, 8)], tables[:1])[3]
    other = _scattered_tables(lengths, 64, seed=9)  # the same keys in other blocks
    in_batch = seqs.step([(1, 310, 1), (0, 150, 1), (2, 40, 5)], [other[1], other[0], other[2]])[1]
    assert torch.equal(alone, in_span)
    assert torch.equal(alone, in_batch)
    torch.testing.assert_close(alone, seqs.reference([(0, 150, 1)])[0])


def test_a_larger_grid_bound_gives_the_same_bits():
    """A CUDA graph launches a grid sized for the longest context it may meet: the programs
    past a row's last chunk must change nothing."""
    seqs = Sequences([130], seed=7)
    table = _scattered_tables([130], 64, seed=6)[0]
    cache_k = torch.zeros(64, BLOCK, HKV, DH)
    cache_v = torch.zeros_like(cache_k)
    slots = _slots(table, 0, 130)
    cache_k.flatten(0, 1)[slots], cache_v.flatten(0, 1)[slots] = seqs.k[0], seqs.v[0]
    q, tokens, seqlens = seqs.q[0][129:], torch.zeros(1, dtype=torch.long), torch.tensor([130], dtype=torch.int32)
    tables = torch.tensor([table], dtype=torch.int32)
    tight, loose = (paged_attention(q, cache_k, cache_v, tokens, seqlens, tables, bound, torch.empty_like(q),
                                    CHUNK, TILE) for bound in (130, 4 * 130))
    assert torch.equal(tight, loose)


def test_chunks_are_combined_in_position_order():
    """Partials whose sum rounds differently in any other order (equal maxima, so every
    rescale is by exp(0) = 1 exactly): the output is their sum in the order c = 0, 1, ..."""
    parts = torch.tensor([1e8, 1.0, -1e8, 1.0, 3.0])  # in order: 4.0; reversed or paired: other values
    num_chunks = len(parts)
    m = torch.zeros(1, 1, num_chunks)
    l_sum = torch.ones(1, 1, num_chunks)
    acc = parts.view(1, 1, num_chunks, 1).expand(1, 1, num_chunks, DH).contiguous()
    out = torch.zeros(1, 1, DH)
    seqlens = torch.tensor([num_chunks * CHUNK], dtype=torch.int32)
    combine_chunk_partials(m, l_sum, acc, out, torch.zeros(1, dtype=torch.long), seqlens, CHUNK)
    total = _float32_sum(parts)
    assert total == 4.0 and _float32_sum(parts.flip(0)) != total  # the order shows in the bits
    assert torch.equal(out, torch.full((1, 1, DH), total) / num_chunks)


def _float32_sum(values: torch.Tensor) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32)
    for x in values:
        total = total + x
    return total


def test_auto_picks_triton_on_cuda_without_flash_attn(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    assert make_backend("auto", torch.device("cuda"), torch.bfloat16).name == "triton"
    assert make_backend("auto", CPU, torch.bfloat16).name == "sdpa"  # the CPU keeps its own kernels
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert make_backend("auto", torch.device("cuda"), torch.bfloat16).name == "sdpa"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        make_backend("triton", CPU, torch.float32)


def test_engine_greedy_speculation_equals_plain_decoding_on_the_triton_backend(tmp_path):
    """End to end on a tiny random model: the KV cache block-major (the backend asks for it),
    a 9-token prompt prefilled through the kernel's rows and a 17-token one through SDPA,
    verify spans of 8 rows with rejections; the output equals plain decoding on this backend
    and on SDPA."""
    from dlite_ray.bench.oracle import OracleDraftTransport
    from dlite_ray.runtime.loading import load_target
    from tests.conftest import make_tiny_checkpoint
    from tests.engine.conftest import make_engine

    target = load_target(make_tiny_checkpoint(tmp_path / "llama", "llama", layers=2))  # the interpreter is slow
    new = 10
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate((9, 17))]
    plain = make_engine(target, attention_backend="triton")
    assert plain.runner.cache.block_major
    reference = [r.token_ids for r in plain.generate(prompts, max_new_tokens=new)]
    sdpa = make_engine(target, attention_backend="sdpa").generate(prompts, max_new_tokens=new)
    assert [r.token_ids for r in sdpa] == reference
    oracle = OracleDraftTransport([p + r for p, r in zip(prompts, reference)], wrong_rate=0.3, vocab_size=128)
    out = make_engine(target, oracle, attention_backend="triton").generate(prompts, max_new_tokens=new)
    assert [r.token_ids for r in out] == reference
    assert max(a for r in out for a in r.stats.accept_lengths) > 1  # drafts were accepted: verify spans ran


def test_graph_metadata_reads_the_static_tensors_refilled_between_forwards():
    """A CUDA graph replays its forward over static tensors rewritten in place before each
    replay: metadata made once over them gives each later step that step's bits (the rows'
    lengths and tables derived again per forward, not kept from the first)."""
    lengths = [150, 40, 70]
    seqs = Sequences(lengths, seed=11)
    tables = _scattered_tables(lengths, 63, seed=12)
    spare, width, q = 63, 12, 3  # a block no sequence owns; 12 blocks hold 192 positions
    cfg = SimpleNamespace(num_kv_heads=HKV, head_dim=DH, num_layers=1)
    cache = PagedKVCache(cfg, 64, BLOCK, torch.float32, CPU, block_major=True)
    for s, table in enumerate(tables):
        cache.write(0, _slots(table, 0, lengths[s]), seqs.k[s], seqs.v[s])
    slots = torch.zeros(2 * q, dtype=torch.long)
    static_tables = torch.zeros(2, width, dtype=torch.long)
    context_lens = torch.zeros(2, dtype=torch.long)
    backend = _backend()
    meta = backend.graph_metadata(slots, static_tables, context_lens, q, BLOCK)
    for rows in ([(0, 100, q), (1, 30, q)], [(2, 60, q), (0, 140, q)]):  # refilled in place, as before a replay
        slots.copy_(torch.cat([_slots(tables[s], f, f + n) for s, f, n in rows]))
        static_tables.fill_(spare)
        for i, (s, f, n) in enumerate(rows):
            static_tables[i, :len(tables[s])] = torch.tensor(tables[s])
            context_lens[i] = f + n
        q_rows, k, v = (torch.cat([t[s][f:f + n] for s, f, n in rows]) for t in (seqs.q, seqs.k, seqs.v))
        got = backend.attend(cache, 0, meta, q_rows, k, v)
        assert torch.equal(got, seqs.step(rows, [tables[s] for s, _, _ in rows]))

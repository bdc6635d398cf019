"""Paged decode / verify attention in Triton: every query row alone over its own keys,
read from the block-major cache through its block table, in two kernels.

1. `_chunk_partials`, one program per (row, KV head, key chunk): the chunk holds the key
   positions [c * chunk, (c + 1) * chunk) of the row's sequence (fixed, position-aligned:
   a function of the position alone, never of the batch), read tile by tile in position
   order through the block table; the GQA group's query heads share the program, so each
   key is read once per KV head. It writes the chunk's running max, sum of exponentials and
   unnormalised output, in float32.
2. `_combine_chunks`, one program per row: merges the row's chunks in position order,
   c = 0, 1, ..., for all its heads at once (elementwise), and writes the output row.

A row's bits thus depend on its query, its keys and its position, not on which rows share
the launch nor on how many the grid holds (programs past a row's last chunk do nothing),
so a decode row, the same row in a verify span and in a batch of other sequences agree
(tests/runtime/test_triton_attention.py). Block tables and lengths are device int32
tensors: nothing about the step is built on the host but the grid's size.

Off CUDA (tests) the kernels run under Triton's interpreter: TRITON_INTERPRET=1, set
before triton is first imported (Triton wraps its own library then; torch._dynamo imports
it early: tests/conftest.py sets it on machines without CUDA). The interpreter multiplies
bfloat16 as integers: there the dots' inputs are upcast to float32 after being rounded as
on the device (`DOT_F32`), so only the order of the dots' sums differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

# Keys per chunk (stage 1's split) and per tile of a chunk's loop. 256 keys x 8 KV heads
# give a 4K decode row 128 programs, about an H100's 132 SMs; the device run picks the
# chunk by measurement (gpu_check/attention_timing.py).
PAGED_CHUNK, PAGED_TILE = 256, 64
_MIN_DOT = 16  # tl.dot's smallest tile side: the GQA group is padded up to it


@triton.jit
def _chunk_partials(Q, K, V, Tokens, Seqlens, Tables, M, L, Acc,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_tr,
                    stride_mr, stride_mh, stride_ar, stride_ah, stride_ac, sm_scale,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr, TILE: tl.constexpr,
                    DOT_F32: tl.constexpr):
    row, kv_head, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seqlen = tl.load(Seqlens + row)
    start = chunk * CHUNK
    if start < seqlen:  # else: past the row's last chunk, nothing to do
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        heads = kv_head * GROUP + g
        g_ok, d_ok = g < GROUP, d < HEAD_DIM
        token = tl.load(Tokens + row).to(tl.int64)
        q = tl.load(Q + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GROUP_PAD, D_PAD]
        if DOT_F32:
            q = q.to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        end = tl.minimum(start + CHUNK, seqlen)
        for t in range(start, end, TILE):  # tiles start at positions start + i * TILE: position-aligned
            pos = t + tl.arange(0, TILE)
            valid = pos < end
            block = tl.load(Tables + row * stride_tr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh  # [TILE]
            kv_ok = valid[:, None] & d_ok[None, :]
            k = tl.load(K + kv[:, None] + d[None, :], mask=kv_ok, other=0.0)  # [TILE, D_PAD]
            if DOT_F32:
                k = k.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale  # [GROUP_PAD, TILE]
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: a tile holds at least one valid key
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + kv[:, None] + d[None, :], mask=kv_ok, other=0.0)
            p = p.to(V.dtype.element_ty)  # the probabilities in the cache's dtype, as on the device
            if DOT_F32:
                v, p = v.to(tl.float32), p.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        at = row * stride_mr + heads * stride_mh + chunk
        tl.store(M + at, m_i, mask=g_ok)
        tl.store(L + at, l_i, mask=g_ok)
        out = row * stride_ar + heads[:, None] * stride_ah + chunk * stride_ac + d[None, :]
        tl.store(Acc + out, acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_chunks(M, L, Acc, Out, Tokens, Seqlens,
                    stride_mr, stride_mh, stride_ar, stride_ah, stride_ac, stride_ot, stride_oh,
                    HEADS: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    CHUNK: tl.constexpr):
    row = tl.program_id(0)
    seqlen = tl.load(Seqlens + row)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_ok = h < HEADS
    hd_ok = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    stats = M + row * stride_mr + h * stride_mh  # [H_PAD]
    sums = L + row * stride_mr + h * stride_mh
    parts = Acc + row * stride_ar + h[:, None] * stride_ah + d[None, :]  # [H_PAD, D_PAD]
    m = tl.load(stats, mask=h_ok, other=0.0)  # chunk 0, which every row has
    l_sum = tl.load(sums, mask=h_ok, other=1.0)
    acc = tl.load(parts, mask=hd_ok, other=0.0)
    for c in range(1, tl.cdiv(seqlen, CHUNK)):  # in position order: the row's bits fix the order
        m_c = tl.load(stats + c, mask=h_ok, other=0.0)
        m_new = tl.maximum(m, m_c)
        alpha, beta = tl.exp(m - m_new), tl.exp(m_c - m_new)
        l_sum = l_sum * alpha + tl.load(sums + c, mask=h_ok, other=1.0) * beta
        acc = acc * alpha[:, None] + tl.load(parts + c * stride_ac, mask=hd_ok, other=0.0) * beta[:, None]
        m = m_new
    token = tl.load(Tokens + row).to(tl.int64)
    out = Out + token * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(out, (acc / l_sum[:, None]).to(Out.dtype.element_ty), mask=hd_ok)


def interpreting() -> bool:
    """Whether Triton runs kernels on the host (TRITON_INTERPRET=1), as the CPU tests do."""
    return bool(knobs.runtime.interpret)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor,
                    seqlens: torch.Tensor, tables: torch.Tensor, max_seqlen: int, out: torch.Tensor,
                    chunk: int = PAGED_CHUNK, tile: int = PAGED_TILE) -> torch.Tensor:
    """Rows `tokens` of q [T, Hq, Dh] attend their sequences' first `seqlens` keys (each
    row's position + 1) in k_cache, v_cache [blocks, block_size, Hkv, Dh], found through
    `tables` [P, W] (int32, a row's blocks in order); written into the same rows of out
    [T, Hq, Dh]. max_seqlen bounds seqlens (the grid's chunk count; any bound gives the
    same bits)."""
    m, l_sum, acc = chunk_partials(q, k_cache, v_cache, tokens, seqlens, tables, max_seqlen, chunk, tile)
    combine_chunk_partials(m, l_sum, acc, out, tokens, seqlens, chunk)
    return out


def chunk_partials(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens: torch.Tensor,
                   seqlens: torch.Tensor, tables: torch.Tensor, max_seqlen: int, chunk: int = PAGED_CHUNK,
                   tile: int = PAGED_TILE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1: per (row, query head, chunk) the max score, the sum of exponentials
    [P, Hq, C] and the unnormalised output [P, Hq, C, Dh], float32; C = the chunks of
    max_seqlen. Entries past a row's last chunk are left unwritten."""
    _, hq, dh = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if chunk % tile or tile < _MIN_DOT or tile & (tile - 1):
        raise ValueError(f"the chunk ({chunk}) must be a multiple of the tile ({tile}), a power of two >= {_MIN_DOT}")
    assert q.stride(-1) == k_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert seqlens.dtype == tables.dtype == torch.int32
    rows, num_chunks, group = tokens.numel(), triton.cdiv(max_seqlen, chunk), hq // hkv
    m = q.new_empty(rows, hq, num_chunks, dtype=torch.float32)
    l_sum = torch.empty_like(m)
    acc = q.new_empty(rows, hq, num_chunks, dh, dtype=torch.float32)
    _chunk_partials[(rows, hkv, num_chunks)](
        q, k_cache, v_cache, tokens, seqlens, tables, m, l_sum, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), dh ** -0.5,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=dh, D_PAD=max(_MIN_DOT, triton.next_power_of_2(dh)), CHUNK=chunk, TILE=tile,
        DOT_F32=interpreting())
    return m, l_sum, acc


def combine_chunk_partials(m: torch.Tensor, l_sum: torch.Tensor, acc: torch.Tensor, out: torch.Tensor,
                           tokens: torch.Tensor, seqlens: torch.Tensor, chunk: int = PAGED_CHUNK) -> torch.Tensor:
    """Stage 2: each row's chunks merged in position order, written to out [T, Hq, Dh] at
    the row's token."""
    rows, hq, _, dh = acc.shape
    assert out.stride(-1) == 1 and m.stride() == l_sum.stride()
    _combine_chunks[(rows,)](
        m, l_sum, acc, out, tokens, seqlens,
        m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), out.stride(0), out.stride(1),
        HEADS=hq, H_PAD=triton.next_power_of_2(hq), HEAD_DIM=dh, D_PAD=max(_MIN_DOT, triton.next_power_of_2(dh)),
        CHUNK=chunk)
    return out

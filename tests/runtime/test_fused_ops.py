"""Fused CPU kernels: each computes what its eager operations compute, gives a row the same
bits whatever the call's row count (what exact speculative decoding needs), and serves the
target's inference forward, never a forward that trains."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.config import ModelConfig
from dlite_ray.runtime.cpu_features import cpu_flags
from dlite_ray.runtime.layers import DecoderLayer, Rotary

DTYPES = [torch.bfloat16, torch.float32]
HQ, HKV, DH = 9, 3, 64


@pytest.mark.skipif(os.environ.get("DLITE_FUSED_OPS") == "0", reason="switched off")
def test_kernels_build_on_this_machine():
    # The project's own machines have a C++ compiler and ninja: a broken build must show
    # here, not only as a slower decode step.
    assert fused_ops.kernels() is not None


@pytest.fixture
def kernels():
    k = fused_ops.kernels()
    if k is None:
        pytest.skip("fused kernels unavailable")
    return k


def _inputs(dtype: torch.dtype, rows: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cos, sin = Rotary(DH, 10000.0).cos_sin(torch.randint(0, 4000, (rows,), generator=gen), dtype)
    return {"x": randn(rows, 576), "residual": randn(rows, 576), "w": randn(576), "gate_up": randn(rows, 3072),
            "qkv": randn(rows, (HQ + 2 * HKV) * DH), "cos": cos, "sin": sin}


def _each_op(kernels, t: dict[str, torch.Tensor], rows: slice) -> list[torch.Tensor]:
    r = {name: (v if name == "w" else v[rows]) for name, v in t.items()}
    return [kernels.rms_norm(r["x"], r["w"], 1e-5), *kernels.add_rms_norm(r["x"], r["residual"], r["w"], 1e-5),
            kernels.silu_mul(r["gate_up"]),
            *kernels.rotate_qkv(r["qkv"], r["cos"].flatten(1), r["sin"].flatten(1), HQ, HKV)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_compute_what_the_eager_operations_compute(kernels, dtype):
    t = _inputs(dtype)
    normed, (added_normed, added), silu, (q, k, v) = (
        kernels.rms_norm(t["x"], t["w"], 1e-5), kernels.add_rms_norm(t["x"], t["residual"], t["w"], 1e-5),
        kernels.silu_mul(t["gate_up"]),
        kernels.rotate_qkv(t["qkv"], t["cos"].flatten(1), t["sin"].flatten(1), HQ, HKV))
    summed = t["residual"] + t["x"]
    torch.testing.assert_close(normed, F.rms_norm(t["x"], (576,), t["w"], 1e-5))
    torch.testing.assert_close(added_normed, F.rms_norm(summed, (576,), t["w"], 1e-5))
    assert torch.equal(added, summed)
    gate, up = t["gate_up"].chunk(2, dim=-1)
    assert torch.equal(silu, F.silu(gate) * up)  # ATen's own silu and multiply
    heads = t["qkv"].unflatten(-1, (HQ + 2 * HKV, DH))
    rotated = fused_ops.apply_rotary(heads[:, :HQ + HKV], t["cos"], t["sin"])
    torch.testing.assert_close(q, rotated[:, :HQ])
    torch.testing.assert_close(k, rotated[:, HQ:])
    assert torch.equal(v, heads[:, HQ + HKV:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_row_gets_the_same_bits_whatever_the_row_count(kernels, dtype, seed):
    t = _inputs(dtype, seed=seed)
    full = _each_op(kernels, t, slice(None))
    for rows in (slice(0, 1), slice(0, 2), slice(0, 3), slice(0, 8), slice(5, 6), slice(7, 31)):
        for got, want in zip(_each_op(kernels, t, rows), full, strict=True):
            assert torch.equal(got, want[rows])


def test_silu_mul_keeps_a_rows_bits_in_calls_longer_than_a_threads_share(kernels):
    """ATen splits long element-wise calls between threads at any element, and the pieces'
    ends round on a scalar path: 32 rows of a 4096-wide MLP are past that on 3 threads (one
    row differed from its one-row call with eager silu * up)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        gate_up = 4 * torch.randn(32, 2 * 4096, generator=torch.Generator().manual_seed(3))
        full = kernels.silu_mul(gate_up)
        assert all(torch.equal(kernels.silu_mul(gate_up[i:i + 1]), full[i:i + 1]) for i in range(32))
    finally:
        torch.set_num_threads(threads)


def test_write_kv_writes_the_slots_finite_and_nothing_else(kernels):
    k_cache, v_cache = torch.full((HKV, 64, DH), 7.0), torch.full((HKV, 64, DH), 7.0)
    k, v = torch.randn(3, HKV, DH), torch.randn(3, HKV, DH)
    k[1, 2, 5], v[0, 0, 0], v[2, 1, 3] = float("nan"), float("inf"), -float("inf")
    slots = torch.tensor([40, 3, 17])
    kernels.write_kv(k_cache, v_cache, slots, k, v)
    for cache, x in ((k_cache, k), (v_cache, v)):
        assert torch.equal(cache[:, slots].transpose(0, 1), torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0))
        untouched = torch.ones(64, dtype=torch.bool)
        untouched[slots] = False
        assert (cache[:, untouched] == 7.0).all()
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.write_kv(k_cache, v_cache, torch.tensor([64]), k[:1], v[:1])


def _layer() -> DecoderLayer:
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=576, intermediate_size=1536, num_layers=1,
                      num_heads=HQ, num_kv_heads=HKV, head_dim=DH, rms_norm_eps=1e-5, rope_theta=10000.0,
                      max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return layer


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    k, v = (t.repeat_interleave(HQ // HKV, dim=1).transpose(0, 1) for t in (k, v))
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, is_causal=True).transpose(0, 1)


class _Recorder:
    """The kernel module, noting which kernels a forward calls."""

    def __init__(self, real):
        self.real, self.called = real, set()

    def __getattr__(self, name):
        self.called.add(name)
        return getattr(self.real, name)


def test_inference_uses_the_kernels_and_training_does_not(kernels, monkeypatch):
    layer = _layer()
    x = torch.randn(5, 576)
    cos, sin = Rotary(DH, 10000.0).cos_sin(torch.arange(5), x.dtype)
    recorder = _Recorder(kernels)
    monkeypatch.setattr(fused_ops, "kernels", lambda: recorder)
    trained = layer(x, cos, sin, _attend)
    assert trained.requires_grad and not recorder.called
    layer.self_attn.freeze()
    layer.mlp.freeze()
    with torch.inference_mode():
        fused = layer(x, cos, sin, _attend)
    small_ops = {"rms_norm", "add_rms_norm", "rotate_qkv", "silu_mul"}
    linears = {"row_linear"} if fused_ops.row_linear_serves(x) else set()  # our linear kernel, where it serves
    assert recorder.called - {"kernel_dtypes"} == small_ops | linears
    torch.testing.assert_close(fused, trained.detach(), rtol=2e-4, atol=2e-4)


DECODE_CASES = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64), (torch.float32, 128)]


@pytest.fixture(params=DECODE_CASES, ids=[f"{d}-head_dim{h}" for d, h in DECODE_CASES])
def decode_case(kernels, request):
    dtype, head_dim = request.param
    if dtype not in fused_ops.kernel_dtypes():
        pytest.skip(f"built without a {dtype} decode kernel (needs AVX-512, and AVX-512 BF16 for bf16)")
    return dtype, head_dim


def _decode_inputs(rows: int, dtype=torch.bfloat16, head_dim: int = 64, seed: int = 0, heads=(HQ, HKV)):
    gen = torch.Generator().manual_seed(seed)
    q = (3 * torch.randn(rows, heads[0], head_dim, generator=gen)).to(dtype)  # peaked softmax
    k_cache, v_cache = (torch.randn(heads[1], 6000, head_dim, generator=gen).to(dtype) for _ in range(2))
    return q, k_cache, v_cache, torch.randperm(6000, generator=gen)


def _causal_reference(q, k_cache, v_cache, slots, first):
    head_dim = q.shape[-1]
    k, v = (c[:, slots[:first + len(q)]].double() for c in (k_cache, v_cache))
    outs = []
    for i, row in enumerate(q.double().view(len(q), HKV, HQ // HKV, head_dim)):
        scores = torch.einsum("hgd,hkd->hgk", row, k[:, :first + i + 1]) * head_dim ** -0.5
        outs.append(torch.einsum("hgk,hkd->hgd", scores.softmax(-1), v[:, :first + i + 1]).reshape(HQ, head_dim))
    return torch.stack(outs)


@pytest.mark.parametrize(("first", "rows"), [(0, 1), (5, 3), (15, 2), (255, 2), (300, 8), (1020, 16), (4090, 8),
                                             (0, 80), (700, 100)])  # the last two: prefill chunks
def test_decode_attention_is_causal_attention(kernels, decode_case, first, rows):
    dtype, head_dim = decode_case
    q, k_cache, v_cache, slots = _decode_inputs(rows, dtype, head_dim)
    got = kernels.decode_attention(q, k_cache, v_cache, slots, first)
    assert got.dtype == dtype
    tolerance = 2e-2 if dtype == torch.bfloat16 else 3e-5
    torch.testing.assert_close(got.double(), _causal_reference(q, k_cache, v_cache, slots, first),
                               rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("heads", [(HQ, HKV), (14, 2)], ids=["group3", "group7"])
def test_decode_attention_gives_a_row_the_same_bits_however_it_is_called(kernels, decode_case, heads):
    """Whatever the row count, the other rows, the threads or where the slots lie: what makes
    a verify step equal plain decoding (and a sequence's output independent of its block
    layout). The kernel scores and weighs many rows from the same loads of a key block, in
    tiles of rows whose sizes depend on the dtype and head dim: every count of new tokens a
    verify step may have, times each GQA group, lands its rows in other tiles."""
    attend = kernels.decode_attention
    first = 1530  # the rows straddle a chunk boundary (1536)
    q, k_cache, v_cache, slots = _decode_inputs(16, *decode_case, heads=heads)
    full = attend(q, k_cache, v_cache, slots, first)
    for count in range(1, 17):
        for i in range(16 - count + 1) if count == 1 else {0, (16 - count) // 2, 16 - count}:
            assert torch.equal(attend(q[i:i + count], k_cache, v_cache, slots, first + i), full[i:i + count])
    others = q.clone()
    others[::2] = torch.randn(others[::2].shape, generator=torch.Generator().manual_seed(9)).to(q.dtype)
    assert torch.equal(attend(others, k_cache, v_cache, slots, first)[1::2], full[1::2])
    moved_k, moved_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    elsewhere = torch.arange(6000).flip(0)  # the same context, other slots
    moved_k[:, elsewhere], moved_v[:, elsewhere] = k_cache[:, slots], v_cache[:, slots]
    assert torch.equal(attend(q, moved_k, moved_v, elsewhere, first), full)
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(attend(q, k_cache, v_cache, slots, first), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("context", [600, 1530])  # the chains in one chunk; straddling a chunk boundary (1536)
def test_tree_attention_gives_each_chain_the_bits_of_decode_attention(kernels, decode_case, context):
    """A tree's chains in one call, the whole chunks of their shared context read once for
    all of them: every row as `decode_attention` computes its chain alone."""
    q, k_cache, v_cache, slots = _decode_inputs(9, *decode_case)
    # chain 0: positions context.. +3; chain 1 branches off after 1 token (2 rows); chain 2
    # off the anchor (1 row); chain 3 after 2 tokens (3 rows); each over its own tail slots
    shapes = [(0, 3, context), (3, 2, context + 1), (5, 1, context + 1), (6, 3, context + 2)]
    chains = []
    for i, (start, length, first) in enumerate(shapes):
        own = slots[context:context + first - context + length] if i == 0 else torch.randperm(
            6000 - context, generator=torch.Generator().manual_seed(i))[:first - context + length] + context
        chain_slots = torch.cat([slots[:context], own]) if i else slots[:first + length].clone()
        chains.append((start, length, first, chain_slots))
    got = kernels.tree_attention(q, k_cache, v_cache, chains, context)
    for start, length, first, chain_slots in chains:
        alone = kernels.decode_attention(q[start:start + length].contiguous(), k_cache, v_cache, chain_slots, first)
        assert torch.equal(got[start:start + length], alone)


def test_batch_attention_gives_each_sequence_the_bits_of_decode_attention(kernels, decode_case):
    """A batch's sequences in one call (a layer's decode / verify rows of every sequence), at
    contexts of other lengths and in other slots: each row as its sequence alone."""
    q, k_cache, v_cache, slots = _decode_inputs(14, *decode_case)
    # (rows, first position): a decode row, a verify chain across a chunk boundary, a long one
    shapes, spans, start = [(1, 40), (5, 1533), (8, 4090)], [], 0
    for i, (length, first) in enumerate(shapes):
        own = slots.roll(1000 * i)[:first + length].clone()
        spans.append((start, length, first, own))
        start += length
    got = kernels.batch_attention(q, k_cache, v_cache, spans)
    for start, length, first, own in spans:
        alone = kernels.decode_attention(q[start:start + length].contiguous(), k_cache, v_cache, own, first)
        assert torch.equal(got[start:start + length], alone)
    with pytest.raises(RuntimeError, match="tile q's rows"):
        kernels.batch_attention(q, k_cache, v_cache, spans[1:])


def test_tree_attention_refuses_chains_that_do_not_share_their_context(kernels, decode_case):
    q, k_cache, v_cache, slots = _decode_inputs(4, *decode_case)
    other = slots.clone()
    other[7] = slots[8]
    chains = [(0, 2, 300, slots[:302]), (2, 2, 300, other[:302])]
    with pytest.raises(RuntimeError, match="differ inside the shared context"):
        kernels.tree_attention(q, k_cache, v_cache, chains, 300)
    with pytest.raises(RuntimeError, match="tile q's rows"):
        kernels.tree_attention(q, k_cache, v_cache, [(0, 2, 300, slots[:302]), (3, 1, 300, slots[:301])], 300)
    with pytest.raises(RuntimeError, match="inside the shared context"):
        kernels.tree_attention(q, k_cache, v_cache, [(0, 4, 300, slots[:304])], 301)


AMX_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[2])
from test_fused_ops import _decode_inputs
from dlite_ray.runtime import fused_ops
q, k_cache, v_cache, slots = _decode_inputs(8, torch.bfloat16, int(sys.argv[3]))
torch.save(fused_ops.kernels().decode_attention(q, k_cache, v_cache, slots, 3000), sys.argv[1])
"""


@pytest.mark.skipif("amx_bf16" not in cpu_flags() or os.environ.get("DLITE_AMX") == "0",
                    reason="the tile unit (AMX) is a Xeon's from Sapphire Rapids on, and DLITE_AMX=0 refuses it")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_attention_runs_on_the_tile_unit_where_the_cpu_has_it(kernels, tmp_path, head_dim):
    """Where the process may use AMX, bf16 scores and P.V sums are tile products: close to the
    dot-product path's (DLITE_AMX=0) but not equal in every bit, which is why the unit is
    fixed per process (its rows' exactness: the tests above, which run on it here)."""
    outs = {}
    for amx in ("1", "0"):
        path = tmp_path / f"amx{amx}.pt"
        subprocess.run([sys.executable, "-c", AMX_SCRIPT, str(path), os.path.dirname(__file__), str(head_dim)],
                       check=True, env={**os.environ, "DLITE_AMX": amx})
        outs[amx] = torch.load(path)
    torch.testing.assert_close(outs["1"].float(), outs["0"].float(), rtol=0.02, atol=0.02)
    assert not torch.equal(outs["1"], outs["0"])


def test_prefill_chunks_attend_through_our_kernel_while_its_partials_stay_bounded(kernels, decode_case):
    dtype, head_dim = decode_case
    chunk = torch.zeros(512, HQ, head_dim, dtype=dtype)
    with torch.inference_mode():
        assert fused_ops.attends_prefill_rows(chunk, 4096)
        assert not fused_ops.attends_prefill_rows(chunk, 256 * 1024)  # gigabytes of partials: the flash kernel


def test_decode_attention_rejects_slots_outside_the_cache(kernels, decode_case):
    attend = kernels.decode_attention
    q, k_cache, v_cache, slots = _decode_inputs(2, *decode_case)
    with pytest.raises(RuntimeError, match="outside the cache"):
        attend(q, k_cache, v_cache, torch.full((12,), 6000), 10)
    with pytest.raises(RuntimeError, match="cover positions"):
        attend(q, k_cache, v_cache, slots[:11], 10)


def test_decode_attention_rejects_other_dtypes_and_head_dims(kernels):
    if torch.float32 not in fused_ops.kernel_dtypes():
        pytest.skip("built without AVX-512: the kernel attends nothing")
    q, k_cache, v_cache, slots = _decode_inputs(2, torch.float32)
    with pytest.raises(RuntimeError, match="dtype and head dim"):
        kernels.decode_attention(q, k_cache.bfloat16(), v_cache.bfloat16(), slots, 10)
    with pytest.raises(RuntimeError, match="64 or 128"):
        kernels.decode_attention(q[..., :32].contiguous(), k_cache[..., :32].contiguous(),
                                 v_cache[..., :32].contiguous(), slots, 10)
    with pytest.raises(RuntimeError, match="does not attend"):
        kernels.decode_attention(q.double(), k_cache.double(), v_cache.double(), slots, 10)


@pytest.mark.parametrize("width", [1, 15, 17, 64, 65, 200, 49152])
def test_argmax_is_torchs_argmax(kernels, width):
    """Random rows, ties (the first of equal maxima), -inf rows (masked by a grammar), NaNs
    (the first one, as torch gives it), at widths around the kernel's 16 and 64 lanes."""
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(2, 6, width, generator=gen)
    logits[0, 1] = 0.5  # every value tied
    logits[0, 2] = -torch.inf
    logits[0, 3, -1] = torch.nan
    logits[0, 4, :] = torch.randint(0, 3, (width,), generator=gen).float()  # ties at the maximum, 2
    if width > 2:
        logits[0, 5, width // 3] = torch.nan
        logits[0, 5, -2] = torch.inf
    with torch.inference_mode():
        got = fused_ops.argmax(logits)
        assert got.shape == (2, 6) and torch.equal(got, logits.argmax(dim=-1))
        assert torch.equal(kernels.argmax_rows(logits.view(-1, width)), logits.argmax(dim=-1).view(-1))


def test_argmax_leaves_what_the_kernel_does_not_serve_to_torch(kernels, monkeypatch):
    x = torch.randn(3, 40)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.argmax_rows(x.double())
    calls = []
    monkeypatch.setattr(kernels, "argmax_rows", lambda x: calls.append(x))
    for other in (x.double(), x.bfloat16(), torch.randn(0, 40)):
        assert torch.equal(fused_ops.argmax(other), other.argmax(-1))
    assert calls == []


def test_argmax_serves_with_gradients_on(kernels, monkeypatch):
    """Verification runs outside the forward's inference mode: the kernel takes it there too."""
    calls = []
    monkeypatch.setattr(kernels, "argmax_rows", lambda x: calls.append(x) or x.argmax(-1))
    x = torch.randn(2, 3, 40)
    assert torch.is_grad_enabled() and torch.equal(fused_ops.argmax(x), x.argmax(-1)) and len(calls) == 1

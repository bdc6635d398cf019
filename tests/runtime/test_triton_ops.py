"""A decoder layer's small operations in Triton (runtime/triton_ops.py), the CUDA path of
`fused_ops`, run on CPU under Triton's interpreter: each against eager PyTorch, each row's
bits the same in a launch of any row count, and a tiny model through them end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels' tests need the triton package (extra 'triton')")

from dlite_ray.runtime import fused_ops, triton_ops  # noqa: E402
from dlite_ray.runtime.attention.paged_triton import interpreting  # noqa: E402

if not torch.cuda.is_available() and not interpreting():
    pytest.skip("without CUDA these tests run under TRITON_INTERPRET=1, set before triton is imported "
                "(tests/conftest.py)", allow_module_level=True)

# Triton's interpreter rounds float32 to bfloat16 toward zero (the device to nearest even),
# so bfloat16 results are compared within a bfloat16 rounding, float32 ones closely.
HQ, HKV, DH, D = 4, 2, 16, 48  # D not a power of two: the kernels' masks are exercised
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _cos_sin(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    from dlite_ray.runtime.layers import Rotary

    return Rotary(DH, 10000.0).cos_sin(torch.arange(3, 3 + rows), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_equal_torch(dtype):
    x, delta = _randn(7, D, dtype=dtype, seed=0), _randn(7, D, dtype=dtype, seed=1)
    weight = (1 + _randn(D, dtype=torch.float32, seed=2) / 4).to(dtype)
    torch.testing.assert_close(triton_ops.rms_norm(x, weight, 1e-6), F.rms_norm(x, (D,), weight, 1e-6))
    normed, summed = triton_ops.add_rms_norm(x, delta, weight, 1e-6)
    torch.testing.assert_close(summed, x + delta)
    torch.testing.assert_close(normed, F.rms_norm(summed, (D,), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norms", [False, True], ids=["llama", "qwen3"])
def test_rotate_qkv_equals_the_eager_rotation(dtype, with_norms):
    """q and k heads rotated (after their RMS norm, as Qwen3 does): against the eager
    `apply_rotary` over `F.rms_norm`; v the projection's own values."""
    rows = 5
    qkv = _randn(rows, (HQ + 2 * HKV) * DH, dtype=dtype, seed=3)
    cos, sin = _cos_sin(rows, dtype)
    q_weight, k_weight = (1 + _randn(DH, dtype=torch.float32, seed=s) / 4 for s in (4, 5))
    norms = (q_weight.to(dtype), k_weight.to(dtype), 1e-6) if with_norms else None
    q, k, v = triton_ops.rotate_qkv(qkv, cos, sin, HQ, HKV, norms)
    heads = qkv.unflatten(-1, (HQ + 2 * HKV, DH))
    want_q, want_k = heads[:, :HQ], heads[:, HQ:HQ + HKV]
    if norms is not None:
        want_q, want_k = F.rms_norm(want_q, (DH,), norms[0], 1e-6), F.rms_norm(want_k, (DH,), norms[1], 1e-6)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(q, fused_ops.apply_rotary(want_q.float(), cos.float(), sin.float()).to(dtype), **tol)
    torch.testing.assert_close(k, fused_ops.apply_rotary(want_k.float(), cos.float(), sin.float()).to(dtype), **tol)
    assert torch.equal(v, heads[:, HQ + HKV:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_equals_torch(dtype, monkeypatch):
    monkeypatch.setattr(triton_ops, "SILU_TILE", 32)  # 40 columns: two tiles, the second masked
    gate_up = _randn(3, 2, 80, dtype=dtype, seed=6)
    gate, up = gate_up.float().chunk(2, dim=-1)
    torch.testing.assert_close(triton_ops.silu_mul(gate_up), (F.silu(gate) * up).to(dtype))


def test_write_kv_writes_only_its_slots_and_zeroes_non_finite_values():
    k_cache = torch.full((4, 8, HKV, DH), 7.0)
    v_cache = torch.full_like(k_cache, 7.0)
    qkv = _randn(3, (HQ + 2 * HKV) * DH, dtype=torch.float32, seed=7)
    heads = qkv.unflatten(-1, (HQ + 2 * HKV, DH))
    k, v = heads[:, HQ:HQ + HKV], heads[:, HQ + HKV:]  # strided views of a projection, as the layer has them
    k[1, 0, 3], v[2, 1, 0], k[0, 1, 5] = float("nan"), float("inf"), -float("inf")
    slots = torch.tensor([5, 17, 30])
    triton_ops.write_kv(k_cache, v_cache, slots, k, v)
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    assert torch.equal(flat_k[slots], torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0))
    assert torch.equal(flat_v[slots], torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0))
    others = torch.ones(32, dtype=torch.bool)
    others[slots] = False
    assert (flat_k[others] == 7).all() and (flat_v[others] == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_has_the_same_bits_in_a_launch_of_any_row_count(dtype):
    """Row 2 of 9 and the same row alone: a decode row and that row in a verify step."""
    rows = 9
    x, delta = _randn(rows, D, dtype=dtype, seed=8), _randn(rows, D, dtype=dtype, seed=9)
    weight = _randn(D, dtype=dtype, seed=10)
    qkv = _randn(rows, (HQ + 2 * HKV) * DH, dtype=dtype, seed=11)
    cos, sin = _cos_sin(rows, dtype)
    norms = (_randn(DH, dtype=dtype, seed=12), _randn(DH, dtype=dtype, seed=13), 1e-6)
    gate_up = _randn(rows, 2 * D, dtype=dtype, seed=14)

    def ops(r: slice) -> list[torch.Tensor]:
        return [triton_ops.rms_norm(x[r], weight, 1e-6), *triton_ops.add_rms_norm(x[r], delta[r], weight, 1e-6),
                *triton_ops.rotate_qkv(qkv[r], cos[r], sin[r], HQ, HKV, norms)[:2], triton_ops.silu_mul(gate_up[r])]

    for batched, alone in zip(ops(slice(0, rows)), ops(slice(2, 3)), strict=True):
        assert torch.equal(batched[2:3], alone)


def test_fused_ops_sends_cuda_inference_calls_to_triton_and_nothing_else(monkeypatch):
    """The dispatch: an inference call on CUDA goes to the Triton kernels where they serve;
    a call with gradients, off CUDA, or with DLITE_TRITON_OPS=0 does not."""
    class FakeCuda:  # what the dispatch reads of a tensor, without a GPU
        device = torch.device("cuda")

    with torch.inference_mode():
        assert fused_ops._gpu(FakeCuda()) is triton_ops  # type: ignore[arg-type]
        assert fused_ops._gpu(torch.zeros(1)) is None
    with torch.enable_grad():
        assert fused_ops._gpu(FakeCuda()) is None  # type: ignore[arg-type]
    monkeypatch.setenv("DLITE_TRITON_OPS", "0")
    fused_ops.triton_kernels.cache_clear()
    try:
        with torch.inference_mode():
            assert fused_ops._gpu(FakeCuda()) is None  # type: ignore[arg-type]
    finally:
        monkeypatch.delenv("DLITE_TRITON_OPS")
        fused_ops.triton_kernels.cache_clear()


@pytest.fixture
def triton_ops_on_cpu(monkeypatch):
    """fused_ops as it runs on CUDA: every inference call through the Triton kernels (here
    under the interpreter), counted per kernel."""
    calls: dict[str, int] = {}

    class Counting:
        def __getattr__(self, name):
            calls[name] = calls.get(name, 0) + 1
            return getattr(triton_ops, name)

    monkeypatch.setattr(fused_ops, "_gpu", lambda x: None if torch.is_grad_enabled() else Counting())
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_tiny_model_through_the_triton_kernels_keeps_greedy_speculation_exact(tmp_path, arch, triton_ops_on_cpu):
    """End to end on the triton attention backend with every small operation a Triton kernel:
    greedy speculation (verify spans with rejections) equals plain decoding on the same
    kernels, and plain decoding through them gives the eager layers' tokens."""
    from dlite_ray.bench.oracle import OracleDraftTransport
    from dlite_ray.runtime.loading import load_target
    from tests.conftest import make_tiny_checkpoint
    from tests.engine.conftest import make_engine

    target = load_target(make_tiny_checkpoint(tmp_path / arch, arch, layers=2))
    prompts = [[(5 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate((9, 6))]
    plain = make_engine(target, attention_backend="triton")
    reference = [r.token_ids for r in plain.generate(prompts, max_new_tokens=8)]
    kernels = {"rms_norm", "add_rms_norm", "rotate_qkv", "silu_mul", "write_kv"}
    assert kernels <= set(triton_ops_on_cpu), triton_ops_on_cpu  # the kernels ran, not the eager fallbacks
    oracle = OracleDraftTransport([p + r for p, r in zip(prompts, reference)], wrong_rate=0.3, vocab_size=128)
    out = make_engine(target, oracle, attention_backend="triton").generate(prompts, max_new_tokens=8)
    assert [r.token_ids for r in out] == reference
    assert max(a for r in out for a in r.stats.accept_lengths) > 1  # verify spans ran
    triton_ops_on_cpu.clear()
    eager = make_engine(target, attention_backend="triton")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fused_ops, "_gpu", lambda x: None)
        patch.setattr(fused_ops, "_fused", lambda x: None)  # eager PyTorch layers, as on a GPU without Triton
        assert [r.token_ids for r in eager.generate(prompts, max_new_tokens=8)] == reference
    assert not triton_ops_on_cpu

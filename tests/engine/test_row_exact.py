"""A verify step computes every row bit for bit as plain decoding would, so greedy
speculative output equals greedy plain decoding exactly, not just up to rounding (bf16
rounding flips near-tied greedy tokens otherwise: 4 of 8 replies differed on the default
model before the attention and linears were made row-exact). Float32 rounds finer, and
the same holds there."""

from __future__ import annotations

import random

import pytest
import torch

from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.engine.sequence import SamplingParams
from dlite_ray.runtime import frozen_linear, fused_ops
from dlite_ray.runtime.attention import WINDOW
from dlite_ray.runtime.frozen_linear import EXACT_ROWS, FrozenLinear, PackedLinear
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft

# Long enough that decoding crosses a window boundary of the positioned attention (every
# WINDOW positions) and a chunk boundary of our decode kernel (every 256).
PROMPTS = [[random.Random(40 + i).randrange(3, 128) for _ in range(n)] for i, n in enumerate((9, WINDOW - 20, 236))]
NEW = 40
# Head dim 16: the flash kernel's position-exact calls; 64 and 128: our decode attention
# kernel (`fused_ops.decode_attention`) where the CPU has AVX-512 (BF16 for bf16).
CASES = [(torch.bfloat16, 16), (torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64), (torch.float32, 128)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{d}-head_dim{h}" for d, h in CASES])
def case(request):
    """Skipped where oneDNN cannot pack the case's weights, as torch itself reports the CPU
    (bf16 needs AVX-512 or AVX-NE-CONVERT; an AVX2-only EPYC runs the float32 cases)."""
    dtype = request.param[0]
    if not torch.backends.mkldnn.is_available():
        pytest.skip("row-exact linears need oneDNN packing")
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN packs no bf16 weights on this CPU")
    return request.param


@pytest.fixture(scope="module")
def target_dir(case, tiny_target_dir, tmp_path_factory):
    head_dim = case[1]
    if head_dim == 16:
        return tiny_target_dir
    return make_tiny_checkpoint(tmp_path_factory.mktemp("row_exact") / f"llama{head_dim}", "llama", head_dim=head_dim)


@pytest.fixture(scope="module")
def dtype(case):
    return case[0]


@pytest.fixture(scope="module")
def target(target_dir, dtype):
    return load_target(target_dir, dtype)


@pytest.fixture(scope="module")
def plain(target):
    ar = make_engine(target, enable_prefix_cache=False)
    return [ar.generate(p, max_new_tokens=NEW, ignore_eos=True)[0].token_ids for p in PROMPTS]


def test_random_draft_mostly_rejected(target, target_dir, dtype, plain):
    draft = random_draft(target, read_config(target_dir)).to(dtype)
    spec = make_engine(target, draft, num_draft_tokens=5, enable_prefix_cache=False)
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        out = spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0]
        assert out.token_ids == expected
        st = out.stats
        # every round after the prefill's drafted, and most rejected the draft's first token
        assert st.position_trials and st.position_trials[0] == len(st.accept_lengths) - 1
        assert st.position_accepts[0] < st.position_trials[0] / 2, (st.position_accepts, st.position_trials)


def test_exact_with_the_small_operations_eager(target, target_dir, dtype, monkeypatch):
    """Where the fused kernels do not build, the eager operations keep a row's bits too."""
    monkeypatch.setattr(fused_ops, "_fused", lambda x: None)
    monkeypatch.setattr(target, "layer_loop", None)  # it calls the kernels from C++
    ar = make_engine(target, enable_prefix_cache=False)
    draft = random_draft(target, read_config(target_dir)).to(dtype)
    spec = make_engine(target, draft, num_draft_tokens=5, enable_prefix_cache=False)
    for prompt in PROMPTS:
        expected = ar.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0].token_ids
        assert spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0].token_ids == expected


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def test_our_decode_kernel_serves_head_dims_64_and_128(target, dtype, monkeypatch):
    """Which kernel attends is read off the CPU's flags here, not off the code's own answer:
    ours for head dims 64 and 128 with AVX-512 (AVX-512 BF16 for bf16), never for 16."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo: this CPU's AVX-512 flags are unknown")
    needed = "avx512_bf16" if dtype == torch.bfloat16 else "avx512f"
    expected = target.cfg.head_dim in (64, 128) and needed in flags
    calls = []
    real = fused_ops.decode_attention
    monkeypatch.setattr(fused_ops, "decode_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(target, "layer_loop", None)  # it calls the kernel from C++ (test_layer_loop.py)
    make_engine(target, enable_prefix_cache=False).generate(PROMPTS[0], max_new_tokens=4, ignore_eos=True)
    assert bool(calls) == expected, (target.cfg.head_dim, dtype, needed in flags)


def test_oracle_draft_always_accepted(target, plain):
    oracle = OracleDraftTransport([p + a for p, a in zip(PROMPTS, plain, strict=True)])
    spec = make_engine(target, oracle, num_draft_tokens=7, enable_prefix_cache=False)
    for prompt, expected in zip(PROMPTS, plain, strict=True):
        out = spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0]
        assert out.token_ids == expected and out.stats.mean_accept_length > 4


def test_copied_rows_of_sixteen_tokens_stay_exact(target):
    """Context lookup verifies up to 16 tokens a row: still the position-exact path."""
    prompts = [p + p[:len(p) // 2] for p in PROMPTS]  # the first round copies 15 tokens
    plain = make_engine(target, enable_prefix_cache=False)
    spec = make_engine(target, lookup_tokens=15, enable_prefix_cache=False)
    for prompt in prompts:
        expected = plain.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0].token_ids
        out = spec.generate(prompt, max_new_tokens=NEW, ignore_eos=True)[0]
        assert out.token_ids == expected
        assert out.stats.copied_rounds[0]


def test_steps_of_many_rows_stay_exact(target_dir, dtype, monkeypatch):
    """A step that carries a prefill chunk next to verify rows puts more than EXACT_ROWS rows
    in one linear call. Where oneDNN rounds such calls differently from short ones (planted
    here: its kernels agree up to 2048 rows on this project's machines), the linears are made
    in pieces, and every request still gets the tokens it gets alone. (Our own linear kernel
    needs no pieces: tests/runtime/test_frozen_linear.py.)"""
    real_linear, real_call = PackedLinear._linear, FrozenLinear.__call__
    longest_call, longest_kernel_call = [0], [0]

    def rounds_long_calls_differently(self, flat):
        longest_kernel_call[0] = max(longest_kernel_call[0], len(flat))
        out = real_linear(self, flat)
        return out + 0.05 * out.roll(1, -1) if len(flat) > EXACT_ROWS else out  # not undone by a norm

    def measured_call(self, x):
        longest_call[0] = max(longest_call[0], x.numel() // x.shape[-1])
        return real_call(self, x)

    monkeypatch.setattr(PackedLinear, "_linear", rounds_long_calls_differently)
    monkeypatch.setattr(FrozenLinear, "__call__", measured_call)
    monkeypatch.setattr(frozen_linear, "large_calls_agree", lambda *shape: False)  # what it measures here
    monkeypatch.setattr(fused_ops, "row_linear_serves", lambda weight: False)  # oneDNN's packed linears
    planted = load_target(target_dir, dtype)
    ar = make_engine(planted, enable_prefix_cache=False)
    alone = [ar.generate(p, max_new_tokens=NEW, ignore_eos=True)[0].token_ids for p in PROMPTS]
    draft = random_draft(planted, read_config(target_dir)).to(dtype)
    engine = make_engine(planted, draft, num_draft_tokens=5, enable_prefix_cache=False)
    params = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    seqs = [engine.add_request(PROMPTS[0], params)]
    for _ in range(3):  # the first request is verifying drafts when the long prompts arrive
        engine.step()
    seqs += [engine.add_request(p, params) for p in PROMPTS[1:]]
    while engine.has_unfinished():
        engine.step()
    assert [s.output_ids for s in seqs] == alone
    assert longest_call[0] > EXACT_ROWS >= longest_kernel_call[0] > 0  # long calls came, and went in pieces

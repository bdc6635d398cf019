"""The embedded default target (SmolLM2-135M-Instruct from its PyPI wheel) against transformers."""

from __future__ import annotations

import pytest
import torch

from dlite_ray.engine.engine import DLiteEngine
from tests.helpers import forward_all, hf_logits, new_runner, new_seq

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ar_engine(default_model_dir):
    return DLiteEngine.from_pretrained(default_model_dir, draft=None, dtype="float32")  # against transformers


def test_no_draft_means_plain_decoding(ar_engine):
    assert ar_engine.draft is None and ar_engine.lookup_tokens == 0  # nothing copied either


def test_logits_match_transformers(ar_engine, default_model_dir):
    ids = ar_engine.encode([{"role": "user", "content": "Explain what a Python decorator is."}])
    ours = forward_all(new_runner(ar_engine.target), new_seq(ids), ids).logits
    ref = hf_logits(default_model_dir, ids).logits[0]
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-4)  # float32, 30 layers


def test_greedy_text_equals_transformers_generate(ar_engine, default_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompts = [[{"role": "user", "content": "Write a Python function that checks if a number is prime."}],
               [{"role": "user", "content": "List three uses of the json module."}]]
    ours = ar_engine.generate(prompts, max_new_tokens=48)
    for prompt, result in zip(prompts, ours):
        ids = ar_engine.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):].tolist()
        assert result.token_ids == ref[:len(result.token_ids)]
        assert len(result.token_ids) == len(ref) or result.finish_reason == "stop"


def test_gguf_file_loads_the_same_weights(ar_engine):
    from dlite_ray.runtime.loading import load_target
    from dlite_ray.runtime.model_store import default_gguf_path

    direct = load_target(default_gguf_path())
    assert direct.fingerprint() == ar_engine.target.fingerprint()


def test_speculative_greedy_output_equals_plain_decoding_in_bf16(default_model_dir):
    """The shipped draft on the real target, in the dtype the benchmarks use: every reply
    token for token what plain decoding gives, on short prompts and on an agent turn with
    a long history (where attention splits its keys). Fails where a kernel rounds a verify
    row differently from a decode row: an AMD EPYC's one-row bf16 linear did, for 5 of 8
    dev prompts, until short calls were padded; a row-count-wide merge of split keys did,
    for 8 of 16 agentic and long-context replies."""
    from dlite_ray.bench.workloads import load_workload

    prompts = [item.payload for item in load_workload("dev", limit=4) + load_workload("agentic", limit=2)]
    spec = DLiteEngine.from_pretrained(None, dtype="bfloat16")  # the default target and its shipped draft
    plain = DLiteEngine.from_pretrained(default_model_dir, draft=None, dtype="bfloat16")
    assert spec.draft is not None
    for prompt in prompts:  # one at a time: batch 1, where a verify step meets one-row decode steps
        ours = spec.generate([prompt], max_new_tokens=96)[0]
        assert sum(ours.stats.accept_lengths) > len(ours.stats.accept_lengths)  # something was accepted
        assert ours.token_ids == plain.generate([prompt], max_new_tokens=96)[0].token_ids


@pytest.mark.parametrize("dtype, kernel", [("float32", "ours"), ("bfloat16", "ours"), ("bfloat16", "torch")])
def test_a_rows_bits_do_not_depend_on_the_thread_count(default_model_dir, dtype, kernel, monkeypatch):
    """A server changes torch's thread count with its load (serve/cpu_threads.py): decode and
    verify rows must give the same logits, bit for bit, on 1 thread as on 2, with our decode
    kernel and, in bf16, with torch's CPU flash kernel (CPUs without AVX-512), past the point
    where the latter splits its keys (cpu_exactness.SPLIT_KEYS). torch's float32 verify rows
    differ there, so the server keeps a fixed thread count where that kernel attends
    (cpu_threads.target_thread_policy)."""
    from dlite_ray.runtime import fused_ops

    if kernel == "ours" and not fused_ops.decode_kernel_serves(64, getattr(torch, dtype)):
        pytest.skip("our decode kernel does not serve this dtype on this CPU")
    if kernel == "torch":
        monkeypatch.setattr(fused_ops, "attends_decode_rows", lambda q: False)
    engine = DLiteEngine.from_pretrained(default_model_dir, draft=None, dtype=dtype)
    ids = torch.randint(0, engine.target.cfg.vocab_size, (1100,), generator=torch.Generator().manual_seed(3))
    prompt, tail = ids[:1090].tolist(), ids[1090:].tolist()
    before = torch.get_num_threads()
    logits = []
    try:
        for threads in (2, 1):
            torch.set_num_threads(threads)
            runner, seq = new_runner(engine.target), new_seq(prompt)
            forward_all(runner, seq, prompt)
            decoded = [forward_all(runner, seq, [t]).logits for t in tail[:4]]
            verified = forward_all(runner, seq, tail[4:]).logits
            logits.append(torch.cat(decoded + [verified]))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(logits[0], logits[1])

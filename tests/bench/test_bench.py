"""Benchmark plumbing: workloads, the equality check, the result schema, the report."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dlite_ray.bench.methods import Run
from dlite_ray.bench.report import write_report
from dlite_ray.bench.runner import (
    BenchRequest,
    _overall,
    _paired_ratios,
    _ratios,
    _target_gguf,
    build_methods,
    measure,
    measure_concurrency,
    measure_turns_in_flight,
    summarize,
)
from dlite_ray.bench.workloads import load_workload
from dlite_ray.runtime.loading import checkpoint_fingerprint, load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft


def test_jsonl_workload_and_errors(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "a", "prompt": "hi"}\n{"id": "b", "messages": [{"role": "user", "content": "x"}]}\n')
    items = load_workload(str(path), limit=10)
    assert [i.id for i in items] == ["a", "b"] and items[0].payload == "hi"
    with pytest.raises(ValueError, match="unknown workload"):
        load_workload("nope", limit=1)
    (tmp_path / "bad.jsonl").write_text('{"id": "c"}\n')
    with pytest.raises(ValueError, match="neither"):
        load_workload(str(tmp_path / "bad.jsonl"), limit=1)


def test_builtin_chat_and_long_context_workloads():
    chat = load_workload("chat", limit=3)
    assert len(chat) == 3 and chat[0].messages[0]["role"] == "user"
    long = load_workload("long-context", limit=3)
    assert [i.tag for i in long] == ["2K", "4K", "7K"]
    assert len(long[2].messages[0]["content"]) > len(long[0].messages[0]["content"])


TWO_REQUESTS = [BenchRequest("p0", "t", [5, 6]), BenchRequest("p1", "t", [7])]


class _Fixed:
    """A method that returns fixed tokens (to plant a mismatch)."""

    def __init__(self, tokens, lossless=True):
        self.tokens, self.lossless = tokens, lossless

    def run(self, ids, max_new_tokens):
        return Run(list(self.tokens), 0.01, 10.0, 9.0, [2, 1], [1], [2], 0.001, 0.01, 0.1)


def _results():
    methods = {"ar": _Fixed([1, 2, 3]), "dlite": _Fixed([1, 2, 3]), "broken": _Fixed([1, 9, 3])}
    per = measure(methods, TWO_REQUESTS, SimpleNamespace(repeats=1, max_new_tokens=3))
    workloads = {"w": per}
    results = {"machine": {"cpu": "x", "cores": 2, "torch_threads": 2, "torch": "t"}, "args": {"a": 1},
               "workloads": workloads, "methods": _overall(workloads)}
    results["ratios"] = _ratios(workloads)
    results["paired_ratios"] = _paired_ratios(workloads)
    return results


def test_the_equality_check_catches_a_planted_mismatch():
    results = _results()
    assert results["methods"]["dlite"]["greedy_mismatches"] == 0
    assert results["methods"]["broken"]["greedy_mismatches"] == 2
    assert results["workloads"]["w"]["broken"]["per_prompt"][0]["first_mismatch"] == 1


def test_a_lossy_methods_replies_are_compared_not_counted_as_mismatches(tmp_path):
    methods = {"ar": _Fixed([1, 2, 3]), "other-kernels": _Fixed([1, 9, 3], lossless=False)}
    per = measure(methods, TWO_REQUESTS, SimpleNamespace(repeats=1, max_new_tokens=3))
    assert per["other-kernels"]["greedy_mismatches"] is None
    assert per["other-kernels"]["same_replies_as_ar"] == 0.0 and per["ar"]["same_replies_as_ar"] == 1.0
    results = _results()
    results["methods"]["broken"].update(greedy_mismatches=None, same_replies_as_ar=0.25)
    write_report(results, tmp_path)
    assert "other kernels: 25% of replies identical to ar's" in (tmp_path / "report.md").read_text()


def test_llama_cpp_reads_gguf_files_only():
    with pytest.raises(SystemExit, match="reads GGUF files"):
        _target_gguf("/some/hf_dir")
    assert str(_target_gguf("/models/x.gguf")) == "/models/x.gguf"


def test_result_schema_and_report(tmp_path):
    results = _results()
    write_report(results, tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    assert set(data) >= {"machine", "methods", "ratios", "workloads"}
    for m in data["methods"].values():
        assert {"tokens_per_second", "mean_accept_length", "ttft_s", "e2e_tokens_per_second"} <= set(m)
    assert data["ratios"]["dlite/ar"] == pytest.approx(1.0)
    report = (tmp_path / "report.md").read_text()
    assert "| w |" in report and "speed_by_workload.png" in report
    assert "dlite/ar prompt by prompt: median 1.00x" in report
    # per round: 1 ms of drafting and 10 ms of forward over the two rounds each run reports
    assert "| w | 0.5 / 5.0 | 0.5 / 5.0 | 0.5 / 5.0 |" in report
    assert (tmp_path / "speed_by_workload.png").stat().st_size > 1000


def test_dlite_b_drafts_with_the_other_checkpoint_on_the_same_target(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(d)
    random_draft(target, read_config(d), seed=1).save(tmp_path / "a")
    random_draft(target, read_config(d), seed=2).save(tmp_path / "b")
    a = make_engine(target, random_draft(target, read_config(d), seed=1))
    methods = build_methods(["dlite", "dlite-b"], a, make_engine(target), {},
                            SimpleNamespace(draft_b=str(tmp_path / "b"), dtype="float32"))
    b = methods["dlite-b"].engine
    assert b.target is target and b.draft.info.fingerprint == checkpoint_fingerprint(tmp_path / "b")
    assert b.generate([5, 6, 7], max_new_tokens=6)[0].token_ids == make_engine(target).generate(
        [5, 6, 7], max_new_tokens=6)[0].token_ids  # another draft, the same greedy output


def test_agent_turns_in_flight_find_their_histories_cached_and_reply_as_plain_decoding(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(d)
    dlite = make_engine(target, random_draft(target, read_config(d)), lookup_tokens=15)
    turns = [BenchRequest(f"a#{i}", f"turn-{i}", [5 + i] * 40 + list(range(30, 60))) for i in range(3)]
    out = measure_turns_in_flight(dlite, {"chat": [], "agentic": turns}, 2, max_new_tokens=6, repeats=2)["2"]
    assert out["prompt_tokens"] == [70, 70] and out["greedy_mismatches"] == 0
    assert out["dlite"]["mean_accept_length"] > 1.0 and out["ar"]["mean_accept_length"] == 1.0
    with pytest.raises(SystemExit, match="agentic"):
        measure_turns_in_flight(dlite, {"chat": turns}, 2, max_new_tokens=6, repeats=1)


def test_requests_in_flight_count_replies_that_differ_between_the_engines(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(d)
    plain, other = make_engine(target), make_engine(target)
    other.generate = lambda batch, max_new_tokens: [_planted(r) for r in plain.generate(batch, max_new_tokens)]
    out = measure_concurrency({"dlite": other, "ar": plain}, [[5, 6, 7], [8, 9]], [2], max_new_tokens=4)
    assert out["2"]["greedy_mismatches"] == 2
    assert measure_concurrency({"dlite": plain, "ar": make_engine(target)}, [[5, 6, 7]], [2],
                               max_new_tokens=4)["2"]["greedy_mismatches"] == 0


def _planted(result):
    """A reply changed after the fact: what a broken engine would have said."""
    result.token_ids = [t + 1 for t in result.token_ids]
    return result


def test_copied_rounds_are_summarised_apart_from_drafted_ones():
    rows = [{"accept_lengths": [4, 2, 6], "copied_rounds": [True, False, True], "position_accepts": [1],
             "position_trials": [1], "decode_tps": 1.0, "e2e_tps": 1.0, "ttft_s": 0.1, "matches_ar": True,
             "lossless": True, "tag": "t", "prompt_tokens": 5, "latency_s": 1.0}]
    s = summarize(rows)
    assert s["mean_accept_length"] == 4.0
    assert s["copied_round_share"] == pytest.approx(2 / 3)
    assert (s["mean_accept_length_copied"], s["mean_accept_length_drafted"]) == (5.0, 2.0)


def test_lookup_methods_take_one_drafter_each(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(d)
    dlite = make_engine(target, random_draft(target, read_config(d)), lookup_tokens=15)
    methods = build_methods(["dlite-nolookup", "lookup"], dlite, make_engine(target), {},
                            SimpleNamespace(dtype="float32"))
    alone = methods["dlite-nolookup"].engine
    assert alone.draft is dlite.draft and alone.lookup_tokens == 0
    copying = methods["lookup"].engine
    assert copying.draft is None and copying.lookup_tokens == 15


def test_paired_ratios_compare_prompt_by_prompt():
    """A slow moment of the machine during one prompt moves both methods' times there, so
    prompt-by-prompt ratios stay put where the ratio of the two medians does not."""
    def rows(tps, tokens, seconds):
        return {"per_prompt": [{"decode_tps": t, "new_tokens": n, "decode_time": s}
                               for t, n, s in zip(tps, tokens, seconds, strict=True)]}

    workloads = {"w": {"dlite": rows([20, 40, 60, 9], [11, 21, 31, 10], [0.5, 0.5, 0.5, 1.0]),
                       "ar": rows([10, 20, 20, 3], [11, 21, 31, 10], [1.0, 1.0, 1.5, 3.0])}}
    ratio = _paired_ratios(workloads)["dlite/ar"]
    assert ratio["median"] == pytest.approx(2.5)  # of 2, 2, 3, 3 (the medians' ratio: 30 / 15 = 2.0)
    assert ratio["total"] == pytest.approx(6.5 / 2.5)  # the same 69 decode tokens in 2.5 s against 6.5 s
    assert ratio["quartiles"][0] <= 2.5 <= ratio["quartiles"][1]

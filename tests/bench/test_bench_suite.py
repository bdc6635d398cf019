"""`make bench`'s parts: constrained workloads, measured memory, percentiles, every report section."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from dlite_ray.bench.memory import kv_draft_bytes, request_state
from dlite_ray.bench.methods import Run
from dlite_ray.bench.report import readme_summary, write_report
from dlite_ray.bench.runner import (
    BenchRequest,
    _overall,
    _paired_ratios,
    _paired_ratios_by_workload,
    _ratios,
    _workload_limit,
    measure,
    methods_for,
)
from dlite_ray.bench.stats import percentile, quartiles
from dlite_ray.bench.workloads import load_workload
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft


class _Recording:
    """A method that records the grammar it was given and returns fixed tokens."""

    def __init__(self, grammar: bool, speed: float = 10.0):
        self.grammar, self.speed, self.lossless, self.grammars = grammar, speed, True, []

    def run(self, ids, max_new_tokens, **kw):
        self.grammars.append(kw.get("grammar"))
        return Run([1, 2, 3], 0.01, self.speed, 9.0, [2, 1], [1], [2], 0.001, 0.01, 0.1, latency_s=0.5)


def test_constrained_workloads_carry_the_servers_grammar_and_prompt():
    structured = load_workload("structured", limit=2)
    assert len(structured) == 2 and all(i.grammar for i in structured)
    calls = load_workload("forced-tools", limit=3)
    assert [i.id for i in calls] == ["call-berlin", "call-tokyo", "call-oslo"]
    assert all(i.grammar and "get_weather" in i.messages[0]["content"] for i in calls)  # the tools message
    assert [i.tag for i in load_workload("code", limit=2)] == ["code", "code"]


def test_only_methods_with_a_grammar_run_a_constrained_workload_and_they_get_it():
    ours, theirs = _Recording(grammar=True), _Recording(grammar=False)
    methods = {"dlite": ours, "hf": theirs}
    constrained = [BenchRequest("a", "json", [5, 6], "GRAMMAR")]
    able = methods_for(methods, constrained)
    assert list(able) == ["dlite"]
    measure(able, constrained, SimpleNamespace(repeats=2, max_new_tokens=3))
    assert ours.grammars == ["GRAMMAR"] * 3  # the warm-up and two repeats
    assert methods_for(methods, [BenchRequest("b", "t", [5])]) == methods


def test_overall_and_paired_ratios_cover_only_the_workloads_a_method_ran():
    args = SimpleNamespace(repeats=1, max_new_tokens=3)
    plain = [BenchRequest("p0", "t", [5]), BenchRequest("p1", "t", [6])]
    workloads = {"chat": measure({"dlite": _Recording(True, 20.0), "hf": _Recording(False, 10.0)}, plain, args),
                 "json": measure({"dlite": _Recording(True, 40.0)}, [r._replace(grammar="G") for r in plain], args)}
    overall = _overall(workloads)
    assert overall["hf"]["tokens_per_second"] == 10.0 and overall["dlite"]["tokens_per_second"] == 30.0
    assert _paired_ratios(workloads)["dlite/hf"]["median"] == pytest.approx(2.0)  # chat only, not json's 40
    assert _paired_ratios_by_workload(workloads) == {"chat": {"dlite/hf": _paired_ratios(workloads)["dlite/hf"]},
                                                     "json": {}}


def test_workload_limits_and_percentiles():
    assert _workload_limit(" agentic:2", 4) == ("agentic", 2) and _workload_limit("chat", 4) == ("chat", 4)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0], 99) == 2.0  # nearest rank
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 3.0
    assert percentile([], 50) is None and quartiles([1.0]) is None
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == [2.0, 4.0]


def test_memory_a_request_holds_is_measured_off_live_requests(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(d)
    engine = make_engine(target, random_draft(target, read_config(d)), enable_prefix_cache=False)
    short = request_state(engine, [5 + i % 100 for i in range(40)])
    long = request_state(engine, [5 + i % 100 for i in range(160)])
    assert short["dlite_draft_bytes"] == long["dlite_draft_bytes"] > 0  # history-free: flat in the context
    assert long["target_kv_bytes"] > 2 * short["target_kv_bytes"] > 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(d).eval()
    assert kv_draft_bytes(hf, list(range(5, 69))) == 2 * kv_draft_bytes(hf, list(range(5, 37))) > 0


def _suite_results() -> dict:
    args = SimpleNamespace(repeats=1, max_new_tokens=3)
    turns = [BenchRequest("a", "turn-1", [5]), BenchRequest("a#2", "turn-2", [5, 6, 7])]
    workloads = {"agentic": measure({"dlite": _Recording(True, 20.0), "ar": _Recording(True, 10.0)}, turns, args)}
    methods = _overall(workloads)
    level = {"tokens_per_second": 30.0, "decode_tokens_per_second": 40.0, "mean_latency_s": 1.0,
             "latency_p50_s": 0.9, "latency_p99_s": 1.5, "mean_accept_length": 2.0}
    turn = {"ttft_s": 0.2, "cached_prompt_tokens": 3000, "prompt_tokens": 3100, "total_s": 1.0}
    evicted = {**turn, "ttft_s": 4.0, "cached_prompt_tokens": 0}
    return {
        "machine": {"cpu": "x", "cores": 2, "torch_threads": 2, "torch": "t"},
        "args": {"workload": "agentic:2", "limit": 4, "max_new_tokens": 96, "repeats": 3},
        "workloads": workloads, "methods": methods, "ratios": _ratios(workloads),
        "paired_ratios": _paired_ratios(workloads), "paired_ratios_by_workload": _paired_ratios_by_workload(workloads),
        "skipped": {"agentic": [], "structured": ["hf"]},
        "concurrency": {"1": {"dlite": level, "ar": level, "dlite/ar": 1.0, "dlite/ar decode": 1.0},
                        "4": {"dlite": level, "ar": level, "dlite/ar": 1.0, "dlite/ar decode": 1.0,
                              "greedy_mismatches": 0}},
        "turns_in_flight": {"4": {"dlite": {**level, "decode_tokens_per_second": 80.0}, "ar": level,
                                  "dlite/ar": 1.5, "dlite/ar decode": 2.0, "greedy_mismatches": 0,
                                  "prompt_tokens": [3010, 3177, 3566, 3723]}},
        "followup": {"rows": [{"id": "h0", "held": turn, "evicted": evicted}],
                     "held_ttft_median_s": 0.2, "evicted_ttft_median_s": 4.0, "speedup": 20.0},
        "served": {"grpc_tps_median": 90.0, "library_tps_median": 100.0, "ratio": 0.9, "comm_ms_per_round": 0.4,
                   "requests": 4, "mismatched_replies": []},
        "memory": {"draft": {"rows": [{"context": 1024, "dlite_draft_bytes": 4096, "target_kv_bytes": 2**21,
                                       "kv_draft_bytes": 2**20},
                                      {"context": 4096, "dlite_draft_bytes": 4096, "target_kv_bytes": 2**23,
                                       "kv_draft_bytes": 2**22, "python_bytes": 2**19}],
                             "kv_draft": "six layers", "dtype": "bfloat16"},
                   "peak_rss": {"context": 4096, "bytes": {"dlite": 900 * 2**20}}},
        "stamp": {"date": "2026-12-05T00:00:00+00:00", "commit": "abc1234", "dtype": "bfloat16", "quick": False,
                  "command": "make bench", "minutes": 40.0, "llama_cpp": False},
    }


def test_the_report_has_every_section_the_suite_measured(tmp_path):
    write_report(_suite_results(), tmp_path)
    report = (tmp_path / "report.md").read_text()
    for text in ("at commit abc1234", "llama.cpp was not measured", "| 4096 | 4.0 KiB | 0.5 MiB |",
                 "| agentic | 2.00x (2.00-2.00) |",
                 "| turn-2 | 3 | 1 | 20.0 (1.50) | 10.0 (1.50) |", "structured: hf", "## Requests in flight",
                 "| 4 | 30.0 | 30.0 | 1.00x | 40.0 / 40.0 | 1.00x | 0.90 / 1.50 |", "| 2.00 | 0 |",
                 "## Agent turns in flight",
                 "| 4 | 3,010, 3,177, 3,566, 3,723 | 80.0 / 40.0 | 2.00x | 1.50x | 2.00 | 0 |",
                 "agent turns 4 in flight, their histories cached, dlite/ar in the decode phase: 2.00x (tau 2.00; "
                 "end to end 1.50x)",
                 "held 0.20 s, evicted 4.00 s (20.0x)", "4: 1.00x (1.00x)",
                 "90.0 vs the library engine in-process 100.0: 90%", "| 8.0 MiB | 4.0 MiB |",
                 "dlite 900 MiB", "latency p50 / p99 s"):
        assert text in report, text
    for plot in ("concurrency.png", "draft_memory.png", "speed_by_workload.png"):
        assert (tmp_path / plot).stat().st_size > 1000 and f"]({plot})" in report
    assert json.loads((tmp_path / "results.json").read_text())["stamp"]["commit"] == "abc1234"
    quick = _suite_results()
    quick["stamp"].update(quick=True, command="make bench ARGS=--quick")
    write_report(quick, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "A quick run" in report and "llama.cpp was not measured" not in report  # a quick run never has it


def test_the_suite_runs_every_section_and_stamps_what_it_wrote(tmp_path, monkeypatch):
    from dlite_ray.bench import suite

    fixture = _suite_results()
    speed = {k: fixture[k] for k in ("machine", "args", "workloads", "methods", "ratios", "paired_ratios",
                                     "paired_ratios_by_workload", "skipped", "concurrency")}
    asked = {}
    monkeypatch.setattr(suite, "measure_all", lambda a: asked.setdefault("speed", a) and dict(speed))
    monkeypatch.setattr(suite.followup_bench, "run", lambda a: fixture["followup"])
    monkeypatch.setattr(suite.serve_bench, "run", lambda a: asked.setdefault("served", a) and fixture["served"])
    monkeypatch.setattr(suite, "measure_draft_memory", lambda *a: fixture["memory"]["draft"])
    monkeypatch.setattr(suite, "measure_peak_rss", lambda methods, dtype: asked.setdefault("rss", methods)
                        and fixture["memory"]["peak_rss"])
    results = suite.run(SimpleNamespace(quick=True, dtype="float32", out=str(tmp_path)))
    assert asked["speed"].workload == suite.QUICK.workloads and asked["speed"].concurrency == "1,4"
    assert asked["speed"].turns_in_flight == suite.QUICK.turns_in_flight
    assert asked["served"].dtype == "float32" and asked["rss"] == ["dlite"]
    written = json.loads((tmp_path / "results.json").read_text())
    assert {"followup", "served", "memory", "stamp"} <= set(written) and written["stamp"]["quick"] is True
    assert written["stamp"]["commit"] == results["stamp"]["commit"] != "unknown"
    assert not (tmp_path / "results.partial.json").exists()  # only a run that stopped midway leaves it
    assert "## Memory" in (tmp_path / "report.md").read_text()


def test_a_reply_that_differed_in_flight_reaches_the_readme_summary():
    results = _suite_results()
    assert "greedy replies different from plain decoding: none" in readme_summary(results)
    results["turns_in_flight"]["4"]["greedy_mismatches"] = 1
    assert "greedy replies different from plain decoding: dlite in flight 1" in readme_summary(results)

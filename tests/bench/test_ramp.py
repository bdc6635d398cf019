"""The load ramp: requests in flight rise from 1 to a peak and fall back, set by progress
so that both engines face the same load; replies compared between the engines."""

from __future__ import annotations

from dlite_ray.bench.ramp import REQUESTS_PER_PEAK, in_flight_cap, measure_ramp, run_ramp
from dlite_ray.runtime.loading import load_target
from tests.conftest import make_tiny_checkpoint, read_config
from tests.engine.conftest import make_engine, random_draft


def test_the_cap_rises_from_one_to_the_peak_and_falls_back():
    caps = [in_flight_cap(a, 32, 8) for a in range(32)]
    assert caps[0] == 1 and max(caps) == 8 and caps[-1] <= 2
    assert caps[:16] == sorted(caps[:16]) and caps[16:] == sorted(caps[16:], reverse=True)


def test_a_ramp_crosses_every_batch_size_up_and_down_and_replies_as_plain_decoding(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "t", "llama")
    target = load_target(d)
    prompts = [[5 + i] * 6 + list(range(30, 40)) for i in range(3)]
    one = run_ramp(make_engine(target), prompts, peak=4, max_new_tokens=6)
    trajectory = one["in_flight"]
    top = trajectory.index(max(trajectory))
    assert max(trajectory) == 4 and trajectory[0] == 1
    assert set(trajectory[:top + 1]) == {1, 2, 3, 4}  # every size on the way up
    assert len(one["replies"]) == REQUESTS_PER_PEAK * 4 and all(len(r) == 6 for r in one["replies"])
    dlite = make_engine(target, random_draft(target, read_config(d)), lookup_tokens=15)
    out = measure_ramp({"dlite": dlite, "ar": make_engine(target)}, prompts, peak=4, max_new_tokens=6, repeats=2)
    assert out["greedy_mismatches"] == 0 and out["requests"] == 16
    assert out["dlite/ar"] > 0 and max(out["dlite"]["in_flight"]) == 4


def test_a_ramp_counts_replies_that_differ(tmp_path):
    target = load_target(make_tiny_checkpoint(tmp_path / "t", "llama"))
    plain, broken = make_engine(target), make_engine(target)
    add = broken.add_request
    broken.add_request = lambda prompt, params: add([*prompt, 9], params)  # answers another prompt
    out = measure_ramp({"dlite": broken, "ar": plain}, [[5, 6, 7, 8]], peak=2, max_new_tokens=4, repeats=1)
    assert out["greedy_mismatches"] > 0


def test_the_report_shows_the_ramp_and_the_agent_histories_and_counts_their_mismatches(tmp_path):
    from dlite_ray.bench.report import write_report
    from tests.bench.test_bench import _results

    engine = {"tokens_per_second": 10.0, "decode_tokens_per_second": 11.0, "latency_p50_s": 1.0,
              "latency_p99_s": 2.0, "mean_accept_length": 2.5}
    results = _results()
    results["methods"].pop("broken")
    results["concurrency_agent"] = {"4": {"dlite": engine, "ar": engine, "dlite/ar": 1.0, "dlite/ar decode": 1.0,
                                          "greedy_mismatches": 0, "prompt_tokens": [2048, 4096]}}
    results["ramp"] = {"peak": 32, "requests": 128, "dlite": {"tokens_per_second": 12.0, "steps": 90},
                       "ar": {"tokens_per_second": 10.0, "steps": 100}, "dlite/ar": 1.2, "greedy_mismatches": 1}
    write_report(results, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "## Agent histories in flight" in report and "(2,048, 4,096 tokens)" in report
    assert "## A ramp: 1 -> 32 -> 1 in flight" in report and "| 12.0 | 10.0 | 1.20x | 90 | 100 | 1 |" in report
    assert "greedy replies different from plain decoding: dlite in flight 1" in report

"""The ablation's bookkeeping (`dlite-ray bench-ablation`): each row over plain decoding prompt by
prompt, per-position acceptance pooled over the workloads, the report, and the command a
per-process setting runs."""

from __future__ import annotations

import pytest

from dlite_ray.bench.ablation import (
    PIECES,
    SETTINGS,
    ablation_rows,
    greedy_mismatches,
    markdown,
    per_position,
    plain_decoding,
    setting_command,
)
from dlite_ray.cli import build_parser


def _prompt(tps: float, accepts=(1, 0), trials=(2, 1)) -> dict:
    return {"decode_tps": tps, "new_tokens": 10, "decode_time": 9 / tps, "position_accepts": list(accepts),
            "position_trials": list(trials)}


def _results(speedup: float, mismatches: int = 0, methods=("ar", *PIECES)) -> dict:
    """Two workloads of two prompts; every method `speedup` times plain decoding, tau 2."""
    workloads = {}
    for w, base in (("code", 50.0), ("agentic", 40.0)):
        workloads[w] = {m: {"per_prompt": [_prompt(base * (1 if m == "ar" else speedup)), _prompt(base + 10)],
                            "mean_accept_length": 1.0 if m == "ar" else 2.0, "tokens_per_second": base}
                        for m in methods}  # tokens_per_second: what the runner's summary would hold
    return {"workloads": workloads, "methods": {m: {"greedy_mismatches": mismatches} for m in methods}}


def test_each_row_is_its_method_over_plain_decoding_in_its_own_process():
    main, float32 = _results(2.0), _results(1.5, methods=("ar", "dlite"))
    rows = ablation_rows(main, {"float32": float32})
    assert [r["name"] for r in rows] == [*PIECES.values(), "dlite, float32"]
    # per prompt: 2.0x and 1.0x (the second prompt runs at the same speed), median 1.5x
    assert rows[0]["code"]["vs_ar"]["median"] == pytest.approx(1.5) and rows[0]["code"]["tau"] == 2.0
    assert rows[-1]["agentic"]["vs_ar"]["median"] == pytest.approx(1.25)  # the setting's own ar
    assert plain_decoding(main, {"float32": float32}) == {"default": {"code": 50.0, "agentic": 40.0},
                                                          "float32": {"code": 50.0, "agentic": 40.0}}


def test_per_position_acceptance_pools_every_workloads_rounds():
    main = _results(2.0)
    main["workloads"]["agentic"]["dlite"]["per_prompt"][0]["position_accepts"] = [2, 1, 1]
    main["workloads"]["agentic"]["dlite"]["per_prompt"][0]["position_trials"] = [2, 2, 1]
    # position 1: (1 + 1 + 2 + 1) / (2 + 2 + 2 + 2); 2: (0 + 0 + 1 + 0) / (1 + 1 + 2 + 1); 3: 1 / 1
    assert per_position(main, ["dlite"])["dlite"] == pytest.approx([5 / 8, 1 / 5, 1.0])


def test_the_report_shows_every_row_and_counts_differing_replies():
    main = _results(2.0)
    settings = {name: _results(1.5, mismatches=1 if name == "float32 instead of bf16" else 0, methods=("ar", "dlite"))
                for name in SETTINGS}
    results = {"stamp": {"date": "2026-12-06T07:00:00+00:00", "commit": "abc1234", "dtype": "bfloat16",
                         "command": "dlite-ray bench-ablation", "minutes": 20.0},
               "plan": {"workload": "code,agentic", "limit": 2, "max_new_tokens": 96, "repeats": 3},
               "workloads": ["code", "agentic"], "rows": ablation_rows(main, settings),
               "plain_decoding": plain_decoding(main, settings), "per_position": per_position(main, ["dlite"]),
               "greedy_mismatches": greedy_mismatches(main, settings)}
    report = markdown(results)
    assert "| dlite, default settings | 1.50x (1.25-1.75) | 1.50x (1.25-1.75) | 2.00 / 2.00 |" in report
    assert "| dlite, our CPU kernels off |" in report
    assert "| plain decoding, float32 instead of bf16 | 50.0 | 40.0 |" in report
    assert "| dlite, default settings | 50.0 | 40.0 |" in report  # the summaries' tokens/s
    assert "- dlite: 0.50 0.00" in report
    assert report.rstrip().endswith("Greedy replies different from plain decoding: dlite, float32 instead of bf16: 1")


def test_a_setting_runs_the_bench_cli_on_the_same_prompts():
    plan = {"workload": "code,agentic:2", "limit": 3, "max_new_tokens": 96, "repeats": 3}
    argv = setting_command(["--dtype", "float32"], plan, "/tmp/x")
    assert argv[1:3] == ["-m", "dlite_ray.cli"]
    args = build_parser().parse_args(argv[3:])
    assert (args.methods, args.workload, args.limit, args.max_new_tokens, args.repeats, args.dtype, args.out) == \
        ("dlite,ar", "code,agentic:2", 3, 96, 3, "float32", "/tmp/x")

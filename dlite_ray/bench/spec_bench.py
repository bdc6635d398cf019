"""`dlite-ray bench-spec`: DLite vs plain decoding on the same engine, dev prompts, batch 1.

Methods run interleaved prompt by prompt (the machine is shared and noisy), greedy, and
their outputs are compared token for token. `--oracle` swaps in a draft that proposes
the target's own tokens: the engine's ceiling at this K.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

from tqdm import tqdm

from dlite_ray.bench.machine import machine_info
from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.training.prompts import build_prompt_set

log = logging.getLogger(__name__)


def _run_one(engine: DLiteEngine, prompt, max_new_tokens: int) -> dict:
    r = engine.generate(prompt, max_new_tokens=max_new_tokens)[0]
    return {"token_ids": r.token_ids, **{k: r.stats[k] for k in (
        "decode_tokens_per_second", "mean_accept_length", "accept_lengths", "draft_time", "verify_time",
        "decode_wall_time", "prefill_time", "position_accepts", "position_trials", "num_prompt_tokens")}}


def run(args) -> dict:
    draft = None if args.draft == "none" else args.draft
    spec = DLiteEngine.from_pretrained(args.target, None if args.oracle else draft, dtype=args.dtype,
                                       num_draft_tokens=args.num_draft_tokens,
                                       verify_block_size=args.verify_block_size)
    ar = DLiteEngine(spec.target, spec.tokenizer, None)
    prompts = [s.messages for s in build_prompt_set().dev[: args.limit]]
    if args.oracle:
        refs = [spec.encode(p) + r.token_ids for p, r in zip(prompts, ar.generate(prompts, max_new_tokens=args.max_new_tokens))]
        spec = DLiteEngine(spec.target, spec.tokenizer, OracleDraftTransport(refs, args.num_draft_tokens),
                           num_draft_tokens=args.num_draft_tokens)
    _run_one(spec, prompts[0], 8), _run_one(ar, prompts[0], 8)  # warm-up
    rows = []
    for i, prompt in enumerate(tqdm(prompts, desc="prompts", unit="prompt")):
        runs = {"dlite": [], "ar": []}
        for _ in range(args.repeats):
            runs["dlite"].append(_run_one(spec, prompt, args.max_new_tokens))
            runs["ar"].append(_run_one(ar, prompt, args.max_new_tokens))
        d, a = runs["dlite"][0], runs["ar"][0]
        rows.append({"prompt": i, "prompt_tokens": d["num_prompt_tokens"], "new_tokens": len(d["token_ids"]),
                     "dlite_tps": statistics.median(r["decode_tokens_per_second"] for r in runs["dlite"]),
                     "ar_tps": statistics.median(r["decode_tokens_per_second"] for r in runs["ar"]),
                     "tau": d["mean_accept_length"], "equal": d["token_ids"] == a["token_ids"],
                     "draft_time": d["draft_time"], "verify_time": d["verify_time"],
                     "rounds": len(d["accept_lengths"]), "position_accepts": d["position_accepts"],
                     "position_trials": d["position_trials"]})
    report = summarize(rows, args)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(report, indent=2))
    return report


def summarize(rows: list[dict], args) -> dict:
    ratios = [r["dlite_tps"] / r["ar_tps"] for r in rows]
    accepts = [sum(r["position_accepts"][k] for r in rows if len(r["position_accepts"]) > k) for k in range(7)]
    trials = [sum(r["position_trials"][k] for r in rows if len(r["position_trials"]) > k) for k in range(7)]
    rounds = sum(r["rounds"] for r in rows)
    report = {
        "machine": machine_info(), "draft": "oracle" if args.oracle else args.draft, "dtype": args.dtype,
        "prompts": len(rows), "max_new_tokens": args.max_new_tokens,
        "tau": sum(r["tau"] * r["rounds"] for r in rows) / max(1, rounds),
        "dlite_tps_median": statistics.median(r["dlite_tps"] for r in rows),
        "ar_tps_median": statistics.median(r["ar_tps"] for r in rows),
        "speedup_median": statistics.median(ratios),
        "per_position_acceptance": [a / t if t else None for a, t in zip(accepts, trials)],
        "draft_ms_per_round": 1e3 * sum(r["draft_time"] for r in rows) / max(1, rounds),
        "verify_ms_per_round": 1e3 * sum(r["verify_time"] for r in rows) / max(1, rounds),
        "greedy_mismatches": sum(not r["equal"] for r in rows), "rows": rows,
    }
    print(f"draft={report['draft']} dtype={args.dtype} prompts={len(rows)} machine={report['machine']['cpu']}")
    print(f"tau (mean accept length, A+1) = {report['tau']:.2f}; per-position acceptance "
          f"{[round(x, 2) for x in report['per_position_acceptance'] if x is not None]}")
    print(f"decode tokens/s median: dlite {report['dlite_tps_median']:.1f}, ar {report['ar_tps_median']:.1f}, "
          f"speedup (median of per-prompt ratios) {report['speedup_median']:.2f}x")
    print(f"per round: draft {report['draft_ms_per_round']:.1f} ms, verify {report['verify_ms_per_round']:.1f} ms; "
          f"greedy outputs differing from plain decoding: {report['greedy_mismatches']}/{len(rows)}")
    return report

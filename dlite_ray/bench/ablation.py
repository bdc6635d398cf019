"""`dlite-ray bench-ablation`: what each piece of dlite buys, each row measured against plain
decoding side by side, on the code, agent-turn and long-context workloads (batch 1, greedy).

- One process runs plain decoding (ar) and dlite at default settings, and dlite with one
  piece taken out or put in (`runner.build_methods`): the draft alone (no context lookup),
  context lookup alone (no draft), the reply corpus on, no adaptive policy (the full length
  every round), and tree verification on. Every method takes its turn on a prompt before the next prompt.
- A setting fixed per process gets a process of its own running dlite and ar: float32
  instead of bf16, and our CPU kernels off (DLITE_FUSED_OPS=0: eager operations and the CPU
  flash kernel). Its dlite/ar is side by side; its plain decoding against the first
  process's is across runs, so noisier.

The reply cache is not a row: a prompt's repeats would copy its own earlier reply. Its
measurement replays conversations turn by turn (scripts/reply_cache_bench.py, docs/design.md).
The reply corpus is one: it is fixed, and holds no benchmark prompt's reply.
Writes ablation.json and ablation.md into --out.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

from dlite_ray.bench.report import ratio_cell
from dlite_ray.bench.runner import measure_all, paired_ratio
from dlite_ray.bench.suite import git_commit
from dlite_ray.engine.engine_config import resolve_dtype

# bench method -> what the row changes against dlite's defaults
PIECES = {
    "dlite": "dlite, default settings",
    "dlite-nolookup": "without context lookup (the draft alone)",
    "dlite-corpus": "with the reply corpus (copies from the target's training replies)",
    "lookup": "without the DLite draft (context lookup alone)",
    "dlite-fixed": "without the adaptive policy (full length every round)",
    "dlite-tree": "with tree verification (runners-up, other copies)",
}
# a setting fixed per process -> (its `dlite-ray bench` arguments, its environment)
SETTINGS = {
    "float32 instead of bf16": (["--dtype", "float32"], {}),
    "our CPU kernels off": ([], {"DLITE_FUSED_OPS": "0"}),
}


def run(args) -> dict:
    dtype = resolve_dtype(args.dtype, "cpu")
    commit = git_commit()
    started = datetime.datetime.now(datetime.timezone.utc)
    plan = dict(workload=args.workload, limit=args.limit, max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    main = measure_all(SimpleNamespace(**plan, methods="ar," + ",".join(PIECES), target=None, draft="default",
                                       draft_b="default", dtype=dtype, concurrency=None, turns_in_flight=None))
    settings = {name: _in_own_process(flags, env, plan) for name, (flags, env) in SETTINGS.items()}
    results = {"stamp": {"date": started.isoformat(timespec="seconds"), "commit": commit, "dtype": dtype,
                         "command": " ".join(["dlite-ray bench-ablation", *sys.argv[2:]]),
                         "minutes": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60},
               "plan": plan, "workloads": list(main["workloads"]), "rows": ablation_rows(main, settings),
               "plain_decoding": plain_decoding(main, settings),
               "per_position": per_position(main, ["dlite", "dlite-tree"]),
               "greedy_mismatches": greedy_mismatches(main, settings)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(results, indent=1))
    (out / "ablation.md").write_text(markdown(results))
    print(markdown(results))
    return results


def _in_own_process(flags: list[str], env: dict[str, str], plan: dict) -> dict:
    """`dlite-ray bench --methods dlite,ar` with `flags` and `env`, on the plan's prompts -> its results."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(setting_command(flags, plan, tmp), env={**os.environ, **env}, check=True)
        return json.loads((Path(tmp) / "results.json").read_text())


def setting_command(flags: list[str], plan: dict, out: str) -> list[str]:
    return [sys.executable, "-m", "dlite_ray.cli", "bench", "--methods", "dlite,ar", "--workload", plan["workload"],
            "--limit", str(plan["limit"]), "--max-new-tokens", str(plan["max_new_tokens"]),
            "--repeats", str(plan["repeats"]), "--out", out, *flags]


def _rows(results: dict, workload: str, method: str) -> list[dict]:
    return results["workloads"][workload][method]["per_prompt"]


def _row(results: dict, method: str) -> dict:
    """Per workload: `method` over ar prompt by prompt, its median decode tokens/s and its tau."""
    cells = {}
    for w, per in results["workloads"].items():
        cells[w] = {"vs_ar": paired_ratio(_rows(results, w, method), _rows(results, w, "ar")),
                    "tokens_per_second": per[method]["tokens_per_second"], "tau": per[method]["mean_accept_length"]}
    return cells


def ablation_rows(main: dict, settings: dict[str, dict]) -> list[dict]:
    rows = [{"name": label, "method": method, "process": "shared", **_row(main, method)}
            for method, label in PIECES.items()]
    rows += [{"name": f"dlite, {name}", "method": "dlite", "process": "own", **_row(results, "dlite")}
             for name, results in settings.items()]
    return rows


def plain_decoding(main: dict, settings: dict[str, dict]) -> dict:
    """Plain decoding's median decode tokens/s per workload, by default and under each setting."""
    runs = {"default": main, **settings}
    return {name: {w: per["ar"]["tokens_per_second"] for w, per in results["workloads"].items()}
            for name, results in runs.items()}


def greedy_mismatches(main: dict, settings: dict[str, dict]) -> dict:
    """Replies that differ from plain decoding's, per row (None: a method not lossless)."""
    counts = {PIECES[name]: m.get("greedy_mismatches") for name, m in main["methods"].items() if name in PIECES}
    counts.update({f"dlite, {name}": r["methods"]["dlite"].get("greedy_mismatches") for name, r in settings.items()})
    return counts


def per_position(results: dict, methods: list[str]) -> dict:
    """P(the k-th proposed token is accepted | the round reached it), over every workload's prompts."""
    out = {}
    for method in methods:
        rows = [r for w in results["workloads"] for r in _rows(results, w, method)]
        k = max((len(r["position_trials"]) for r in rows), default=0)
        accepts = [sum(r["position_accepts"][j] for r in rows if len(r["position_accepts"]) > j) for j in range(k)]
        trials = [sum(r["position_trials"][j] for r in rows if len(r["position_trials"]) > j) for j in range(k)]
        out[method] = [a / t if t else None for a, t in zip(accepts, trials)]
    return out


def readme_table(results: dict) -> str:
    """The ratio table: each row over plain decoding per workload, and its tau (README quotes it)."""
    workloads = results["workloads"]
    lines = ["| | " + " | ".join(workloads) + " | tau: " + " / ".join(workloads) + " |",
             "|---|" + "---|" * (len(workloads) + 1)]
    for row in results["rows"]:
        taus = " / ".join("-" if row[w]["tau"] is None else f"{row[w]['tau']:.2f}" for w in workloads)
        lines.append(f"| {row['name']} | " + " | ".join(ratio_cell(row[w]["vs_ar"]) for w in workloads)
                     + f" | {taus} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    stamp, plan = results["stamp"], results["plan"]
    workloads = results["workloads"]
    lines = [f"# What each piece buys ({stamp['date'][:10]}, commit {stamp['commit']})", "",
             f"`{stamp['command']}`, {stamp['minutes']:.0f} minutes, {stamp['dtype']} unless a row says otherwise: "
             f"workloads {plan['workload']} ({plan['limit']} prompts a workload unless given), "
             f"{plan['max_new_tokens']} new tokens, {plan['repeats']} interleaved repeats, greedy, batch 1.", "",
             "Decode speed over plain decoding's in the same process, prompt by prompt: median (quartiles); "
             "tau in the last column. The first rows share one process and its plain decoding; each of the last "
             f"{len(SETTINGS)} ran in a process of its own, dlite and plain decoding both under its setting.", "",
             readme_table(results)]
    lines += ["", "Median decode tokens/s of each row, then of plain decoding by default and under each setting "
              "(compare across processes with care: they ran one after another):", "",
              "| | " + " | ".join(workloads) + " |", "|---|" + "---|" * len(workloads)]
    for row in results["rows"]:
        lines.append(f"| {row['name']} | " + " | ".join(f"{row[w]['tokens_per_second']:.1f}" for w in workloads) + " |")
    for name, per in results["plain_decoding"].items():
        label = "plain decoding" + ("" if name == "default" else f", {name}")
        lines.append(f"| {label} | " + " | ".join(f"{per[w]:.1f}" for w in workloads) + " |")
    lines += ["", "Per-position acceptance over every prompt, P(position k accepted | reached), k = 1, 2, ..:", ""]
    for method, probs in results["per_position"].items():
        lines.append(f"- {method}: " + " ".join("-" if p is None else f"{p:.2f}" for p in probs))
    mismatches = {n: m for n, m in results["greedy_mismatches"].items() if m}
    lines += ["", "Greedy replies different from plain decoding: "
              + (", ".join(f"{n}: {m}" for n, m in mismatches.items()) if mismatches else "none"), ""]
    return "\n".join(lines)

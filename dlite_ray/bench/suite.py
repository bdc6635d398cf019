"""`dlite-ray bench-suite` (`make bench`): every published figure, remade by one command.

Sections, run one after another on this machine (each writes into one results.json):
1. speed: every workload x dlite, ar and transformers' methods (llama.cpp where its extra
   is installed), interleaved repeats (`runner.measure_all`), with a concurrency sweep and
   agent turns decoded 4 at a time;
2. follow-up turns through gRPC, the conversation held vs evicted (`followup_bench`);
3. served (Ray Serve, gRPC, the draft in its own process) vs library tokens/s (`serve_bench`);
4. memory: a request's draft state and target KV at 1K / 4K / 8K, peak RSS per method (`memory`).
Then report.md and the plots (`report`), stamped with the machine, dtype, commit and date.
`--quick` runs every section small, in a few minutes: a check of the harness, not figures.
"""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from dlite_ray.bench import followup_bench, serve_bench
from dlite_ray.bench.llamacpp import LLAMACPP_METHODS
from dlite_ray.bench.memory import CONTEXTS, measure_draft_memory, measure_peak_rss
from dlite_ray.bench.methods import HF_METHODS
from dlite_ray.bench.report import readme_summary, write_report
from dlite_ray.bench.runner import measure_all
from dlite_ray.engine.engine_config import resolve_dtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    workloads: str  # name or name:limit, comma separated
    limit: int
    max_new_tokens: int
    repeats: int
    concurrency: str
    turns_in_flight: int  # agent turns decoded together, their histories cached (runner.measure_turns_in_flight)
    followup_items: int
    serve_workloads: str
    serve_limit: int
    serve_repeats: int
    memory_contexts: tuple[int, ...]
    rss_methods: tuple[str, ...]


FULL = Plan(workloads="chat,code,tool-use,agentic:2,long-context:2,structured:4,forced-tools:4", limit=3,
            max_new_tokens=96, repeats=3, concurrency="1,4,16,32", turns_in_flight=4, followup_items=2,
            serve_workloads="chat,code", serve_limit=2, serve_repeats=2, memory_contexts=CONTEXTS,
            rss_methods=("dlite", "ar", *HF_METHODS))
QUICK = Plan(workloads="chat:1,agentic:1,structured:1", limit=1, max_new_tokens=24, repeats=1,
             concurrency="1,4", turns_in_flight=2, followup_items=1, serve_workloads="chat", serve_limit=1,
             serve_repeats=1,
             memory_contexts=(1024,), rss_methods=("dlite",))


def run(args) -> dict:
    plan = QUICK if args.quick else FULL
    dtype = resolve_dtype(args.dtype, "cpu")
    commit = git_commit()  # the code measured: taken now, not after a run that may outlast a commit
    started = time.perf_counter()
    timings = {}
    partial = Path(args.out) / "results.partial.json"  # what a failed or stopped run had measured
    results: dict = {}

    def section(name, fn):
        """Run one section into `results` (the speed section's keys at the top level)."""
        t0 = time.perf_counter()
        log.info("bench-suite: %s", name)
        out = fn()
        if name == "speed":
            results.update(out)
        else:
            results[name] = out
        timings[name] = time.perf_counter() - t0
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(results, default=str))

    methods = _methods(args.quick)
    speed_args = SimpleNamespace(workload=plan.workloads, methods=",".join(methods), target=None,
                                 draft="default", draft_b="default", dtype=dtype, limit=plan.limit,
                                 max_new_tokens=plan.max_new_tokens, repeats=plan.repeats,
                                 concurrency=plan.concurrency, turns_in_flight=plan.turns_in_flight,
                                 out=args.out)
    section("speed", lambda: measure_all(speed_args))
    section("followup", lambda: followup_bench.run(SimpleNamespace(
        limit=plan.followup_items, max_tokens=16, kv_tokens=12288, dtype=dtype)))
    section("served", lambda: serve_bench.run(SimpleNamespace(
        workload=plan.serve_workloads, limit=plan.serve_limit, repeats=plan.serve_repeats,
        max_new_tokens=plan.max_new_tokens, cpu_threads=None, dtype=dtype)))
    section("memory", lambda: {
        "draft": measure_draft_memory(None, "default", dtype, plan.memory_contexts),
        "peak_rss": measure_peak_rss(list(plan.rss_methods), dtype)})
    results["stamp"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "commit": commit, "dtype": dtype, "quick": args.quick,
                        "command": "make bench" + (" ARGS=--quick" if args.quick else ""),
                        "llama_cpp": any(m in LLAMACPP_METHODS for m in methods),
                        "minutes": (time.perf_counter() - started) / 60,
                        "section_minutes": {k: v / 60 for k, v in timings.items()}}
    write_report(results, Path(args.out))
    partial.unlink()
    print(readme_summary(results))
    log.info("bench-suite: wrote %s in %.1f min", args.out, results["stamp"]["minutes"])
    return results


def _methods(quick: bool) -> list[str]:
    """dlite, ar and transformers' methods; llama.cpp too where its extra is installed."""
    if quick:
        return ["dlite", "ar", "hf"]
    methods = ["dlite", "ar", *HF_METHODS]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        log.info("llama-cpp-python is not installed (pip install -e '.[llamacpp]'): no llama.cpp rows")
    else:
        methods += list(LLAMACPP_METHODS)
    return methods


def git_commit() -> str:
    """HEAD, marked dirty where tracked files other than the bench's own outputs differ from it."""
    repo = Path(__file__).resolve().parents[2]

    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, check=False, cwd=repo).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/bench") else "")

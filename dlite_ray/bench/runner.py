"""`dlite-ray bench`: every method on the same prompts, interleaved, in one run.

A workload is named alone or with its own prompt count ("agentic:2"); methods that cannot
decode under a grammar (transformers', llama.cpp) skip the constrained workloads.

Methods run prompt by prompt in turn (the machine is shared and noisy), after a warm-up,
`--repeats` times; per-prompt figures are medians. Greedy outputs of every method on our
runtime are compared with its plain decoding and any mismatch is reported; other runtimes
(transformers, llama.cpp: other kernels, other rounding) get the share of identical replies.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from tqdm import tqdm

from dlite_ray.bench.llamacpp import LLAMACPP_METHODS, LlamaCppMethod, bf16_copy
from dlite_ray.bench.machine import machine_info
from dlite_ray.bench.methods import HF_METHODS, EngineMethod, Run, hf_method, hf_target
from dlite_ray.bench.oracle import OracleDraftTransport
from dlite_ray.bench.ramp import measure_ramp
from dlite_ray.bench.report import paired_ratio_line, write_report
from dlite_ray.bench.stats import percentile, quartiles
from dlite_ray.bench.workloads import Item, load_workload
from dlite_ray.constants import DEFAULT_LOOKUP_TOKENS, TREE_TOKENS
from dlite_ray.engine.engine import DLiteEngine, GenerationResult
from dlite_ray.engine.engine_config import EngineConfig, resolve_dtype
from dlite_ray.engine.loading import default_draft_dir, load_corpus, load_draft
from dlite_ray.engine.reply_corpus import ReplyCorpus
from dlite_ray.runtime.model_store import default_gguf_path
from dlite_ray.training.prompts import tool_turn

log = logging.getLogger(__name__)
ALL_METHODS = ("dlite", "ar", "hf", "hf-prompt-lookup", "hf-assisted", "oracle", "dlite-nocache", "dlite-b",
               "dlite-nolookup", "dlite-corpus", "dlite-tree", "dlite-fixed", "lookup", *LLAMACPP_METHODS)
CONCURRENCY_MAX_PROMPT = 1024  # longer prompts are agent histories: swept apart, prefix-cached


class BenchRequest(NamedTuple):
    id: str
    tag: str
    ids: list[int]
    grammar: str | None = None  # every method that runs it decodes under this grammar


def run(args) -> dict:
    """`dlite-ray bench`: measure, then write results.json, report.md and the plots."""
    results = measure_all(args)
    write_report(results, Path(args.out))
    _print_table(results)
    return results


def measure_all(args) -> dict:
    methods_wanted = [m.strip() for m in args.methods.split(",")]
    unknown = set(methods_wanted) - set(ALL_METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {', '.join(ALL_METHODS)}")
    args.dtype = resolve_dtype(args.dtype, "cpu")  # every method in the dtype "auto" picks here
    dlite = DLiteEngine.from_pretrained(args.target, args.draft, dtype=args.dtype)
    ar = DLiteEngine(dlite.target, dlite.tokenizer, None)
    workloads = dict(_workload_limit(w, args.limit) for w in args.workload.split(","))
    # References come from an engine of their own: the measured engines must see the same
    # requests in the same order, or their prefix caches hold prompt KV computed in other
    # chunks, which rounds differently in bf16 (plain decoding itself then differs in ties).
    reference = DLiteEngine(dlite.target, dlite.tokenizer, None)
    prompts = {w: expand(load_workload(w, n), reference, args.max_new_tokens) for w, n in workloads.items()}
    del reference
    methods = build_methods(methods_wanted, dlite, ar, prompts, args)
    results = {"machine": machine_info(), "args": vars(args), "workloads": {}, "skipped": {}}
    for w, items in prompts.items():
        able = methods_for(methods, items)
        results["skipped"][w] = sorted(set(methods) - set(able))
        results["workloads"][w] = measure(able, items, args)
    results["methods"] = _overall(results["workloads"])
    results["ratios"] = _ratios(results["workloads"])
    results["paired_ratios"] = _paired_ratios(results["workloads"])
    results["paired_ratios_by_workload"] = _paired_ratios_by_workload(results["workloads"])
    free = [r.ids for w in prompts.values() for r in w if r.grammar is None]  # batched: no grammar
    short = [ids for ids in free if len(ids) <= CONCURRENCY_MAX_PROMPT]
    histories = [ids for ids in free if len(ids) > CONCURRENCY_MAX_PROMPT]
    if args.concurrency:
        levels = [int(c) for c in str(args.concurrency).split(",")]
        if not short and not histories:
            raise SystemExit("--concurrency needs requests without a grammar: add a workload such as chat, "
                             "code, tool-use, agentic or long-context")
        if short:  # fresh requests: no prefix cache, every level pays its own prefill
            results["concurrency"] = measure_concurrency(_pair(dlite, prefix_cache=False), short, levels,
                                                         args.max_new_tokens, args.repeats)
            results["concurrency_max_prompt"] = CONCURRENCY_MAX_PROMPT
        if histories:  # an agent loop's next turns: their histories already in the prefix cache
            results["concurrency_agent"] = measure_concurrency(_pair(dlite, prefix_cache=True), histories, levels,
                                                               args.max_new_tokens, args.repeats, warm_prompts=True)
            for n, level in results["concurrency_agent"].items():
                level["prompt_tokens"] = sorted({len(histories[i % len(histories)]) for i in range(int(n))})
    if getattr(args, "ramp", None):
        results["ramp"] = measure_ramp(_pair(dlite, prefix_cache=False), short or free, args.ramp,
                                       args.max_new_tokens, args.repeats)
    if args.turns_in_flight:
        results["turns_in_flight"] = measure_turns_in_flight(dlite, prompts, args.turns_in_flight,
                                                             args.max_new_tokens, args.repeats)
    return results


def _pair(dlite: DLiteEngine, prefix_cache: bool) -> dict[str, DLiteEngine]:
    """dlite and plain decoding ("ar") on the same target, fresh schedulers and policies."""
    return {name: DLiteEngine(dlite.target, dlite.tokenizer, draft, lookup_tokens=lookup,
                              enable_prefix_cache=prefix_cache, corpus=dlite.corpus)
            for name, draft, lookup in (("dlite", dlite.draft, dlite.lookup_tokens), ("ar", None, 0))}


def measure_turns_in_flight(dlite: DLiteEngine, prompts: dict[str, list[BenchRequest]], n: int,
                            max_new_tokens: int, repeats: int) -> dict:
    """The agentic workload's turns, n at a time, each engine with its prefix cache and the
    turns' histories already in it, as an agent's next turn finds its earlier ones: what DLite
    is for, batched (the concurrency sweep sends short requests, fresh)."""
    turns = [r.ids for r in prompts.get("agentic", [])]
    if not turns:
        raise SystemExit("--turns-in-flight needs the agentic workload")
    engines = _pair(dlite, prefix_cache=True)
    out = measure_concurrency(engines, turns, [n], max_new_tokens, repeats, warm_prompts=True)[str(n)]
    out["prompt_tokens"] = sorted(len(turns[i % len(turns)]) for i in range(n))  # the batch cycles the turns
    return {str(n): out}


def _workload_limit(spec: str, default: int) -> tuple[str, int]:
    """"agentic:2" -> ("agentic", 2); "chat" -> ("chat", default)."""
    name, _, limit = spec.strip().partition(":")
    return name, int(limit) if limit else default


def methods_for(methods: dict, items: list[BenchRequest]) -> dict:
    """The methods that can run every request of a workload: under a grammar, only ours."""
    needs_grammar = any(r.grammar is not None for r in items)
    return {n: m for n, m in methods.items() if m.grammar or not needs_grammar}


def expand(items: list[Item], ar: DLiteEngine, max_new_tokens: int) -> list[BenchRequest]:
    """One measured request per item, and per later turn of an agentic item: its history
    grown with the *reference* replies, so every method sees the same."""
    out = []
    for item in items:
        ids = ar.encode(item.payload)
        out.append(BenchRequest(item.id, item.tag or "turn-1", ids, item.grammar))
        messages = list(item.messages or [])
        for turn, text in enumerate(item.later_turns, start=2):
            reply = ar.generate(ar.encode(messages), max_new_tokens=max_new_tokens)[0]
            messages += [{"role": "assistant", "content": reply.text}, tool_turn(text)]
            ids = ar.encode(messages)
            if len(ids) + max_new_tokens >= ar.runner.max_context:
                break
            out.append(BenchRequest(f"{item.id}#{turn}", f"turn-{turn}", ids))
    return out


def build_methods(names: list[str], dlite: DLiteEngine, ar: DLiteEngine, prompts, args) -> dict:
    methods: dict = {}
    hf = hf_target(args.target, args.dtype) if any(n in HF_METHODS for n in names) else None
    lookup = dlite.lookup_tokens  # context lookup as in `dlite`, unless the method is about it
    corpus = dlite.corpus  # the reply corpus too, where it is on (None: off)
    for name in names:
        if name == "dlite":
            methods[name] = EngineMethod(name, dlite)
        elif name == "dlite-b":  # another draft (--draft-b) on the same target: two drafts side by side
            draft_b = default_draft_dir() if args.draft_b == "default" else args.draft_b
            if draft_b is None:
                raise ValueError("dlite-b: no default draft is shipped here; give --draft-b a draft directory")
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer,
                                                           load_draft(draft_b, dlite.target, args.dtype),
                                                           lookup_tokens=lookup,
                                                           corpus=ReplyCorpus.load(draft_b) if corpus else None))
        elif name == "dlite-nocache":  # the same draft, no prefix cache / stored boundaries
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft,
                                                           lookup_tokens=lookup, enable_prefix_cache=False,
                                                           corpus=corpus))
        elif name == "dlite-nolookup":  # the DLite draft alone: no tokens copied from the context
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft,
                                                           lookup_tokens=0))
        elif name == "dlite-corpus":  # with copies from the draft's reply corpus too
            on = EngineConfig(target=args.target, draft=args.draft, reply_corpus=True)
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft,
                                                           lookup_tokens=lookup, reply_corpus=True,
                                                           corpus=load_corpus(on)))
        elif name == "dlite-tree":  # with tree verification: the draft's runners-up and other copies as branches
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft,
                                                           lookup_tokens=lookup, tree_tokens=TREE_TOKENS,
                                                           corpus=corpus))
        elif name == "dlite-fixed":  # the same draft at its full length every round: no adaptive policy
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft,
                                                           lookup_tokens=lookup, adaptive_draft_length=False,
                                                           corpus=corpus))
        elif name == "lookup":  # tokens copied from the context alone: no DLite draft
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer, None,
                                                           lookup_tokens=lookup or DEFAULT_LOOKUP_TOKENS))
        elif name == "ar":
            methods[name] = EngineMethod(name, ar)
        elif name == "oracle":
            refs = [r.ids + ar.generate(r.ids, max_new_tokens=args.max_new_tokens, grammar=r.grammar)[0].token_ids
                    for items in prompts.values() for r in items]
            methods[name] = EngineMethod(name, DLiteEngine(dlite.target, dlite.tokenizer, OracleDraftTransport(refs),
                                                           lookup_tokens=0))  # the draft's ceiling, alone
        elif name in HF_METHODS:
            methods[name] = hf_method(name, hf)
        elif name in LLAMACPP_METHODS:
            gguf = _target_gguf(args.target)
            methods[name] = LlamaCppMethod(name, bf16_copy(gguf) if name == "llama.cpp-bf16" else gguf,
                                           dlite.eos_ids, dlite.runner.max_context)
    return methods


def _target_gguf(target: str | None) -> Path:
    """The GGUF file llama.cpp reads: the target's own (the default model's is cached)."""
    if target is None:
        return default_gguf_path()
    if Path(target).suffix != ".gguf":
        raise SystemExit(f"llama.cpp reads GGUF files; --target {target} is not one")
    return Path(target)


def measure(methods: dict, items: list[BenchRequest], args) -> dict:
    """Every method on every request, `args.repeats` times, the methods taking turns per
    request (their order reversed on every other repeat), after a warm-up."""
    warm_up = items[0]._replace(ids=items[0].ids[:16])  # a prefix: the measured prompts stay uncached
    for m in methods.values():
        _run(m, warm_up, 8)
    rows: dict[str, list[dict]] = {name: [] for name in methods}
    for request in tqdm(items, desc="prompts", unit="prompt"):
        runs: dict[str, list[Run]] = {name: [] for name in methods}
        for rep in range(args.repeats):
            order = list(methods.items()) if rep % 2 == 0 else list(methods.items())[::-1]
            for name, m in order:
                runs[name].append(_run(m, request, args.max_new_tokens))
        reference = runs["ar"][0].token_ids if "ar" in runs else None
        for name, rs in runs.items():
            r0 = rs[0]
            rows[name].append({
                "id": request.id, "tag": request.tag, "prompt_tokens": len(request.ids),
                "new_tokens": len(r0.token_ids),
                "decode_tps": statistics.median(r.decode_tps for r in rs),
                "e2e_tps": statistics.median(r.e2e_tps for r in rs),
                # a prompt's first run: later repeats find it in our engines' prefix cache
                "ttft_s": r0.ttft_s, "latency_s": r0.latency_s,
                "accept_lengths": r0.accept_lengths, "copied_rounds": r0.copied_rounds,
                "branch_gains": r0.branch_gains,
                "position_accepts": r0.position_accepts,
                "position_trials": r0.position_trials,
                "draft_time": statistics.median(r.draft_time for r in rs),
                "verify_time": statistics.median(r.verify_time for r in rs),
                "decode_time": statistics.median(r.decode_time for r in rs),
                "lossless": methods[name].lossless,
                "matches_ar": None if reference is None else r0.token_ids == reference,
                "first_mismatch": None if reference is None else _first_mismatch(r0.token_ids, reference),
            })
    return {name: summarize(rs) for name, rs in rows.items()}


def _run(method, request: BenchRequest, max_new_tokens: int) -> Run:
    if request.grammar is None:  # transformers' and llama.cpp's methods take no grammar
        return method.run(request.ids, max_new_tokens)
    return method.run(request.ids, max_new_tokens, grammar=request.grammar)


def summarize(rows: list[dict]) -> dict:
    lengths = [a for r in rows for a in r["accept_lengths"]]
    copied = [c for r in rows for c in r["copied_rounds"]]
    gains = [g for r in rows for g in r.get("branch_gains", [])]
    k = max((len(r["position_trials"]) for r in rows), default=0)
    accepts = [sum(r["position_accepts"][j] for r in rows if len(r["position_accepts"]) > j) for j in range(k)]
    trials = [sum(r["position_trials"][j] for r in rows if len(r["position_trials"]) > j) for j in range(k)]
    speeds = [r["decode_tps"] for r in rows]
    latencies = [r["latency_s"] for r in rows if "latency_s" in r]
    return {
        "tokens_per_second": statistics.median(speeds),
        "tokens_per_second_quartiles": quartiles(speeds),
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "requests": len(rows),
        "e2e_tokens_per_second": statistics.median(r["e2e_tps"] for r in rows),
        "ttft_s": statistics.median(r["ttft_s"] for r in rows),
        "mean_accept_length": _mean(lengths),
        # rounds that copied from the context vs rounds the DLite draft drafted
        "copied_round_share": _mean(copied),
        "mean_accept_length_copied": _mean([a for a, c in zip(lengths, copied) if c]),
        "mean_accept_length_drafted": _mean([a for a, c in zip(lengths, copied) if not c]),
        "per_position_acceptance": [a / t if t else None for a, t in zip(accepts, trials)],
        # rounds where another branch of a tree went further than the main proposal, and by how much
        "branch_round_share": _mean([g > 0 for g in gains]),
        "branch_gain_per_round": _mean(gains),
        # a lossy method's replies (other kernels, other weights) are compared, not counted as errors
        "greedy_mismatches": (sum(1 for r in rows if r["matches_ar"] is False)
                              if all(r["lossless"] for r in rows) else None),
        "same_replies_as_ar": _mean([r["matches_ar"] for r in rows if r["matches_ar"] is not None]),
        "by_tag": _by_tag(rows),
        "per_prompt": rows,
    }


def _by_tag(rows: list[dict]) -> dict:
    """Per tag (an agentic turn, a context bucket): median decode tokens/s, tau, prompt tokens."""
    out = {}
    for tag in dict.fromkeys(r["tag"] for r in rows):
        mine = [r for r in rows if r["tag"] == tag]
        lengths = [a for r in mine for a in r["accept_lengths"]]
        out[tag] = {"tokens_per_second": statistics.median(r["decode_tps"] for r in mine),
                    "mean_accept_length": _mean(lengths), "prompts": len(mine),
                    "prompt_tokens": statistics.median(r["prompt_tokens"] for r in mine)}
    return out


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None


def measure_concurrency(engines: dict[str, DLiteEngine], items: list[list[int]], levels: list[int],
                        max_new_tokens: int, repeats: int = 1, warm_prompts: bool = False) -> dict:
    """N requests in flight through the continuous-batching engine: throughput (generated
    tokens / wall time), decode-phase throughput (the tokens after each request's first round
    over the time from the first request's first token to the last one's last: the per-prompt
    table's decode tokens/s, for a batch; prefill, which both engines pay alike, is out) and
    request latency (mean, p50, p99), each engine on the same requests, engines alternating,
    medians over `repeats`; and how many of the last repeat's replies differ between the
    engines (greedy: none may). `warm_prompts`: each engine first runs the batch for one token,
    so that engines with a prefix cache find the prompts in it."""
    out: dict = {}
    for n in levels:
        batch = [items[i % len(items)] for i in range(n)]
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        warm_up, warm_tokens = (batch, 1) if warm_prompts else (batch[:1], 4)
        for engine in engines.values():
            engine.generate(warm_up, max_new_tokens=warm_tokens)
        replies: dict[str, list[list[int]]] = {}
        for rep in range(repeats):
            order = list(engines.items()) if rep % 2 == 0 else list(reversed(engines.items()))
            for name, engine in order:
                start = time.perf_counter()
                results = engine.generate(batch, max_new_tokens=max_new_tokens)
                wall = time.perf_counter() - start
                replies[name] = [r.token_ids for r in results]
                latencies = [_latency(r) for r in results]
                runs[name].append({
                    "tokens_per_second": sum(len(r.token_ids) for r in results) / wall,
                    "decode_tokens_per_second": _decode_phase_rate(results),
                    "mean_latency_s": statistics.mean(latencies),
                    "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
                    "mean_accept_length": statistics.mean(r.stats.mean_accept_length for r in results)})
        out[str(n)] = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        ratio = out[str(n)]["dlite"]["tokens_per_second"] / out[str(n)]["ar"]["tokens_per_second"]
        out[str(n)]["dlite/ar"] = ratio
        out[str(n)]["dlite/ar decode"] = (out[str(n)]["dlite"]["decode_tokens_per_second"]
                                          / out[str(n)]["ar"]["decode_tokens_per_second"])
        out[str(n)]["greedy_mismatches"] = sum(d != a for d, a in zip(replies["dlite"], replies["ar"]))
        print(f"concurrency {n:>3}: dlite {out[str(n)]['dlite']['tokens_per_second']:.1f} tok/s, "
              f"ar {out[str(n)]['ar']['tokens_per_second']:.1f} tok/s, ratio {ratio:.2f}x")
    return out


def _latency(result: GenerationResult) -> float:
    """Seconds from a request's arrival to its last token."""
    if result.stats.ttft is None:  # a reply ended before its first token: nothing to time
        raise RuntimeError(f"a reply without a first token ({result.finish_reason}: {result.error})")
    return result.stats.ttft + result.stats.decode_wall_time


def _decode_phase_rate(results: list) -> float:
    """A batch's tokens after each request's first round, over the time from the first
    request's first token to the last request's last (all arrived together)."""
    tokens = sum(len(r.token_ids) - (r.stats.accept_lengths[0] if r.stats.accept_lengths else 0) for r in results)
    start = min(r.stats.ttft for r in results)
    end = max(r.stats.ttft + r.stats.decode_wall_time for r in results)
    return tokens / (end - start) if end > start else 0.0


def _overall(workloads: dict) -> dict:
    """Per method, over the workloads it ran (a grammar-constrained one runs ours only)."""
    names = dict.fromkeys(n for w in workloads.values() for n in w)
    out = {}
    for name in names:
        rows = [r for w in workloads.values() if name in w for r in w[name]["per_prompt"]]
        out[name] = {k: v for k, v in summarize(rows).items() if k not in ("per_prompt", "by_tag")}
    return out


def _shared_rows(workloads: dict) -> dict[str, tuple[list[dict], list[dict]]]:
    """Per other method: dlite's and its per-prompt rows, over the workloads both ran."""
    out = {}
    for name in dict.fromkeys(n for w in workloads.values() for n in w):
        both = [w for w in workloads.values() if "dlite" in w and name in w]
        if name != "dlite" and both:
            out[name] = ([r for w in both for r in w["dlite"]["per_prompt"]],
                         [r for w in both for r in w[name]["per_prompt"]])
    return out


def _ratios(workloads: dict) -> dict:
    """dlite's median decode tokens/s over each method's, both over the workloads both ran."""
    out = {}
    for name, (mine, theirs) in _shared_rows(workloads).items():
        theirs_median = statistics.median(r["decode_tps"] for r in theirs)
        if theirs_median:
            out[f"dlite/{name}"] = statistics.median(r["decode_tps"] for r in mine) / theirs_median
    return out


def _paired_ratios(workloads: dict) -> dict:
    """dlite against each other method prompt by prompt (both ran each prompt back to back),
    which a shared machine's drifting speed disturbs less than a ratio of two medians:
    the median and quartiles of the per-prompt ratios, and total tokens over total time."""
    ratios = {f"dlite/{name}": paired_ratio(*rows) for name, rows in _shared_rows(workloads).items()}
    return {k: r for k, r in ratios.items() if r is not None}


def _paired_ratios_by_workload(workloads: dict) -> dict:
    return {w: _paired_ratios({w: per}) for w, per in workloads.items()}


def paired_ratio(mine: list[dict], theirs: list[dict]) -> dict | None:
    """Median and quartiles of the per-prompt decode-speed ratios, and their totals' ratio."""
    ratios = [a["decode_tps"] / b["decode_tps"] for a, b in zip(mine, theirs, strict=True)
              if a["decode_tps"] and b["decode_tps"]]
    if len(ratios) < 2:
        return None
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return {"median": median, "quartiles": [q1, q3], "total": _total_rate(mine) / _total_rate(theirs)}


def _total_rate(rows: list[dict]) -> float:
    """Decode tokens (after the first) over decode time, summed over the prompts."""
    return sum(r["new_tokens"] - 1 for r in rows) / sum(r["decode_time"] for r in rows)


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _print_table(results: dict) -> None:
    print(f"machine: {results['machine']['cpu']} ({results['machine']['torch_threads']} threads)")
    names = list(results["methods"])
    print(f"{'workload':<14}" + "".join(f"{n:>18}" for n in names) + "   (decode tokens/s, median; tau)")
    for w, per in results["workloads"].items():
        cells = []
        for n in names:
            if n not in per:
                cells.append("n/a" + " " * 7)
                continue
            tau = per[n]["mean_accept_length"]
            cells.append(f"{per[n]['tokens_per_second']:>10.1f}" + (f" ({tau:4.2f})" if tau else " " * 7))
        print(f"{w:<14}" + "".join(f"{c:>18}" for c in cells))
    print("ratios: " + ", ".join(f"{k} = {v:.2f}x" for k, v in results["ratios"].items()))
    for k, v in results["paired_ratios"].items():
        print(paired_ratio_line(k, v))
    for n, m in results["methods"].items():
        if m.get("copied_round_share"):
            drafted = m["mean_accept_length_drafted"]
            print(f"{n}: {m['copied_round_share']:.0%} of rounds copied from the context (tau "
                  f"{m['mean_accept_length_copied']:.2f}), the rest drafted (tau "
                  + (f"{drafted:.2f})" if drafted else "-)"))
        if m.get("branch_round_share"):
            print(f"{n}: in {m['branch_round_share']:.0%} of rounds another branch of the tree went further "
                  f"than the main proposal ({m['branch_gain_per_round']:.2f} tokens a round on average)")
        if any(m["per_position_acceptance"]):
            print(f"{n}: per-position acceptance of the draft "
                  + " ".join("-" if a is None else f"{a:.2f}" for a in m["per_position_acceptance"]))
    mism = {n: m["greedy_mismatches"] for n, m in results["methods"].items() if m["greedy_mismatches"]}
    print(f"greedy outputs differing from plain decoding: {mism or 'none'}")
    for n, m in results["methods"].items():
        if m["greedy_mismatches"] is None and m["same_replies_as_ar"] is not None:
            print(f"{n} (other kernels than ours): {m['same_replies_as_ar']:.0%} of greedy replies identical")

"""results.json, report.md and the plots of a benchmark run.

Every section is drawn from results.json alone and appears only where the run measured it
(`dlite-ray bench` measures speed; `make bench` adds the concurrency sweep, follow-up turns,
served vs library and memory).
"""

from __future__ import annotations

import json
from pathlib import Path

from dlite_ray.bench.plots import draw_plots

MIB = 2**20


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plots = draw_plots(results, out)
    (out / "report.md").write_text(_markdown(results, plots))


def _markdown(results: dict, plots: list[str]) -> str:
    names = list(results["methods"])
    lines = ["# dlite-ray benchmark", "", *_header(results), ""]
    lines += ["## Summary (what the README quotes)", "", readme_summary(results), "## Speed, batch 1", ""]
    lines += _headline(results)
    lines += _speed_table(results, names)
    lines += _overall_table(results)
    lines += ["Ratios of the overall medians (decode tokens/s): "
              + ", ".join(f"{k} = {v:.2f}x" for k, v in results["ratios"].items()), ""]
    lines += [line for k, v in results.get("paired_ratios", {}).items() for line in (paired_ratio_line(k, v), "")]
    lines += _by_tag(results)
    lines += _round_times(results, names)
    lines += _acceptance(results)
    lines += _skipped(results)
    lines += _concurrency(results.get("concurrency"), results.get("concurrency_max_prompt"))
    lines += _concurrency_agent(results.get("concurrency_agent"))
    lines += _ramp(results.get("ramp"))
    lines += _turns_in_flight(results.get("turns_in_flight"))
    lines += _followup(results.get("followup"))
    lines += _served(results.get("served"))
    lines += _memory(results.get("memory"))
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def readme_summary(results: dict) -> str:
    """The figures the README quotes, drawn from results.json alone (a test holds the README to
    them): decode tokens/s per workload and method, dlite/ar prompt by prompt, and one line per
    other section."""
    names = list(results["methods"])
    by_workload = results.get("paired_ratios_by_workload") or {}
    lines = ["| workload | " + " | ".join(names) + " | dlite/ar per prompt |", "|---" * (len(names) + 2) + "|"]
    for w, per in results["workloads"].items():
        cells = [_speed_cell(per.get(n)) for n in names]
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {ratio_cell(by_workload.get(w, {}).get('dlite/ar'))} |")
    lines.append("")
    sweep, followup, served, memory = (results.get(k) for k in ("concurrency", "followup", "served", "memory"))
    if sweep:
        lines.append("- requests in flight, dlite/ar generated tokens/s end to end (decode phase): "
                     + ", ".join(f"{n}: {level['dlite/ar']:.2f}x{_decode_ratio(level)}" for n, level in sweep.items()))
    for n, level in (results.get("turns_in_flight") or {}).items():
        lines.append(f"- agent turns {n} in flight, their histories cached, dlite/ar in the decode phase: "
                     f"{level['dlite/ar decode']:.2f}x (tau {level['dlite']['mean_accept_length']:.2f}; "
                     f"end to end {level['dlite/ar']:.2f}x)")
    if followup:
        lines.append(f"- an agent's follow-up turn through gRPC, time to first token: "
                     f"{followup['held_ttft_median_s']:.2f} s with its KV held, "
                     f"{followup['evicted_ttft_median_s']:.2f} s evicted (medians)")
    if served:
        lines.append(f"- served through Ray Serve and gRPC (the draft in its own process): {served['ratio']:.0%} "
                     f"of the library's decode tokens/s, {len(served['mismatched_replies'])} of "
                     f"{served['requests']} replies different")
    if memory:
        last = memory["draft"]["rows"][-1]
        lines.append(f"- at {last['context']:,} tokens a request holds {last['dlite_draft_bytes'] / 1024:.1f} KiB "
                     f"of DLite draft state against {last['kv_draft_bytes'] / MIB:.1f} MiB of KV for a draft "
                     f"that keeps its history; beside them {last.get('python_bytes', 0) / MIB:.1f} MiB of Python "
                     f"state, its context-lookup index above all, and the target's KV: "
                     f"{last['target_kv_bytes'] / MIB:.1f} MiB")
    mismatches = {n: m["greedy_mismatches"] for n, m in results["methods"].items() if m["greedy_mismatches"]}
    batched = sum(level.get("greedy_mismatches", 0) for key in ("concurrency", "concurrency_agent", "turns_in_flight")
                  for level in (results.get(key) or {}).values())
    batched += (results.get("ramp") or {}).get("greedy_mismatches", 0)
    if batched:
        mismatches["dlite in flight"] = batched
    lines.append("- greedy replies different from plain decoding: "
                 + (", ".join(f"{n} {k}" for n, k in mismatches.items()) if mismatches else "none"))
    return "\n".join(lines) + "\n"


def _speed_cell(summary: dict | None) -> str:
    if summary is None:
        return "n/a"
    return f"{summary['tokens_per_second']:.1f}" + _tau(summary)


def _tau(summary: dict) -> str:
    """" (tau)" where the method speculated (drafted or copied); nothing for plain decoding."""
    drafted = any(a is not None for a in summary.get("per_position_acceptance") or [])
    tau = summary.get("mean_accept_length")
    return f" ({tau:.2f})" if tau and (drafted or summary.get("copied_round_share")) else ""


def _header(results: dict) -> list[str]:
    m, stamp = results["machine"], results.get("stamp")
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}."]
    if stamp:
        lines[0] += (f" Made by `{stamp['command']}` on {stamp['date']} at commit {stamp['commit']}, in "
                     f"{stamp['minutes']:.0f} minutes; dtype {stamp['dtype']}.")
        if stamp["quick"]:
            lines.append("**A quick run: a check of the harness, too small to quote.**")
        if not stamp.get("llama_cpp") and not stamp["quick"]:
            lines.append("llama.cpp was not measured: llama-cpp-python is not installed "
                         "(`pip install -e '.[llamacpp]'`; its rows are in docs/bench/cpu-step.md).")
    args = results["args"]
    if {"methods", "dtype"} <= set(args):
        lines.append(f"Methods `{args['methods']}`, dtype {args['dtype']}, draft {args.get('draft', 'default')}.")
    if {"workload", "limit", "max_new_tokens", "repeats"} <= set(args):
        lines.append(f"Speed settings: workloads `{args['workload']}` (prompts each, default {args['limit']}), "
                     f"{args['max_new_tokens']} new tokens, {args['repeats']} interleaved repeats (per-prompt "
                     "figures are their medians), greedy, batch 1. TTFT and latency are each prompt's first "
                     "run: later repeats find its prompt in our engines' prefix cache, and an agent's later turn "
                     "finds its earlier turns there, as a conversation does; transformers' methods have no such "
                     "cache.")
    return lines


def _headline(results: dict) -> list[str]:
    """dlite against every other method per workload: per-prompt speed ratios."""
    by_workload = results.get("paired_ratios_by_workload") or {}
    others = list(dict.fromkeys(k for per in by_workload.values() for k in per))
    if not others:
        return []
    lines = ["dlite's decode speed over each method's, prompt by prompt: median (quartiles):", "",
             "| workload | " + " | ".join(others) + " |", "|---" * (len(others) + 1) + "|"]
    for w, per in by_workload.items():
        cells = [ratio_cell(per.get(k)) for k in others]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines + [""]


def ratio_cell(ratio: dict | None) -> str:
    if ratio is None:
        return "-"
    q1, q3 = ratio["quartiles"]
    return f"{ratio['median']:.2f}x ({q1:.2f}-{q3:.2f})"


def _speed_table(results: dict, names: list[str]) -> list[str]:
    lines = [("Decode tokens/s (median over prompts, quartiles below it; tokens after the first / time from "
              "first to last token), mean accept length tau = E[A + 1] in parentheses:"), "",
             "| workload | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for w, per in results["workloads"].items():
        cells = []
        for n in names:
            if n not in per:
                cells.append("n/a")
                continue
            q = per[n].get("tokens_per_second_quartiles")
            cells.append(_speed_cell(per[n]) + (f"<br>{q[0]:.0f}-{q[1]:.0f}" if q else ""))
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    return lines + [""]


def _overall_table(results: dict) -> list[str]:
    lines = [("| overall | requests | tokens/s | e2e tokens/s | TTFT s | latency p50 / p99 s | tau | rounds copied "
              "from the context (their tau) | greedy mismatches |"), "|---|---|---|---|---|---|---|---|---|"]
    for n, s in results["methods"].items():
        tau = _tau(s).strip(" ()") or "-"
        copied = (f"{s['copied_round_share']:.0%} ({s['mean_accept_length_copied']:.2f})"
                  if s.get("copied_round_share") else "-")
        latency = (f"{s['latency_p50_s']:.2f} / {s['latency_p99_s']:.2f}"
                   if s.get("latency_p50_s") is not None else "-")
        mismatches = s["greedy_mismatches"]
        if mismatches is None:
            same = s["same_replies_as_ar"]
            mismatches = "other kernels" + ("" if same is None else f": {same:.0%} of replies identical to ar's")
        lines.append(f"| {n} | {s.get('requests', '-')} | {s['tokens_per_second']:.1f} | "
                     f"{s['e2e_tokens_per_second']:.1f} | {s['ttft_s']:.3f} | {latency} | {tau} | {copied} | "
                     f"{mismatches} |")
    return lines + [""]


def paired_ratio_line(name: str, ratio: dict) -> str:
    q1, q3 = ratio["quartiles"]
    return (f"{name} prompt by prompt: median {ratio['median']:.2f}x (quartiles {q1:.2f}x-{q3:.2f}x), "
            f"total tokens over total time {ratio['total']:.2f}x")


def _by_tag(results: dict) -> list[str]:
    """Workloads with several kinds of request (agent turns, context buckets), kind by kind."""
    lines = []
    for w, per in results["workloads"].items():
        names = [n for n in per if per[n].get("by_tag")]
        tags = list(per[names[0]]["by_tag"]) if names else []
        if len(tags) < 2:
            continue
        lines += [f"{w}, request by kind: decode tokens/s (median), tau in parentheses, and the prompt length:", "",
                  "| kind | prompt tokens | requests | " + " | ".join(names) + " |",
                  "|---" * (len(names) + 3) + "|"]
        for tag in tags:
            first = per[names[0]]["by_tag"][tag]
            cells = []
            for n in names:
                t = per[n]["by_tag"][tag]
                tau = t["mean_accept_length"] if _tau(per[n]) else None
                cells.append(f"{t['tokens_per_second']:.1f}" + (f" ({tau:.2f})" if tau else ""))
            lines.append(f"| {tag} | {first['prompt_tokens']:.0f} | {first['prompts']} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _round_times(results: dict, names: list[str]) -> list[str]:
    """ms per round, drafting / target forward: what speed is tau divided by (our engines only)."""
    ours = [n for n in names if all(r["accept_lengths"] for w in results["workloads"].values() if n in w
                                    for r in w[n]["per_prompt"])]  # transformers' methods report no rounds
    if not ours:
        return []
    lines = ["Milliseconds per round (per step without a draft), drafting / target forward:", "",
             "| workload | " + " | ".join(ours) + " |", "|---" * (len(ours) + 1) + "|"]
    for w, per in results["workloads"].items():
        splits = [round_split(per[n]["per_prompt"]) if n in per else None for n in ours]
        lines.append(f"| {w} | " + " | ".join("n/a" if s is None else f"{s['draft']:.1f} / {s['verify']:.1f}"
                                             for s in splits) + " |")
    return lines + [""]


def _acceptance(results: dict) -> list[str]:
    """Per-position acceptance of the draft and what trees added, per method that drafted."""
    rows = {n: s for n, s in results["methods"].items() if any(s["per_position_acceptance"])}
    if not rows:
        return []
    k = max(len(s["per_position_acceptance"]) for s in rows.values())
    lines = ["Per-position acceptance of the draft (drafted rounds; P(draft k accepted | reached)), and the rounds "
             "where another branch of a tree went further than the main proposal:", "",
             "| method | " + " | ".join(f"k={j + 1}" for j in range(k)) + " | tree rounds (tokens gained) |",
             "|---" * (k + 2) + "|"]
    for n, s in rows.items():
        acc = s["per_position_acceptance"] + [None] * (k - len(s["per_position_acceptance"]))
        tree = (f"{s['branch_round_share']:.0%} ({s['branch_gain_per_round']:.2f})"
                if s.get("branch_round_share") else "-")
        lines.append(f"| {n} | " + " | ".join("-" if a is None else f"{a:.2f}" for a in acc) + f" | {tree} |")
    return lines + [""]


def _skipped(results: dict) -> list[str]:
    skipped = {w: ns for w, ns in results.get("skipped", {}).items() if ns}
    if not skipped:
        return []
    return ["Not run, because they cannot decode under a grammar (a JSON schema, a forced tool call): "
            + "; ".join(f"{w}: {', '.join(ns)}" for w, ns in skipped.items()) + ".", ""]


def _concurrency(sweep: dict | None, max_prompt: int | None) -> list[str]:
    if not sweep:
        return []
    which = f"of at most {max_prompt:,} prompt tokens" if max_prompt else ""
    return _sweep_table("## Requests in flight", (
        f"The speed section's requests {which} (no grammar), cycled, N at a time through "
        "the continuous-batching engine, no prefix cache (every level pays its prefill); generated tokens/s "
        "over the wall time; in the decode phase, the tokens after each request's first round over the time "
        "from the first request's first token to the last request's last (prefill, which both pay alike, "
        "left out, as in the per-prompt decode tokens/s); request latency:"), sweep)


def _concurrency_agent(sweep: dict | None) -> list[str]:
    if not sweep:
        return []
    lengths = sorted({t for level in sweep.values() for t in level.get("prompt_tokens", [])})
    which = f" ({', '.join(f'{t:,}' for t in lengths)} tokens)" if lengths else ""
    return _sweep_table("## Agent histories in flight", (
        f"The speed section's requests over 1,024 prompt tokens{which}, agent histories, cycled, N at a time, "
        "each engine holding them in its prefix cache (as a loop's next turn finds its history); columns as "
        "above:"), sweep)


def _ramp(ramp: dict | None) -> list[str]:
    if not ramp:
        return []
    d, a = ramp["dlite"], ramp["ar"]
    return ["## A ramp: 1 -> {peak} -> 1 in flight".format(peak=ramp["peak"]), "",
            (f"{ramp['requests']} short requests admitted in order, at most 1 in flight at first, rising to "
             f"{ramp['peak']} at half of them and falling back to 1 (the cap set by how many were admitted, so "
             "both engines face the same load); generated tokens/s over the run's wall time:"), "",
            "| dlite tokens/s | ar tokens/s | dlite/ar | dlite steps | ar steps | replies different |",
            "|---" * 6 + "|",
            f"| {d['tokens_per_second']:.1f} | {a['tokens_per_second']:.1f} | {ramp['dlite/ar']:.2f}x | "
            f"{d['steps']:.0f} | {a['steps']:.0f} | {ramp['greedy_mismatches']} |", ""]


def _sweep_table(title: str, intro: str, sweep: dict) -> list[str]:
    lines = [title, "", intro, "",
             "| in flight | dlite tokens/s | ar tokens/s | dlite/ar | decode phase dlite / ar | dlite/ar decode | "
             "dlite latency p50 / p99 s | ar latency p50 / p99 s | dlite tau | replies different |",
             "|---" * 10 + "|"]
    for n, level in sweep.items():
        d, a = level["dlite"], level["ar"]
        decode = (f"{d['decode_tokens_per_second']:.1f} / {a['decode_tokens_per_second']:.1f} | "
                  f"{level['dlite/ar decode']:.2f}x" if "dlite/ar decode" in level else "- | -")
        lines.append(f"| {n} | {d['tokens_per_second']:.1f} | {a['tokens_per_second']:.1f} | "
                     f"{level['dlite/ar']:.2f}x | {decode} | {d['latency_p50_s']:.2f} / {d['latency_p99_s']:.2f} | "
                     f"{a['latency_p50_s']:.2f} / {a['latency_p99_s']:.2f} | {d['mean_accept_length']:.2f} | "
                     f"{level.get('greedy_mismatches', '-')} |")
    return lines + [""]


def _turns_in_flight(turns: dict | None) -> list[str]:
    if not turns:
        return []
    lines = ["## Agent turns in flight", "",
             ("The agentic workload's turns, N at a time, each engine holding their histories in its prefix "
              "cache (as an agent's next turn finds its earlier ones); decode phase as above:"), "",
             "| in flight | prompt tokens | decode phase dlite / ar | dlite/ar decode | dlite/ar end to end | "
             "dlite tau | replies different |", "|---" * 7 + "|"]
    for n, level in turns.items():
        d, a = level["dlite"], level["ar"]
        lines.append(f"| {n} | {', '.join(f'{t:,}' for t in level['prompt_tokens'])} | "
                     f"{d['decode_tokens_per_second']:.1f} / {a['decode_tokens_per_second']:.1f} | "
                     f"{level['dlite/ar decode']:.2f}x | {level['dlite/ar']:.2f}x | "
                     f"{d['mean_accept_length']:.2f} | {level['greedy_mismatches']} |")
    return lines + [""]


def _decode_ratio(level: dict) -> str:
    """" (1.23x)": the decode phase's dlite/ar, where the run measured it."""
    return f" ({level['dlite/ar decode']:.2f}x)" if "dlite/ar decode" in level else ""


def _followup(followup: dict | None) -> list[str]:
    if not followup:
        return []
    lines = ["## An agent's follow-up turn through gRPC", "",
             ("Time to first token of turn 2 (a tool result appended) when the conversation's KV is held by its "
              "lease vs evicted by other traffic (the turn re-prefills its history), `dlite-ray bench-followup`:"), "",
             "| history | history tokens | held TTFT s (cached tokens) | evicted TTFT s (cached tokens) |",
             "|---|---|---|---|"]
    for r in followup["rows"]:
        h, e = r["held"], r["evicted"]
        lines.append(f"| {r['id']} | {h['prompt_tokens']} | {h['ttft_s']:.2f} ({h['cached_prompt_tokens']}) | "
                     f"{e['ttft_s']:.2f} ({e['cached_prompt_tokens']}) |")
    lines += ["", f"Median: held {followup['held_ttft_median_s']:.2f} s, evicted "
                  f"{followup['evicted_ttft_median_s']:.2f} s ({followup['speedup']:.1f}x).", ""]
    return lines


def _served(served: dict | None) -> list[str]:
    if not served:
        return []
    return ["## Served vs library", "",
            (f"Decode tokens/s through the Ray Serve app over gRPC (the draft in its own process, over gloo) "
             f"{served['grpc_tps_median']:.1f} vs the library engine in-process {served['library_tps_median']:.1f}: "
             f"{served['ratio']:.0%}, median of {served['requests']} requests each, alternating "
             f"(`dlite-ray bench-serve`). Target-draft communication: {served['comm_ms_per_round']:.2f} ms a round. "
             f"Served replies (T = 0) different from the library's: {len(served['mismatched_replies'])}."), ""]


def _memory(memory: dict | None) -> list[str]:
    if not memory:
        return []
    draft = memory["draft"]
    lines = ["## Memory", "",
             (f"What one request holds, read off a live request ({draft['dtype']}): DLite's draft state between "
              f"rounds, the target's KV blocks, and the KV cache of a draft that keeps its own history "
              f"({draft['kv_draft']}) after reading the same context:"), "",
             "| context | DLite draft | Python state (its context-lookup index above all) | target KV | "
             "KV-keeping draft |", "|---|---|---|---|---|"]
    for r in draft["rows"]:
        python = f"{r['python_bytes'] / MIB:.1f} MiB" if "python_bytes" in r else "-"
        lines.append(f"| {r['context']} | {r['dlite_draft_bytes'] / 1024:.1f} KiB | {python} | "
                     f"{r['target_kv_bytes'] / MIB:.1f} MiB | {r['kv_draft_bytes'] / MIB:.1f} MiB |")
    rss = memory.get("peak_rss")
    if rss:
        sizes = ", ".join(f"{n} {b / MIB:.0f} MiB" for n, b in rss["bytes"].items())
        lines += ["", f"Peak RSS of a process that loads one method and answers one request at {rss['context']} "
                      f"tokens of context (our engines' KV pool sized for that request): {sizes}."]
    return lines + [""]


def round_split(rows: list[dict]) -> dict:
    """ms per round: drafting, target forward, and the rest."""
    rounds = sum(len(r["accept_lengths"]) for r in rows) or 1
    draft = sum(r["draft_time"] for r in rows)
    verify = sum(r["verify_time"] for r in rows)
    total = sum(r["decode_time"] for r in rows)
    return {"draft": 1e3 * draft / rounds, "verify": 1e3 * verify / rounds,
            "overhead": max(0.0, 1e3 * (total - draft - verify) / rounds)}

"""results.json, report.md and PNG plots of a benchmark run."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plots = _plots(results, out)
    (out / "report.md").write_text(_markdown(results, plots))


def _markdown(results: dict, plots: list[str]) -> str:
    m = results["machine"]
    names = list(results["methods"])
    lines = ["# dlite-ray benchmark", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['torch_threads']} torch threads, torch {m['torch']}.",
             f"Command args: `{ {k: v for k, v in results['args'].items() if k != 'func'} }`", "",
             ("Decode tokens/s (median over prompts; tokens after the first / time from first to last token), "
              "mean accept length tau = E[A + 1] in parentheses."), "",
             "| workload | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for w, per in results["workloads"].items():
        cells = []
        for n in names:
            tau = per[n]["mean_accept_length"]
            cells.append(f"{per[n]['tokens_per_second']:.1f}" + (f" ({tau:.2f})" if tau else ""))
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += ["", ("| overall | tokens/s | e2e tokens/s | TTFT s | tau | rounds copied from the context (their tau) "
                   "| greedy mismatches |"), "|---|---|---|---|---|---|---|"]
    for n, s in results["methods"].items():
        tau = f"{s['mean_accept_length']:.2f}" if s["mean_accept_length"] else "-"
        copied = (f"{s['copied_round_share']:.0%} ({s['mean_accept_length_copied']:.2f})"
                  if s.get("copied_round_share") else "-")
        mismatches = s["greedy_mismatches"]
        if mismatches is None:
            same = s["same_replies_as_ar"]
            mismatches = "not lossless" + ("" if same is None else f": {same:.0%} of replies identical")
        lines.append(f"| {n} | {s['tokens_per_second']:.1f} | {s['e2e_tokens_per_second']:.1f} | "
                     f"{s['ttft_s']:.3f} | {tau} | {copied} | {mismatches} |")
    lines += ["", "Ratios (decode tokens/s): " + ", ".join(f"{k} = {v:.2f}x" for k, v in results["ratios"].items()), ""]
    lines += [line for k, v in results.get("paired_ratios", {}).items() for line in (paired_ratio_line(k, v), "")]
    lines += _round_times(results, names)
    lines += _acceptance(results)
    lines += [f"![{p}]({p})" for p in plots]
    return "\n".join(lines) + "\n"


def paired_ratio_line(name: str, ratio: dict) -> str:
    q1, q3 = ratio["quartiles"]
    return (f"{name} prompt by prompt: median {ratio['median']:.2f}x (quartiles {q1:.2f}x-{q3:.2f}x), "
            f"total tokens over total time {ratio['total']:.2f}x")


def _round_times(results: dict, names: list[str]) -> list[str]:
    """ms per round, drafting / target forward: what speed is tau divided by (our engines only)."""
    ours = [n for n in names if all(r["accept_lengths"] for w in results["workloads"].values()
                                    for r in w[n]["per_prompt"])]  # transformers' methods report no rounds
    if not ours:
        return []
    lines = ["Milliseconds per round (per step without a draft), drafting / target forward:", "",
             "| workload | " + " | ".join(ours) + " |", "|---" * (len(ours) + 1) + "|"]
    for w, per in results["workloads"].items():
        splits = [_split(per[n]["per_prompt"]) for n in ours]
        lines.append(f"| {w} | " + " | ".join(f"{s['draft']:.1f} / {s['verify']:.1f}" for s in splits) + " |")
    return lines + [""]


def _acceptance(results: dict) -> list[str]:
    """Per-position acceptance of the draft and what trees added, per method that drafted."""
    rows = {n: s for n, s in results["methods"].items() if any(s["per_position_acceptance"])}
    if not rows:
        return []
    k = max(len(s["per_position_acceptance"]) for s in rows.values())
    lines = ["Per-position acceptance of the draft (drafted rounds; P(draft k accepted)), and the rounds where "
             "another branch of a tree went further than the main proposal:", "",
             "| method | " + " | ".join(f"k={j + 1}" for j in range(k)) + " | tree rounds (tokens gained) |",
             "|---" * (k + 2) + "|"]
    for n, s in rows.items():
        acc = s["per_position_acceptance"] + [None] * (k - len(s["per_position_acceptance"]))
        tree = (f"{s['branch_round_share']:.0%} ({s['branch_gain_per_round']:.2f})"
                if s.get("branch_round_share") else "-")
        lines.append(f"| {n} | " + " | ".join("-" if a is None else f"{a:.2f}" for a in acc) + f" | {tree} |")
    return lines + [""]


def _plots(results: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    names = list(results["methods"])
    workloads = list(results["workloads"])
    # 1. decode tokens/s by workload and method
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        ax.bar([w + i * width for w in range(len(workloads))],
               [results["workloads"][w][n]["tokens_per_second"] for w in workloads], width, label=n)
    ax.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads)
    ax.set_ylabel("decode tokens/s")
    ax.legend(fontsize=8)
    ax.set_title("Decode speed by workload")
    made.append(_save(fig, out, "speed_by_workload.png"))
    # 2. per-position acceptance of the DLite draft
    if "dlite" in results["methods"] and results["methods"]["dlite"]["per_position_acceptance"]:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for w in workloads:
            acc = results["workloads"][w]["dlite"]["per_position_acceptance"]
            ax.plot(range(1, len(acc) + 1), [a or 0 for a in acc], marker="o", label=w)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(draft k accepted)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)
        ax.set_title("DLite per-position acceptance")
        made.append(_save(fig, out, "per_position_acceptance.png"))
        # 3. accept length by prompt length
        rows = [r for w in workloads for r in results["workloads"][w]["dlite"]["per_prompt"] if r["accept_lengths"]]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.scatter([r["prompt_tokens"] for r in rows],
                   [sum(r["accept_lengths"]) / len(r["accept_lengths"]) for r in rows], s=14)
        ax.set_xlabel("context (prompt tokens)")
        ax.set_ylabel("mean accept length")
        ax.set_title("DLite acceptance vs context length")
        made.append(_save(fig, out, "accept_vs_context.png"))
        # 4. time split per round
        fig, ax = plt.subplots(figsize=(6, 3.5))
        split = {w: _split(results["workloads"][w]["dlite"]["per_prompt"]) for w in workloads}
        bottom = [0.0] * len(workloads)
        for part in ("draft", "verify", "overhead"):
            vals = [split[w][part] for w in workloads]
            ax.bar(workloads, vals, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("ms per round")
        ax.legend(fontsize=8)
        ax.set_title("DLite time per round")
        made.append(_save(fig, out, "time_split.png"))
    # 5. draft-side memory vs context
    mem = results.get("draft_memory")
    if mem:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(mem["contexts"], [b / 2**20 for b in mem["kv_draft_bytes"]], marker="o", label="draft with its own KV")
        ax.plot(mem["contexts"], [b / 2**20 for b in mem["dlite_bytes"]], marker="o", label="DLite (history-free)")
        ax.set_xlabel("context tokens")
        ax.set_ylabel("draft state per request (MiB)")
        ax.legend(fontsize=8)
        ax.set_title("Draft-side memory vs context")
        made.append(_save(fig, out, "draft_memory.png"))
    return made


def _split(rows: list[dict]) -> dict:
    rounds = sum(len(r["accept_lengths"]) for r in rows) or 1
    draft = sum(r["draft_time"] for r in rows)
    verify = sum(r["verify_time"] for r in rows)
    total = sum(r["decode_time"] for r in rows)
    return {"draft": 1e3 * draft / rounds, "verify": 1e3 * verify / rounds,
            "overhead": max(0.0, 1e3 * (total - draft - verify) / rounds)}


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return name

"""The PNG plots of a benchmark report, each drawn only from what results.json holds."""

from __future__ import annotations

from pathlib import Path

from dlite_ray.bench.methods import ASSISTANT_LAYERS


def draw_plots(results: dict, out: Path) -> list[str]:
    """The plots this run's results allow, saved under `out`; their file names."""
    import matplotlib

    matplotlib.use("Agg")
    made = [_speed_by_workload(results, out)]
    if "dlite" in results["methods"] and any(results["methods"]["dlite"]["per_position_acceptance"]):
        made += [_per_position(results, out), _accept_vs_context(results, out), _time_split(results, out)]
    if results.get("concurrency"):
        made.append(_concurrency(results["concurrency"], out))
    if results.get("memory"):
        made.append(_draft_memory(results["memory"]["draft"], out))
    return made


def _speed_by_workload(results: dict, out: Path) -> str:
    import matplotlib.pyplot as plt

    names, workloads = list(results["methods"]), list(results["workloads"])
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for i, n in enumerate(names):
        xs = [x + i * width for x, w in enumerate(workloads) if n in results["workloads"][w]]
        ys = [results["workloads"][w][n]["tokens_per_second"] for w in workloads if n in results["workloads"][w]]
        ax.bar(xs, ys, width, label=n)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(workloads))], workloads, fontsize=8)
    ax.set_ylabel("decode tokens/s (median)")
    ax.legend(fontsize=8)
    ax.set_title("Decode speed by workload, batch 1")
    return _save(fig, out, "speed_by_workload.png")


def _per_position(results: dict, out: Path) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for w, per in results["workloads"].items():
        acc = per.get("dlite", {}).get("per_position_acceptance") or []
        if any(acc):
            ax.plot(range(1, len(acc) + 1), [a or 0 for a in acc], marker="o", label=w)
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | reached)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("DLite per-position acceptance (drafted rounds)")
    return _save(fig, out, "per_position_acceptance.png")


def _accept_vs_context(results: dict, out: Path) -> str:
    import matplotlib.pyplot as plt

    rows = [r for per in results["workloads"].values() if "dlite" in per
            for r in per["dlite"]["per_prompt"] if r["accept_lengths"]]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.scatter([r["prompt_tokens"] for r in rows],
               [sum(r["accept_lengths"]) / len(r["accept_lengths"]) for r in rows], s=14)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("mean accept length")
    ax.set_title("DLite acceptance vs context length")
    return _save(fig, out, "accept_vs_context.png")


def _time_split(results: dict, out: Path) -> str:
    import matplotlib.pyplot as plt

    from dlite_ray.bench.report import round_split

    workloads = [w for w, per in results["workloads"].items() if "dlite" in per]
    split = {w: round_split(results["workloads"][w]["dlite"]["per_prompt"]) for w in workloads}
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(workloads)
    for part in ("draft", "verify", "overhead"):
        vals = [split[w][part] for w in workloads]
        ax.bar(workloads, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.tick_params(axis="x", labelsize=8)
    ax.set_ylabel("ms per round")
    ax.legend(fontsize=8)
    ax.set_title("DLite time per round")
    return _save(fig, out, "time_split.png")


def _concurrency(sweep: dict, out: Path) -> str:
    import matplotlib.pyplot as plt

    levels = [int(n) for n in sweep]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for name in ("dlite", "ar"):
        left.plot(levels, [sweep[str(n)][name]["tokens_per_second"] for n in levels], marker="o", label=name)
        right.plot(levels, [sweep[str(n)][name]["latency_p99_s"] for n in levels], marker="o", label=f"{name} p99")
        right.plot(levels, [sweep[str(n)][name]["latency_p50_s"] for n in levels], marker=".", linestyle="--",
                   label=f"{name} p50")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("requests in flight")
        ax.legend(fontsize=8)
    left.set_ylabel("generated tokens/s")
    left.set_title("Throughput")
    right.set_ylabel("request latency (s)")
    right.set_title("Latency")
    return _save(fig, out, "concurrency.png")


def _draft_memory(memory: dict, out: Path) -> str:
    import matplotlib.pyplot as plt

    rows = memory["rows"]
    contexts = [r["context"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("kv_draft_bytes", f"draft with its own KV ({ASSISTANT_LAYERS} layers)"),
                       ("dlite_draft_bytes", "DLite draft (history-free)"),
                       ("target_kv_bytes", "the target's KV (both keep it)")):
        ax.plot(contexts, [r[key] / 2**20 for r in rows], marker="o", label=label)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("MiB per request")
    ax.legend(fontsize=8)
    ax.set_title("Memory a request holds, measured")
    return _save(fig, out, "draft_memory.png")


def _save(fig, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name

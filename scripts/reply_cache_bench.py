"""Reply cache (engine/reply_cache.py) on agent conversations: tau and decode tokens/s with
and without it, side by side in one run.

The conversations are the bench's `agentic` workload (BFCL multi-turn tool loops: tool
schemas, a task, then a tool result and the next request per turn), decoded turn-major:
every conversation's first turn, then every second turn, and so on, so that each later
turn comes after its own earlier turns and after other conversations'. Two engines share
the target and the default draft, at default settings; one keeps a reply cache
(REPLY_CACHE_TOKENS; the engine's default is off), the other none. Each request runs on both in turn (the
order alternates), each repeat starts from an empty reply cache (the prefix cache stays
warm: only decoding is measured), and a conversation's history grows with its reply. At
T = 0 both engines must give the same tokens; the script counts any that differ.

It then replays the recorded replies (greedy, in decode order) against caches of other
n-gram sizes: how many rounds each would copy from earlier replies where the context has
no match, and how many tokens such a round keeps (A + 1), to set REPLY_NGRAM_SIZES.

    .venv/bin/python scripts/reply_cache_bench.py [--conversations 4] [--turns 3]
        [--max-new-tokens 48] [--repeats 3] [--fixed-length] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from tqdm import tqdm

from dlite_ray.bench.workloads import TOOL_RESULT, load_workload
from dlite_ray.constants import DEFAULT_LOOKUP_TOKENS, DEFAULT_REPLY_CACHE_NAMESPACES, REPLY_CACHE_TOKENS
from dlite_ray.engine.context_lookup import NgramIndex
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.reply_cache import REPLY_NGRAM_SIZES, ReplyCache
from dlite_ray.engine.request_stats import RequestStats

METHODS = ("dlite", "dlite-noreplycache")
REPLAYED_SIZES = ((4, 3, 2), (6, 5, 4, 3), REPLY_NGRAM_SIZES, (12, 10, 8), (16, 12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3, help="turns per conversation (at most 3)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=24576, help="each engine's KV pool")
    ap.add_argument("--fixed-length", action="store_true",
                    help="no adaptive length: every round drafts or copies in full, so tau no longer depends on "
                         "timing, and copies from replies are never given back to the draft")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    adaptive = not args.fixed_length
    dlite = DLiteEngine.from_pretrained(max_kv_tokens=args.kv_tokens, adaptive_draft_length=adaptive,
                                        reply_cache_tokens=REPLY_CACHE_TOKENS)
    engines = {"dlite": dlite,
               "dlite-noreplycache": DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft, reply_cache_tokens=0,
                                                 max_kv_tokens=args.kv_tokens, adaptive_draft_length=adaptive)}
    items = load_workload("agentic", args.conversations)
    first = dlite.encode(items[0].messages)
    for engine in engines.values():  # warm-up (and the first prompt's KV)
        engine.generate(first, max_new_tokens=4)
    runs: dict[str, list[list[RequestStats]]] = {name: [] for name in METHODS}
    order, mismatches = [], 0
    total = args.repeats * len(items) * args.turns * len(METHODS)
    with tqdm(total=total, desc="requests", unit="req") as bar:
        for rep in range(args.repeats):
            dlite.reply_cache.clear()
            for name in METHODS:
                runs[name].append([])
            histories = [list(item.messages) for item in items]
            order = []
            for turn in range(args.turns):
                for item, history in zip(items, histories):
                    if turn > 0:
                        history.append({"role": "user",
                                        "content": f"Tool result: {TOOL_RESULT}\n\n{item.later_turns[turn - 1]}"})
                    ids = dlite.encode(history)
                    names = METHODS if (rep + turn) % 2 == 0 else METHODS[::-1]
                    results = {}
                    for name in names:
                        results[name] = engines[name].generate(ids, max_new_tokens=args.max_new_tokens)[0]
                        runs[name][-1].append(results[name].stats)
                        bar.update()
                    mismatches += results["dlite"].token_ids != results["dlite-noreplycache"].token_ids
                    reply = results["dlite-noreplycache"]
                    history.append({"role": "assistant", "content": reply.text})
                    order.append((ids, reply.token_ids))
    figures = {"args": vars(args), "mismatches": mismatches,
               "methods": {name: summary(reps) for name, reps in runs.items()},
               "replay": {str(sizes): replay(order, sizes) for sizes in REPLAYED_SIZES}}
    ratios = [a / b for a, b in zip(figures["methods"]["dlite"]["tokens_per_second_per_repeat"],
                                    figures["methods"]["dlite-noreplycache"]["tokens_per_second_per_repeat"])]
    figures["speedup_median"] = statistics.median(ratios)
    report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


def summary(repeats: list[list[RequestStats]]) -> dict:
    """Per repeat: decode tokens/s over all its requests (tokens after each first round /
    the time from first to last token) and tau over all its rounds; medians over repeats,
    and every repeat's rounds by kind."""
    rates, taus = [], []
    for stats in repeats:
        tokens = sum(s.num_output_tokens - (s.accept_lengths[0] if s.accept_lengths else 0) for s in stats)
        rates.append(tokens / sum(s.decode_wall_time for s in stats))
        rounds = [a for s in stats for a in s.accept_lengths]
        taus.append(sum(rounds) / len(rounds))
    kinds = {"drafted": [], "context": [], "reply": []}
    for s in (s for stats in repeats for s in stats):
        for a, copied, reply in zip(s.accept_lengths, s.copied_rounds, s.reply_rounds):
            kinds["reply" if reply else "context" if copied else "drafted"].append(a)
    return {"tokens_per_second": statistics.median(rates), "tau": statistics.median(taus),
            "tokens_per_second_per_repeat": rates, "tau_per_repeat": taus,
            "rounds": {k: {"n": len(v), "tau": sum(v) / len(v) if v else None} for k, v in kinds.items()}}


def replay(requests: list[tuple[list[int], list[int]]], sizes: tuple[int, ...]) -> dict:
    """Greedy replay in decode order: per round, a copy from the context where it has a
    match, else from a cache of earlier replies indexed with `sizes`, else a drafted round
    (not simulated here: it moves on one token). Cache rounds: how many, and tokens kept."""
    cache = ReplyCache(REPLY_CACHE_TOKENS, DEFAULT_REPLY_CACHE_NAMESPACES, sizes)
    kept = []
    for prompt, reply in requests:
        index, p = NgramIndex(), 0
        while p < len(reply):
            tokens, limit = prompt + reply[:p], min(DEFAULT_LOOKUP_TOKENS, len(reply) - p - 1)
            if limit > 0 and not index.continuation(tokens, limit):
                copy = cache.propose(None, tokens, limit)
                if copy:
                    a = next((i for i, (c, r) in enumerate(zip(copy, reply[p:])) if c != r), len(copy))
                    kept.append(a + 1)
                    p += a + 1
                    continue
            p += 1
        cache.add(None, prompt, reply)
    return {"rounds": len(kept), "tau": sum(kept) / len(kept) if kept else None,
            "first_token_right": sum(k > 1 for k in kept) / len(kept) if kept else None}


def report(figures: dict) -> None:
    print(f"\n{'method':<20} {'decode tok/s':>12} {'tau':>6}   rounds (n, tau): drafted / context / reply")
    for name, m in figures["methods"].items():
        kinds = " / ".join(f"{r['n']}, {r['tau']:.2f}" if r["tau"] else "0" for r in m["rounds"].values())
        print(f"{name:<20} {m['tokens_per_second']:>12.2f} {m['tau']:>6.2f}   {kinds}")
    print(f"dlite / dlite-noreplycache decode speed, median over repeats: {figures['speedup_median']:.3f}; "
          f"replies that differ between the two: {figures['mismatches']}")
    print("\nreplay, n-gram sizes -> rounds copied from earlier replies, their tau, share whose first token was right")
    for sizes, r in figures["replay"].items():
        if r["rounds"]:
            print(f"  {sizes:<16} {r['rounds']:>5} {r['tau']:>6.2f} {r['first_token_right']:>6.2f}")
        else:
            print(f"  {sizes:<16}     0")


if __name__ == "__main__":
    main()

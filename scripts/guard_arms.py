"""N requests in flight through plain decoding and through dlite, alternately, with what the
speculation guard chose: per batch bucket and arm (0 plain, 1 or 3 tokens a row at most,
None the cost model's allocation) its steps, tokens/s and median step time, and each run's
tokens/s and the last request's time to first token. The requests are the chat, code and
tool-use workloads' first 8 each, as `dlite-ray bench --concurrency` sends them.

    .venv/bin/python scripts/guard_arms.py 32 --runs 3
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

from dlite_ray.bench.runner import expand
from dlite_ray.bench.workloads import load_workload
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.step_rates import batch_bucket


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("in_flight", type=int)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    dlite = DLiteEngine.from_pretrained(dtype="auto", enable_prefix_cache=False)
    plain = DLiteEngine(dlite.target, dlite.tokenizer, None, enable_prefix_cache=False)
    items = [r.ids for w in ("chat", "code", "tool-use") for r in expand(load_workload(w, 8), plain, 96)]
    batch = [items[i % len(items)] for i in range(args.in_flight)]
    steps: list[tuple[int, object, int, float]] = []
    record = dlite.policy.rates.record

    def logged(n, arm, tokens, seconds):
        steps.append((batch_bucket(n), arm, tokens, seconds))
        record(n, arm, tokens, seconds)

    dlite.policy.rates.record = logged
    for engine in (dlite, plain):
        engine.generate(batch[:1], max_new_tokens=4)  # warm-up
    for _ in range(args.runs):
        for name, engine in (("ar", plain), ("dlite", dlite)):
            steps.clear()
            start = time.perf_counter()
            results = engine.generate(batch, max_new_tokens=args.max_new_tokens)
            wall = time.perf_counter() - start
            print(f"{name}: {sum(len(r.token_ids) for r in results) / wall:.1f} tok/s, "
                  f"last time to first token {max(r.stats.ttft for r in results):.2f} s")
            by_arm = collections.defaultdict(list)
            for bucket, arm, tokens, seconds in steps:
                by_arm[(bucket, arm)].append((tokens, seconds))
            for (bucket, arm), rows in sorted(by_arm.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
                rate = sum(t for t, _ in rows) / sum(s for _, s in rows)
                print(f"    bucket {bucket:>2} arm {arm!s:>4}: {len(rows):>3} steps, {rate:6.0f} tok/s, "
                      f"{1000 * statistics.median(s for _, s in rows):.0f} ms a step")


if __name__ == "__main__":
    main()

"""What tree verification buys and costs on this machine (docs/bench/tree-verification.md),
bf16, batch 1, the default model and draft, agentic, dev and long-context prompts:

- `acceptance`: tau per prompt with trees off and on (TREE_TOKENS), both at the full draft
  length every round (no adaptive policy, so the same rounds are proposed): what the
  branches add to acceptance alone, and which rounds gained (drafted or copied);
- `speed`: decode tokens/s per prompt, plain decoding (ar), dlite without trees and dlite
  with trees verified every round (the policy's budget forced on), 3 interleaved repeats,
  medians;
- `step`: one target forward at 3,000 tokens of context: 1 row, a chain of 8 and of 16, and
  trees of 9 nodes (2 chains) and 16 nodes (9 chains), medians of 15.

    PYTHONPATH=. .venv/bin/python scripts/tree_bench.py acceptance|speed|step
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dlite_ray.bench.runner import expand
from dlite_ray.bench.workloads import load_workload
from dlite_ray.constants import TREE_TOKENS
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.model_runner import RowInput
from tests.helpers import forward_all, new_seq


def _prompts(ref: DLiteEngine, long_context: bool) -> list[tuple[str, str, list[int]]]:
    items = expand(load_workload("agentic", 2), ref, 96)[:4] + expand(load_workload("dev", 3), ref, 96)
    return items + (expand(load_workload("long-context", 2), ref, 96) if long_context else [])


def acceptance() -> None:
    dlite = DLiteEngine.from_pretrained(None, "default", dtype="bfloat16", adaptive_draft_length=False)
    items = _prompts(DLiteEngine(dlite.target, dlite.tokenizer, None), long_context=False)
    for tree_tokens in (0, TREE_TOKENS):
        engine = DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft, tree_tokens=tree_tokens,
                             adaptive_draft_length=False)
        for r in items:
            pid, ids = r.id, r.ids
            s = engine.generate(ids, max_new_tokens=96)[0].stats
            drafted = [a for a, c in zip(s.accept_lengths, s.copied_rounds) if not c]
            gained_drafted = sum(g for g, c in zip(s.branch_gains, s.copied_rounds) if not c)
            gained_copied = sum(g for g, c in zip(s.branch_gains, s.copied_rounds) if c)
            print(f"tree_tokens {tree_tokens} {pid[:22]} ({len(ids)} tokens): tau {s.mean_accept_length:.2f}, "
                  f"drafted rounds {len(drafted)} (tau {statistics.mean(drafted) if drafted else 0:.2f}), "
                  f"copied rounds {sum(s.copied_rounds)}; tokens gained by branches: {gained_drafted} in drafted "
                  f"rounds, {gained_copied} in copied ones", flush=True)


def speed() -> None:
    dlite = DLiteEngine.from_pretrained(None, "default", dtype="bfloat16")
    ar = DLiteEngine(dlite.target, dlite.tokenizer, None)
    items = _prompts(ar, long_context=True)
    engines = {"notree": DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft, tree_tokens=0),
               "tree": DLiteEngine(dlite.target, dlite.tokenizer, dlite.draft, tree_tokens=TREE_TOKENS), "ar": ar}
    engines["tree"].policy.branch_budget = lambda limit: limit  # every round verifies its branches
    for engine in engines.values():
        engine.generate(items[0].ids, max_new_tokens=8)
    ratios: dict[str, list[float]] = {"notree": [], "tree": []}
    for r in items:
        pid, ids = r.id, r.ids
        tps: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(3):
            for name, engine in engines.items():
                tps[name].append(engine.generate(ids, max_new_tokens=96)[0].stats.decode_tokens_per_second)
        med = {name: statistics.median(v) for name, v in tps.items()}
        for name in ratios:
            ratios[name].append(med[name] / med["ar"])
        print(f"{pid[:22]} ({len(ids)} tokens): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items())
              + f" tokens/s; tree/notree {med['tree'] / med['notree']:.2f}", flush=True)
    print("median over prompts, against ar: " + ", ".join(f"{k} {statistics.median(v):.2f}x"
                                                            for k, v in ratios.items()))


def step() -> None:
    torch.set_grad_enabled(False)
    runner = DLiteEngine.from_pretrained(None, None, dtype="bfloat16").runner
    context = 3000
    seq = new_seq([100 + i % 1000 for i in range(context)])
    for i in range(0, context, 512):
        forward_all(runner, seq, seq.token_ids[i:i + 512])

    def timed_ms(num_tokens: int, parents: list[int] | None) -> float:
        times = []
        for _ in range(15):
            runner.blocks.prepare_write(seq.block_table, seq.num_computed, seq.num_computed + num_tokens)
            start = time.perf_counter()
            runner.run([RowInput(seq, [5] * num_tokens, num_tokens, parents)])
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e3

    chain = [-1, 0, 1, 2, 3, 4, 5, 6]
    for _ in range(2):
        print(f"1 row {timed_ms(1, None):.1f} ms, a chain of 8 {timed_ms(8, None):.1f}, of 16 "
              f"{timed_ms(16, None):.1f}, a tree of 9 nodes (2 chains) {timed_ms(9, chain + [0]):.1f}, of 16 nodes "
              f"(9 chains) {timed_ms(16, chain + [0, 1, 2, 3, 4, 5, 6, 0]):.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("acceptance", "speed", "step"))
    {"acceptance": acceptance, "speed": speed, "step": step}[parser.parse_args().what]()

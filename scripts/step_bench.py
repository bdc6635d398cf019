"""Times one target forward of the default model on CPU, a decode step (1 new row) and a
verify step (8 rows) at several context lengths, three ways side by side (interleaved
repeats, medians), and splits the default way's step into the weights' read time at this
machine's measured bandwidth, attention, and the rest; and times prefills (the three ways,
and the default way with its chunks attended by the CPU flash kernel or by our decode kernel):

- `onednn`: the linears through oneDNN's packed calls, the layers one by one from Python
  (what the runtime did before csrc/row_linear.cpp);
- `row`: the linears through our kernel (`RowLinear`), the layers one by one;
- `row+loop`: our kernel, and a decode / verify forward's layers in one C++ call
  (`LayerLoop`, the default).

    .venv/bin/python scripts/step_bench.py --dtype bfloat16 --contexts 64 2048 4096
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))
from decode_attention_bench import time_layer_call  # noqa: E402

from dlite_ray.bench.machine import memory_bandwidth_gbs  # noqa: E402
from dlite_ray.engine.model_runner import ModelRunner, RowInput  # noqa: E402
from dlite_ray.engine.sequence import SamplingParams, Sequence  # noqa: E402
from dlite_ray.runtime import fused_ops  # noqa: E402
from dlite_ray.runtime.loading import load_target  # noqa: E402
from dlite_ray.runtime.model_store import default_model_dir  # noqa: E402

WAYS = ("onednn", "row", "row+loop")


def load(way: str, dtype: torch.dtype):
    if way == "onednn":
        with mock.patch.object(fused_ops, "row_linear_serves", lambda weight: False):
            return load_target(default_model_dir(), dtype)
    model = load_target(default_model_dir(), dtype)
    if way == "row":
        model.layer_loop = None
    return model


def weight_bytes(model) -> int:
    """What a step reads of the weights: every linear and norm, and the LM head (the
    embedding itself, where they are tied); not the embedding's other rows."""
    head = model.lm_head.weight
    body = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if not name.startswith(("embed_tokens.", "lm_head.")))
    return body + head.numel() * head.element_size()


def prefilled(runner: ModelRunner, context: int) -> Sequence:
    seq = Sequence([100 + i % 1000 for i in range(context)], SamplingParams())
    for start in range(0, context, 512):
        runner.forward([RowInput(seq, seq.token_ids[start:start + 512])])
        runner.commit(seq, min(context, start + 512))
    return seq


def step_seconds(runner: ModelRunner, seq: Sequence, rows: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        runner.forward([RowInput(seq, [5] * rows, rows)])
        times.append(time.perf_counter() - start)
        runner.commit(seq, len(seq.token_ids))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per repeat")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    models = {way: load(way, dtype) for way in WAYS}
    bandwidth = memory_bandwidth_gbs() * 1e9
    weights_ms = weight_bytes(models["row+loop"]) / bandwidth * 1e3
    cfg = models["row+loop"].cfg
    print(f"{args.dtype}, {torch.get_num_threads()} threads; weights {weight_bytes(models['row+loop']) / 1e6:.0f} MB, "
          f"read at {bandwidth / 1e9:.1f} GB/s: {weights_ms:.1f} ms a step\n")
    print("| context | rows | " + " | ".join(f"{w} ms" for w in WAYS) + " | weights ms | attention ms | rest ms |")
    print("|---|---|" + "---|" * (len(WAYS) + 3))
    prefill_ms: dict[int, dict[str, float]] = {}
    prefill_attention: dict[int, dict[str, float]] = {}
    for context in args.contexts:
        runners = {way: ModelRunner(m, (), context + 64, 16) for way, m in models.items()}
        seqs, prefill_ms[context] = {}, {}
        for way, runner in runners.items():
            start = time.perf_counter()
            seqs[way] = prefilled(runner, context)
            prefill_ms[context][way] = (time.perf_counter() - start) * 1e3
        if context >= 1024:
            prefill_attention[context] = compare_prefill_attention(models["row+loop"], context, args.repeats)
        for rows in (1, 8):
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            for _ in range(args.repeats):
                for way in WAYS:
                    times[way] += step_seconds(runners[way], seqs[way], rows, args.steps + 1)[1:]
            medians = {way: statistics.median(t) * 1e3 for way, t in times.items()}
            attention_ms = time_layer_call(fused_ops.decode_attention, rows, context + rows, dtype, cfg.head_dim,
                                           heads=(cfg.num_heads, cfg.num_kv_heads), layers=cfg.num_layers
                                           ) * cfg.num_layers * 1e3
            rest = medians["row+loop"] - weights_ms - attention_ms
            print(f"| {context} | {rows} | " + " | ".join(f"{medians[w]:.1f}" for w in WAYS)
                  + f" | {weights_ms:.1f} | {attention_ms:.1f} | {rest:.1f} |", flush=True)
    print("\nPrefill (chunks of 512 tokens, one run each, after the warm-up of the first context):\n")
    print("| context | " + " | ".join(f"{w} ms" for w in WAYS) + " |")
    print("|---|" + "---|" * len(WAYS))
    for context, by_way in list(prefill_ms.items())[1:]:
        print(f"| {context} | " + " | ".join(f"{by_way[w]:.0f}" for w in WAYS) + " |")
    print("\nPrefill of the default way, its chunks attended by the CPU flash kernel or by our decode kernel"
          f" (medians of {args.repeats} alternating runs):\n")
    print("| context | flash ms | ours ms |\n|---|---|---|")
    for context, by_way in prefill_attention.items():
        print(f"| {context} | {by_way['flash']:.0f} | {by_way['ours']:.0f} |")


def compare_prefill_attention(model, context: int, repeats: int) -> dict[str, float]:
    """Median ms of a prefill of `context` tokens, prefill chunks attended by the CPU flash
    kernel and by our decode kernel (`fused_ops.attends_prefill_rows`), alternating."""
    times: dict[str, list[float]] = {"flash": [], "ours": []}
    for _ in range(repeats):
        for way in times:
            runner = ModelRunner(model, (), context + 64, 16)
            with mock.patch.object(fused_ops, "attends_prefill_rows",
                                   fused_ops.attends_prefill_rows if way == "ours" else lambda q, ctx: False):
                start = time.perf_counter()
                prefilled(runner, context)
                times[way].append((time.perf_counter() - start) * 1e3)
    return {way: statistics.median(t) for way, t in times.items()}


if __name__ == "__main__":
    main()

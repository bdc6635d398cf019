"""`dlite-ray bench-runtime`: decode tokens/s of our runtime vs transformers' `generate`.

Same model, dtype, threads and prompt, batch 1, measured side by side in one run
(medians over repeats after a warm-up). Also the physical limit of this machine: each
decoded token reads every weight once, so tokens/s <= bandwidth / weight bytes.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
from tqdm import tqdm

from dlite_ray.bench.machine import machine_info, memory_bandwidth_gbs
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.engine_config import DTYPES, resolve_dtype
from dlite_ray.runtime.model_store import default_model_dir

log = logging.getLogger(__name__)


def _prompt(engine: DLiteEngine, length: int) -> list[int]:
    import inspect
    import json as json_module

    text = inspect.getsource(json_module.decoder) * 8
    return engine.tokenizer(text, add_special_tokens=False)["input_ids"][:length]


def ours_tokens_per_second(engine: DLiteEngine, ids: list[int], new_tokens: int) -> float:
    result = engine.generate([ids], max_new_tokens=new_tokens + 1, ignore_eos=True)[0]
    return result.stats.decode_tokens_per_second


@torch.inference_mode()
def hf_tokens_per_second(model, ids: list[int], new_tokens: int) -> float:
    """(time for prefill + N+1 tokens) - (time for prefill + 1 token), over N tokens."""
    x = torch.tensor([ids])

    def timed(n):
        start = time.perf_counter()
        model.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    first = timed(1)
    return new_tokens / (timed(new_tokens + 1) - first)


def run(contexts: list[int], new_tokens: int, repeats: int, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = resolve_dtype(dtype, "cpu")
    engine = DLiteEngine.from_pretrained(None, draft=None, dtype=dtype)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=DTYPES[dtype]).eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.target.parameters())
    bandwidth = memory_bandwidth_gbs()
    limit = bandwidth * 1e9 / weight_bytes
    rows = []
    for ctx in contexts:
        ids = _prompt(engine, ctx)
        ours_tokens_per_second(engine, ids, 4)  # warm-up
        hf_tokens_per_second(hf, ids[:64], 4)
        ours, theirs = [], []
        for _ in tqdm(range(repeats), desc=f"context {ctx}", unit="repeat"):
            ours.append(ours_tokens_per_second(engine, ids, new_tokens))
            theirs.append(hf_tokens_per_second(hf, ids, new_tokens))
        o, t = statistics.median(ours), statistics.median(theirs)
        rows.append({"context": len(ids), "ours_tps": o, "hf_tps": t, "ratio": o / t,
                     "ours_of_limit": o / limit, "hf_of_limit": t / limit})
    report = {"machine": machine_info(), "dtype": dtype, "weight_bytes": weight_bytes,
              "bandwidth_gbs": bandwidth, "limit_tps": limit, "rows": rows}
    print(f"machine: {report['machine']}")
    print(f"weights {weight_bytes / 1e6:.0f} MB, read bandwidth {bandwidth:.1f} GB/s "
          f"-> physical limit {limit:.1f} tokens/s ({dtype}, batch 1)")
    print(f"{'context':>8} {'ours tok/s':>11} {'hf tok/s':>9} {'ours/hf':>8} {'ours/limit':>10} {'hf/limit':>9}")
    for r in rows:
        print(f"{r['context']:>8} {r['ours_tps']:>11.1f} {r['hf_tps']:>9.1f} {r['ratio']:>8.2f} "
              f"{r['ours_of_limit']:>10.0%} {r['hf_of_limit']:>9.0%}")
    return report

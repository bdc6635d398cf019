"""Memory, measured: what a request keeps between rounds at 1K / 4K / 8K tokens of context,
and each method's peak resident memory.

Per request and context:
- DLite's draft: the tensors the engine holds for the draft between rounds (the pivot
  features of the target's tap layers), read off a live request;
- the request's Python state, which grows with its context: above all the context-lookup
  index of its n-grams (what `dlite` copies from), traced by tracemalloc while it runs;
- the target's KV: the blocks that request holds in the paged cache, times a block's bytes;
- a draft with its own history (transformers' assisted generation: the target's first
  `ASSISTANT_LAYERS` layers): its KV cache after reading the same context, summed tensor
  by tensor.
Peak RSS: each method in a process of its own (peak RSS only grows), loading the target and
answering one request at 4K tokens of context; our engines' KV pool sized for that request
(a server sizes it for its load: `max_kv_tokens`).
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tracemalloc

import torch

from dlite_ray.bench.methods import (
    ASSISTANT_LAYERS,
    HF_METHODS,
    EngineMethod,
    HFMethod,
    hf_method,
    hf_target,
    truncated_draft,
)
from dlite_ray.bench.workloads import long_context_text
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.sequence import SamplingParams

log = logging.getLogger(__name__)
CONTEXTS = (1024, 4096, 8192)
RSS_CONTEXT = 4096
NEW_TOKENS = 16


def context_ids(tokenizer, tokens: int) -> list[int]:
    """A prompt that, with `NEW_TOKENS` generated, fills `tokens` positions: Python source."""
    ids = tokenizer(long_context_text(tokens * 8))["input_ids"]  # 3-5 characters a token
    if len(ids) < tokens - NEW_TOKENS:
        raise ValueError(f"the source text is shorter than {tokens} tokens")
    return ids[: tokens - NEW_TOKENS]


def request_state(engine: DLiteEngine, ids: list[int]) -> dict:
    """Bytes a live request holds, read after a few rounds: the draft's state, the Python
    objects made for it (torch's tensors are not traced) and the target's KV."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    seq = engine.add_request(ids, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    while len(seq.output_ids) < NEW_TOKENS // 2 and not seq.is_finished:
        engine.step()
    python_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    cache = engine.runner.cache
    block_bytes = (cache.k.nbytes + cache.v.nbytes) // engine.runner.num_blocks
    state = {"dlite_draft_bytes": 0 if seq.pivot_features is None else seq.pivot_features.nbytes,
             "python_bytes": python_bytes, "target_kv_bytes": len(seq.block_table) * block_bytes}
    while not seq.is_finished:
        engine.step()
    return state


@torch.inference_mode()
def kv_draft_bytes(assistant, ids: list[int]) -> int:
    """The KV cache a history-keeping draft holds after reading `ids`."""
    cache = assistant.model(torch.tensor([ids]), use_cache=True).past_key_values  # no logits needed
    return sum(t.nbytes for layer in _cache_layers(cache) for t in layer)


def _cache_layers(cache):
    if hasattr(cache, "layers"):  # transformers >= 4.56: one object per layer
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in zip(cache.key_cache, cache.value_cache)]


def measure_draft_memory(target: str | None, draft: str | None, dtype: str, contexts=CONTEXTS) -> dict:
    engine = DLiteEngine.from_pretrained(target, draft, dtype=dtype, enable_prefix_cache=False)
    contexts = [c for c in contexts if c <= engine.runner.max_context]
    hf = hf_target(target, dtype)
    assistant = truncated_draft(hf, ASSISTANT_LAYERS)
    del hf
    rows = []
    for c in contexts:
        ids = context_ids(engine.tokenizer, c)
        rows.append({"context": c, **request_state(engine, ids), "kv_draft_bytes": kv_draft_bytes(assistant, ids)})
        log.info("draft memory at %d tokens: %s", c, rows[-1])
    return {"rows": rows, "kv_draft": f"transformers' assisted generation with the target's first "
                                       f"{ASSISTANT_LAYERS} layers as its draft", "dtype": dtype}


def measure_peak_rss(methods: list[str], dtype: str, context: int = RSS_CONTEXT) -> dict:
    """Peak RSS per method, each in a fresh process."""
    out = {}
    for name in methods:
        cmd = [sys.executable, "-m", "dlite_ray.bench.memory", name, "--dtype", dtype, "--context", str(context)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"peak RSS of {name} failed: {done.stderr[-2000:]}")
        out[name] = json.loads(done.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
        log.info("peak RSS of %s: %.0f MiB", name, out[name] / 2**20)
    return {"context": context, "bytes": out}


def _one_method_peak(name: str, dtype: str, context: int) -> int:
    """Load `name` as the bench does (and nothing else), answer one request at `context`
    tokens, report the process's peak RSS."""
    from transformers import AutoTokenizer

    from dlite_ray.runtime.model_store import default_model_dir

    method: HFMethod | EngineMethod
    if name in HF_METHODS:
        method = hf_method(name, hf_target(None, dtype))
        tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    elif name in ("dlite", "ar"):
        engine = DLiteEngine.from_pretrained(None, "default" if name == "dlite" else None, dtype=dtype,
                                             max_kv_tokens=context + NEW_TOKENS)
        method, tokenizer = EngineMethod(name, engine), engine.tokenizer
    else:
        raise ValueError(f"no peak-RSS measurement for method {name!r}")
    method.run(context_ids(tokenizer, context), NEW_TOKENS)
    return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """This process's peak RSS. Not getrusage's ru_maxrss: Linux keeps that across exec, so a
    child forked from a large parent would report the parent's size."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024


def main() -> None:
    ap = argparse.ArgumentParser(description="peak RSS of one bench method (run by measure_peak_rss)")
    ap.add_argument("method")
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--context", type=int, default=RSS_CONTEXT)
    args = ap.parse_args()
    print(json.dumps({"peak_rss_bytes": _one_method_peak(args.method, args.dtype, args.context)}))


if __name__ == "__main__":
    main()

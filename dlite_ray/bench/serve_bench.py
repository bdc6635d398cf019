"""`dlite-ray bench-serve`: tokens/s through the Ray Serve app over gRPC (target and
draft in two processes over gloo) vs the in-process library engine, same prompts, one run,
one request at a time, the two alternating; and whether every served reply (T = 0) has the
library's tokens. Starts the app on loopback (`loadtest.local_app`) and tears it down."""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from dlite_ray.bench.workloads import Item, load_workload
from dlite_ray.engine.engine import DLiteEngine
from dlite_ray.engine.prompts import Messages


def _grpc_run(stub, metadata, messages: Messages, max_tokens: int) -> tuple[float, list[int]]:
    """Decode tokens/s of one served reply (from its first chunk to its last) and its tokens."""
    from dlite_ray.serve.proto import dlite_pb2
    from dlite_ray.serve.proto_convert import proto_messages

    req = dlite_pb2.GenerateRequest(messages=proto_messages(messages), max_tokens=max_tokens)
    times, tokens, first_count = [], [], 0
    for chunk in stub.Generate(req, metadata=metadata, timeout=600):
        times.append(time.perf_counter())
        tokens.extend(chunk.token_ids)
        if len(times) == 1:
            first_count = len(tokens)
    decode = times[-1] - times[0]
    return ((len(tokens) - first_count) / decode if decode > 0 else 0.0), tokens


def _chat(item: Item) -> Messages:
    """The item's chat messages: gRPC's Generate takes messages, not a raw completion prompt."""
    if item.messages is None:
        raise ValueError(f"bench-serve sends chat messages; {item.id} is a raw prompt")
    return item.messages


def run(args) -> dict:
    import grpc
    from ray import serve

    from dlite_ray.bench.loadtest import GRPC_PORT, local_app
    from dlite_ray.serve.config import EngineArgs
    from dlite_ray.serve.proto import dlite_pb2_grpc

    items = [i for w in args.workload.split(",") for i in load_workload(w, args.limit)]
    library = DLiteEngine.from_pretrained(None, "default", dtype=args.dtype, enable_prefix_cache=False)
    engine = EngineArgs(disaggregated_draft=True, cpu_threads=args.cpu_threads, dtype=args.dtype)
    with local_app(engine, tenants=1) as keys:
        metadata = (("application", "dlite"), ("authorization", f"Bearer {keys[0]}"))
        worker = serve.get_deployment_handle("TargetWorker", app_name="dlite")
        stub = dlite_pb2_grpc.DLiteServiceStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
        _grpc_run(stub, metadata, _chat(items[0]), 8)
        library.generate(_chat(items[0]), max_new_tokens=8)
        served, lib, rounds, mismatched = [], [], 0, []
        comm_before = worker.stats.remote().result().draft_comm_time_s
        for item in tqdm(items, desc="bench-serve", unit="prompt"):
            messages = _chat(item)
            for _ in range(args.repeats):
                tps, tokens = _grpc_run(stub, metadata, messages, args.max_new_tokens)
                served.append(tps)
                r = library.generate(messages, max_new_tokens=args.max_new_tokens)[0]
                lib.append(r.stats.decode_tokens_per_second)
                rounds += len(r.stats.accept_lengths)
                if tokens != r.token_ids:
                    mismatched.append(item.id)
        comm = worker.stats.remote().result().draft_comm_time_s - comm_before
    out = {"grpc_tps_median": statistics.median(served), "library_tps_median": statistics.median(lib),
           "ratio": statistics.median(served) / statistics.median(lib),
           "comm_ms_per_round": 1e3 * comm / max(1, rounds), "requests": len(served),
           "mismatched_replies": mismatched}
    print(f"gRPC (disaggregated draft over gloo) {out['grpc_tps_median']:.1f} tok/s vs library "
          f"{out['library_tps_median']:.1f} tok/s: {out['ratio']:.0%}; target<->draft communication "
          f"~{out['comm_ms_per_round']:.2f} ms per round; T = 0 replies different from the library's: "
          f"{len(mismatched)} of {len(served)} {mismatched or ''}")
    return out

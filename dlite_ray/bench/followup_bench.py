"""`dlite-ray bench-followup`: an agent's follow-up turn through gRPC when the
conversation's KV is still pinned on its replica (held) vs after its lease ended and the
KV was pushed out by other traffic (evicted: the turn re-prefills from the history).

Per agentic item (BFCL multi-turn long-context: tool schemas + a task, ~3-4K tokens):
  held:    create, turn 1, then turn 2 appends a tool result -> measured;
  evicted: the same history marked as another session (so no KV is shared), turn 1 with
           a one-second lease, wait until the router evicts it, send filler requests of
           the same size (plain Generate, no lease) until the unpinned blocks have been
           reused, then turn 2 -> measured.
The KV pool is sized so the held conversation, the evicted one and the fillers cannot all
stay: what survives is what the lease pins. Both conversations are deleted after each
item, so the next item starts from the same free pool.
"""

from __future__ import annotations

import math
import statistics
import time

from tqdm import tqdm

from dlite_ray.bench.workloads import load_workload
from dlite_ray.training.prompts import TOOL_RESULT

EXPIRY_WAIT_S = 30.0


def run(args) -> dict:
    import grpc

    from dlite_ray.bench.loadtest import GRPC_PORT, local_app
    from dlite_ray.serve.config import EngineArgs
    from dlite_ray.serve.proto import dlite_pb2, dlite_pb2_grpc

    items = load_workload("agentic", args.limit)
    engine_args = EngineArgs(max_kv_tokens=args.kv_tokens, disaggregated_draft=False,
                             dtype=args.dtype)
    rows = []
    with local_app(engine_args, tenants=1) as keys:
        metadata = (("application", "dlite"), ("authorization", f"Bearer {keys[0]}"))
        stub = dlite_pb2_grpc.DLiteServiceStub(grpc.insecure_channel(f"127.0.0.1:{GRPC_PORT}"))
        for i, item in enumerate(tqdm(items, desc="follow-up turns", unit="item")):
            held = _held_turn(stub, metadata, _as_session(item.messages, f"held-{i}"), args.max_tokens)
            # enough same-sized traffic to cycle the whole pool: the released history cannot survive it
            n_fillers = math.ceil(args.kv_tokens / held["prompt_tokens"]) + 1
            fillers = [_as_session(item.messages, f"filler-{i}-{j}") for j in range(n_fillers)]
            evicted = _evicted_turn(stub, metadata, _as_session(item.messages, f"evicted-{i}"), fillers,
                                    args.max_tokens)
            for conv in (held.pop("conversation"), evicted.pop("conversation")):
                stub.DeleteConversation(dlite_pb2.DeleteConversationRequest(conversation_id=conv),
                                        metadata=metadata, timeout=60)
            rows.append({"id": item.id, "held": held, "evicted": evicted})
            print(f"{item.id}: history {held['prompt_tokens']} tokens; held TTFT {held['ttft_s']:.2f} s "
                  f"({held['cached_prompt_tokens']} cached) vs evicted {evicted['ttft_s']:.2f} s "
                  f"({evicted['cached_prompt_tokens']} cached)")
    out = {"rows": rows,
           "held_ttft_median_s": statistics.median(r["held"]["ttft_s"] for r in rows),
           "evicted_ttft_median_s": statistics.median(r["evicted"]["ttft_s"] for r in rows)}
    out["speedup"] = out["evicted_ttft_median_s"] / out["held_ttft_median_s"]
    print(f"follow-up turn TTFT, median: held {out['held_ttft_median_s']:.2f} s, evicted "
          f"{out['evicted_ttft_median_s']:.2f} s ({out['speedup']:.1f}x)")
    return out


def _as_session(messages: list[dict], session: str) -> list[dict]:
    """The same history under another session tag: the same length, no shared prefix."""
    first = dict(messages[0], content=f"[session {session}]\n{messages[0]['content']}")
    return [first, *messages[1:]]


def _held_turn(stub, metadata, messages: list[dict], max_tokens: int) -> dict:
    conv = _create(stub, metadata, messages)
    _turn(stub, metadata, conv, [], max_tokens, lease_s=600)
    return {**_turn(stub, metadata, conv, [_tool_message()], max_tokens, lease_s=600), "conversation": conv}


def _evicted_turn(stub, metadata, messages: list[dict], fillers: list[list[dict]], max_tokens: int) -> dict:
    from dlite_ray.serve.proto import dlite_pb2
    from dlite_ray.serve.proto_convert import proto_messages

    conv = _create(stub, metadata, messages)
    _turn(stub, metadata, conv, [], max_tokens, lease_s=1)
    deadline = time.time() + EXPIRY_WAIT_S
    while stub.GetConversation(dlite_pb2.GetConversationRequest(conversation_id=conv), metadata=metadata,
                               timeout=60).state != "evicted":
        if time.time() > deadline:
            raise RuntimeError("the lease never expired")
        time.sleep(0.5)
    for filler in fillers:  # other traffic, no lease: it may take any unpinned block
        req = dlite_pb2.GenerateRequest(messages=proto_messages(filler), max_tokens=1)
        list(stub.Generate(req, metadata=metadata, timeout=600))
    return {**_turn(stub, metadata, conv, [_tool_message()], max_tokens, lease_s=1), "conversation": conv}


def _tool_message() -> dict:
    return {"role": "tool", "content": TOOL_RESULT}


def _create(stub, metadata, messages: list[dict]) -> str:
    from dlite_ray.serve.proto import dlite_pb2
    from dlite_ray.serve.proto_convert import proto_messages

    req = dlite_pb2.CreateConversationRequest(messages=proto_messages(messages))
    return stub.CreateConversation(req, metadata=metadata, timeout=60).conversation_id


def _turn(stub, metadata, conv: str, new: list[dict], max_tokens: int, lease_s: int) -> dict:
    from dlite_ray.serve.proto import dlite_pb2
    from dlite_ray.serve.proto_convert import proto_messages

    req = dlite_pb2.AppendRequest(conversation_id=conv, messages=proto_messages(new),
                                  max_tokens=max_tokens, lease_seconds=lease_s)
    start = time.perf_counter()
    first, last = None, None
    for chunk in stub.AppendAndGenerate(req, metadata=metadata, timeout=600):
        first = first if first is not None else time.perf_counter()
        last = chunk
    if first is None or last is None:
        raise RuntimeError(f"conversation {conv}: the turn's stream ended without a chunk")
    return {"ttft_s": first - start, "total_s": time.perf_counter() - start,
            "cached_prompt_tokens": last.stats.cached_prompt_tokens, "prompt_tokens": last.stats.num_prompt_tokens}

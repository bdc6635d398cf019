"""`dlite-ray loadtest`: N concurrent clients against a dlite-ray app on loopback.

Each client, until the time is up, runs either a one-shot chat (HTTP chat/completions or
gRPC Generate) or a multi-turn tool loop through the conversation API (CreateConversation,
AppendAndGenerate per turn with a tool result in between, GetConversation, Delete). Then:

- a conversation is *lost* when its stored history is not what the client sent and
  received (a failed turn may leave its new messages stored without a reply: not lost);
- every T = 0 reply is checked against the in-process library engine (DLiteEngine) on
  the same input: token ids over gRPC, text over HTTP (which carries no ids);
- the report counts requests, errors by kind (overload answers are explained, anything
  else is not), latency percentiles and tokens/s, and is written as JSON.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from dlite_ray.bench.loadtest_client import (
    GRPC_PORT,
    HTTP_PORT,
    Client,
    LoadTestConfig,
    LoopOutcome,
    Record,
    wait_until_ready,
)
from dlite_ray.bench.machine import machine_info
from dlite_ray.bench.stats import percentile

EXPLAINED_ERRORS = ("http:429", "grpc:RESOURCE_EXHAUSTED")  # the per-tenant cap answering as designed
REFERENCE_BATCH = 16


def run_clients(cfg: LoadTestConfig) -> tuple[list[Record], list[LoopOutcome], float]:
    """Run `cfg.clients` clients for `cfg.duration_s` (in-flight loops finish their turn), or
    for `cfg.actions_per_client` actions each, however long they take."""
    records: list[Record] = []  # list.append is atomic under the GIL: the clients share these
    loops: list[LoopOutcome] = []
    clients = [Client(i, cfg) for i in range(cfg.clients)]
    started = time.monotonic()
    deadline = started + cfg.duration_s if cfg.actions_per_client is None else float("inf")
    threads = [threading.Thread(target=c.run_until, args=(deadline, records, loops), name=f"loadtest-{i}")
               for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records, loops, time.monotonic() - started


def check_greedy_replies(records: list[Record], engine, max_tokens: int) -> dict:
    """Compare every successful T = 0 reply with the library engine's reply to the same
    input (token ids where the protocol carries them, else text)."""
    checked = [r for r in records if r.greedy and r.error is None and r.kind != "create"]
    inputs = list({json.dumps(r.messages): r.messages for r in checked}.items())
    references = {}
    for start in range(0, len(inputs), REFERENCE_BATCH):
        batch = inputs[start:start + REFERENCE_BATCH]
        results = engine.generate([messages for _, messages in batch], max_new_tokens=max_tokens)
        references.update({key: result for (key, _), result in zip(batch, results, strict=True)})
    mismatches = []
    for r in checked:
        ref = references[json.dumps(r.messages)]
        same = r.token_ids == ref.token_ids if r.token_ids is not None else r.text == ref.text
        if not same:
            mismatches.append({"kind": r.kind, "messages": r.messages, "got": r.token_ids or r.text,
                               "expected": ref.token_ids if r.token_ids is not None else ref.text})
    return {"checked": len(checked), "distinct_inputs": len(inputs), "mismatches": len(mismatches),
            "mismatch_examples": mismatches[:3]}


def summarize(cfg: LoadTestConfig, records: list[Record], loops: list[LoopOutcome], wall_s: float,
              greedy: dict) -> dict:
    ok = [r for r in records if r.error is None and r.kind != "create"]
    errors = Counter(r.error for r in records if r.error)
    latencies = sorted(r.latency_s for r in ok)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tokens = sum(r.num_tokens for r in ok)
    return {
        "config": asdict(cfg) | {"api_keys": len(cfg.api_keys)},  # never the keys themselves
        "machine": machine_info(),
        "wall_s": wall_s,
        "requests": len(records),
        "requests_ok": len(ok),
        "requests_by_kind": dict(Counter(r.kind for r in records)),
        "errors": dict(errors),
        "unexplained_errors": sum(n for kind, n in errors.items() if kind not in EXPLAINED_ERRORS),
        "error_examples": {kind: next(r.error_detail for r in records if r.error == kind) for kind in errors},
        "conversations": len(loops),
        "conversation_turns": sum(lo.turns_done for lo in loops),
        "lost_conversations": sum(lo.lost for lo in loops),
        "lost_details": [lo.detail for lo in loops if lo.lost][:5],
        "greedy": greedy,
        "latency_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                      "mean": statistics.fmean(latencies) if latencies else None},
        "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
        "tokens": tokens,
        "tokens_per_second": tokens / wall_s if wall_s > 0 else 0.0,
    }


@contextmanager
def local_app(engine_args, tenants: int, limits: dict | None = None) -> Iterator[list[str]]:
    """The Serve app on loopback (started as `bench-serve` starts it) with one API key per
    tenant; yields the keys and tears everything down after."""
    import ray
    from ray import serve

    from dlite_ray.serve.app import build_app
    from dlite_ray.serve.config import AppArgs

    api_keys = [f"loadtest-key-{i}" for i in range(tenants)]
    with tempfile.TemporaryDirectory(prefix="dlite-loadtest-") as state:
        keys = Path(state) / "keys"
        keys.write_text("".join(f"{key} tenant-{i}\n" for i, key in enumerate(api_keys)))
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT}, grpc_options={
                "port": GRPC_PORT, "grpc_servicer_functions": [
                    "dlite_ray.serve.grpc_service.add_DLiteServiceServicer_to_server"]})
            args = AppArgs(engine=engine_args, api_keys_file=str(keys), limits=limits or {},
                           conversations={"store_path": str(Path(state) / "conversations.sqlite3")})
            serve.run(build_app(args), name="dlite", route_prefix="/")
            if engine_args.draft != "none" and engine_args.disaggregated_draft:
                worker = serve.get_deployment_handle("TargetWorker", app_name="dlite")
                while not worker.stats.remote().result().draft_connected:  # measure DLite, not its fallback
                    time.sleep(0.5)
            yield api_keys
        finally:
            serve.shutdown()
            ray.shutdown()


def run_loadtest(cfg: LoadTestConfig, engine, out_path: str | Path | None = None) -> dict:
    """Drive the clients, verify T = 0 replies against `engine`, write and return the report."""
    wait_until_ready(cfg)
    records, loops, wall = run_clients(cfg)
    report = summarize(cfg, records, loops, wall, check_greedy_replies(records, engine, cfg.max_tokens))
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=2))
    return report


def run(args) -> dict:
    """The CLI: start a local app (or --connect to one), run, print and write the report."""
    from dlite_ray.engine.engine import DLiteEngine
    from dlite_ray.serve.config import EngineArgs

    cfg = LoadTestConfig(clients=args.clients, duration_s=args.duration_s, max_tokens=args.max_tokens,
                         turns=args.turns, one_shot_fraction=args.one_shot_fraction,
                         actions_per_client=args.actions_per_client,
                         sampled_fraction=args.sampled_fraction, seed=args.seed,
                         api_keys=[k for k in (args.api_keys or "").split(",") if k])
    engine = DLiteEngine.from_pretrained(args.target, args.draft, dtype=args.dtype, adaptive_draft_length=False)
    out = Path(args.out) / "loadtest.json"
    if args.connect:
        cfg.http_url, cfg.grpc_address = f"http://{args.connect}:{args.http_port}", f"{args.connect}:{args.grpc_port}"
        report = run_loadtest(cfg, engine, out)
    else:
        engine_args = EngineArgs(target=args.target, draft=args.draft, dtype=args.dtype, adaptive_draft_length=False)
        with local_app(engine_args, args.tenants) as api_keys:
            cfg.api_keys = api_keys
            report = run_loadtest(cfg, engine, out)
    print(format_summary(report))
    print(f"report: {out}")
    return report


def format_summary(report: dict) -> str:
    lat, greedy = report["latency_s"], report["greedy"]

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    return (f"{report['requests']} requests ({report['requests_ok']} ok) in {report['wall_s']:.1f} s from "
            f"{report['config']['clients']} clients; errors {report['errors'] or 'none'} "
            f"(unexplained: {report['unexplained_errors']}); conversations {report['conversations']} "
            f"(lost: {report['lost_conversations']}); T=0 replies checked {greedy['checked']} "
            f"(mismatched: {greedy['mismatches']}); latency p50 {fmt(lat['p50'])} s, p99 {fmt(lat['p99'])} s; "
            f"{report['tokens_per_second']:.1f} tokens/s")

"""dlite-ray: one entry point (generate, fetch-model, build-kernels, bench, bench-suite, bench-ablation, bench-runtime,
bench-serve, bench-followup, loadtest, soak, train, draft-vocab, reply-corpus, gpu-check)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
import typing

from dlite_ray.constants import DEFAULT_MAX_NEW_TOKENS
from dlite_ray.engine.stream_text import TextStream

# "auto": bf16 where the CPU has AVX-512 BF16 or AMX (or on an accelerator), else float32
DTYPE_CHOICES = ["auto", "float32", "bfloat16"]

log = logging.getLogger("dlite_ray")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dlite-ray", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text (DLite by default, --draft none for plain decoding)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a user message (sent through the chat template)")
    src.add_argument("--messages-json", help="a JSON file with a list of {role, content} messages")
    gen.add_argument("--raw", action="store_true", help="send --prompt as raw text, without the chat template")
    _model_args(gen)
    gen.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--verify-mode", choices=["greedy", "rejection", "match"], default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable): the reply ends before it")
    gen.add_argument("--json-schema", default=None,
                     help="the reply must be JSON this schema accepts: JSON text, or @FILE ('{}' any JSON)")
    gen.add_argument("--json", action="store_true", help="print one JSON object")

    sub.add_parser("fetch-model", help="fetch and convert the default target into the user cache")
    sub.add_parser("build-kernels", help="build the CPU kernels now (make setup; else the first CPU load does)")

    rb = sub.add_parser("bench-runtime", help="decode tokens/s: our runtime vs transformers generate")
    rb.add_argument("--contexts", default="512,4096")
    rb.add_argument("--new-tokens", type=int, default=64)
    rb.add_argument("--repeats", type=int, default=3)
    rb.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)

    bench = sub.add_parser("bench", help="DLite vs plain decoding vs transformers' methods, side by side")
    bench.add_argument("--workload", default="dev",
                       help="dev, chat, code, tool-use, agentic, long-context, structured, forced-tools or a .jsonl; "
                            "a comma list, each optionally with its own prompt count (agentic:2)")
    bench.add_argument("--methods", default="dlite,ar,hf,hf-prompt-lookup,hf-assisted",
                       help="comma list of dlite, ar, hf, hf-prompt-lookup, hf-assisted, oracle, dlite-nocache, "
                            "dlite-b, dlite-nolookup (the draft without context lookup), dlite-corpus (copies from "
                            "the draft's reply corpus too), dlite-tree (with "
                            "tree verification: the draft's runners-up and other copies verified as branches), "
                            "dlite-fixed (full draft and copy length every round, no adaptive policy), lookup "
                            "(context lookup alone), llama.cpp and llama.cpp-bf16 "
                            "(llama-cpp-python on the target's GGUF as stored / converted to bf16; "
                            "pip install -e '.[llamacpp]')")
    bench.add_argument("--target", default=None)
    bench.add_argument("--draft", default="default")
    bench.add_argument("--draft-b", default="default",
                       help="the draft of method dlite-b, to compare two drafts in one run (default: the shipped one)")
    bench.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    bench.add_argument("--limit", type=int, default=6, help="prompts per workload")
    bench.add_argument("--max-new-tokens", type=int, default=96)
    bench.add_argument("--repeats", type=int, default=2)
    bench.add_argument("--concurrency", default=None,
                       help="also measure N requests in flight, e.g. 1,4,16 (dlite vs ar, continuous batching): short "
                            "requests fresh, and agent histories (over 1,024 tokens) prefix-cached, apart")
    bench.add_argument("--ramp", type=int, default=None, metavar="PEAK",
                       help="also measure a load ramping from 1 request in flight to PEAK and back (dlite vs ar)")
    bench.add_argument("--turns-in-flight", type=int, default=None,
                       help="also measure N of the agentic workload's turns in flight, their histories in the "
                            "prefix cache (dlite vs ar)")
    bench.add_argument("--out", default="runs/bench")

    suite = sub.add_parser("bench-suite", help="every published figure in one run (make bench): docs/bench")
    suite.add_argument("--out", default="docs/bench", help="results.json, report.md and the plots go here")
    suite.add_argument("--quick", action="store_true", help="every section small, in a few minutes (not figures)")
    suite.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)

    ab = sub.add_parser("bench-ablation", help="what each piece of dlite buys, against plain decoding: "
                        "docs/bench/ablation")
    ab.add_argument("--out", default="docs/bench/ablation", help="ablation.json and ablation.md go here")
    ab.add_argument("--workload", default="code,agentic:2,long-context:2")
    ab.add_argument("--limit", type=int, default=3, help="prompts per workload")
    ab.add_argument("--max-new-tokens", type=int, default=96)
    ab.add_argument("--repeats", type=int, default=3)
    ab.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)

    sv = sub.add_parser("bench-serve", help="tokens/s through the Serve app over gRPC vs the library engine")
    sv.add_argument("--workload", default="chat")
    sv.add_argument("--limit", type=int, default=4)
    sv.add_argument("--max-new-tokens", type=int, default=96)
    sv.add_argument("--repeats", type=int, default=1)
    sv.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    sv.add_argument("--cpu-threads", type=int, default=None,
                    help="the served target's torch threads (default: the config's, following the load)")

    fu = sub.add_parser("bench-followup", help="follow-up turn latency over gRPC: KV held by its lease vs evicted")
    fu.add_argument("--limit", type=int, default=3, help="agentic histories (~3-4K tokens each)")
    fu.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    fu.add_argument("--max-tokens", type=int, default=16)
    fu.add_argument("--kv-tokens", type=int, default=12288,
                    help="KV pool: room for the held history and one more, so the filler must evict")

    lt = sub.add_parser("loadtest", help="N concurrent clients (one-shot chats, tool loops) against the Serve app")
    lt.add_argument("--clients", type=int, default=4)
    lt.add_argument("--duration-s", type=float, default=60.0, help="start no new request after this")
    lt.add_argument("--actions-per-client", type=int, default=None,
                    help="fixed work instead of --duration-s: this many one-shot requests or tool loops per client")
    lt.add_argument("--max-tokens", type=int, default=32)
    lt.add_argument("--turns", type=int, default=3, help="assistant replies per tool loop")
    lt.add_argument("--one-shot-fraction", type=float, default=0.5)
    lt.add_argument("--sampled-fraction", type=float, default=0.2, help="one-shot requests at T > 0 (not verified)")
    lt.add_argument("--target", default=None, help="the served target, also the reference (default: embedded)")
    lt.add_argument("--draft", default="default")
    lt.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    lt.add_argument("--tenants", type=int, default=4, help="API keys of the app this command starts")
    lt.add_argument("--connect", default=None, help="host of a running app (loopback) instead of starting one")
    lt.add_argument("--http-port", type=int, default=8000)
    lt.add_argument("--grpc-port", type=int, default=9000)
    lt.add_argument("--api-keys", default=None, help="with --connect: comma list of keys the clients use")
    lt.add_argument("--seed", type=int, default=0)
    lt.add_argument("--out", default="runs/loadtest")

    sk = sub.add_parser("soak", help="the load test for long, with an abusive tenant and faults on a schedule")
    sk.add_argument("--solo-s", type=float, default=120.0, help="tenant B alone first, for its baseline latency")
    sk.add_argument("--duration-s", type=float, default=600.0, help="the soak: B, the abusive A and the faults")
    sk.add_argument("--fault-period-s", type=float, default=100.0, help="one fault this often (the first at half)")
    sk.add_argument("--faults", default="draft,target_worker,ingress,router", help="the kinds, in cycling order")
    sk.add_argument("--clients", type=int, default=3, help="tenant B's clients (the load test's mix)")
    sk.add_argument("--abusers", type=int, default=2, help="tenant A's threads")
    sk.add_argument("--flood-width", type=int, default=12, help="requests one abuser sends at once in a flood")
    sk.add_argument("--abuse-max-tokens", type=int, default=64, help="max_tokens of A's generation requests")
    sk.add_argument("--max-tokens", type=int, default=16, help="max_tokens of B's requests")
    sk.add_argument("--turns", type=int, default=3, help="assistant replies per tool loop")
    sk.add_argument("--one-shot-fraction", type=float, default=0.5)
    sk.add_argument("--sampled-fraction", type=float, default=0.2, help="B's one-shot requests at T > 0 (not verified)")
    sk.add_argument("--tenant-limit", type=int, default=4, help="the app's max_in_flight_per_tenant")
    sk.add_argument("--retry-window-s", type=float, default=120.0, help="how long B retries a failed request")
    sk.add_argument("--request-timeout-s", type=float, default=120.0)
    sk.add_argument("--max-p99-ratio", type=float, default=2.0, help="B's p99 latency, soak over solo, at most")
    sk.add_argument("--target", default=None, help="the served target, also the reference (default: embedded)")
    sk.add_argument("--draft", default="default")
    sk.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    sk.add_argument("--seed", type=int, default=0)
    sk.add_argument("--out", default="runs/soak", help="the report goes to OUT/soak.json")
    sk.add_argument("--every-fault", action="store_true",
                    help="go on past --duration-s until every planned fault has been injected and waited out")
    sk.add_argument("--quick", action="store_true",
                    help="every fault kind once in a 2-minute soak, one abuser (~4 min in all; make test runs it): "
                         "checks the harness and the correctness verdicts; no latency verdict (a 20 s solo phase "
                         "is no baseline)")

    tr = sub.add_parser("train", help="distil a DLite draft for a target (see dlite_ray/training)")
    from dlite_ray.training.cli_args import (  # keeps --help fast
        add_draft_vocab_args,
        add_reply_corpus_args,
        add_train_args,
    )

    add_train_args(tr)
    dv = sub.add_parser("draft-vocab", help="limit a draft to the tokens its training data says most often")
    add_draft_vocab_args(dv)
    rc = sub.add_parser("reply-corpus", help="ship the target's training replies with a draft, to copy from")
    add_reply_corpus_args(rc)

    gc = sub.add_parser("gpu-check", help="prove the GPU path on a device (random Qwen3-8B-shaped target, no Ray)")
    gc.add_argument("--out", default="gpu-check.json", help="the JSON report (rewritten after every section)")
    gc.add_argument("--small", action="store_true", help="tiny shapes (runs on a CPU in seconds)")
    gc.add_argument("--device", default=None, help="default: cuda when there is one, else cpu (with --small only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose or args.command != "generate" else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return COMMANDS[args.command](args)


def _model_args(p: argparse.ArgumentParser) -> None:
    """A flag per engine knob (--max-num-seqs for max_num_seqs), with EngineConfig's default and description."""
    from dlite_ray.engine.engine_config import knob_fields, knob_types

    hints = knob_types()
    for name, knob in knob_fields().items():
        p.add_argument("--" + name.replace("_", "-"), default=knob.default, help=knob.metadata["help"],
                       **_flag_reading(hints[name]))


def _flag_reading(hint) -> dict:
    """How argparse reads a knob of type `hint`: X | None as X (the default is None), str | Path as str,
    a bool as --x / --no-x, a Literal as its choices, a tuple as a list of values."""
    kind = [t for t in typing.get_args(hint) if t is not type(None)][0] if isinstance(hint, types.UnionType) else hint
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(kind) is typing.Literal:
        return {"choices": typing.get_args(kind)}
    if typing.get_origin(kind) is tuple:
        return {"type": typing.get_args(kind)[0], "nargs": "+"}
    return {"type": kind}


def engine_config(args):
    """The EngineConfig that a command's engine flags (_model_args) name."""
    from dlite_ray.engine.engine_config import config_from_knobs, knob_fields

    return config_from_knobs({name: getattr(args, name) for name in knob_fields()})


def _engine(args):
    from dlite_ray.engine.engine import DLiteEngine

    return DLiteEngine.from_config(engine_config(args))


def cmd_generate(args) -> int:
    from dlite_ray.engine.sequence import InvalidRequest

    try:
        if args.messages_json:
            with open(args.messages_json) as f:
                prompt = json.load(f)
        else:
            prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
        schema = args.json_schema
        if schema is not None and schema.startswith("@"):
            with open(schema[1:]) as f:
                schema = f.read()
        engine = _engine(args)
        stream = None if args.json else TextStream(engine.decode_output, tuple(args.stop))
        printer = None if stream is None else (lambda _i, toks: print(stream.push(toks, False), end="", flush=True))
        result = engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, verify_mode=args.verify_mode,
                                 stop=tuple(args.stop), json_schema=schema, callback=printer)[0]
    except (InvalidRequest, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if stream is not None:
        print(stream.push([], finished=True))  # what was held back, up to any stop
    if args.json:
        keys = ("accept_lengths", "copied_rounds", "mean_accept_length", "prefill_time", "decode_wall_time",
                "draft_time", "verify_time", "decode_tokens_per_second")
        stats = result.stats.as_dict()
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": {k: stats[k] for k in keys}}))
    return 0


def cmd_fetch_model(args) -> int:
    from dlite_ray.runtime.model_store import default_model_dir

    print(default_model_dir())
    return 0


def cmd_bench_runtime(args) -> int:
    from dlite_ray.bench.runtime_bench import run

    run([int(c) for c in args.contexts.split(",")], args.new_tokens, args.repeats, args.dtype)
    return 0


def cmd_bench(args) -> int:
    from dlite_ray.bench.runner import run

    run(args)
    return 0


def cmd_bench_ablation(args) -> int:
    from dlite_ray.bench.ablation import run

    run(args)
    return 0


def cmd_bench_suite(args) -> int:
    from dlite_ray.bench.suite import run

    run(args)
    return 0


def cmd_bench_followup(args) -> int:
    from dlite_ray.bench.followup_bench import run

    run(args)
    return 0


def cmd_bench_serve(args) -> int:
    from dlite_ray.bench.serve_bench import run

    run(args)
    return 0


def cmd_loadtest(args) -> int:
    from dlite_ray.bench.loadtest import run

    report = run(args)
    return 0 if not (report["unexplained_errors"] or report["lost_conversations"]
                     or report["greedy"]["mismatches"]) else 1


def cmd_build_kernels(args) -> int:
    import os

    from dlite_ray.runtime import fused_ops

    if os.environ.get("DLITE_FUSED_OPS", "1") == "0":
        print("build-kernels: DLITE_FUSED_OPS=0, nothing to build")
        return 0
    built = fused_ops.kernels() is not None
    where = fused_ops.kernel_build().directory
    print(f"build-kernels: {'built' if built else 'NOT built (eager operations; see the warning above)'} in {where}")
    return 0 if built else 1


def cmd_soak(args) -> int:
    from dlite_ray.bench.soak import run

    if args.quick:
        from dlite_ray.bench.soak import quick_args

        quick_args(args)
    return 0 if run(args)["verdict"]["pass"] else 1


def cmd_train(args) -> int:
    from dlite_ray.training.pipeline import run

    run(args)
    return 0


def cmd_draft_vocab(args) -> int:
    from dlite_ray.training.data import load_records
    from dlite_ray.training.pipeline import write_draft_vocab

    try:  # one record file in memory at a time
        write_draft_vocab([args.draft], (r for f in args.data for r in load_records(f)), args.size)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_reply_corpus(args) -> int:
    from dlite_ray.engine.engine_config import EngineConfig
    from dlite_ray.engine.loading import load_tokenizer, target_path
    from dlite_ray.training.data import load_records
    from dlite_ray.training.pipeline import without_held_out_prompts, write_reply_corpus

    try:  # one record file in memory at a time
        tokenizer = load_tokenizer(target_path(EngineConfig(target=args.target, draft=None)))
        records = (r for f in args.data for r in load_records(f))
        write_reply_corpus([args.draft], without_held_out_prompts(records, tokenizer))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_gpu_check(args) -> int:
    from pathlib import Path

    import torch

    from dlite_ray.gpu_check.run import run_checks

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda" and not args.small:
        print("gpu-check: no CUDA device; the full check needs one (--small runs the tiny shapes on a CPU)",
              file=sys.stderr)
        return 2
    report = run_checks(Path(args.out), args.small, device)
    print(json.dumps(report["exact"], indent=2))
    print(f"all_equal: {report['all_equal']}  ({report['elapsed_s']} s, report in {args.out})")
    return 0 if report["all_equal"] else 1


COMMANDS = {"generate": cmd_generate, "fetch-model": cmd_fetch_model, "build-kernels": cmd_build_kernels,
            "bench-runtime": cmd_bench_runtime,
            "bench": cmd_bench, "bench-serve": cmd_bench_serve, "bench-followup": cmd_bench_followup,
            "bench-suite": cmd_bench_suite, "bench-ablation": cmd_bench_ablation, "loadtest": cmd_loadtest,
            "soak": cmd_soak, "train": cmd_train,
            "draft-vocab": cmd_draft_vocab, "reply-corpus": cmd_reply_corpus, "gpu-check": cmd_gpu_check}

if __name__ == "__main__":
    sys.exit(main())

"""`dlite-ray gpu-check`: what a device session runs to prove the GPU path, in one command.

No Ray and no download: a random-weight Qwen3-8B-shaped target (bf16) and a 5-layer
draft are drawn on the device. The result is one JSON file, rewritten after every
section so that a run cut short still reports what it reached; every exactness check is
a boolean named `..._equal`. `--small` runs the same sections on tiny shapes (the CPU
test suite does, so the command never rots).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlite_ray.constants import KV_BLOCK_SIZE
from dlite_ray.engine.graph_runner import GraphConfig, is_graph_safe
from dlite_ray.engine.model_runner import ModelRunner
from dlite_ray.gpu_check import end_to_end, exactness, gemm_settings, timing, transport
from dlite_ray.gpu_check.random_models import (
    DRAFT_8B,
    DRAFT_SMALL,
    QWEN3_8B,
    QWEN3_SMALL,
    DraftDims,
    random_draft,
    random_target,
)
from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.attention import make_backend
from dlite_ray.runtime.attention.flash import flash_attn_available

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CheckPlan:
    target: dict[str, Any]
    draft: DraftDims
    prompt_lengths: list[int]  # ragged prompts for the equality checks
    new_tokens: int
    row_contexts: list[int]  # contexts of the row-exactness batch (one per sequence)
    step_shapes: list[tuple[int, int]]  # (batch, context) of the step timings
    draft_batches: list[int]
    bandwidth_mb: int
    end_to_end: list[tuple[int, int]]  # (batch, context) of the oracle-against-plain generations
    end_to_end_tokens: int  # new tokens per request there


# The full plan's budget: 8 minutes on one GPU, so that it runs twice in a quarter hour. The
# sections before `end_to_end` took 68 s on an H200 (gpu-check-h200-final.json); the steps
# run twice now (graphs off and on, with kernel counts), ~60 s with captures; end_to_end
# prefills 73 x 4K tokens twice and decodes 64 tokens per request (estimated 2-3 min).
FULL = CheckPlan(QWEN3_8B, DRAFT_8B, [37, 211, 530, 96, 1030, 64, 300, 17], 48,
                 [4000, 97, 1500, 33, 700, 2100, 260, 9000],
                 [(1, 4096), (8, 4096), (64, 4096), (1, 32768), (8, 32768)], [1, 8, 64], 4096,
                 [(1, 4096), (8, 4096), (64, 4096)], 64)
SMALL = CheckPlan(QWEN3_SMALL, DRAFT_SMALL, [9, 40, 23, 70, 12, 31, 5, 50], 24,
                  [300, 17, 90, 130], [(1, 256), (4, 1024)], [1, 4], 16,
                  [(1, 128), (4, 128)], 16)


def run_checks(out: Path, small: bool, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    plan = SMALL if small else FULL
    report: dict[str, Any] = {"plan": "small" if small else "qwen3-8b", "dtype": str(dtype).removeprefix("torch."),
                              "commit": _commit(), "versions": _versions(device)}
    started = time.perf_counter()

    def section(name: str, fn) -> Any:
        log.info("gpu-check: %s", name)
        t0 = time.perf_counter()
        report[name] = fn()
        report.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 2)
        _write(out, report, started, device)
        return report[name]

    target = random_target(plan.target, dtype, device)
    draft = random_draft(target, plan.target, **plan.draft)
    section("models", lambda: {"target_parameters": sum(p.numel() for p in target.parameters()),
                               "target_weight_bytes": _weight_bytes(target),
                               "draft_parameters": _draft_parameters(draft), "built_s": time.perf_counter() - started})
    section("linear_plan", lambda: _linear_plan(target))
    taps = (tuple(draft.cfg.target_layer_ids), draft.cfg.normed_last_tap)  # what the draft reads
    section("row_exactness", lambda: _row_exactness(target, taps, plan))
    section("greedy", lambda: {f"batch{b}": exactness.greedy_equality(
        target, draft, b, plan.prompt_lengths, plan.new_tokens, max_kv_tokens=32768) for b in (1, 8)})
    section("rejection", lambda: exactness.rejection_chi_square(device))
    section("steps", lambda: _step_times(target, taps, plan))
    section("graphs", lambda: _graph_steps(target, taps, plan, report["steps"]))
    section("small_ops", lambda: _eager_small_ops_steps(target, taps, plan, report["steps"]))
    section("draft", lambda: [timing.draft_times(draft, b) for b in plan.draft_batches])
    section("bandwidth", lambda: _bandwidth(target, device, plan))
    section("gemm_settings", lambda: gemm_settings.compare_settings(_linear_shapes(target.cfg), dtype, device))
    section("end_to_end", lambda: [end_to_end.compare(target, b, c, plan.end_to_end_tokens, cuda_graphs=True)
                                   for b, c in plan.end_to_end])
    # last: a draft process on the same device would skew the timings above
    section("transport", lambda: transport.one_device_pair(target, draft, plan.target, plan.draft, plan.prompt_lengths,
                                                           plan.new_tokens))
    report["exact"] = _exact_flags(report)
    report["all_equal"] = all(report["exact"].values())
    _write(out, report, started, device)
    return report


def _row_exactness(target, taps: tuple[tuple[int, ...], bool], plan: CheckPlan) -> dict:
    runner = ModelRunner(target, taps[0], sum(plan.row_contexts) + 1024, KV_BLOCK_SIZE, "auto",
                         normed_last_tap=taps[1])
    result = {"backend": runner.backend.name,
              "batch1": exactness.row_exactness(runner, plan.row_contexts[:1], target.cfg.vocab_size),
              "batch8": exactness.row_exactness(runner, plan.row_contexts, target.cfg.vocab_size)}
    del runner
    _free_cache()
    config = _graph_config(target, plan)
    if config is not None:  # the same check with both steps through the graph runner's buckets
        runner = ModelRunner(target, taps[0], sum(plan.row_contexts) + 1024, KV_BLOCK_SIZE, "auto",
                             normed_last_tap=taps[1], graphs=config)
        result["graphs_batch8"] = exactness.row_exactness(runner, plan.row_contexts, target.cfg.vocab_size)
        del runner
        _free_cache()
    return result


def _graph_config(target, plan: CheckPlan) -> GraphConfig | None:
    """CUDA graphs where the backend is graph-safe on CUDA; on a CPU the graph runner's
    padding, run eagerly; None on CUDA with a backend that is not graph-safe."""
    param = next(target.parameters())
    if param.device.type == "cuda" and not is_graph_safe(make_backend("auto", param.device, param.dtype)):
        return None
    return GraphConfig(max(b for b, _ in plan.step_shapes), (1, exactness.VERIFY_ROWS),
                       capture=param.device.type == "cuda")


def _step_times(target, taps: tuple[tuple[int, ...], bool], plan: CheckPlan,
                graphs: GraphConfig | None = None) -> list[dict]:
    kv_tokens = max(b * (c + 2 * KV_BLOCK_SIZE) for b, c in plan.step_shapes)
    runner = ModelRunner(target, taps[0], kv_tokens, KV_BLOCK_SIZE, "auto", normed_last_tap=taps[1], graphs=graphs)
    rows = [timing.step_times(runner, b, c) for b, c in plan.step_shapes]
    stats = runner.graphs.stats.to_dict() if runner.graphs is not None else None
    del runner
    _free_cache()
    return rows if stats is None else [dict(r, graph_stats=stats) for r in rows]


def _graph_steps(target, taps: tuple[tuple[int, ...], bool], plan: CheckPlan, eager: list[dict]) -> dict:
    """The steps again through the graph runner, beside the eager ones: CUDA graphs where
    the backend is graph-safe on CUDA; on a CPU its bucketing and padding run eagerly (the
    path checked, no speed claimed); on CUDA with a backend that is not graph-safe, skipped."""
    config = _graph_config(target, plan)
    if config is None:
        param = next(target.parameters())
        name = make_backend("auto", param.device, param.dtype).name
        return {"mode": "off", "reason": f"the {name} backend is not graph-safe", "steps": []}
    mode = "cuda_graphs" if config.capture else "padded_eager"
    rows = _step_times(target, taps, plan, config)
    side_by_side = [{"batch": g["batch"], "context": g["context"], "decode_ms": e["decode_ms"],
                     "graph_decode_ms": g["decode_ms"], "verify_ms": e["verify_ms"], "graph_verify_ms": g["verify_ms"],
                     "launches": e["launches"], "graph_launches": g["launches"]} for e, g in zip(eager, rows)]
    return {"mode": mode, "reason": None, "steps": side_by_side, "stats": rows[-1]["graph_stats"] if rows else None}


def _eager_small_ops_steps(target, taps: tuple[tuple[int, ...], bool], plan: CheckPlan, steps: list[dict]) -> dict:
    """The eager steps again with each layer's small operations as eager PyTorch calls
    (DLITE_TRITON_OPS=0), beside the steps through the Triton kernels (runtime/triton_ops.py):
    what those kernels save in time and launches. Only on CUDA where they serve."""
    if next(target.parameters()).device.type != "cuda" or fused_ops.triton_kernels() is None:
        return {"mode": "off", "reason": "the Triton small operations serve CUDA only, with triton installed",
                "steps": []}
    with _without_triton_ops():
        eager = _step_times(target, taps, plan)
    return {"mode": "triton_vs_eager", "reason": None,
            "steps": [{"batch": t["batch"], "context": t["context"], "decode_ms": t["decode_ms"],
                       "eager_ops_decode_ms": e["decode_ms"], "verify_ms": t["verify_ms"],
                       "eager_ops_verify_ms": e["verify_ms"], "launches": t["launches"],
                       "eager_ops_launches": e["launches"]} for t, e in zip(steps, eager)]}


@contextmanager
def _without_triton_ops() -> Iterator[None]:
    """The small operations as eager PyTorch calls inside the block (the way is otherwise
    settled once per process: `fused_ops.triton_kernels`)."""
    before = os.environ.get("DLITE_TRITON_OPS")
    os.environ["DLITE_TRITON_OPS"] = "0"
    fused_ops.triton_kernels.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["DLITE_TRITON_OPS"]
        else:
            os.environ["DLITE_TRITON_OPS"] = before
        fused_ops.triton_kernels.cache_clear()


def _bandwidth(target, device: torch.device, plan: CheckPlan) -> dict:
    gbs = timing.copy_bandwidth_gbs(device, plan.bandwidth_mb)
    weights = _weight_bytes(target)
    return {"copy_gb_per_s": gbs, "weight_bytes": weights, "weights_read_ms": weights / (gbs * 1e9) * 1000}


def _exact_flags(report: dict) -> dict[str, bool]:
    rows, greedy, rejection = report["row_exactness"], report["greedy"], report["rejection"]
    flags = {f"row_{b}_equal": rows[b]["equal"] for b in ("batch1", "batch8", "graphs_batch8") if b in rows}
    for b, result in greedy.items():
        flags[f"spec_greedy_{b}_equal"] = result["draft_equal"]
        flags[f"oracle_greedy_{b}_equal"] = result["oracle_equal"]
    # the law is kept if the exact sampler passes and the broken one is caught by the same test
    flags["rejection_law_equal"] = rejection["p_value"] > 1e-3 and rejection["broken_sampler_p_value"] < 1e-6
    flags["end_to_end_greedy_equal"] = all(row["greedy_equal"] for row in report["end_to_end"])
    flags["one_device_proposals_equal"] = report["transport"]["proposals_equal"]
    flags["killed_draft_greedy_equal"] = report["transport"]["killed_draft_greedy_equal"]
    return flags


def _linear_plan(target) -> dict:
    """How each linear shape is called to stay row-exact (frozen_linear.py): the fewest rows
    a call is padded to, and whether long calls are split into pieces."""
    layer = target.layers[0]
    named = {"qkv": layer.self_attn.qkv, "o_proj": layer.self_attn.o_proj.forward,
             "gate_up": layer.mlp.gate_up, "down_proj": layer.mlp.down_proj.forward, "lm_head": target.lm_head.forward}
    return {name: {"kind": type(f).__name__, "min_rows": getattr(f, "min_rows", None),
                   "split_rows": None if getattr(f, "max_rows", float("inf")) == float("inf") else f.max_rows}
            for name, f in named.items()}


def _linear_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each of a layer's linears, fused as frozen."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (q + 2 * kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q),
            "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size)}


def _commit() -> str:
    """The commit this check ran at: DLITE_COMMIT where set (a copy of the tree without its
    .git, as a device session gets), else the checkout's HEAD, else "unknown"."""
    if os.environ.get("DLITE_COMMIT"):
        return os.environ["DLITE_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                              timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() or "unknown"


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _draft_parameters(draft) -> int:
    shared = draft.embed_tokens.weight
    return sum(p.numel() for p in draft.parameters() if p is not shared)


def _versions(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "flash_attn": flash_attn_available(),
            "small_ops": "triton" if device.type == "cuda" and fused_ops.triton_kernels() is not None else "default"}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(cuda=torch.version.cuda, name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gb=round(props.total_memory / 2**30, 1))
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def _free_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write(out: Path, report: dict, started: float, device: torch.device) -> None:
    report["elapsed_s"] = round(time.perf_counter() - started, 1)
    if device.type == "cuda":
        report["peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))

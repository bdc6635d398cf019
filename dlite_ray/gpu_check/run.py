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
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlite_ray.constants import KV_BLOCK_SIZE
from dlite_ray.engine.model_runner import ModelRunner
from dlite_ray.gpu_check import exactness, gemm_settings, timing, transport
from dlite_ray.gpu_check.random_models import DRAFT_8B, DRAFT_SMALL, QWEN3_8B, QWEN3_SMALL, random_draft, random_target
from dlite_ray.runtime.attention.flash import flash_attn_available

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CheckPlan:
    target: dict[str, Any]
    draft: dict[str, int]
    prompt_lengths: list[int]  # ragged prompts for the equality checks
    new_tokens: int
    row_contexts: list[int]  # contexts of the row-exactness batch (one per sequence)
    step_shapes: list[tuple[int, int]]  # (batch, context) of the step timings
    draft_batches: list[int]
    bandwidth_mb: int


FULL = CheckPlan(QWEN3_8B, DRAFT_8B, [37, 211, 530, 96, 1030, 64, 300, 17], 48,
                 [4000, 97, 1500, 33, 700, 2100, 260, 9000],
                 [(1, 4096), (8, 4096), (64, 4096), (1, 32768), (8, 32768)], [1, 8, 64], 4096)
SMALL = CheckPlan(QWEN3_SMALL, DRAFT_SMALL, [9, 40, 23, 70, 12, 31, 5, 50], 24,
                  [300, 17, 90, 130], [(1, 256), (4, 1024)], [1, 4], 16)


def run_checks(out: Path, small: bool, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> dict:
    plan = SMALL if small else FULL
    report: dict[str, Any] = {"plan": "small" if small else "qwen3-8b", "dtype": str(dtype).removeprefix("torch."),
                              "versions": _versions(device)}
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
    section("draft", lambda: [timing.draft_times(draft, b) for b in plan.draft_batches])
    section("bandwidth", lambda: _bandwidth(target, device, plan))
    section("gemm_settings", lambda: gemm_settings.compare_settings(_linear_shapes(target.cfg), dtype, device))
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
    return result


def _step_times(target, taps: tuple[tuple[int, ...], bool], plan: CheckPlan) -> list[dict]:
    kv_tokens = max(b * (c + 2 * KV_BLOCK_SIZE) for b, c in plan.step_shapes)
    runner = ModelRunner(target, taps[0], kv_tokens, KV_BLOCK_SIZE, "auto", normed_last_tap=taps[1])
    rows = [timing.step_times(runner, b, c) for b, c in plan.step_shapes]
    del runner
    _free_cache()
    return rows


def _bandwidth(target, device: torch.device, plan: CheckPlan) -> dict:
    gbs = timing.copy_bandwidth_gbs(device, plan.bandwidth_mb)
    weights = _weight_bytes(target)
    return {"copy_gb_per_s": gbs, "weight_bytes": weights, "weights_read_ms": weights / (gbs * 1e9) * 1000}


def _exact_flags(report: dict) -> dict[str, bool]:
    rows, greedy, rejection = report["row_exactness"], report["greedy"], report["rejection"]
    flags = {f"row_{b}_equal": rows[b]["equal"] for b in ("batch1", "batch8")}
    for b, result in greedy.items():
        flags[f"spec_greedy_{b}_equal"] = result["draft_equal"]
        flags[f"oracle_greedy_{b}_equal"] = result["oracle_equal"]
    # the law is kept if the exact sampler passes and the broken one is caught by the same test
    flags["rejection_law_equal"] = rejection["p_value"] > 1e-3 and rejection["broken_sampler_p_value"] < 1e-6
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


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _draft_parameters(draft) -> int:
    shared = draft.embed_tokens.weight
    return sum(p.numel() for p in draft.parameters() if p is not shared)


def _versions(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "device": str(device),
            "flash_attn": flash_attn_available()}
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

"""Step times on the device: a decode step (1 row per request) against a verify step
(K + 1 rows per request) at several batch sizes and context lengths, the draft's round,
and the memory bandwidth that bounds them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from dlite_ray.engine.draft_graphs import DraftRoundGraphs
from dlite_ray.engine.model_runner import ModelRunner, RowInput
from dlite_ray.engine.sequence import SamplingParams, Sequence
from dlite_ray.gpu_check.exactness import VERIFY_ROWS
from dlite_ray.runtime.draft_model import DLiteDraftModel
from dlite_ray.runtime.sampling import RowSampling


def timed_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2, repeats: int = 7) -> float:
    """Median time of fn in ms, the device queue drained before each call: on CUDA between
    two events on the stream (the host's launches and the GPU's work both inside, nothing
    of the synchronisation after), elsewhere by the wall clock."""
    times = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
        if i >= warmup:
            times.append(elapsed)
    return 1000 * statistics.median(times)


# What the host calls to start work on the GPU (a graph replay is one call).
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
                "cudaMemcpyAsync", "cudaMemsetAsync")


def launch_counts(fn: Callable[[], object], device: torch.device) -> dict:
    """What one call of fn launches, from torch.profiler: on CUDA the host's launch calls
    (`host_launches`; a graph replay counts once) and the kernels the GPU ran
    (`device_kernels`); on a CPU, where nothing is launched, the aten operations run
    (`aten_ops`), a proxy for the same Python-side cost."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm: lazy initialisation and first-call work stay out of the count
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()
    if device.type != "cuda":
        return {"aten_ops": sum(1 for e in events if e.name.startswith("aten::"))}
    return {"host_launches": sum(1 for e in events if e.name in LAUNCH_CALLS),
            "device_kernels": sum(1 for e in events if e.device_type == DeviceType.CUDA)}


def copy_bandwidth_gbs(device: torch.device, megabytes: int) -> float:
    """Device memory bandwidth from a large copy (bytes read + written)."""
    src = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed_ms(lambda: dst.copy_(src), device)
    return 2 * src.numel() / (ms / 1000) / 1e9


def step_times(runner: ModelRunner, batch: int, context: int) -> dict:
    """Decode and verify forwards over `batch` sequences holding `context` positions each.
    The KV is allocated, not prefilled: attention reads as many keys either way."""
    seqs = []
    for _ in range(batch):
        seq = Sequence([1] * context, SamplingParams(max_new_tokens=VERIFY_ROWS))
        runner.blocks.ensure_capacity(seq.block_table, context + VERIFY_ROWS)
        seq.num_computed = context
        seqs.append(seq)

    def forward(rows: int):
        return lambda: runner.forward([RowInput(s, [1] * rows, num_outputs=rows) for s in seqs])

    device = runner.device
    decode, verify = timed_ms(forward(1), device), timed_ms(forward(VERIFY_ROWS), device)
    launches = {"decode": launch_counts(forward(1), device), "verify": launch_counts(forward(VERIFY_ROWS), device)}
    for seq in seqs:
        runner.blocks.free(seq.block_table)
    return {"batch": batch, "context": context, "decode_ms": decode, "verify_ms": verify,
            "verify_over_decode": verify / decode, "launches": launches}


def draft_times(draft: DLiteDraftModel, batch: int) -> dict:
    """One greedy drafting round of K tokens for `batch` requests."""
    param = next(draft.parameters())
    k = draft.cfg.max_draft_tokens
    features = torch.randn(batch, draft.cfg.num_slots, draft.cfg.layers.hidden_size, device=param.device,
                           dtype=param.dtype)
    groups = torch.ones(batch, draft.cfg.anchor_group_size, dtype=torch.long, device=param.device)
    sampling = RowSampling.build([0.0] * batch, [0] * batch, [1.0] * batch, [None] * batch, param.device)
    greedy = torch.ones(batch, dtype=torch.bool, device=param.device)
    ms = timed_ms(lambda: draft.propose(features, groups, k, sampling, greedy).tokens.tolist(), param.device)
    # the same round through DraftRoundGraphs: a CUDA graph on CUDA, padded eagerly elsewhere
    graphs = DraftRoundGraphs(draft, batch, capture=param.device.type == "cuda")
    graph_ms = timed_ms(lambda: graphs.propose(features, groups, k).tokens.tolist(), param.device)
    return {"batch": batch, "num_tokens": k, "propose_ms": ms, "graph_propose_ms": graph_ms,
            "graph_captured": graphs.stats.captured, "graph_failed": graphs.stats.failed}

"""Times the CPU decode-attention kernel (`fused_ops.decode_attention`) per layer call: a
sequence's 1 new row (decode) against 4, 8, 16 (verify), at 1K and 4K positions, bf16 and
float32, head dims 64 and 128, with SmolLM2-135M's heads (9 query, 3 KV).

Each layer has its own paged cache (blocks of 16 slots in shuffled order), and a repeat
calls every layer once, as a forward does, so a call reads its keys from memory rather than
from the cache its previous call warmed (--layers 1: from the cache). Medians over the
repeats, after warm-up; with --baseline, the kernel built from another version's sources is
timed alternately with this one in the same process (fairer on a busy machine):

    .venv/bin/python scripts/decode_attention_bench.py --threads 1
    mkdir -p /tmp/base && for f in $(git ls-tree --name-only REV dlite_ray/runtime/csrc/); do
        git show REV:$f > /tmp/base/$(basename $f); done
    .venv/bin/python scripts/decode_attention_bench.py --threads 1 --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from dlite_ray.runtime import fused_ops

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
BLOCK = 16  # slots per cache block


def paged_layers(layers: int, heads: tuple[int, int], head_dim: int, positions: int, dtype: torch.dtype,
                 seed: int = 0) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """`layers` (k_cache, v_cache) pairs [Hkv, slots, Dh] and the slots of positions [0, positions),
    blocks of BLOCK consecutive slots in shuffled order."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-positions // BLOCK)
    slots = (torch.randperm(blocks, generator=gen)[:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:positions]
    shape = (heads[1], blocks * BLOCK, head_dim)
    caches = [tuple(torch.randn(*shape, generator=gen).to(dtype) for _ in range(2)) for _ in range(layers)]
    return caches, slots


def time_layer_call(attend: Attend, rows: int, positions: int, dtype: torch.dtype, head_dim: int, *,
                    heads: tuple[int, int] = (9, 3), layers: int = 30, repeats: int = 15, warmup: int = 3) -> float:
    """Median seconds of one layer's call: `rows` new rows whose last is at position positions - 1."""
    caches, slots = paged_layers(layers, heads, head_dim, positions, dtype)
    q = torch.randn(rows, heads[0], head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    first = positions - rows
    sweeps = []
    for _ in range(warmup + repeats):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            attend(q, k_cache, v_cache, slots, first)
        sweeps.append((time.perf_counter() - start) / layers)
    return statistics.median(sweeps[warmup:])


def baseline_kernel(sources: Path) -> Attend:
    """decode_attention built from another version's csrc files (every .cpp in the folder)."""
    from torch.utils.cpp_extension import load

    files = sorted(str(path) for path in sources.glob("*.cpp"))
    return load("dlite_decode_baseline", files, extra_cflags=fused_ops.CFLAGS).decode_attention


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--positions", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="timings per kernel and case, alternating kernels")
    ap.add_argument("--layers", type=int, default=30, help="caches called in turn (SmolLM2-135M has 30)")
    ap.add_argument("--baseline", type=Path, default=None, help="a folder with another version's csrc files")
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    ops = fused_ops.kernels()
    if ops is None:
        raise SystemExit("the fused kernels did not build (see the log)")
    kernels = {"this": ops.decode_attention}
    if args.baseline is not None:
        kernels = {"baseline": baseline_kernel(args.baseline), **kernels}
    print(f"threads {torch.get_num_threads()}, heads 9/3, {args.layers} layers, "
          f"median of {args.rounds} x {args.repeats}; us a layer call (x the 1-row call)")
    print(f"{'dtype':>9} {'Dh':>4} {'positions':>9} {'rows':>4} " + " ".join(f"{name:>17}" for name in kernels))
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            if dtype not in fused_ops.kernel_dtypes():
                print(f"{dtype_name}: not built on this CPU")
                continue
            for head_dim, positions in itertools.product(args.head_dims, args.positions):
                one_row = {}
                for rows in args.rows:
                    seconds = {name: [] for name in kernels}
                    for _, (name, attend) in itertools.product(range(args.rounds), kernels.items()):
                        seconds[name].append(time_layer_call(attend, rows, positions, dtype, head_dim,
                                                             layers=args.layers, repeats=args.repeats))
                    cells = []
                    for name in kernels:
                        median = statistics.median(seconds[name])
                        if rows == 1:
                            one_row[name] = median
                        ratio = f"({median / one_row[name]:.2f})" if name in one_row else ""
                        cells.append(f"{median * 1e6:9.1f} {ratio:>7}")
                    print(f"{dtype_name:>9} {head_dim:>4} {positions:>9} {rows:>4} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()

"""The triton attention timing section on tiny shapes on CPU (Triton's interpreter, set by
tests/conftest.py), so the device session's command does not rot."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the triton attention timing needs the triton package (extra 'triton')")

from dlite_ray.gpu_check.attention_timing import SMALL, attention_times  # noqa: E402


def test_small_attention_timing_is_close_to_torch_and_row_exact():
    report = attention_times(torch.device("cpu"), torch.bfloat16, small=True)
    assert len(report["cases"]) == len(SMALL.cases) * len(SMALL.chunks)
    assert max(c["max_abs_error"] for c in report["cases"]) < 2e-2  # bf16 inputs and output, float32 sums
    assert all(c["ms"] > 0 for c in report["cases"])
    assert [(b["batch"], b["rows"]) for b in report["best_chunk"]] == [(b, r) for b, _, r in SMALL.cases]
    assert report["exact"] == {"triton_row_batch3_equal": True, "triton_row_verify8_equal": True}

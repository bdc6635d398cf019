"""`dlite-ray gpu-check --small` on CPU: every section runs on tiny shapes, so the device
session's command never rots, and its exactness flags hold here too."""

from __future__ import annotations

import json

import pytest
import torch

from dlite_ray.cli import main
from dlite_ray.gpu_check.run import _without_triton_ops, run_checks
from dlite_ray.runtime import fused_ops


def test_small_check_writes_every_section_and_all_flags_hold(tmp_path):
    out = tmp_path / "gpu-check.json"
    report = run_checks(out, small=True, device=torch.device("cpu"))
    written = json.loads(out.read_text())
    for section in ("commit", "versions", "models", "linear_plan", "row_exactness", "greedy", "rejection", "steps",
                    "graphs", "small_ops", "draft", "bandwidth", "end_to_end", "transport", "gemm_settings", "exact"):
        assert section in written, section
    assert len(written["commit"]) == 40 or written["commit"] == "unknown"
    for step in written["steps"]:
        assert step["launches"]["decode"]["aten_ops"] > 0 and step["launches"]["verify"]["aten_ops"] > 0
    graphs = written["graphs"]  # on a CPU the graph runner's padding runs eagerly, beside the plain steps
    assert graphs["mode"] == "padded_eager" and graphs["stats"]["padded_eager"] > 0
    assert report["exact"]["row_graphs_batch8_equal"]  # verify and decode rows through the buckets agree
    shapes = [(s["batch"], s["context"]) for s in written["steps"]]
    assert [(g["batch"], g["context"]) for g in graphs["steps"]] == shapes
    assert all(g["graph_decode_ms"] > 0 and g["graph_verify_ms"] > 0 for g in graphs["steps"])
    for row in written["draft"]:  # the round eagerly and through the graph runner's padded buffers
        assert row["propose_ms"] > 0 and row["graph_propose_ms"] > 0 and row["graph_captured"] == []
    assert written["small_ops"]["mode"] == "off"  # the Triton small operations serve CUDA only
    for row in written["end_to_end"]:
        assert set(row) >= {"batch", "context", "tau", "dlite_tokens_per_second", "ar_tokens_per_second"}
        assert row["dlite_tokens_per_second"] > 0 and row["ar_tokens_per_second"] > 0
        assert 4.0 <= row["tau"] <= 5.0, row  # the oracle's fixed acceptance: 4.5 but for the last rounds'
    assert [r["batch"] for r in written["end_to_end"]] == [1, 4]
    assert all(name.endswith("_equal") for name in report["exact"])
    assert report["exact"] and report["all_equal"], report["exact"]
    assert report["greedy"]["batch8"]["oracle_mean_accept_length"] > 2  # drafts were accepted, not only rejected
    assert report["rejection"]["broken_sampler_p_value"] < 1e-6  # the chi-square has power


def test_full_check_refuses_a_cpu_device(tmp_path, capsys):
    # `--device cpu` without `--small` is refused on any machine, a CUDA one included
    assert main(["gpu-check", "--out", str(tmp_path / "x.json"), "--device", "cpu"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_the_small_ops_section_switches_the_triton_kernels_off_and_back_on():
    pytest.importorskip("triton")
    assert fused_ops.triton_kernels() is not None
    with _without_triton_ops():
        assert fused_ops.triton_kernels() is None  # its steps run the eager small operations
    assert fused_ops.triton_kernels() is not None  # and the rest of the check the kernels again

"""`dlite-ray gpu-check --small` on CPU: every section runs on tiny shapes, so the device
session's command never rots, and its exactness flags hold here too."""

from __future__ import annotations

import json

import torch

from dlite_ray.cli import main
from dlite_ray.gpu_check.run import run_checks


def test_small_check_writes_every_section_and_all_flags_hold(tmp_path):
    out = tmp_path / "gpu-check.json"
    report = run_checks(out, small=True, device=torch.device("cpu"))
    written = json.loads(out.read_text())
    for section in ("versions", "models", "linear_plan", "row_exactness", "greedy", "rejection", "steps", "draft",
                    "bandwidth", "transport", "gemm_settings", "exact"):
        assert section in written, section
    assert all(name.endswith("_equal") for name in report["exact"])
    assert report["exact"] and report["all_equal"], report["exact"]
    assert report["greedy"]["batch8"]["oracle_mean_accept_length"] > 2  # drafts were accepted, not only rejected
    assert report["rejection"]["broken_sampler_p_value"] < 1e-6  # the chi-square has power


def test_full_check_refuses_a_cpu_device(tmp_path, capsys):
    # `--device cpu` without `--small` is refused on any machine, a CUDA one included
    assert main(["gpu-check", "--out", str(tmp_path / "x.json"), "--device", "cpu"]) == 2
    assert "no CUDA device" in capsys.readouterr().err

"""Deployment files validate against Serve's schema and our args model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["dlite.yaml", "qwen3-8b-h800.yaml"])
def test_deployment_yaml_validates(name):
    from ray.serve.schema import ServeDeploySchema

    from dlite_ray.serve.config import AppArgs

    data = yaml.safe_load((ROOT / "deployments" / name).read_text())
    ServeDeploySchema.model_validate(data)
    app = data["applications"][0]
    assert app["route_prefix"]  # an app without a prefix is unreachable over gRPC
    AppArgs.model_validate(app["args"])


def test_unknown_args_are_refused():
    from pydantic import ValidationError

    from dlite_ray.serve.config import AppArgs

    with pytest.raises(ValidationError):
        AppArgs.model_validate({"engine": {"drafts": "x"}})


def test_grpc_stubs_match_the_proto(tmp_path):
    import subprocess
    import sys

    env = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    subprocess.run([str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, env=env, cwd=ROOT)
    for f in ("dlite_pb2.py", "dlite_pb2_grpc.py"):
        assert (tmp_path / f).read_text() == (ROOT / "dlite_ray" / "serve" / "proto" / f).read_text()

"""Deployment files validate against Serve's schema and our args model."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["dlite.yaml", "qwen3-8b-h800.yaml"])
def test_deployment_yaml_validates(name, monkeypatch):
    from ray.serve.schema import ServeDeploySchema

    from dlite_ray.serve.config import AppArgs

    # the H800 config's conversations.store_url reads it, as every node of its cluster has it
    monkeypatch.setenv("DLITE_STORE_URL", "postgresql://dlite@dlite-postgres:5432/dlite")
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
    for f in ("dlite_pb2.py", "dlite_pb2.pyi", "dlite_pb2_grpc.py"):
        assert (tmp_path / f).read_text() == (ROOT / "dlite_ray" / "serve" / "proto" / f).read_text()


def test_engine_args_offer_every_engine_knob_with_its_default():
    """EngineConfig (its scheduler's knobs too) is the one list: a knob added there and not to
    EngineArgs fails here, as does a default or description written twice."""
    from dlite_ray.engine.engine_config import knob_fields
    from dlite_ray.serve.config import EngineArgs

    offered = EngineArgs.model_fields
    missing = sorted(knob_fields().keys() - offered.keys())
    assert not missing, f"EngineConfig knobs a deployment cannot set: {missing}"
    for name, knob in knob_fields().items():
        assert offered[name].default == knob.default, name
        assert offered[name].description == knob.metadata["help"], name


DEPLOYMENT_WITH_ENGINE_KNOBS = """
engine:
  draft: none
  max_num_seqs: 4
  max_batch_tokens: 256
  enable_prefix_cache: false
  block_size: 8
  boundary_capacity: 3
  verify_block_size: 5
  cuda_graphs: false
"""


def test_a_deployment_sets_the_scheduler_and_kv_knobs(tiny_serving_model):
    """The scheduler's and the KV pool's knobs, set in a deployment's args, reach the engine
    that the serve layer builds from them (its one conversion, engine_config)."""
    from dlite_ray.engine.engine import DLiteEngine
    from dlite_ray.engine.scheduler import SchedulerConfig
    from dlite_ray.serve.config import AppArgs
    from dlite_ray.serve.engine_factory import engine_config

    target_dir, _ = tiny_serving_model
    args = AppArgs.model_validate(yaml.safe_load(DEPLOYMENT_WITH_ENGINE_KNOBS)).engine
    engine = DLiteEngine.from_config(engine_config(args.model_copy(update={"target": str(target_dir)})))
    assert engine.scheduler.cfg == SchedulerConfig(max_num_seqs=4, max_batch_tokens=256)
    assert not engine.scheduler.blocks.enable_prefix_cache and engine.scheduler.boundaries is None
    assert engine.runner.block_size == 8 and engine.config.boundary_capacity == 3
    assert engine.config.verify_block_size == 5 and engine.draft is None


@pytest.mark.parametrize("knob", ["max_num_seqs", "max_batch_tokens", "block_size"])
def test_a_deployment_cannot_set_an_engine_knob_below_one(knob):
    from pydantic import ValidationError

    from dlite_ray.serve.config import AppArgs

    with pytest.raises(ValidationError, match=knob):
        AppArgs.model_validate({"engine": {knob: 0}})

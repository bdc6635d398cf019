"""Every shipped Serve config (deployments/*.yaml, the one cluster/rayservice-h800.yaml
embeds) holds Serve's gRPC proxy to the ingress's max_body_bytes, and lets a drained
TargetWorker finish its longest reply (issue 53 items 3 and 5)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
GRPC_CAP = "RAY_SERVE_GRPC_MAX_MESSAGE_SIZE"
# The slowest a request decodes on a loaded replica, per token, as the configs' comments
# derive their graceful_shutdown_timeout_s from: the embedded model on a 2-core CPU, a
# Qwen3-8B pair on an H800 at its max_ongoing_requests.
WORST_TOKEN_S = {"cpu": 0.25, "cuda": 0.05}


def _shipped() -> dict[str, dict]:
    configs = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "deployments").glob("*.yaml"))}
    rayservice = yaml.safe_load((ROOT / "cluster" / "rayservice-h800.yaml").read_text())
    configs["rayservice-h800.yaml"] = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    return configs


CONFIGS = _shipped()


@pytest.fixture(autouse=True)
def _store_url(monkeypatch):
    """The H800 configs' conversations.store_url reads it, as every node of their cluster has it."""
    monkeypatch.setenv("DLITE_STORE_URL", "postgresql://dlite@dlite-postgres:5432/dlite")


def _args(config: dict):
    from dlite_ray.serve.config import AppArgs

    (app,) = config["applications"]
    return AppArgs.model_validate(app["args"])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_caps_grpc_messages_near_max_body_bytes(name):
    from ray.serve.schema import ServeDeploySchema

    config = CONFIGS[name]
    schema = ServeDeploySchema.model_validate(config)
    cap = int(schema.controller_options.runtime_env["env_vars"][GRPC_CAP])
    max_body = _args(config).limits.max_body_bytes
    assert max_body <= cap <= 2 * max_body  # never below what the ingress takes, never 2 GiB


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_config_lets_a_drained_worker_finish_its_longest_reply(name):
    from ray.serve.schema import ServeDeploySchema

    config = CONFIGS[name]
    (app,) = ServeDeploySchema.model_validate(config).applications
    (worker,) = [d for d in app.deployments if d.name == "TargetWorker"]
    args = _args(config)
    longest_reply_s = args.limits.max_tokens_cap * WORST_TOKEN_S[args.engine.device]
    assert worker.graceful_shutdown_timeout_s >= longest_reply_s
    assert worker.graceful_shutdown_wait_loop_s <= 10  # a drained replica goes soon after its last reply


def test_serve_reads_the_cap_from_its_environment():
    """The mechanism the configs rely on: Serve's gRPC servers take their message limits
    from RAY_SERVE_GRPC_MAX_MESSAGE_SIZE in the environment of the process that starts them."""
    code = ("from ray.serve._private.constants import DEFAULT_GRPC_SERVER_OPTIONS as o; "
            "print(dict(o)['grpc.max_receive_message_length'])")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, GRPC_CAP: "4194304"},
                         capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split()[-1] == "4194304"

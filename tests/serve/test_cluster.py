"""cluster/: the Ray launcher YAML against Ray's own schema; the RayService's embedded
Serve config against Serve's schema and our args model."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_cluster_launcher_yaml_validates_against_ray_schema():
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster" / "h800-cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    worker = config["available_node_types"]["h800_worker"]
    assert worker["resources"]["GPU"] == 8 and worker["resources"]["accelerator_type:H800"] == 8
    assert worker["min_workers"] == 0 and worker["max_workers"] >= 1 and config["idle_timeout_minutes"] > 0


def test_rayservice_manifest():
    from ray.serve.schema import ServeDeploySchema

    from dlite_ray.serve.config import AppArgs

    manifest = yaml.safe_load((ROOT / "cluster" / "rayservice-h800.yaml").read_text())
    assert manifest["kind"] == "RayService" and manifest["apiVersion"] == "ray.io/v1"
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    group = cluster["workerGroupSpecs"][0]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"
    ports = {p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
    assert {8000, 9000} <= ports
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    AppArgs.model_validate(serve_config["applications"][0]["args"])

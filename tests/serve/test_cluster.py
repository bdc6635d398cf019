"""cluster/: the files that put deployments/qwen3-8b-h800.yaml on H800 nodes, checked without
a network or a cluster.

- the launcher YAML through Ray's own launcher preparation and schema (ray-schema.json);
- the RayService against cluster/schema/rayservice-v1.schema.json (hand-written, closed
  objects) and, given KUBERAY_CRD=<ray.io_rayservices.yaml>, against KubeRay's CRD itself;
- the embedded Serve config against Serve's schema, our AppArgs, and the deployment file;
- that a TargetWorker pair's placement group fits a worker node as Ray's autoscaler sees it;
- volumes, ports and the image in every place they must agree;
- cluster/fetch_models.py with a stand-in for the Hub;
- cluster/Dockerfile's versions against pyproject.toml and the installed Ray;
- cluster/postgres.yaml as Kubernetes objects (closed schemas on the RayService schema's pod
  definitions), and the conversation store's URL reaching the app from its Secret (KubeRay) or
  an env file (the launcher), never written in a config.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
HTTP_PORT, GRPC_PORT = 8000, 9000


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def rayservice() -> dict:
    return load("rayservice-h800.yaml")


def serve_config() -> dict:
    return yaml.safe_load((ROOT / "deployments" / "qwen3-8b-h800.yaml").read_text())


def head_pod() -> dict:
    return rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]


def worker_group() -> dict:
    (group,) = rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    return group


def containers(pod: dict) -> list[dict]:
    return pod["containers"] + pod.get("initContainers", [])


STORE_ENV = "DLITE_STORE_URL"  # what the shipped Serve config's conversations.store_url reads


@pytest.fixture(autouse=True)
def _store_url(monkeypatch):
    """Every node of the cluster has it (from the Secret, or the launcher's env file)."""
    monkeypatch.setenv(STORE_ENV, "postgresql://dlite@dlite-postgres:5432/dlite")


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)?", quantity)
    assert match, quantity
    return int(match[1]) * units.get(match[2] or "", 1)


# --- the Ray cluster launcher -------------------------------------------------------------

def test_launcher_yaml_passes_rays_own_preparation_and_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = load("h800-cluster.yaml")
    # What `ray up` does before it contacts the cloud: defaults, docker checks, schema.
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    worker = prepared["available_node_types"]["h800_worker"]
    assert worker["resources"]["GPU"] == 8 and worker["min_workers"] == 0 and worker["max_workers"] >= 1
    assert config["idle_timeout_minutes"] > 0 and worker["idle_timeout_s"] > 0


def test_launcher_provider_class_is_the_aliyun_one():
    from ray.autoscaler._private.providers import _DEFAULT_CONFIGS

    provider = load("h800-cluster.yaml")["provider"]
    module, _, name = provider["module"].rpartition(".")
    # Importing the module needs Alibaba's SDK; its source is in the Ray wheel either way.
    assert importlib.util.find_spec(module) is not None and name == "AliyunNodeProvider"
    for key in ("region", "zone_id", "cidr_block", "access_key", "access_key_secret", "key_name"):
        assert key in provider, key  # what Ray's Aliyun provider reads
    # Why `type: external`: the wheel's `type: aliyun` defaults file is missing. Once it ships,
    # this fails, and `type: aliyun` can come back.
    assert not Path(_DEFAULT_CONFIGS["aliyun"]()).exists(), "Ray ships aliyun/defaults.yaml again: use type: aliyun"


def test_launcher_runs_the_serving_image_with_weights_read_only():
    config = load("h800-cluster.yaml")
    image = config["docker"]["image"]
    assert image == rayservice_image()
    worker = config["available_node_types"]["h800_worker"]
    assert "-v /mnt/models:/models:ro" in config["docker"]["worker_run_options"]
    fetch = " ".join(worker["initialization_commands"])
    assert "-v /mnt/models:/models " in fetch and image in fetch and "cluster/fetch_models.py" in fetch


def test_launcher_exports_the_store_url_from_a_file_kept_out_of_git():
    config = load("h800-cluster.yaml")
    (remote,) = [r for r, local in config["file_mounts"].items() if local.endswith("dlite-store.env")]
    local = config["file_mounts"][remote]
    assert local.startswith("~/")  # beside the user's credentials, not in the repository (nor the image)
    for commands in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        (start,) = [c for c in commands if "ray start" in c]
        # exported before `ray start`: its raylet and every worker it starts inherit it
        assert f"set -a; . {remote}; set +a; ray start" in start, start


# --- the KubeRay RayService ---------------------------------------------------------------

def rayservice_image() -> str:
    pods = [head_pod(), worker_group()["template"]["spec"]]
    (image,) = {c["image"] for pod in pods for c in containers(pod)}
    return image


def test_rayservice_validates_against_the_checked_in_schema():
    import jsonschema

    schema = json.loads((CLUSTER / "schema" / "rayservice-v1.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator(schema).validate(rayservice())


def test_the_schema_refuses_what_kuberay_would_drop_or_refuse():
    import jsonschema

    schema = json.loads((CLUSTER / "schema" / "rayservice-v1.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)

    def fails(edit) -> bool:
        manifest = rayservice()
        edit(manifest)
        return not validator.is_valid(manifest)

    def spec(manifest: dict) -> dict:
        return manifest["spec"]

    def worker(manifest: dict) -> dict:
        return manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]

    assert fails(lambda m: spec(m).update(serviceUnhealthySecondThreshold=900))  # deprecated
    assert fails(lambda m: spec(m).update(deploymentUnhealthySecondThreshold=300))  # deprecated
    assert fails(lambda m: worker(m).update(maxReplica=2))  # misspelt
    assert fails(lambda m: worker(m)["template"]["spec"]["containers"][0]["ports"].append(
        {"containerPort": 9001, "name": "serve-grpc-extra"}))  # port names are <= 15 characters
    assert fails(lambda m: worker(m)["template"]["spec"]["volumes"][1].update(
        persistentVolumeClaim={"claimName": "x"}))  # one source per volume


def strict_crd_schema(crd: dict, version: str = "v1") -> dict:
    """The CRD's openAPIV3Schema with every object closed, as kubectl's strict field
    validation treats it (the API server would otherwise drop unknown fields silently)."""
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = copy.deepcopy(served["schema"]["openAPIV3Schema"])

    def close(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    return schema


def schema_paths(node: dict, defs: dict, prefix: tuple = ()) -> set[tuple]:
    """Property paths of a JSON schema, through $ref, 'items' as '[]'."""
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    paths = set()
    for key, sub in node.get("properties", {}).items():
        paths.add(prefix + (key,))
        paths |= schema_paths(sub, defs, prefix + (key,))
    if isinstance(node.get("items"), dict):
        paths |= schema_paths(node["items"], defs, prefix + ("[]",))
    return paths


@pytest.mark.skipif(not os.environ.get("KUBERAY_CRD"), reason="KUBERAY_CRD=<path to ray.io_rayservices.yaml> not set")
def test_rayservice_validates_against_kuberays_crd():
    """KUBERAY_CRD: ray-operator/config/crd/bases/ray.io_rayservices.yaml of KubeRay v1.6+
    (the same file `helm install kuberay-operator` applies)."""
    import jsonschema

    crd = yaml.safe_load(Path(os.environ["KUBERAY_CRD"]).read_text())
    strict = strict_crd_schema(crd)
    manifest = rayservice()
    strict["properties"]["metadata"] = {"type": "object"}  # the API server checks metadata itself
    jsonschema.Draft7Validator(strict).validate(manifest)
    # Every field the checked-in schema admits exists in KubeRay's.
    ours = json.loads((CLUSTER / "schema" / "rayservice-v1.schema.json").read_text())
    theirs = schema_paths(strict, {})
    mine = {p for p in schema_paths(ours, ours["$defs"]) if p[0] != "metadata" and "metadata" not in p[:-1]}
    assert not mine - theirs, sorted(mine - theirs)


def test_rayservice_embeds_the_deployment_file():
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    from dlite_ray.serve.config import AppArgs

    embedded = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    assert embedded == serve_config()
    ServeDeploySchema.model_validate(embedded)
    (app,) = embedded["applications"]
    args = AppArgs.model_validate(app["args"])
    AutoscalingConfig.model_validate(args.autoscaling)
    assert args.engine.device == "cuda" and args.engine.target.startswith("/models/")
    assert args.engine.draft.startswith("/models/")
    assert (embedded["http_options"]["port"], embedded["grpc_options"]["port"]) == (HTTP_PORT, GRPC_PORT)


def test_http_and_grpc_are_exposed():
    ports = {p["name"]: p["containerPort"] for p in head_pod()["containers"][0]["ports"]}
    # KubeRay (>= 1.6) builds the serve service from the head's ports named serve / serve-*.
    assert ports["serve"] == HTTP_PORT and ports["serve-grpc"] == GRPC_PORT
    worker_ports = {p["containerPort"] for p in worker_group()["template"]["spec"]["containers"][0]["ports"]}
    assert {HTTP_PORT, GRPC_PORT} <= worker_ports
    service_ports = {p["name"]: p for p in rayservice()["spec"]["serveService"]["spec"]["ports"]}
    assert service_ports["serve"]["port"] == HTTP_PORT and service_ports["serve-grpc"]["port"] == GRPC_PORT
    assert service_ports["serve-grpc"]["appProtocol"] == "kubernetes.io/h2c"


def test_shared_memory_weights_and_gpus_in_the_pods():
    for pod, start_params in ((head_pod(), rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]),
                              (worker_group()["template"]["spec"], worker_group())):
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in containers(pod):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, mount  # every mount has its volume
        (shm,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        empty_dir = volumes[shm["name"]]["emptyDir"]
        assert empty_dir["medium"] == "Memory"
        # Ray's object store must fit in /dev/shm, or Ray falls back to disk.
        assert int(start_params["rayStartParams"]["object-store-memory"]) < quantity_bytes(empty_dir["sizeLimit"])

    pod = worker_group()["template"]["spec"]
    serving = pod["containers"][0]
    (models,) = [m for m in serving["volumeMounts"] if m["mountPath"] == "/models"]
    assert models["readOnly"] is True
    (fetch,) = pod["initContainers"]
    assert [m for m in fetch["volumeMounts"] if m["mountPath"] == "/models" and not m.get("readOnly")]
    assert "cluster/fetch_models.py" in " ".join(fetch["command"])
    claim = {v["name"]: v for v in pod["volumes"]}[models["name"]]["persistentVolumeClaim"]["claimName"]
    pvc = load("models-pvc.yaml")
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["metadata"]["name"] == claim
    assert set(pvc["spec"]["accessModes"]) & {"ReadWriteMany", "ReadOnlyMany"}  # every node mounts it

    limits = serving["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == serving["resources"]["requests"]["nvidia.com/gpu"]
    assert int(limits["nvidia.com/gpu"]) == int(worker_group()["resources"]["GPU"])  # Ray's num-gpus
    assert "nvidia.com/gpu" not in head_pod()["containers"][0]["resources"]["limits"]


# --- the conversation store: cluster/postgres.yaml and its Secret ---------------------------

def postgres_objects() -> dict[str, dict]:
    objects = [o for o in yaml.safe_load_all((CLUSTER / "postgres.yaml").read_text()) if o is not None]
    by_kind = {o["kind"]: o for o in objects}
    assert len(by_kind) == len(objects), "one object of each kind"
    return by_kind


def kubernetes_schemas() -> dict[str, dict]:
    """Closed schemas of a Service and a StatefulSet (from Kubernetes' API reference, the fields
    in use), on the RayService schema's definitions of metadata, pod templates and quantities:
    a misspelt or misplaced field fails, as kubectl's strict validation would refuse it."""
    ray = json.loads((CLUSTER / "schema" / "rayservice-v1.schema.json").read_text())
    defs = ray["$defs"]
    name = {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
    labels = {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 1}

    def closed(required: list[str], **properties) -> dict:
        return {"type": "object", "additionalProperties": False, "required": required, "properties": properties}

    def kind(api_version: str, kind_name: str, spec: dict) -> dict:
        return {"$defs": defs, **closed(["apiVersion", "kind", "metadata", "spec"], apiVersion={"const": api_version},
                                        kind={"const": kind_name}, metadata={"$ref": "#/$defs/objectMeta"}, spec=spec)}

    service_ports = defs["service"]["properties"]["spec"]["properties"]["ports"]
    claim = closed(["metadata", "spec"], metadata={"$ref": "#/$defs/objectMeta"}, spec=closed(
        ["accessModes", "resources"],
        accessModes={"type": "array", "minItems": 1,
                     "items": {"enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"]}},
        storageClassName={"type": "string"},
        resources=closed(["requests"], requests=closed(["storage"], storage={"$ref": "#/$defs/quantity"}))))
    return {
        "Service": kind("v1", "Service", closed(["selector", "ports"], type={"enum": ["ClusterIP", "NodePort",
                                                                                      "LoadBalancer"]},
                                                 clusterIP={"type": "string"}, selector=labels, ports=service_ports)),
        "StatefulSet": kind("apps/v1", "StatefulSet", closed(
            ["selector", "serviceName", "template"], replicas={"type": "integer", "minimum": 0}, serviceName=name,
            selector=closed(["matchLabels"], matchLabels=labels), template={"$ref": "#/$defs/podTemplate"},
            volumeClaimTemplates={"type": "array", "items": claim},
            podManagementPolicy={"enum": ["OrderedReady", "Parallel"]})),
    }


def test_postgres_manifest_is_a_service_and_a_statefulset_with_its_volume():
    import jsonschema

    objects, schemas = postgres_objects(), kubernetes_schemas()
    assert set(objects) == {"Service", "StatefulSet"}
    for kind_name, manifest in objects.items():
        jsonschema.Draft202012Validator(schemas[kind_name]).validate(manifest)
    service, stateful = objects["Service"], objects["StatefulSet"]
    pod = stateful["spec"]["template"]
    # the Service finds the pod, the StatefulSet owns it and names the Service
    assert stateful["spec"]["serviceName"] == service["metadata"]["name"]
    assert stateful["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in {p["containerPort"] for p in container["ports"]} and port["port"] == 5432
    # the data on the PVC the StatefulSet makes, in a subdirectory (initdb refuses a lost+found)
    (claim,) = stateful["spec"]["volumeClaimTemplates"]
    (data,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    env = {e["name"]: e for e in container["env"]}
    assert env["PGDATA"]["value"].startswith(data["mountPath"] + "/")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and stateful["spec"]["replicas"] == 1
    assert "value" not in env["POSTGRES_PASSWORD"]  # from the Secret, below

    def refused(edit) -> bool:
        manifest = copy.deepcopy(stateful)
        edit(manifest)
        return not jsonschema.Draft202012Validator(schemas["StatefulSet"]).is_valid(manifest)

    assert refused(lambda m: m["spec"].update(serviceNmae="x"))  # the schema is closed
    assert refused(lambda m: m["spec"]["template"]["spec"]["containers"][0].update(envv=[]))


def secret_command() -> tuple[str, dict[str, str]]:
    """The Secret cluster/README.md has you create for the database of postgres.yaml (the one
    command with a password): its name and its --from-literal keys."""
    text = (CLUSTER / "README.md").read_text()
    commands = re.findall(r"kubectl create secret generic (\S+)((?:\s*\\?\n?\s*--from-literal=\S+)+)", text)
    (command,) = [(name, literals) for name, literals in commands if "--from-literal=password=" in literals]
    return command[0], dict(re.findall(r"--from-literal=(\w+)=(\S+)", command[1]))


def test_the_apps_store_url_comes_from_the_secret_the_database_reads():
    from urllib.parse import urlsplit

    from dlite_ray.serve.config import AppArgs

    (app,) = serve_config()["applications"]
    conversations = app["args"]["conversations"]
    written = conversations["store_url"]
    assert written == "${" + STORE_ENV + "}"  # the whole URL from the environment: no password in a config
    assert urlsplit(written).password is None
    args = AppArgs.model_validate(app["args"])
    assert args.conversations.router_replicas == 2 and args.conversations.store_location().startswith("postgresql")

    # every Ray container (the app is built, and its routers run, on any node) reads it from
    # the Secret whose password the database is started with
    stateful = postgres_objects()["StatefulSet"]
    (db,) = stateful["spec"]["template"]["spec"]["containers"]
    db_password = {e["name"]: e for e in db["env"]}["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    for pod in (head_pod(), worker_group()["template"]["spec"]):
        ray_container = pod["containers"][0]
        (ref,) = [e["valueFrom"]["secretKeyRef"] for e in ray_container["env"] if e["name"] == STORE_ENV]
        assert ref["name"] == db_password["name"] and ref["key"] == "url" and not ref.get("optional")

    # and the README's command makes that Secret, with a URL that reaches the Service as the
    # database's own user, into its own database
    name, literals = secret_command()
    assert name == db_password["name"] and {db_password["key"], "url"} <= set(literals)
    url = urlsplit(literals["url"].strip("'\""))
    db_env = {e["name"]: e.get("value") for e in db["env"]}
    assert url.scheme == "postgresql" and url.hostname == postgres_objects()["Service"]["metadata"]["name"]
    assert url.port == 5432 and url.username == db_env["POSTGRES_USER"] and url.path == "/" + db_env["POSTGRES_DB"]


# --- a TargetWorker pair on a worker node ---------------------------------------------------

def target_worker_placement() -> tuple[list[dict], str, int]:
    from ray.serve.deployment import Application

    from dlite_ray.serve.app import build_app

    (app,) = serve_config()["applications"]
    pending = [build_app(app["args"])]
    while pending:
        deployment = pending.pop()._bound_deployment
        if deployment.name == "TargetWorker":
            replica = deployment._replica_config
            return (replica.placement_group_bundles, replica.placement_group_strategy,
                    app["args"]["autoscaling"]["max_replicas"])
        pending += [a for a in [*deployment.init_args, *deployment.init_kwargs.values()] if isinstance(a, Application)]
    raise AssertionError("no TargetWorker in the app")


def pairs_per_node(node: dict, bundles: list[dict]) -> int:
    need: dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0) + amount
    assert set(need) <= set(node), f"the node offers no {set(need) - set(node)}"
    return min(math.floor(node[key] / amount + 1e-9) for key, amount in need.items())


def test_a_pair_fits_one_worker_node_as_the_autoscalers_see_it():
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    bundles, strategy, max_replicas = target_worker_placement()
    assert strategy == "STRICT_PACK" and len(bundles) == 2 and all(b["GPU"] == 1 for b in bundles)
    kuberay_node = _get_ray_resources_from_group_spec(worker_group(), is_head=False)
    launcher = load("h800-cluster.yaml")
    launcher_node = launcher["available_node_types"]["h800_worker"]
    for node, max_nodes in ((kuberay_node, worker_group()["maxReplicas"]),
                            (launcher_node["resources"], launcher_node["max_workers"])):
        pairs = pairs_per_node(node, bundles)
        assert pairs == node["GPU"] // 2 == 4
        assert pairs * max_nodes >= max_replicas  # the node maxima can hold Serve's max_replicas
        assert pairs * (max_nodes - 1) < max_replicas  # and no node more
    head = _get_ray_resources_from_group_spec(rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"], is_head=True)
    assert not head.get("GPU")


# --- weights ---------------------------------------------------------------------------------

def _load_fetch_models(monkeypatch):
    """cluster/fetch_models.py as a module (registered: its dataclass looks itself up there)."""
    spec = importlib.util.spec_from_file_location("fetch_models", CLUSTER / "fetch_models.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fetch_models", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture()
def fetch_models(monkeypatch):
    module = _load_fetch_models(monkeypatch)
    calls = []

    def fake_download(repo_id: str, revision: str, local_dir: Path, source) -> None:
        calls.append(repo_id)
        module.last_download = (repo_id, revision, source)
        local_dir.mkdir(parents=True, exist_ok=True)
        if repo_id == module.DEFAULT_TARGET_REPO:
            shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
            (local_dir / "model.safetensors.index.json").write_text(
                json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
            for name in [*shards, "config.json", "tokenizer_config.json"]:
                (local_dir / name).write_text("{}")
        else:
            (local_dir / "config.json").write_text(json.dumps({"dlite_config": {"architecture_version": "dlite_v1"}}))
            (local_dir / "model.safetensors").write_text("")

    monkeypatch.setattr(module, "snapshot_download", fake_download)
    return module, calls


def test_fetch_models_downloads_once_then_only_checks(fetch_models, tmp_path):
    module, calls = fetch_models
    assert module.main(["--models-dir", str(tmp_path)]) == 0
    assert calls == [module.DEFAULT_TARGET_REPO, module.DEFAULT_DRAFT_REPO]
    # The directories deployments/qwen3-8b-h800.yaml reads.
    engine = serve_config()["applications"][0]["args"]["engine"]
    assert engine["target"] == f"/models/{module.TARGET_DIR}" and engine["draft"] == f"/models/{module.DRAFT_DIR}"
    assert module.main(["--models-dir", str(tmp_path)]) == 0 and len(calls) == 2  # complete: no Hub call
    (tmp_path / module.TARGET_DIR / "model-00002-of-00002.safetensors").unlink()  # a shard lost
    assert module.main(["--models-dir", str(tmp_path)]) == 0 and calls[2:] == [module.DEFAULT_TARGET_REPO]


def test_fetch_models_refuses_a_draft_without_dlite_config(fetch_models, tmp_path, monkeypatch):
    module, _ = fetch_models
    draft = tmp_path / module.DRAFT_DIR
    monkeypatch.setattr(module, "snapshot_download", lambda repo_id, revision, local_dir, source: (
        local_dir.mkdir(parents=True, exist_ok=True), (local_dir / "config.json").write_text("{}")))
    assert module.main(["--models-dir", str(tmp_path)]) == 1
    assert "config.json:dlite_config" in module.draft_missing(draft)


def test_fetch_models_from_a_mirror_or_modelscope(fetch_models, tmp_path, monkeypatch):
    module, _ = fetch_models
    monkeypatch.setenv("HF_ENDPOINT", "https://hf-mirror.example")
    assert module.main(["--models-dir", str(tmp_path / "a")]) == 0
    assert module.last_download == (module.DEFAULT_DRAFT_REPO, "main", module.Source("huggingface",
                                                                                    "https://hf-mirror.example"))
    monkeypatch.delenv("HF_ENDPOINT")
    assert module.main(["--models-dir", str(tmp_path / "b"), "--source", "modelscope"]) == 0
    assert module.last_download == (module.DEFAULT_DRAFT_REPO, "master", module.Source("modelscope"))
    assert module.main(["--models-dir", str(tmp_path / "c"), "--source", "modelscope", "--endpoint", "x"]) == 1


def test_fetch_models_hands_the_source_to_the_downloader(tmp_path, monkeypatch):
    """What reaches huggingface_hub and modelscope (stand-ins: neither is reachable here)."""
    import types

    import huggingface_hub

    module = _load_fetch_models(monkeypatch)
    seen = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: seen.append(("hf", kw)))
    module.snapshot_download("Qwen/Qwen3-8B", "main", tmp_path, module.Source(endpoint="https://m.example"))
    assert seen[-1] == ("hf", {"repo_id": "Qwen/Qwen3-8B", "revision": "main", "local_dir": str(tmp_path),
                               "endpoint": "https://m.example"})
    monkeypatch.setitem(sys.modules, "modelscope", None)  # not installed
    with pytest.raises(RuntimeError, match="pip install modelscope"):
        module.snapshot_download("Qwen/Qwen3-8B", "master", tmp_path, module.Source("modelscope"))
    fake = types.ModuleType("modelscope")
    fake.snapshot_download = lambda repo, **kw: seen.append(("ms", repo, kw))
    monkeypatch.setitem(sys.modules, "modelscope", fake)
    module.snapshot_download("Qwen/Qwen3-8B", "master", tmp_path, module.Source("modelscope"))
    assert seen[-1] == ("ms", "Qwen/Qwen3-8B", {"revision": "master", "local_dir": str(tmp_path)})


# --- the image -------------------------------------------------------------------------------

def dockerfile_args() -> dict[str, str]:
    text = (CLUSTER / "Dockerfile").read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, flags=re.MULTILINE))


def test_dockerfile_versions_agree_with_the_project():
    import ray

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    args = dockerfile_args()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["serve"]
    pins = dict(re.match(r"([\w\[\]-]+)==(\S+)", d).groups() for d in declared if "==" in d)
    ray_version, py, cuda = re.fullmatch(r"rayproject/ray:([\d.]+)-py(\d+)-(cu\d+)", args["RAY_IMAGE"]).groups()
    assert ray_version == ray.__version__ and pins["ray[serve]"].rstrip(".*") in ray_version
    assert rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == ray_version
    assert py == "311"  # the Python of this project's venv and of the wheels below
    assert args["TORCH_VERSION"] == pins["torch"]
    torch_major_minor = ".".join(pins["torch"].split(".")[:2])
    # flash-attn's wheel must match torch X.Y, its CUDA build, CPython 3.11 and x86_64.
    wheel = args["FLASH_ATTN_WHEEL"].rsplit("/", 1)[1]
    assert re.fullmatch(rf"flash_attn-[\d.]+\+{args['TORCH_CUDA']}torch{re.escape(torch_major_minor)}"
                        rf"(cxx11abi(TRUE|FALSE))?-cp{py}-cp{py}-linux_x86_64\.whl", wheel), wheel
    assert args["TORCH_CUDA"][:4] == cuda[:4]  # one CUDA major version (12) in base image and torch


def test_the_image_installs_the_postgres_client():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dockerfile = re.sub(r"#.*", "", (CLUSTER / "Dockerfile").read_text())
    (installed,) = re.findall(r'pip install [^\n]*"/home/ray/dlite-ray\[([\w,]+)\]"', dockerfile)
    chosen = installed.split(",")
    assert "serve" in chosen and [e for e in chosen if any(d.startswith("psycopg") for d in extras[e])]
    assert "dlite_ray.serve.conversation_pg" in dockerfile  # imported at build: psycopg and libpq load


def test_nothing_builds_flash_attn_from_source():
    tomllib = pytest.importorskip("tomllib")
    gpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    # PyPI has flash-attn only as a source distribution: an extra naming it compiles CUDA for hours.
    assert not [d for d in gpu if d.lower().startswith(("flash-attn", "flash_attn"))]
    dockerfile = (CLUSTER / "Dockerfile").read_text()
    assert "[gpu]" not in re.sub(r"#.*", "", dockerfile) and "--no-deps \"${FLASH_ATTN_WHEEL}\"" in dockerfile
    assert "[gpu]" not in (CLUSTER / "h800-cluster.yaml").read_text()


def test_the_image_carries_what_the_nodes_run():
    ignored = (CLUSTER / "Dockerfile.dockerignore").read_text().split()
    # fetch_models.py and the deployment file are run from the image's copy of the repository.
    assert not {"cluster", "cluster/", "deployments", "deployments/", "dlite_ray"} & set(ignored)
    assert ".venv" in ignored and ".git" in ignored
    assert "COPY --chown=1000:100 . /home/ray/dlite-ray" in (CLUSTER / "Dockerfile").read_text()

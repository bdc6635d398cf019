"""One Ray + Serve instance per test session, with a tiny model that speaks the default
tokenizer (vocabulary 49152) and a random draft, served by the real application."""

from __future__ import annotations

import shutil
import socket

import pytest


def _free_port() -> int:
    """A port the OS has just handed out: two sessions on one host never share one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# chosen once per session, when this conftest is first imported (test modules import them from here)
HTTP_PORT, GRPC_PORT = _free_port(), _free_port()
KEYS = {"tenant-a": "key-a", "tenant-b": "key-b"}
AUTH_A = {"authorization": "Bearer key-a"}
GRPC_A = (("application", "dlite"), ("authorization", "Bearer key-a"))
GRPC_B = (("application", "dlite"), ("authorization", "Bearer key-b"))


@pytest.fixture(scope="session")
def tiny_serving_model(tmp_path_factory, default_model_dir):
    import torch

    from dlite_ray.runtime.draft_config import DraftConfig
    from dlite_ray.runtime.draft_model import DLiteDraftModel
    from dlite_ray.runtime.loading import load_target
    from tests.conftest import make_tiny_checkpoint, read_config

    root = tmp_path_factory.mktemp("serve")
    target_dir = make_tiny_checkpoint(root / "target", "llama", vocab=49152)
    for f in default_model_dir.glob("tokenizer*"):
        shutil.copy(f, target_dir)
    for f in default_model_dir.glob("*.jinja"):
        shutil.copy(f, target_dir)
    target = load_target(target_dir)
    cfg = DraftConfig.for_target(read_config(target_dir), 1, 3, 8, mask_token_id=0)
    torch.manual_seed(0)
    DLiteDraftModel(cfg, target.embed_tokens).save(root / "draft", dtype=torch.float32)
    return target_dir, root / "draft"


@pytest.fixture(scope="session")
def ray_serve():
    """The session's one Ray + Serve instance: every module that needs Ray gets this one,
    whether it runs alone or in the suite, and it ends with the session."""
    import ray
    from ray import serve

    # two logical GPUs: enough to place a GPU pair's bundles and see what each actor gets
    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT},
                grpc_options={"port": GRPC_PORT, "grpc_servicer_functions": [
                    "dlite_ray.serve.grpc_service.add_DLiteServiceServicer_to_server"]})
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(ray_serve, tiny_serving_model, tmp_path_factory):
    from ray import serve

    from dlite_ray.serve.app import build_app
    from dlite_ray.serve.config import AppArgs, EngineArgs

    target_dir, draft_dir = tiny_serving_model
    root = tmp_path_factory.mktemp("serve-state")
    (root / "keys").write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    # float32, not "auto": these tests compare served logprobs with the library's exactly,
    # and in bf16 they differed in the 4th decimal (an open question, not a serving one)
    args = AppArgs(engine=EngineArgs(target=str(target_dir), draft=str(draft_dir), disaggregated_draft=True,
                                     dtype="float32", adaptive_draft_length=False, reply_cache_tokens=0,
                                     max_kv_tokens=8192,
                                     draft_timeout_s=10, cpu_threads=2),
                   api_keys_file=str(root / "keys"), conversations={"store_path": str(root / "conv.sqlite3")})
    handle = serve.run(build_app(args), name="dlite", route_prefix="/")
    yield handle, args
    serve.delete("dlite")


@pytest.fixture(scope="module")
def tiny_pair(tiny_dirs, tmp_path_factory):
    """(target dir, target, draft dir): a random draft saved for a child process to load."""
    import torch

    from dlite_ray.runtime.loading import load_target
    from tests.conftest import read_config
    from tests.engine.conftest import random_draft

    target_dir = tiny_dirs["llama"]
    target = load_target(target_dir)
    draft_dir = tmp_path_factory.mktemp("pair") / "draft"
    random_draft(target, read_config(target_dir)).save(draft_dir, dtype=torch.float32)
    return target_dir, target, draft_dir


@pytest.fixture(scope="module")
def postgres():
    """A real PostgreSQL server for the module (tests/serve/postgres_server.py); a test that
    stops it starts it again."""
    from tests.serve.postgres_server import PostgresServer

    server = PostgresServer()
    server.start()
    yield server
    server.remove()


@pytest.fixture
def database(postgres) -> str:
    """The URL of a fresh database on the module's server."""
    return postgres.new_database()

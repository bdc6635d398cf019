"""The PostgreSQL that `make setup` brings where none is installed: the binaries in the
pgserver wheel (the `postgres` extra) run the suite's server and hold the store."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dlite_ray.serve.conversation_store import open_store
from tests.serve.postgres_server import PostgresServer


def test_the_bundled_binaries_serve_the_store():
    spec = importlib.util.find_spec("pgserver")
    assert spec is not None and spec.submodule_search_locations, "the postgres extra (pgserver) is not installed"
    bundled = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    server = PostgresServer(bundled)
    try:
        server.start()
        store = open_store(server.url)
        conv = store.create("a", [{"role": "user", "content": "hi"}])
        store.begin_turn("a", conv.id, [])
        store.finish_turn("a", conv.id, 1, "hello", None, 60)
        other = open_store(server.url)
        assert [m["content"] for m in other.get("a", conv.id).messages] == ["hi", "hello"]
        other.close()
        health = store.health()
        assert health.reachable and health.backend == "postgresql"
        store.close()
    finally:
        server.remove()
    assert server.bin_dir == bundled

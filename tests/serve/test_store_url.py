"""`conversations.store_url` picks the store's backend; anything else is refused at load with
what is accepted, and never with the URL's password."""

from __future__ import annotations

import pydantic
import pytest

from dlite_ray.serve.config import AppArgs, ConversationArgs
from dlite_ray.serve.store_url import parse_store_url


@pytest.mark.parametrize(("url", "parsed"), [
    ("sqlite:///conv.db", ("sqlite", "conv.db")),
    ("sqlite:////var/lib/dlite/conv.db", ("sqlite", "/var/lib/dlite/conv.db")),
    ("conv.sqlite3", ("sqlite", "conv.sqlite3")),
    ("postgresql://dlite@db:5432/dlite", ("postgresql", "postgresql://dlite@db:5432/dlite")),
    ("postgres://dlite@db/dlite?sslmode=require", ("postgresql", "postgres://dlite@db/dlite?sslmode=require")),
])
def test_the_accepted_forms(url, parsed):
    assert parse_store_url(url) == parsed


@pytest.mark.parametrize("url", ["redis://:s3cret@gcs:6379/0", "postgresql://dlite:s3cret@db:5432", "sqlite://x.db"])
def test_anything_else_is_refused_at_load_without_its_password(url):
    with pytest.raises(pydantic.ValidationError) as refused:
        AppArgs(conversations={"store_url": url})
    message = str(refused.value)
    assert "store_url" in message and ("sqlite:///PATH" in message or "postgresql://USER@HOST:PORT/DB" in message)
    assert "s3cret" not in message


def test_without_a_url_the_sqlite_file_of_store_path_as_before():
    assert ConversationArgs().store_location() == "sqlite:///dlite-conversations.sqlite3"
    assert ConversationArgs(store_path="/tmp/c.db").store_location() == "sqlite:////tmp/c.db"
    assert parse_store_url(ConversationArgs(store_path="/tmp/c.db").store_location()) == ("sqlite", "/tmp/c.db")


# --- ${NAME}: the URL from the environment (a Kubernetes Secret, an env file) -------------------

SECRET_URL = "postgresql://dlite:s3cret@dlite-postgres:5432/dlite"


def test_a_url_from_the_environment_is_expanded_where_the_store_opens_never_kept(monkeypatch):
    import pickle

    monkeypatch.setenv("DLITE_STORE_URL", SECRET_URL)
    args = AppArgs(conversations={"store_url": "${DLITE_STORE_URL}", "router_replicas": 2})
    assert args.conversations.store_url == "${DLITE_STORE_URL}"  # as written: the config holds no password
    assert b"s3cret" not in pickle.dumps(args)  # nor what Serve ships to each replica
    assert args.conversations.store_location() == SECRET_URL  # what the router opens
    assert parse_store_url(args.conversations.store_location())[0] == "postgresql"


def test_an_unset_variable_is_refused_at_load_by_name(monkeypatch):
    monkeypatch.delenv("DLITE_STORE_URL", raising=False)
    # Left as it is, "${DLITE_STORE_URL}" would read as a SQLite file of that name on one node.
    with pytest.raises(pydantic.ValidationError, match=r"DLITE_STORE_URL\}, which is not set"):
        AppArgs(conversations={"store_url": "${DLITE_STORE_URL}"})
    monkeypatch.setenv("DLITE_STORE_URL", "")
    with pytest.raises(pydantic.ValidationError, match="not set"):
        AppArgs(conversations={"store_url": "${DLITE_STORE_URL}"})


def test_the_expanded_url_is_checked_too(monkeypatch):
    monkeypatch.setenv("DLITE_STORE_URL", "redis://:s3cret@gcs:6379/0")
    with pytest.raises(pydantic.ValidationError) as refused:
        AppArgs(conversations={"store_url": "${DLITE_STORE_URL}"})
    assert "'redis' is not supported" in str(refused.value) and "s3cret" not in str(refused.value)
    monkeypatch.setenv("DLITE_STORE_URL", "sqlite:///conv.db")  # a file on one node: not for 2 routers
    with pytest.raises(pydantic.ValidationError, match="router_replicas = 2 needs a store every replica shares"):
        AppArgs(conversations={"store_url": "${DLITE_STORE_URL}", "router_replicas": 2})


def test_the_store_opens_where_the_variable_says(tmp_path, monkeypatch):
    from dlite_ray.serve.conversation_store import open_store

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DLITE_STORE_DIR", str(tmp_path / "store"))
    (tmp_path / "store").mkdir()
    args = ConversationArgs(store_url="sqlite:///${DLITE_STORE_DIR}/conv.db")
    store = open_store(args.store_location())
    try:
        conv = store.create("tenant-a", [{"role": "user", "content": "hello"}])
        assert store.get("tenant-a", conv.id).messages == [{"role": "user", "content": "hello"}]
    finally:
        store.close()
    assert (tmp_path / "store" / "conv.db").is_file()

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

"""Where the conversation store lives, as one setting (`conversations.store_url`).

- `sqlite:///PATH`: a SQLite file (SQLAlchemy's spelling: `sqlite:///rel/path.db` is relative
  to the working directory, `sqlite:////abs/path.db` absolute); a bare path means the same.
- `postgresql://USER[:PASSWORD]@HOST[:PORT]/DB[?sslmode=...]` (or `postgres://`): a
  PostgreSQL server, in libpq's URI form, handed to psycopg as it is. Its password had
  better come from PGPASSWORD, ~/.pgpass or an environment variable than from the YAML.
- `${NAME}` anywhere in it is the environment variable NAME of the process that opens the
  store (`expand_env`): `store_url: "${DLITE_STORE_URL}"` takes the whole URL, password
  included, from a Kubernetes Secret or an env file on each node (cluster/README.md,
  section 6), and one Serve config serves clusters with different databases.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("sqlite", "postgresql", "postgres")
_ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand_env(url: str, environ: Mapping[str, str] | None = None) -> str:
    """`url` with each `${NAME}` replaced by the environment variable NAME (`environ`, else
    os.environ). Expanded where the store is opened and where the config is checked, never
    written back into the config, so the password travels in no pickled argument. ValueError
    naming the variable (not any value) when one is unset or empty."""
    env = os.environ if environ is None else environ

    def value(match: re.Match[str]) -> str:
        name = match[1]
        if not env.get(name):
            raise ValueError(f"the conversation store's URL reads ${{{name}}}, which is not set in the "
                             f"environment of this process: set {name} on every node that runs Ray "
                             f"(cluster/README.md, section 6)")
        return env[name]

    return _ENV_REFERENCE.sub(value, url)


def parse_store_url(url: str) -> tuple[str, str]:
    """(backend, where): ("sqlite", a file path or ":memory:") or ("postgresql", the URI).
    ValueError, saying what is accepted, for anything else."""
    if "://" not in url:
        if not url.strip():
            raise ValueError("the conversation store's location is empty")
        return "sqlite", url
    scheme = url.split("://", 1)[0].lower()
    if scheme == "sqlite":
        path = url[len("sqlite:///"):] if url.lower().startswith("sqlite:///") else ""
        if not path:
            raise ValueError(f"a SQLite store URL is sqlite:///PATH (sqlite:////abs/path for an absolute path), "
                             f"got {redacted(url)!r}")
        return "sqlite", path
    if scheme in ("postgresql", "postgres"):
        if not urlsplit(url).path.strip("/"):
            raise ValueError(f"a PostgreSQL store URL names its database: postgresql://USER@HOST:PORT/DB, "
                             f"got {redacted(url)!r}")
        return "postgresql", url
    raise ValueError(f"the conversation store is sqlite:///PATH or postgresql://USER@HOST:PORT/DB; "
                     f"{scheme!r} is not supported (got {redacted(url)!r})")


def redacted(url: str) -> str:
    """`url` without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))

"""A real PostgreSQL server for the tests, started by the suite itself on this machine.

The binaries: $DLITE_PG_BIN, else a system install (`postgres` on PATH, /usr/lib/postgresql/N/bin),
else the ones bundled in the `pgserver` wheel (the `postgres` extra, so `make setup` brings
them to a machine without PostgreSQL). The server: `initdb` into a fresh directory, then
`postgres` on 127.0.0.1 at a free port (its socket in that directory too), with fsync off
(a test's data need not survive a power cut). PostgreSQL refuses to run as root, so under
root it runs as the `postgres` user (or `nobody`). Never a mock or an in-process fake.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

READY_WAIT_S = 60.0  # how long a starting server may take before the suite gives up (not a test threshold)


def postgres_bin_dir() -> Path | None:
    """Where initdb and postgres are, or None."""
    candidates = [os.environ.get("DLITE_PG_BIN")]
    on_path = shutil.which("postgres")
    candidates.append(str(Path(on_path).parent) if on_path else None)
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    bundled = importlib.util.find_spec("pgserver")  # its files only: importing it has side effects
    if bundled is not None and bundled.submodule_search_locations:
        candidates += [str(Path(d) / "pginstall" / "bin") for d in bundled.submodule_search_locations]
    for c in candidates:
        if c and (Path(c) / "postgres").is_file() and (Path(c) / "initdb").is_file():
            return Path(c)
    return None


def _version(path: str) -> int:
    digits = Path(path).parent.name
    return int(digits) if digits.isdigit() else 0


class PostgresServer:
    """One server in its own directory: `start()`, `stop()`, `start()` again on the same data
    and port (a restart), `remove()` at the end. `url` is what the store connects to."""

    def __init__(self, bin_dir: Path | None = None):
        found = bin_dir or postgres_bin_dir()
        if found is None:
            raise RuntimeError("no PostgreSQL binaries (initdb, postgres): install the system package or run "
                               "`make setup` (the `postgres` extra brings pgserver's)")
        self.bin_dir = found
        self.root = Path(tempfile.mkdtemp(prefix="dlite-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self.port = _free_port()
        self.url = f"postgresql://dlite@127.0.0.1:{self.port}/postgres"
        self._as_user: dict = {}
        if os.geteuid() == 0:
            account = _unprivileged_account()
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._as_user = {"user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
        self._proc: subprocess.Popen | None = None
        subprocess.run([str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", "dlite", "--auth=trust",
                        "-E", "UTF8", "--no-sync", "--no-instructions"], check=True, capture_output=True,
                       cwd=self.root, **self._as_user)

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [str(self.bin_dir / "postgres"), "-D", str(self.data), "-h", "127.0.0.1", "-p", str(self.port),
                 "-k", str(self.root), "-c", "fsync=off", "-c", "full_page_writes=off", "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.root, **self._as_user)
        self._wait_ready()

    def stop(self) -> None:
        """A fast shutdown (SIGINT): clients' connections are cut, as a crash or a failover cuts them."""
        if self._proc is not None:
            self._proc.send_signal(2)
            self._proc.wait(timeout=READY_WAIT_S)
            self._proc = None

    def new_database(self) -> str:
        """A fresh, empty database on this server (one per test: no test sees another's
        rows); its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def _wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + READY_WAIT_S
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"postgres exited ({self._proc.returncode}): {self.log.read_text()[-2000:]}")
            try:
                psycopg.connect(self.url, connect_timeout=2).close()
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"postgres did not accept connections: {self.log.read_text()[-2000:]}") from exc
                time.sleep(0.2)


def _unprivileged_account() -> pwd.struct_passwd:
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("running as root and no 'postgres' or 'nobody' account to run PostgreSQL as")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

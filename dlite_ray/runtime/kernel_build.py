"""Building the C++ kernels at a known step, into a directory of their own, without ever
waiting forever.

torch's extension loader guards a build directory with a bare `lock` file that records no
owner: a process killed mid-build leaves it behind, and every later load spins on it
forever at 0% CPU. So a build here:

- goes to a directory keyed by a hash of the sources, the flags, the CPU tag, Python's and
  torch's versions: two checkouts with different sources never share (or import) each other's build;
- holds an OS lock (`flock` on OWNER_LOCK) for the whole load: the kernel frees it when
  its process dies, so a torch `lock` found while holding it has no live owner and is
  removed;
- waits for a live builder only up to a deadline, then raises KernelBuildTimeout (the
  caller runs the eager operations and says so);
- imports a module already linked there directly, without asking ninja again.

`dlite-ray build-kernels` (run by `make setup` and the Dockerfile) builds ahead of first use.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

OWNER_LOCK = "dlite-build.lock"  # flock'ed by the process that loads or builds here
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton
LOCK_POLL_S = 0.2

# torch.utils.cpp_extension.load, called by keyword (tests pass a stand-in)
Loader = Callable[..., ModuleType]


class KernelBuildTimeout(RuntimeError):
    """Another live process held the build past the deadline."""


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One build of the kernels: what is compiled, how, for which CPU, under which root."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    cpu_tag: str
    root: Path
    headers: tuple[Path, ...] = ()  # included by the sources: part of the key, not compiled

    @property
    def key(self) -> str:
        digest = hashlib.sha256()
        for part in (sys.implementation.cache_tag, torch.__version__, self.cpu_tag, *self.cflags):
            digest.update(part.encode() + b"\0")
        for source in (*self.sources, *self.headers):
            digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
        return digest.hexdigest()[:16]

    @property
    def module_name(self) -> str:
        return f"{self.name}_{self.key}"

    @property
    def directory(self) -> Path:
        return self.root / self.module_name


def default_root() -> Path:
    """torch's extension root (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/...)."""
    from torch.utils.cpp_extension import get_default_build_root

    # torch's own helper ignores TORCH_EXTENSIONS_DIR (only its loader reads it)
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def load_kernels(build: KernelBuild, wait_s: float, loader: Loader | None = None) -> ModuleType:
    """The built module, building it first where needed; KernelBuildTimeout when another
    live process holds the build for longer than `wait_s`."""
    if loader is None:
        from torch.utils.cpp_extension import load

        loader = load
    directory = build.directory
    directory.mkdir(parents=True, exist_ok=True)
    with _owner_lock(directory / OWNER_LOCK, wait_s):
        _remove_stale_torch_lock(directory)
        built = _import_built(build, directory)
        if built is not None:
            return built
        return loader(name=build.module_name, sources=[str(s) for s in build.sources],
                      extra_cflags=list(build.cflags), build_directory=str(directory))


def _import_built(build: KernelBuild, directory: Path) -> ModuleType | None:
    """The module already linked in this directory, imported without asking ninja: the
    directory's name is the key of what was compiled, while ninja compares whole command
    lines, which differ between processes that see another compiler or include path (seen:
    Ray's actors and the test suite rebuilt the same sources in turn, minutes each on 2
    cores, until a draft actor's start timed out). None where nothing was linked yet, or
    what was is unreadable (a link killed midway): then the loader builds."""
    library = directory / f"{build.module_name}.so"
    if not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(build.module_name, library)
    if spec is None or spec.loader is None:
        return None
    try:
        module = importlib.util.module_from_spec(spec)  # dlopen: where a truncated file fails
        spec.loader.exec_module(module)
    except ImportError as exc:
        log.warning("rebuilding the kernels: %s does not load (%s)", library, exc)
        return None
    return module


@contextlib.contextmanager
def _owner_lock(path: Path, wait_s: float) -> Iterator[None]:
    """flock(path) for the block, polled until `wait_s` has passed (flock has no timeout)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelBuildTimeout(
                        f"another process has held the kernel build in {path.parent} for over {wait_s:.0f} s"
                    ) from None
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _remove_stale_torch_lock(directory: Path) -> None:
    """Under the owner lock no live process builds here: a torch lock is a dead build's."""
    stale = directory / TORCH_LOCK
    if stale.exists():
        log.warning("removing %s, left by a kernel build that did not finish", stale)
        stale.unlink(missing_ok=True)

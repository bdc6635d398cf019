"""The kernel build never waits forever and never shares a build across source sets
(runtime/kernel_build.py). No real compile here: tiny fake sources and a stand-in loader
that guards the directory with torch's own FileBaton, as torch's loader does."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dlite_ray.runtime import fused_ops
from dlite_ray.runtime.kernel_build import OWNER_LOCK, TORCH_LOCK, KernelBuild, KernelBuildTimeout, load_kernels

REPO = Path(__file__).resolve().parents[2]


def _build(tmp_path: Path, source_text: str, flags: tuple[str, ...] = ("-O3",), name: str = "src") -> KernelBuild:
    source = tmp_path / name / "k.cpp"
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_text(source_text)
    return KernelBuild("fake_ops", (source,), flags, "cpu0", tmp_path / "root")


def test_two_source_sets_get_two_build_directories(tmp_path):
    a = _build(tmp_path, "int f() { return 1; }", name="checkout_a")
    b = _build(tmp_path, "int f() { return 2; }", name="checkout_b")
    same_as_a = _build(tmp_path, "int f() { return 1; }", name="checkout_c")
    assert a.directory != b.directory
    assert a.directory == same_as_a.directory  # the key is the content, not the checkout's path
    assert _build(tmp_path, "int f() { return 1; }", ("-O2",), name="d").directory != a.directory
    assert KernelBuild("fake_ops", a.sources, a.cflags, "cpu1", a.root).directory != a.directory


def test_the_shipped_build_is_keyed_by_its_sources_and_headers():
    build = fused_ops.kernel_build()
    assert {p.name for p in build.headers} >= {"kernels.h"}
    assert build.key in build.directory.name


# A process that loads the kernels, with a stand-in loader that waits on torch's FileBaton
# exactly as torch.utils.cpp_extension.load does (forever, while a `lock` file exists).
STARTER = textwrap.dedent("""
    import sys, types
    from pathlib import Path
    from torch.utils.file_baton import FileBaton
    from dlite_ray.runtime.kernel_build import KernelBuild, load_kernels

    def torch_like_loader(name, sources, extra_cflags, build_directory):
        baton = FileBaton(str(Path(build_directory) / "lock"))
        if baton.try_acquire():
            baton.release()
        else:
            baton.wait()
        return types.ModuleType(name)

    source = Path(sys.argv[1])
    build = KernelBuild("fake_ops", (source,), ("-O3",), "cpu0", Path(sys.argv[2]))
    print("loaded", load_kernels(build, wait_s=60, loader=torch_like_loader).__name__)
""")


def test_a_lock_left_by_a_killed_build_does_not_stop_the_next_start(tmp_path):
    build = _build(tmp_path, "int f() { return 1; }")
    build.directory.mkdir(parents=True)
    (build.directory / TORCH_LOCK).touch()  # what a build killed midway leaves: no owner alive
    done = subprocess.run([sys.executable, "-c", STARTER, str(build.sources[0]), str(build.root)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert f"loaded {build.module_name}" in done.stdout
    assert "did not finish" in done.stderr  # the removal is logged
    assert not (build.directory / TORCH_LOCK).exists()


def _hold_owner_lock(build: KernelBuild) -> int:
    """What a live builder holds for the whole build (released when the fd closes)."""
    build.directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(build.directory / OWNER_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_live_builder_is_waited_on_until_the_deadline_only(tmp_path):
    build = _build(tmp_path, "int f() { return 1; }")
    fd = _hold_owner_lock(build)
    calls = []
    try:
        with pytest.raises(KernelBuildTimeout, match="held the kernel build"):
            load_kernels(build, wait_s=0.3, loader=lambda **kw: calls.append(kw))
    finally:
        os.close(fd)
    assert calls == []  # never built under another's feet
    assert load_kernels(build, wait_s=0.3, loader=lambda **kw: kw["name"]) == build.module_name


def test_a_start_during_a_live_build_past_the_deadline_runs_eagerly_and_says_so(tmp_path):
    env = os.environ | {"TORCH_EXTENSIONS_DIR": str(tmp_path), "DLITE_KERNEL_BUILD_WAIT_S": "0.5",
                        "DLITE_FUSED_OPS": "1"}
    os.environ["TORCH_EXTENSIONS_DIR"] = str(tmp_path)
    try:
        build = fused_ops.kernel_build()
    finally:
        del os.environ["TORCH_EXTENSIONS_DIR"]
    fd = _hold_owner_lock(build)
    try:
        code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
                "from dlite_ray.runtime import fused_ops; print('kernels:', fused_ops.kernels())")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env=env)
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    assert "kernels: None" in done.stdout
    assert "using eager PyTorch operations" in done.stderr


def _link_module(path: Path, name: str) -> None:
    """A real, minimal extension module `name` at `path` (plain CPython, no torch)."""
    import sysconfig

    source = path.with_suffix(".c")
    source.write_text(textwrap.dedent(f"""
        #include <Python.h>
        static struct PyModuleDef def = {{PyModuleDef_HEAD_INIT, "{name}", NULL, -1, NULL}};
        PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&def); }}
    """))
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(path)],
                   check=True)


def test_a_module_already_linked_is_imported_without_the_loader(tmp_path):
    """ninja compares whole command lines, which differ between processes (Ray's actors saw
    another include path): the directory's key already says what was compiled."""
    build = _build(tmp_path, "int f() { return 1; }")
    build.directory.mkdir(parents=True)
    _link_module(build.directory / f"{build.module_name}.so", build.module_name)
    calls = []
    module = load_kernels(build, wait_s=1, loader=lambda **kw: calls.append(kw))
    assert module.__name__ == build.module_name and calls == []


def test_an_unreadable_module_is_built_again(tmp_path):
    build = _build(tmp_path, "int f() { return 2; }")
    build.directory.mkdir(parents=True)
    (build.directory / f"{build.module_name}.so").write_bytes(b"a link killed midway")
    rebuilt = load_kernels(build, wait_s=1, loader=lambda name, **kw: sys.modules.setdefault(name, "built"))
    assert rebuilt == "built"

"""Packaging: every third-party module that dlite_ray imports is declared in pyproject.toml
(in the core, or in the extra of the subpackage that imports it), and the core library
(runtime, engine, CLI) imports nothing of the serving or benchmark stack, so that it works
installed without its extras."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dlite_ray"
# The extras a subpackage's imports may come from, besides the core (runtime, engine, cli.py: core only).
# serve/conversation_pg.py (store_url: postgresql://...) imports psycopg, of the `postgres` extra.
EXTRAS_OF = {"serve": ("serve", "postgres"), "training": ("train",), "bench": ("bench", "llamacpp"),
             "gpu_check": ("gpu",)}
# Imported, never declared, on purpose.
UNDECLARED = {
    "flash-attn": "the `gpu` extra: a prebuilt wheel installed by hand, PyPI has only its source (cluster/README.md)",
    "triton": "comes with torch's CUDA wheels",
}
# Modules whose distribution may not be installed here, so that packages_distributions() cannot name it.
DISTRIBUTION_OF = {"flash_attn": "flash-attn", "llama_cpp": "llama-cpp-python", "triton": "triton"}
SERVE_AND_BENCH_STACK = ("ray", "fastapi", "grpc", "matplotlib", "prometheus_client", "pydantic", "requests")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared(extras: tuple[str, ...]) -> set[str]:
    """Distributions (normalized names) the core and these extras declare, self-references
    such as `dlite-ray[serve]` followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements, todo, seen = list(project["dependencies"]), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra not in seen:
            seen.add(extra)
            requirements += project["optional-dependencies"][extra]
            todo += [e for r in project["optional-dependencies"][extra] if _name(r) == "dlite-ray"
                     for e in re.search(r"\[(.*?)\]", r).group(1).split(",")]
    return {_name(r) for r in requirements} - {"dlite-ray"}


def _name(requirement: str) -> str:
    return _normalized(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group())


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of the modules a file imports, anywhere in it, but the standard library's and ours."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "dlite_ray"}


def test_every_imported_package_is_declared():
    distributions = importlib.metadata.packages_distributions()
    undeclared = []
    for path in sorted(PACKAGE.rglob("*.py")):
        subpackage = path.relative_to(PACKAGE).parts[0]
        declared = _declared(EXTRAS_OF.get(subpackage, ())) | UNDECLARED.keys()
        for module in sorted(_third_party_imports(path)):
            names = {_normalized(d) for d in distributions.get(module, [])} or {DISTRIBUTION_OF.get(module)} - {None}
            assert names, f"{module}, imported by {path.relative_to(ROOT)}: not installed here, not in DISTRIBUTION_OF"
            if not names & declared:
                undeclared.append(f"{path.relative_to(ROOT)}: {module} ({' or '.join(sorted(names))})")
    assert not undeclared, "imported, not declared in the core or the subpackage's extra:\n" + "\n".join(undeclared)


def test_the_core_library_imports_neither_the_serve_nor_the_bench_stack():
    code = (
        "import pkgutil, sys, importlib\n"
        "import dlite_ray.engine.engine, dlite_ray.runtime.target_model, dlite_ray.cli\n"
        "import dlite_ray.engine, dlite_ray.runtime\n"
        "for package in (dlite_ray.engine, dlite_ray.runtime):\n"
        "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
        "        importlib.import_module(module.name)\n"
        f"bad = [m for m in {SERVE_AND_BENCH_STACK!r} if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]

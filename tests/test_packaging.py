"""Project-wide rules that no single module can check for itself."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = [ROOT / "kvtier", ROOT / "protocol" / "kvtier_protocol", ROOT / "connectors"]

# Modules that must stay importable without torch, aiohttp or RocksDB (docs/design.md §3): the
# bookkeeping core of the store and the torch-free half of the protocol.
LIGHT_MODULES = [
    "kvtier_protocol.errors",
    "kvtier_protocol.quant",
    "kvtier_protocol.header",
    "kvtier_protocol.keys",
    "kvtier_protocol.namespace",
    "kvtier_protocol.frames",
    "kvtier_protocol.events",
    "kvtier.daemon.store.types",
    "kvtier.daemon.store.index",
    "kvtier.daemon.store.policy",
    "kvtier.daemon.store.lease",
    "kvtier.daemon.store.allocator",
    "kvtier.daemon.store.pooled",
    "kvtier.daemon.store.stats",
]
HEAVY = ("torch", "aiohttp", "rocksdict")


def _python_files() -> list[Path]:
    return [p for root in SOURCE_ROOTS if root.exists() for p in root.rglob("*.py")]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_modules_import_no_heavy_dependency(module: str) -> None:
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
        env={"PYTHONPATH": f"{ROOT}:{ROOT / 'protocol'}:{ROOT / 'connectors'}", "PATH": "/usr/bin:/bin"},
    )
    assert out.stdout.strip() == "", f"{module} pulls in {out.stdout.strip()}"


def test_protocol_imports_nothing_from_kvtier() -> None:
    for path in (ROOT / "protocol" / "kvtier_protocol").rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] != "kvtier", f"{path}: imports {name}"


def test_no_pickle_eval_or_shell_in_sources() -> None:
    banned_modules = {"pickle", "cPickle", "dill", "marshal", "shelve"}
    for path in _python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    assert a.name.split(".")[0] not in banned_modules, f"{path}: import {a.name}"
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in banned_modules, f"{path}: from {node.module}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in {"eval", "exec"}, f"{path}:{node.lineno}: {node.func.id}()"
            elif isinstance(node, ast.keyword) and node.arg == "shell":
                assert not (isinstance(node.value, ast.Constant) and node.value.value is True), (
                    f"{path}:{node.value.lineno}: shell=True"
                )


def test_no_generic_top_level_packages() -> None:
    """`protocol` and `connectors` are source roots, never import packages."""
    for generic in ("protocol", "connectors"):
        assert not (ROOT / generic / "__init__.py").exists()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    assert all(p.startswith("kvtier") for p in include)


def test_torch_range_admits_the_cpu_build_on_disk() -> None:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (torch_req,) = [d for d in cfg["project"]["dependencies"] if d.startswith("torch")]
    assert "<2.14" in torch_req and ">=" in torch_req


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    start = readme.index("<!-- test-command -->")
    block = readme[start:].split("```")[1].strip().splitlines()
    command = [line for line in block if line and not line.startswith("#")][-1].strip()
    assert command in ci, f"README test command {command!r} not in .ci/run"

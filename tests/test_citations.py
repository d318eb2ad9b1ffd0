"""Nothing in the project cites a file or a module the project does not contain.

Sources, tests, docs, configs and scripts name files (``kvtier/daemon/store/disk.py``,
``docs/design.md``) and modules (``kvtier.daemon.server.collector``, ``python -m
kvtier.bench.crash.writer``). After a move, a stale name is a trap for the next reader: this test
finds every such name in the tracked text files and checks that it exists. (Relative links in the
README and docs/ are checked by tests/test_readme.py.)
"""

from __future__ import annotations

import ast
import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".service", ".yml", ".yaml", ".c", ".cfg"}
TOP_DIRS = ("kvtier", "connectors", "protocol", "tests", "docs", "configs", "systemd", "tools", ".ci")
PATH_RE = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w\.(?:py|md|c|toml|json|sh|service|yml|yaml|bin))(?![\w/])"
                     % "|".join(re.escape(d) for d in TOP_DIRS))
MODULE_RE = re.compile(r"(?<![\w./-])((?:kvtier|kvtier_protocol|kvtier_vllm|kvtier_sglang|kvtier_hf)(?:\.\w+)+)")
SOURCE_ROOTS = {"kvtier": ROOT, "kvtier_protocol": ROOT / "protocol", "kvtier_vllm": ROOT / "connectors",
                "kvtier_sglang": ROOT / "connectors", "kvtier_hf": ROOT / "connectors"}
# Names that look like paths or modules but are not the project's: other projects' files quoted in
# docs, and files a command creates at run time.
OUTSIDE = re.compile(r"^(?:tests/v1/|tools/engine-iface-env\.sh$)")
# Dotted words that are file names (kvtier.sock, kvtier.toml) rather than modules.
FILE_SUFFIXES = {"sock", "toml", "yaml", "yml", "service", "token", "json", "md", "py", "c", "txt", "bin"}
# Logger and client names ("kvtier.vllm") and the deliberately missing module of a test are not
# citations.
NOT_CITED = re.compile(r"""(?:getLogger\(\s*|client_name=)["'][\w.]+["']|logger=["'][\w.]+["']|kvtier\.bench\.ghost_suite_not_written""")


def _tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    paths = [ROOT / p for p in listed.decode().split("\0") if p]
    own = Path(__file__).resolve()
    return [p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file() and p != own
            and "vectors" not in p.relative_to(ROOT).parts]


def _module_file(dotted: str) -> Path | None:
    """The file of a dotted module or package name, or None."""
    top, *rest = dotted.split(".")
    base = SOURCE_ROOTS[top] / top
    path = base.joinpath(*rest)
    for candidate in (path.with_suffix(".py"), path / "__init__.py", path.with_suffix(".c")):
        if candidate.is_file():
            return candidate
    return None


@cache
def _names_in(module_file: Path) -> frozenset[str]:
    """Every name a module binds at any level (defs, classes, assignments, imports)."""
    if module_file.suffix != ".py":
        return frozenset()
    names: set[str] = set()
    for node in ast.walk(ast.parse(module_file.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return frozenset(names)


def module_citation_exists(dotted: str) -> bool:
    """A dotted name exists when its longest module prefix is a module or package of the project
    and the next part, if any, is a name that module binds (a class, function, attribute)."""
    parts = dotted.rstrip(".").split(".")
    if parts[-1] in FILE_SUFFIXES or parts[-1].startswith("__"):
        return True  # a file name such as kvtier.toml, or a dunder every module has
    for n in range(len(parts), 0, -1):
        found = _module_file(".".join(parts[:n]))
        if found is not None:
            return n == len(parts) or parts[n] in _names_in(found)
    return False


def _citations() -> list[tuple[str, str, str]]:
    found = []
    for path in _tracked_text_files():
        rel = str(path.relative_to(ROOT))
        text = NOT_CITED.sub("", path.read_text(errors="replace"))
        for m in PATH_RE.finditer(text):
            found.append(("path", rel, m.group(1)))
        for m in MODULE_RE.finditer(text):
            found.append(("module", rel, m.group(1)))
    return found


def test_every_cited_file_exists() -> None:
    missing = sorted({f"{where}: {cited}" for kind, where, cited in _citations()
                      if kind == "path" and not OUTSIDE.match(cited) and not (ROOT / cited).exists()})
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)


def test_every_cited_module_exists() -> None:
    missing = sorted({f"{where}: {cited}" for kind, where, cited in _citations()
                      if kind == "module" and not module_citation_exists(cited)})
    assert not missing, "cited modules that do not exist:\n" + "\n".join(missing)


def test_no_citation_of_the_original_design_note() -> None:
    cites = [str(p.relative_to(ROOT)) for p in _tracked_text_files() if "DESIGN.md" in p.read_text(errors="replace")
             and p.relative_to(ROOT) != Path("docs/design.md")]
    assert not cites, f"DESIGN.md is not in the project; cite docs/design.md: {cites}"


@pytest.mark.parametrize(("dotted", "exists"), [
    ("kvtier.daemon.store.index", True), ("kvtier.daemon.store.index.BlockIndex", True),
    ("kvtier.client.flows", False), ("kvtier.store.index", False), ("kvtier.client.connect", True),
    ("kvtier.daemon.store.index.NoSuchThing", False),
])
def test_the_module_check_itself(dotted: str, exists: bool) -> None:
    assert module_citation_exists(dotted) is exists

"""The README is a front door that works: its marked examples run verbatim, its links resolve.

The README marks the examples a test can run with ``<!-- example: python -->`` or
``<!-- example: shell -->`` on the line before the fence. They run here exactly as written,
against a real ``kvtier serve`` started the way the README starts it: on its defaults, with no
``--socket`` and no ``--data-dir``, so the daemon listens at ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock``
and every client finds it by ``kvtier_protocol.address.default_address()``. Only the environment
is the test's: a temporary ``XDG_RUNTIME_DIR`` and ``XDG_CACHE_HOME``, a free REST port in
``KVTIER_REST`` (read by the daemon and by the admin commands alike) and small tiers.

Unmarked blocks (the install and test commands, vLLM and SGLang servers) cannot run here.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier_protocol.address import default_socket
from tests.kvtier.conftest import KvtierDaemon

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 250

_MARKED = re.compile(r"<!-- example: (?P<kind>python|shell) -->\n```[a-z]*\n(?P<body>.*?)```", re.S)
_LINK = re.compile(r"\[[^\]]*\]\((?P<target>[^)\s]+)\)")
_DATED = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def examples(kind: str) -> list[str]:
    """The README's code blocks marked ``<!-- example: KIND -->``, in order."""
    return [m["body"] for m in _MARKED.finditer(README.read_text()) if m["kind"] == kind]


def shell_commands(block: str) -> list[str]:
    """The commands of a shell block: its non-empty lines that are not comments."""
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lowercase, punctuation dropped, spaces to '-')."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title)))
    return anchors


class ReadmeDaemon(KvtierDaemon):
    """The suite's daemon harness, started as the README starts it: ``kvtier serve`` on its defaults.

    KvtierDaemon passes ``--socket`` and ``--data-dir``; here only the tier sizes are flags, and the
    socket and data dir follow from ``XDG_RUNTIME_DIR`` (the harness's short temp dir, so the
    socket path stays under 107 bytes) and ``XDG_CACHE_HOME``. The same environment runs the examples.
    """

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path, host_bytes="64MiB", disk_bytes="128MiB")
        with socket.socket() as s:  # a free port for REST; the daemon binds it right after
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.env = {**self._env,
                    "XDG_RUNTIME_DIR": str(self._sock_dir),
                    "XDG_CACHE_HOME": str(tmp_path / "cache"),
                    "KVTIER_REST": f"127.0.0.1:{port}",
                    # `kvtier` and `python3` in the examples are this interpreter's
                    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
        self.env.pop("KVTIER_ADDRESS", None)
        self._env = self.env
        self._args = ["--host-bytes", "64MiB", "--disk-bytes", "128MiB", "--log-level", "info"]
        self.data_dir = tmp_path / "cache" / "kvtier"
        self.socket = Path(default_socket(self.env, str(self.data_dir)))
        self.address = f"unix:{self.socket}"

    def run(self, argv: list[str], cwd: Path, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
        """Run an example's command in the README's environment; fail with its output if it fails."""
        out = subprocess.run(argv, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert out.returncode == 0, f"{argv[-1]!r} exited {out.returncode}:\n{out.stdout}\n{out.stderr}\n{self.log()}"
        return out


@pytest.fixture(scope="module")
def readme_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadmeDaemon]:
    """One daemon on its defaults for every example of the README."""
    daemon = ReadmeDaemon(tmp_path_factory.mktemp("readme"))
    try:
        daemon.start()
        assert daemon.socket.is_socket(), f"no socket at the documented default {daemon.socket}:\n{daemon.log()}"
        yield daemon
    finally:
        daemon.cleanup()


def test_the_readme_is_a_short_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert not _DATED.findall(text), "dated entries belong in git history, not the README"
    setup = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    assert setup.count("```sh") == 2, "exactly two set-up commands: install-and-serve, and the tests"
    assert "<!-- test-command -->" in setup
    assert examples("python") and examples("shell"), "the README marks its runnable examples"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_points_at_a_file(doc: Path) -> None:
    broken = []
    for m in _LINK.finditer(doc.read_text()):
        target = m["target"]
        if re.match(r"[a-z]+:", target):
            continue  # http(s):, mailto: and the like
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target} (no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{doc.name}: broken links: {broken}"


def test_the_python_example_runs_verbatim(readme_daemon: ReadmeDaemon, tmp_path: Path) -> None:
    (block,) = examples("python")
    script = tmp_path / "example.py"
    script.write_text(block)
    out = readme_daemon.run([sys.executable, str(script)], cwd=tmp_path)
    assert "['stored', 'stored', 'stored', 'stored']" in out.stdout, out.stdout
    assert "4 of 4 blocks hit" in out.stdout, out.stdout


def test_the_operator_commands_run_verbatim(readme_daemon: ReadmeDaemon, tmp_path: Path) -> None:
    (block,) = [b for b in examples("shell") if "kvtier status" in b]
    outputs = {}
    for command in shell_commands(block):
        outputs[command.split("#")[0].strip()] = readme_daemon.run(["bash", "-e", "-c", command], cwd=tmp_path).stdout
    assert ": ready" in outputs["kvtier status"] and "host" in outputs["kvtier status"], outputs
    assert "no problems found" in outputs["kvtier check"], outputs
    assert all(text.strip() for text in outputs.values()), outputs


def test_the_reference_engine_example_runs_verbatim(readme_daemon: ReadmeDaemon, tmp_path: Path) -> None:
    (block,) = [b for b in examples("shell") if "kvtier engine" in b]
    results = [readme_daemon.run(["bash", "-e", "-c", c], cwd=tmp_path).stdout for c in shell_commands(block)]
    first, second = (r for r in results if "prefix_hit_tokens" in r)
    said = re.search(r"prints `(prefix_hit_tokens: \d+ of \d+)`", README.read_text())
    assert said, "the README says what the second run prints"
    assert "prefix_hit_tokens: 0 of" in first, first
    assert said[1] in second, second

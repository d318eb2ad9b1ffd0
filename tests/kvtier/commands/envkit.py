"""The environment a command test runs in: none of this machine's kvtier settings, private dirs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def isolate_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, runtime_dir: bool = True) -> None:
    """No ``KVTIER_*`` variable of the machine leaks in, and the default data dir (where the token
    file goes) is under ``tmp_path``; with ``runtime_dir`` the default socket's dir is too."""
    for name in list(os.environ):
        if name.startswith("KVTIER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if runtime_dir:
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))

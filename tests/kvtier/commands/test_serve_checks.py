"""What ``kvtier serve`` refuses before it starts, and the token rule it states:

* ``KVTIER_TOKEN`` holds the token itself (``KVTIER_TOKEN_FILE`` names a file); a value naming a
  file is refused, and ``--token-file`` wins over both;
* a host tier larger than the memory that can back it (RAM, free /dev/shm) is refused with one
  line and exit 2, unless ``--force-host-bytes``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.client import Client
from kvtier_protocol.errors import Unauthorized
from kvtier.commands import serve
from kvtier.commands.admin import register as register_admin
from kvtier.daemon.config import load_config
from tests.kvtier.commands.envkit import isolate_env
from tests.kvtier.conftest import ROOT, KvtierDaemon

GIB = 1 << 30


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    isolate_env(monkeypatch, tmp_path)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier")
    sub = parser.add_subparsers(dest="command", required=True)
    serve.register(sub)
    register_admin(sub)
    return parser.parse_args(list(argv))


def help_text(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        parse(*argv, "--help")
    return " ".join(capsys.readouterr().out.split())


def serve_env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "NOTIFY_SOCKET"))}
    return {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol")]),
            "KVTIER_STORE__HOST_PREFAULT": "0"}


# --- the token ---------------------------------------------------------------------------------


def test_the_help_says_what_kvtier_token_holds(capsys) -> None:
    out = help_text(capsys, "serve")
    assert "KVTIER_TOKEN (or auth.token) holds the token itself" in out
    assert "KVTIER_TOKEN_FILE (or auth.token_file, --token-file) names a file holding it" in out
    assert "--token-file, which wins over both" in out
    ls = help_text(capsys, "ls")
    assert "default: $KVTIER_TOKEN" not in ls and "the token itself from $KVTIER_TOKEN" in ls


def test_token_file_flag_wins_over_kvtier_token(tmp_path: Path) -> None:
    env = {"KVTIER_TOKEN": "t" * 20, "KVTIER_TOKEN_FILE": str(tmp_path / "env.token"), "HOME": str(tmp_path)}
    cfg = load_config(None, env=env, overrides=serve.overrides_from(parse("serve")))
    assert cfg.auth.token == "t" * 20  # the token itself wins over KVTIER_TOKEN_FILE
    flag = str(tmp_path / "flag.token")
    cfg = load_config(None, env=env, overrides=serve.overrides_from(parse("serve", "--token-file", flag)))
    assert cfg.auth.token is None and cfg.auth.token_file == flag


def test_a_kvtier_token_naming_a_file_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    token_file = tmp_path / "the-token-file-path"
    token_file.write_text(secrets.token_hex(16))
    monkeypatch.setenv("KVTIER_TOKEN", str(token_file))
    args = parse("serve", "--data-dir", str(tmp_path / "data"), "--socket", str(tmp_path / "s.sock"), "--rest", "off")
    assert args.func(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"set KVTIER_TOKEN_FILE={token_file}" in err
    assert not (tmp_path / "data").exists()  # refused before anything was made
    args = parse("ls", "--rest", "127.0.0.1:9")
    assert args.func(args) == 2  # a user error: the token to fix
    assert capsys.readouterr().err == (f"kvtier: KVTIER_TOKEN (auth.token) holds the token itself, but its value "
                                       f"names the file {token_file}; set KVTIER_TOKEN_FILE={token_file} (or pass "
                                       f"--token-file) instead\n")


def test_the_daemon_takes_the_token_file_flag_over_kvtier_token(tmp_path: Path) -> None:
    flag_token, env_token = secrets.token_hex(16), secrets.token_hex(16)
    (tmp_path / "flag.token").write_text(flag_token)
    (tmp_path / "flag.token").chmod(0o600)
    daemon = KvtierDaemon(tmp_path, host_bytes="64MiB", disk_bytes="64MiB",
                          extra_args=("--listen", "127.0.0.1:0", "--token-file", str(tmp_path / "flag.token")))
    daemon._env["KVTIER_TOKEN"] = env_token
    try:
        daemon.start()
        with Client(daemon.tcp_address(), token=flag_token) as client:
            assert client.ping() >= 0
        with Client(daemon.tcp_address(), token=env_token, retries=0) as client, pytest.raises(Unauthorized):
            client.ping()
    finally:
        daemon.cleanup()


# --- the host tier's size ------------------------------------------------------------------------


def test_a_host_tier_beyond_memory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--host-bytes", "1TiB", "--data-dir",
                          str(tmp_path / "data"), "--socket", str(tmp_path / "s.sock"), "--rest", "off"],
                         cwd=ROOT, env=serve_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == "", out.stderr
    assert out.stderr.startswith("kvtier serve: host tier 1.0 TiB is larger than the memory that can back it (")
    assert out.stderr.count("\n") == 1 and "--force-host-bytes" in out.stderr and "Traceback" not in out.stderr


def test_forced_a_host_tier_beyond_memory_starts(tmp_path: Path) -> None:
    backing = serve.host_backing("kvtier")
    size = (backing.limit + GIB) // GIB * GIB  # sparse segments: nothing is touched (no prefault)
    daemon = KvtierDaemon(tmp_path, host_bytes=str(size), disk_bytes="64MiB", extra_args=("--force-host-bytes",))
    try:
        daemon.start()  # waits for "kvtierd ready"
        with Client(daemon.address) as client:
            assert client.ping() >= 0
    finally:
        daemon.cleanup()


def test_what_backs_a_host_tier(tmp_path: Path) -> None:
    """Segments a dead daemon of the same prefix left in /dev/shm count as free: the store
    reclaims or adopts them at start, so a restart after a crash is not refused over its own."""
    prefix = f"kvtck{secrets.token_hex(4)}"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a pid that is gone
    before = serve.host_backing(prefix)
    assert before.reclaimable == 0 and before.ram > 0 and before.limit <= before.ram
    path = f"/dev/shm/{prefix}-{child.pid}-{secrets.token_hex(8)}"
    live = f"/dev/shm/{prefix}-{os.getpid()}-{secrets.token_hex(8)}"  # a live daemon's: not free
    try:
        for p in (path, live):
            with open(p, "wb") as f:
                f.write(b"\1" * (1 << 20))
        after = serve.host_backing(prefix)
        assert after.reclaimable == 1 << 20
    finally:
        for p in (path, live):
            os.unlink(p)
    fits = serve.HostBacking(ram=8 * GIB, shm_free=4 * GIB, reclaimable=GIB)
    assert serve.host_bytes_problem(5 * GIB, fits) is None
    assert serve.host_bytes_problem(5 * GIB + 1, fits) == (
        "host tier 5.0 GiB is larger than the memory that can back it (8.0 GiB RAM, 4.0 GiB free in /dev/shm "
        "+ 1.0 GiB of a dead daemon's segments); lower --host-bytes (store.host_bytes), or pass "
        "--force-host-bytes to start anyway")
    assert serve.host_bytes_problem(9 * GIB, serve.HostBacking(ram=8 * GIB, shm_free=16 * GIB, reclaimable=0))

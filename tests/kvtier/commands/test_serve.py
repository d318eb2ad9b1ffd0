"""kvtier serve: flags, their mapping onto options, errors; and the systemd unit that runs it."""

from __future__ import annotations

import argparse
import configparser
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier import cli
from kvtier.commands import serve
from kvtier.daemon.config import OPTIONS

ROOT = Path(__file__).resolve().parents[3]
UNIT = ROOT / "systemd" / "kvtier.service"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier")
    serve.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse("--help")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--config", "--data-dir", "--host-bytes", "--disk-bytes", "--socket", "--listen", "--rest",
                 "--events", "--replay", "--topic", "--token-file", "--log-level"):
        assert flag in out


def test_flags_map_onto_options() -> None:
    args = parse("--data-dir", "/d", "--host-bytes", "4GiB", "--disk-bytes", "0", "--socket", "/s.sock",
                 "--listen", ":0", "--rest", "off", "--events", "tcp://127.0.0.1:0", "--log-level", "debug")
    assert serve.overrides_from(args) == {
        "daemon.data_dir": "/d", "store.host_bytes": "4GiB", "store.disk_bytes": "0", "dataplane.socket": "/s.sock",
        "dataplane.listen": ":0", "rest.listen": "off", "events.endpoint": "tcp://127.0.0.1:0",
        "daemon.log_level": "debug"}
    assert serve.overrides_from(parse()) == {}
    assert all(option in OPTIONS for _, option, _, _ in serve.FLAGS)


@pytest.mark.parametrize("argv, match", [
    (("--host-bytes", "lots"), "store.host_bytes (flag): 'lots' is not a size"),
    (("--rest", "localhost"), "rest.listen"),
    (("--config", "/nonexistent/kvtier.toml"), "cannot read config file"),
])
def test_bad_settings_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...],
                                                    match: str) -> None:
    args = parse(*argv)
    assert args.func(args) == 2
    assert match in capsys.readouterr().err


def test_kvtier_cli_runs_serve_when_registered(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "COMMANDS", tuple(dict.fromkeys((*cli.COMMANDS, "kvtier.commands.serve"))))
    assert cli.main(["serve", "--disk-bytes", "-3"]) == 2
    assert "disk_bytes" in capsys.readouterr().err


def test_module_entry_point_help() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.commands.serve", "--help"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "usage: kvtier serve" in out.stdout


# --- systemd/kvtier.service ----------------------------------------------------------------------


def unit() -> dict[str, dict[str, list[str]]]:
    """The unit as {section: {key: [values]}} (systemd keys repeat, so configparser's strict mode is off)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        key, _, value = line.partition("=")
        assert section is not None, f"key outside a section: {line}"
        out[section].setdefault(key, []).append(value)
    return out


def test_unit_has_the_required_keys() -> None:
    u = unit()
    svc = u["Service"]
    assert svc["Type"] == ["notify"]
    assert svc["ExecStart"] == ["/usr/bin/env kvtier serve --config /etc/kvtier/kvtier.toml"]
    assert svc["StateDirectory"] == ["kvtier"] and svc["RuntimeDirectory"] == ["kvtier"]
    assert svc["RuntimeDirectoryMode"] == ["0700"]
    assert svc["LimitMEMLOCK"] == ["infinity"] and svc["Restart"] == ["on-failure"]
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelTunables", "ProtectControlGroups",
                "RestrictSUIDSGID", "LockPersonality", "RestrictRealtime"):
        assert svc[key] == ["yes"], key
    assert svc["ProtectSystem"] == ["strict"]
    assert svc["PrivateDevices"] == ["no"]  # a GPU tier needs /dev/nvidia*
    assert "MemoryDenyWriteExecute" not in svc  # torch and CUDA JIT write executable memory
    assert any("nvidia" in v for v in svc["DeviceAllow"])
    assert "WantedBy" in u["Install"]
    # systemd must wait longer than the drain (10 s by default) plus the write-back of the host tier.
    assert int(svc["TimeoutStopSec"][0]) > 10 * 3


def test_unit_is_plain_ini() -> None:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read_string(UNIT.read_text())
    assert parser.has_section("Unit") and parser.has_section("Service") and parser.has_section("Install")


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        print("systemd-analyze is not installed (apt package systemd): verify skipped")
        pytest.skip("systemd-analyze is not installed")
    out = subprocess.run([tool, "verify", str(UNIT)], capture_output=True, text=True, timeout=60)
    problems = [line for line in out.stderr.splitlines() if "kvtier.service" in line]
    assert out.returncode == 0 and not problems, out.stderr


def test_systemd_analyze_security_exposure_is_ok() -> None:
    """``systemd-analyze security`` rates the unit "OK" (exposure at most 2.5): a dedicated user,
    no capabilities, the @system-service system calls, other processes hidden; the host tier's
    shared memory kept across a restart (no RemoveIPC, no DynamicUser)."""
    svc = unit()["Service"]
    assert svc["User"] == ["kvtier"] and "DynamicUser" not in svc and svc["RemoveIPC"] == ["no"]
    assert svc["CapabilityBoundingSet"] == [""] and "@system-service" in svc["SystemCallFilter"]
    assert svc["ProtectProc"] == ["invisible"]
    tool = shutil.which("systemd-analyze")
    if tool is None:
        print("systemd-analyze is not installed (apt package systemd): exposure check skipped")
        pytest.skip("systemd-analyze is not installed")
    out = subprocess.run([tool, "security", "--offline=true", "--no-pager", str(UNIT)], capture_output=True,
                         text=True, timeout=60)
    found = re.search(r"Overall exposure level for kvtier\.service: (\d+\.\d+) (\w+)", out.stdout)
    assert found is not None, out.stdout[-2000:] + out.stderr
    assert float(found[1]) <= 2.5 and found[2] == "OK", out.stdout[-4000:]

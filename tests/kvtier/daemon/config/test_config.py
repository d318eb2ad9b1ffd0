"""kvtier.daemon.config: defaults, sizes, precedence (flags > env > file > defaults) and typed errors."""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.daemon.config import (ENV_ALIASES, GIB, MIB, OPTIONS, SECTIONS, TENANT_KEYS, AuthConfig, ConfigError,
                                  DaemonConfig, DataPlaneConfig, EventsConfig, RestConfig, TenantConfig,
                                  default_host_bytes, env_name, load_config, nvidia_driver_present, parse_size,
                                  split_hostport)
from kvtier_protocol.errors import InvalidRequest

ROOT = Path(__file__).resolve().parents[4]
TOML = ROOT / "configs" / "kvtier.toml"
ENV = {"HOME": "/home/tester", "XDG_RUNTIME_DIR": "/run/user/1000"}


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    return str(path)


# --- sizes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 << 30), ("512MiB", 512 << 20), ("20G", 20 << 30), ("1.5GiB", 3 << 29), ("123", 123),
    (123, 123), ("0", 0), ("64 KiB", 64 << 10), ("2k", 2048), ("500MB", 500_000_000), ("1TB", 10**12),
    ("3Gi", 3 << 30), (" 7 B ", 7), (".5KiB", 512), ("1T", 1 << 40),
])
def test_parse_size_accepts_units(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("junk", ["", "lots", "4 GiBs", "-1", -1, "1.3B", "0.1KiB", "4GiB4", "1e9", "GiB",
                                  True, 1.5, None, "½GiB", "4,5GiB"])
def test_parse_size_refuses_junk_with_a_typed_error(junk: object) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_size(junk)  # type: ignore[arg-type]
    assert isinstance(exc.value, InvalidRequest) and isinstance(exc.value, ValueError)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 1 << 40), st.sampled_from([("", 1), ("B", 1), ("KiB", 1 << 10), ("MiB", 1 << 20),
                                                   ("GiB", 1 << 30), ("K", 1 << 10), ("MB", 10**6)]))
def test_parse_size_scales_every_integer(n: int, unit: tuple[str, int]) -> None:
    assert parse_size(f"{n}{unit[0]}") == n * unit[1]


def test_split_hostport() -> None:
    assert split_hostport("10.0.0.1:80") == ("10.0.0.1", 80)
    assert split_hostport(":0") == ("127.0.0.1", 0)
    assert split_hostport("7470") == ("127.0.0.1", 7470)
    assert split_hostport("[::1]:9") == ("::1", 9)
    for junk in ("host:", "host:http", "1.2.3.4:70000", "", "h:-1"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            split_hostport(junk)


# --- defaults ------------------------------------------------------------------------------------


def test_embedded_defaults_without_a_file() -> None:
    cfg = load_config(env=ENV)
    assert cfg.data_dir == "/home/tester/.cache/kvtier"
    assert cfg.store.host_bytes == default_host_bytes()
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < cfg.store.host_bytes <= min(4 * GIB, ram // 4)
    assert cfg.store.disk_path == "/home/tester/.cache/kvtier/disk" and cfg.store.disk_bytes == 20 * GIB
    assert cfg.store.gpu_bytes == 0 and not cfg.store.write_through and cfg.store.flush_on_close
    assert cfg.store.host_pin is (None if nvidia_driver_present() else False)
    assert cfg.dataplane.socket == "/run/user/1000/kvtier/kvtier.sock" and cfg.dataplane.listen is None
    assert cfg.rest.listen == "127.0.0.1:7471"
    assert cfg.events.endpoint is None and re.fullmatch(r"kv@[^@]+@kvtier", cfg.events.topic)
    assert cfg.auth == AuthConfig() and cfg.log_level == "info" and cfg.drain_timeout_s == 10.0


def test_xdg_cache_home_and_socket_fallbacks(tmp_path: Path) -> None:
    cfg = load_config(env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert cfg.data_dir == str(tmp_path / "cache" / "kvtier")
    assert cfg.dataplane.socket in ("/run/kvtier/kvtier.sock", str(tmp_path / "cache" / "kvtier" / "kvtier.sock"))
    if not os.access("/run", os.W_OK):
        assert cfg.dataplane.socket == str(tmp_path / "cache" / "kvtier" / "kvtier.sock")
    cfg = load_config(env={}, overrides={"daemon.data_dir": str(tmp_path / "d")})
    assert cfg.store.disk_path == str(tmp_path / "d" / "disk")


def test_relative_and_home_paths_become_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(env=ENV, overrides={"daemon.data_dir": "rel", "dataplane.socket": "~/s.sock"})
    assert cfg.data_dir == str(tmp_path / "rel")
    assert cfg.dataplane.socket == os.path.expanduser("~/s.sock")


def test_the_shipped_toml_equals_the_embedded_defaults() -> None:
    assert load_config(str(TOML), env=ENV) == load_config(env=ENV)


def test_the_shipped_toml_mentions_every_option_in_its_section() -> None:
    text = TOML.read_text()
    tomllib.loads(text)
    section, seen = None, set()
    for line in text.splitlines():
        if m := re.fullmatch(r"\[(\w+)\]", line):
            section = m.group(1)
        elif section and (m := re.match(r"#? ?(\w+) = ", line)):
            seen.add(f"{section}.{m.group(1)}")
    assert set(OPTIONS) <= seen, f"missing from configs/kvtier.toml: {sorted(set(OPTIONS) - seen)}"
    nested = {f.name for f in dataclasses.fields(DaemonConfig)} - {"data_dir", "log_level", "drain_timeout_s",
                                                                    "gc_freeze", "tenants"}
    assert nested == set(SECTIONS) - {"daemon"}
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name in nested or f"{name}.{f.name}" in seen or (name, f.name) == ("daemon", "tenants")
    for key in TENANT_KEYS:  # the tenant tables are documented by a commented example
        assert re.search(rf"^# {key} = ", text, re.M), key


# --- precedence ----------------------------------------------------------------------------------


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path) -> None:
    path = write(tmp_path, '[store]\nhost_bytes = "1GiB"\ndisk_bytes = "2GiB"\nio_threads = 3\n'
                           '[daemon]\nlog_level = "debug"\n')
    env = {**ENV, "KVTIER_DISK_BYTES": "3GiB", "KVTIER_STORE__IO_THREADS": "5"}
    cfg = load_config(path, env=env, overrides={"store.io_threads": "7"})
    assert cfg.store.host_bytes == GIB  # file
    assert cfg.store.disk_bytes == 3 * GIB  # env over file
    assert cfg.store.io_threads == 7  # flag over env over file
    assert cfg.log_level == "debug"
    assert cfg.store.admission_ghosts == 65536  # default


def test_env_names_long_and_short(tmp_path: Path) -> None:
    env = {**ENV, "KVTIER_SOCKET": str(tmp_path / "x.sock"), "KVTIER_LISTEN": ":0", "KVTIER_REST": "off",
           "KVTIER_EVENTS": "tcp://127.0.0.1:0", "KVTIER_TOKEN": "t" * 20, "KVTIER_STORE__WRITE_THROUGH": "yes",
           "KVTIER_EVENTS__LEGACY_ARRAY": "on", "KVTIER_DATAPLANE__IDLE_TIMEOUT_S": "2.5",
           "KVTIER_LOG_LEVEL": "WARNING", "KVTIER_STORE__HOST_PIN": "false", "KVTIER_CLIENT_THING": "ignored"}
    cfg = load_config(env=env)
    assert cfg.dataplane.socket == str(tmp_path / "x.sock") and cfg.dataplane.listen == "127.0.0.1:0"
    assert cfg.rest.listen is None and cfg.events.endpoint == "tcp://127.0.0.1:0"
    assert cfg.auth.token == "t" * 20 and "t" * 20 not in repr(cfg)
    assert cfg.store.write_through and cfg.events.legacy_array and cfg.dataplane.idle_timeout_s == 2.5
    assert cfg.log_level == "warning" and cfg.store.host_pin is False
    assert env_name("store.host_bytes") == "KVTIER_STORE__HOST_BYTES"
    assert all(option in OPTIONS for option in ENV_ALIASES.values())


def test_kvtier_config_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[store]\nio_threads = 9\n")
    assert load_config(env={**ENV, "KVTIER_CONFIG": path}).store.io_threads == 9


def test_disk_bytes_zero_switches_the_disk_tier_off() -> None:
    cfg = load_config(env=ENV, overrides={"store.disk_bytes": "0"})
    assert cfg.store.disk_path is None


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, match", [
    ("[store]\nhost_bytez = 1\n", r"\[store\] host_bytez"),
    ("[stor]\nhost_bytes = 1\n", r"\[stor\]"),
    ("store = 3\n", r"\[store\]"),
    ("[store]\nhost_bytes = true\n", "store.host_bytes"),
    ("[store]\nhost_bytes = \"4 GiBs\"\n", "store.host_bytes.*not a size"),
    ("[store]\nhost_bytes = 1.5e9\n", "store.host_bytes"),
    ("[store]\nio_threads = \"2\"\n", "store.io_threads .*must be int"),
    ("[store]\nio_threads = 0\n", "io_threads"),
    ("[store]\nwrite_through = 1\n", "store.write_through .*must be bool"),
    ("[store]\nlease_seconds = \"soon\"\n", "store.lease_seconds"),
    ("[store]\ndisk_bytes = 0\nwrite_through = true\n", "write_through needs a disk tier"),
    ("[dataplane]\nlisten = \"localhost:http\"\n", "HOST:PORT"),
    ("[dataplane]\nsocket = \"off\"\nlisten = \"off\"\n", "nothing would serve"),
    ("[dataplane]\nmax_inflight = -1\n", "dataplane.max_inflight"),
    ("[events]\nendpoint = \"udp://x\"\n", "events.endpoint"),
    ("[auth]\ntoken = \"short\"\n", "at least 16"),
    ("[daemon]\nlog_level = \"loud\"\n", "log_level"),
    ("[daemon]\ndrain_timeout_s = -1\n", "drain_timeout_s"),
    ("[store\n", "not valid TOML"),
    ("[store]\nhost_bytes = = 3\n", "not valid TOML"),
])
def test_bad_files_raise_config_errors_naming_the_option(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text), env=ENV)


def test_a_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(tmp_path / "nope.toml"), env=ENV)


@pytest.mark.parametrize("env, match", [
    ({"KVTIER_HOST_BYTES": "lots"}, r"store.host_bytes \(env KVTIER_HOST_BYTES\).*not a size"),
    ({"KVTIER_STORE__WRITE_THROUGH": "maybe"}, "not a boolean"),
    ({"KVTIER_STORE__IO_THREADS": "two"}, "KVTIER_STORE__IO_THREADS"),
    ({"KVTIER_STORE__NOPE": "1"}, "unknown environment option KVTIER_STORE__NOPE"),
    ({"KVTIER_HOST_BYTES": "1GiB", "KVTIER_STORE__HOST_BYTES": "2GiB"}, "both set store.host_bytes"),
    ({"KVTIER_REST": "127.0.0.1"}, "HOST:PORT"),
])
def test_bad_environment_raises_config_errors(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(env={**ENV, **env})


@pytest.mark.parametrize("overrides, match", [
    ({"store.host_bytes": "4 GiBs"}, r"store.host_bytes \(flag\)"),
    ({"store.nope": "1"}, "unknown option"),
    ({"rest.listen": "nowhere:"}, "HOST:PORT"),
    ({"dataplane.socket": "/" + "x" * 120}, "dataplane.socket"),
])
def test_bad_flags_raise_config_errors(overrides: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(env=ENV, overrides=overrides)


def test_sections_validate_when_built_directly() -> None:
    assert DataPlaneConfig("/tmp/s.sock", listen="[::1]:0").listen == "[::1]:0"
    assert RestConfig("0.0.0.0:80").listen == "0.0.0.0:80"
    assert EventsConfig(endpoint="ipc:///tmp/ev").endpoint == "ipc:///tmp/ev"
    with pytest.raises(ConfigError):
        DataPlaneConfig("/tmp/s.sock", max_payload_bytes=0)
    with pytest.raises(ConfigError):
        EventsConfig(buffer_steps=True)
    with pytest.raises(ConfigError, match="max_batch"):
        DataPlaneConfig("/tmp/s.sock", max_batch=2.5)  # type: ignore[arg-type]
    cfg = load_config(env=ENV, overrides={"dataplane.max_payload_bytes": "8MiB"})
    assert cfg.dataplane.max_payload_bytes == 8 * MIB


# --- tenants ---------------------------------------------------------------------------------------

TENANTS = '''
[store]
host_name_prefix = "kv"
host_segment_bytes = "2MiB"
[events]
topic = "kv@pod@model"
[tenants.bob]
host_bytes = "1MiB"
disk_bytes = 0
token = "bob-token-0123456789"
[tenants.alice]
host_bytes = "64MiB"
disk_bytes = "1GiB"
gpu_bytes = 0
token_file = "~/alice.token"
events_endpoint = "tcp://127.0.0.1:5600"
events_replay_endpoint = "off"
'''


def test_tenants_from_the_file(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, TENANTS), env={**ENV, "KVTIER_DATA_DIR": str(tmp_path / "d")})
    alice, bob = cfg.tenants
    assert (alice.name, alice.host_bytes, alice.disk_bytes, alice.token_file) == (
        "alice", 64 * MIB, GIB, os.path.expanduser("~/alice.token"))
    assert (bob.name, bob.host_bytes, bob.disk_bytes, bob.token) == ("bob", MIB, 0, "bob-token-0123456789")
    assert "bob-token-0123456789" not in repr(cfg) and "<set>" in repr(bob)
    a_store, b_store = alice.store_config(cfg.store, cfg.data_dir), bob.store_config(cfg.store, cfg.data_dir)
    assert a_store.host_name_prefix == "kv-t-alice" and a_store.host_segment_bytes == 2 * MIB
    assert a_store.disk_path == str(tmp_path / "d" / "tenants" / "alice" / "disk")
    assert b_store.disk_path is None and b_store.host_segment_bytes == MIB
    assert cfg.store.host_name_prefix == "kv" and cfg.store.disk_path == str(tmp_path / "d" / "disk")  # unchanged
    events = alice.events_config(cfg.events)
    assert (events.endpoint, events.replay_endpoint, events.topic) == ("tcp://127.0.0.1:5600", None,
                                                                       "kv@pod@model/alice")
    assert bob.events_config(cfg.events).endpoint is None  # opt-in: no ZMQ for bob
    assert load_config(env=ENV).tenants == ()


@pytest.mark.parametrize("text, match", [
    ('[tenants]\nalice = 3\n', "must be a table"),
    ('[tenants.Alice]\nhost_bytes = 1\ndisk_bytes = 0\n', "tenant name"),
    ('[tenants.alice]\nhost_bytes = "1MiB"\n', "needs disk_bytes"),
    ('[tenants.alice]\nhost_bytes = 0\ndisk_bytes = 0\n', "host_bytes must be > 0"),
    ('[tenants.alice]\nhost_bytes = "lots"\ndisk_bytes = 0\n', r"tenants\.alice\.host_bytes"),
    ('[tenants.alice]\nhost_bytes = 1\ndisk_bytes = 0\ncolour = "red"\n', "unknown key"),
    ('[tenants.alice]\nhost_bytes = 1\ndisk_bytes = 0\ntoken = "short"\n', "at least 16"),
    ('[tenants.alice]\nhost_bytes = 1\ndisk_bytes = 0\nevents_endpoint = "udp://x"\n', "ZMQ endpoint"),
    ('[store]\nwrite_through = true\n[tenants.alice]\nhost_bytes = 1\ndisk_bytes = 0\n', "write_through"),
    ('[store]\nhost_name_prefix = "' + "p" * 60 + '"\n[tenants.alice]\nhost_bytes = 1\ndisk_bytes = 0\n',
     "host_name_prefix"),
    ('[auth]\ntoken = "same-token-0123456789"\n[tenants.alice]\nhost_bytes = 1\ndisk_bytes = 0\n'
     'token = "same-token-0123456789"\n', "share a token"),
])
def test_bad_tenants_are_config_errors(tmp_path: Path, text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as exc:
        load_config(write(tmp_path, text), env=ENV)
    assert "same-token-0123456789" not in str(exc.value)


def test_tenants_validate_when_built_directly(tmp_path: Path) -> None:
    base = load_config(env=ENV)
    alice = TenantConfig("alice", MIB, 0)
    assert dataclasses.replace(base, tenants=(alice,)).tenants == (alice,)
    with pytest.raises(ConfigError, match="unique"):
        dataclasses.replace(base, tenants=(alice, alice))
    with pytest.raises(ConfigError, match="tuple of TenantConfig"):
        dataclasses.replace(base, tenants=[alice])  # type: ignore[arg-type]

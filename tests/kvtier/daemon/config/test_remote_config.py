"""The ``[remote]`` options (issue 23): sources, defaults and checks (that the password never reaches
a log is checked against a real daemon in tests/kvtier/daemon/remote/test_daemon_remote.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.daemon.config import ConfigError, load_config

ENV = {"HOME": "/home/tester", "XDG_RUNTIME_DIR": "/run/user/1000"}


def test_off_by_default_and_documented_defaults() -> None:
    rc = load_config(env=ENV).remote
    assert not rc.enabled and rc.url is None
    assert (rc.write_mode, rc.upload_queue_bytes, rc.timeout_s, rc.lookup_budget_ms, rc.key_prefix) == \
        ("through", 256 << 20, 1.0, 10.0, "kvtier")


def test_flag_env_and_file_set_the_options(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[remote]\nwrite_mode = "back"\nupload_queue_bytes = "64MiB"\nkey_prefix = "fleet"\n'
                    'password_file = "secret"\n')
    env = {**ENV, "KVTIER_REMOTE": "redis+cluster://10.0.0.1:7000", "KVTIER_REMOTE__TIMEOUT_S": "0.5",
           "KVTIER_REMOTE__USER": "kvtier"}
    rc = load_config(str(path), env=env, overrides={"remote.lookup_budget_ms": "25"}).remote
    assert rc.enabled and rc.url == "redis+cluster://10.0.0.1:7000" and rc.user == "kvtier"
    assert (rc.write_mode, rc.upload_queue_bytes, rc.key_prefix) == ("back", 64 << 20, "fleet")
    assert rc.timeout_s == 0.5 and rc.lookup_budget_ms == 25.0
    assert Path(rc.password_file).is_absolute()  # type: ignore[arg-type]


@pytest.mark.parametrize("option, value, words", [
    ("remote.url", "redis://10.0.0.1:7000", "redis+cluster://"),
    ("remote.url", "redis+cluster://user:pw@10.0.0.1:7000", "credentials"),
    ("remote.url", "redis+cluster://10.0.0.1:99999", "out of range"),
    ("remote.write_mode", "sometimes", "write_mode"),
    ("remote.key_prefix", "a:b", "key_prefix"),
    ("remote.key_prefix", "{tag}", "key_prefix"),
    ("remote.timeout_s", "0", "timeout_s"),
    ("remote.lookup_budget_ms", "-1", "lookup_budget_ms"),
])
def test_bad_values_are_refused_naming_the_option(option: str, value: str, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(env=ENV, overrides={"remote.url": "redis+cluster://10.0.0.1:7000", option: value})
    assert words in str(exc.value)


def test_a_tenant_named_default_would_share_the_default_stores_keys(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[tenants.default]\nhost_bytes = "64MiB"\ndisk_bytes = 0\n')
    load_config(str(path), env=ENV)  # fine without a remote tier
    with pytest.raises(ConfigError, match="default"):
        load_config(str(path), env=ENV, overrides={"remote.url": "redis+cluster://10.0.0.1:7000"})


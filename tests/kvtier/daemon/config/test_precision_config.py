"""Precision by tier (issue 25): ``store.disk_codec`` / ``store.disk_compression`` (also spelt
``[tiers.disk] codec`` / ``compression`` in the file), ``remote.codec`` / ``remote.compression``
(``[tiers.remote]``), ``store.accept_lossy`` and the tenants' own ``accept_lossy``: sources,
defaults (raw everywhere, any copy served) and checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.daemon.config import ConfigError, load_config

ENV = {"HOME": "/home/tester", "XDG_RUNTIME_DIR": "/run/user/1000"}


def test_exact_by_default() -> None:
    store = load_config(env=ENV).store
    assert (store.disk_codec, store.disk_compression, store.accept_lossy) == ("raw", "none", True)
    remote = load_config(env=ENV).remote
    assert (remote.codec, remote.compression) == ("raw", "none")


def test_tiers_table_flags_and_environment_set_the_options(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[tiers.disk]\ncodec = "int8"\ncompression = "lz4"\n')
    store = load_config(str(path), env=ENV).store
    assert (store.disk_codec, store.disk_compression) == ("int8", "lz4")
    env = {**ENV, "KVTIER_STORE__DISK_CODEC": "int4", "KVTIER_STORE__ACCEPT_LOSSY": "false"}
    store = load_config(str(path), env=env).store
    assert (store.disk_codec, store.disk_compression, store.accept_lossy) == ("int4", "lz4", False)
    store = load_config(str(path), env=env, overrides={"store.disk_codec": "fp8_e4m3"}).store
    assert store.disk_codec == "fp8_e4m3"
    path.write_text('[store]\ndisk_codec = "int2"\naccept_lossy = false\n')
    store = load_config(str(path), env=ENV).store
    assert (store.disk_codec, store.accept_lossy) == ("int2", False)


@pytest.mark.parametrize("text, words", [
    ('[tiers.disk]\ncodec = "int3"\n', "disk_codec"),
    ('[tiers.disk]\ncompression = "zstd"\n', "disk_compression"),
    ('[tiers.disk]\ncodec = 8\n', "disk_codec"),
    ('[tiers.disk]\nlevel = 3\n', "[tiers.disk] level"),
    ('[tiers.host]\ncodec = "raw"\n', "[tiers.host]"),
    ('[tiers.remote]\ncodec = "int3"\n', "remote.codec"),
    ('[tiers.remote]\ncompression = "zstd"\n', "remote.compression"),
    ('[tiers.remote]\ncodec = 8\n', "remote.codec"),
    ('[tiers.remote]\nlevel = 3\n', "[tiers.remote] level"),
    ('[remote]\ncodec = "int8"\n[tiers.remote]\ncodec = "int8"\n', "remote.codec is set twice"),
    ('[tiers.gpu]\ncodec = "int8"\n', "[tiers.gpu]"),
    ('[tiers]\ncodec = "int8"\n', "tiers"),
    ('[store]\ndisk_codec = "int8"\n[tiers.disk]\ncodec = "int8"\n', "set twice"),
    ('[store]\naccept_lossy = "no"\n', "accept_lossy"),
])
def test_bad_values_name_the_option(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        load_config(str(path), env=ENV)


def test_the_remote_tier_takes_a_codec_from_its_table_the_environment_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[remote]\nurl = "redis+cluster://127.0.0.1:7001"\n'
                    '[tiers.remote]\ncodec = "int8"\ncompression = "lz4"\n')
    remote = load_config(str(path), env=ENV).remote
    assert (remote.codec, remote.compression) == ("int8", "lz4")
    env = {**ENV, "KVTIER_REMOTE__CODEC": "fp8_e4m3"}
    assert load_config(str(path), env=env).remote.codec == "fp8_e4m3"
    assert load_config(str(path), env=env, overrides={"remote.codec": "int4"}).remote.codec == "int4"
    path.write_text('[remote]\ncodec = "int2"\ncompression = "lz4"\n')
    remote = load_config(str(path), env=ENV).remote
    assert (remote.codec, remote.compression) == ("int2", "lz4")
    with pytest.raises(ConfigError, match="remote.codec"):
        load_config(env={**ENV, "KVTIER_REMOTE__CODEC": "int9"})


def test_the_daemon_hands_the_remote_codec_to_each_store(tmp_path: Path) -> None:
    pytest.importorskip("redis")
    from kvtier.daemon.server.remote_setup import remote_args  # noqa: PLC0415  (the server side, redis-py)

    path = tmp_path / "kvtier.toml"
    path.write_text('[remote]\nurl = "redis+cluster://127.0.0.1:7001"\n'
                    '[tiers.remote]\ncodec = "int8"\ncompression = "lz4"\n')
    options = remote_args(load_config(str(path), env=ENV), None)["remote_options"]
    assert (options.codec, options.compression) == ("int8", "lz4")


def test_a_tenant_may_have_its_own_accept_lossy(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[store]\naccept_lossy = false\ndisk_codec = "int8"\n'
                    '[tenants.alice]\nhost_bytes = "1GiB"\ndisk_bytes = "1GiB"\naccept_lossy = true\n'
                    '[tenants.bob]\nhost_bytes = "1GiB"\ndisk_bytes = "1GiB"\n')
    cfg = load_config(str(path), env=ENV)
    alice, bob = (t.store_config(cfg.store, cfg.data_dir) for t in cfg.tenants)
    assert (alice.accept_lossy, bob.accept_lossy) == (True, False)  # bob: the default store's
    assert alice.disk_codec == bob.disk_codec == "int8"  # the tier policy is the daemon's
    path.write_text('[tenants.carol]\nhost_bytes = "1GiB"\ndisk_bytes = 0\naccept_lossy = 1\n')
    with pytest.raises(ConfigError, match="accept_lossy"):
        load_config(str(path), env=ENV)

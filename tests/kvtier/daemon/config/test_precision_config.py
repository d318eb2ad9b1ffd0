"""Precision by tier (issue 25): ``store.disk_codec`` / ``store.disk_compression`` /
``store.disk_k_axis`` / ``store.disk_models`` (also spelt ``[tiers.disk] codec`` / ``compression`` /
``k_axis`` and ``[tiers.disk.models]`` in the file), ``remote.codec`` / ``remote.compression`` /
``remote.k_axis`` / ``remote.models`` (``[tiers.remote]``), ``store.accept_lossy`` and the tenants'
own ``accept_lossy``: sources, defaults (raw everywhere, K per channel, no model table, any copy
served) and checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.daemon.config import ConfigError, load_config

ENV = {"HOME": "/home/tester", "XDG_RUNTIME_DIR": "/run/user/1000"}


def test_exact_by_default() -> None:
    store = load_config(env=ENV).store
    assert (store.disk_codec, store.disk_compression, store.accept_lossy) == ("raw", "none", True)
    assert (store.disk_k_axis, store.disk_models, store.disk_recodes) == ("channel", (), False)
    remote = load_config(env=ENV).remote
    assert (remote.codec, remote.compression, remote.k_axis, remote.models) == ("raw", "none", "channel", ())


MODELS_TOML = """
[tiers.disk]
codec = "int8"
k_axis = "token"
[tiers.disk.models]
"meta-llama/Llama-3.1-8B*" = "raw"
"*-draft" = "int4"
"*" = "int8"
[tiers.remote]
codec = "int8"
k_axis = "token"
[tiers.remote.models]
"*-draft" = "raw"
"""


def test_k_axis_and_model_tables_from_the_tiers_tables_in_file_order(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text('[remote]\nurl = "redis+cluster://127.0.0.1:7001"\n' + MODELS_TOML)
    cfg = load_config(str(path), env=ENV)
    assert cfg.store.disk_k_axis == "token"
    assert cfg.store.disk_models == (("meta-llama/Llama-3.1-8B*", "raw"), ("*-draft", "int4"), ("*", "int8"))
    assert (cfg.remote.k_axis, cfg.remote.models) == ("token", (("*-draft", "raw"),))
    # The same options inline in [store] / [remote], from the environment and from flags.
    path.write_text('[store]\ndisk_k_axis = "token"\ndisk_models = { "a*" = "raw", "b*" = "int4" }\n'
                    '[remote]\nk_axis = "token"\nmodels = { "c*" = "int2" }\n')
    cfg = load_config(str(path), env=ENV)
    assert (cfg.store.disk_k_axis, cfg.store.disk_models) == ("token", (("a*", "raw"), ("b*", "int4")))
    assert (cfg.remote.k_axis, cfg.remote.models) == ("token", (("c*", "int2"),))
    env = {**ENV, "KVTIER_STORE__DISK_K_AXIS": "channel", "KVTIER_STORE__DISK_MODELS": " x-*=raw , *-draft = int8,",
           "KVTIER_REMOTE__K_AXIS": "channel", "KVTIER_REMOTE__MODELS": ""}
    cfg = load_config(str(path), env=env)
    assert (cfg.store.disk_k_axis, cfg.store.disk_models) == ("channel", (("x-*", "raw"), ("*-draft", "int8")))
    assert (cfg.remote.k_axis, cfg.remote.models) == ("channel", ())
    cfg = load_config(str(path), env=env, overrides={"store.disk_models": "m=int2", "remote.models": {"n": "raw"}})
    assert (cfg.store.disk_models, cfg.remote.models) == ((("m", "int2"),), (("n", "raw"),))


def test_tenants_share_the_daemons_tier_policy(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(MODELS_TOML + '[tenants.alice]\nhost_bytes = "1GiB"\ndisk_bytes = "1GiB"\n')
    cfg = load_config(str(path), env=ENV)
    alice = cfg.tenants[0].store_config(cfg.store, cfg.data_dir)
    assert (alice.disk_k_axis, alice.disk_models) == (cfg.store.disk_k_axis, cfg.store.disk_models)


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
    ('[tiers.disk]\nk_axis = "row"\n', "disk_k_axis"),
    ('[tiers.disk]\nk_axis = 1\n', "disk_k_axis"),
    ('[tiers.remote]\nk_axis = "row"\n', "remote.k_axis"),
    ('[tiers.disk.models]\n"llama*" = "int3"\n', "store.disk_models (file .*[tiers.disk.models]): ['llama*']"),
    ('[tiers.disk.models]\n"llama*" = 8\n', "store.disk_models (file .*): ['llama*']"),
    ('[tiers.disk.models]\n"" = "raw"\n', "store.disk_models (file .*): pattern ''"),
    ('[tiers.disk]\nmodels = "llama*=raw"\n', "store.disk_models (file .*): must be a table"),
    ('[tiers.disk]\nmodels = 3\n', "store.disk_models"),
    ('[tiers.remote.models]\n"x" = "int9"\n', "remote.models (file .*[tiers.remote.models]): ['x']"),
    ('[store]\ndisk_models = {}\n[tiers.disk.models]\n"x" = "raw"\n', "store.disk_models is set twice"),
    ('[tiers.host.models]\n"x" = "raw"\n', "[tiers.host]"),
])
def test_bad_values_name_the_option(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    pattern = words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(ConfigError, match=pattern.replace("*", r"\*").replace(r".\*", ".*")):
        load_config(str(path), env=ENV)


@pytest.mark.parametrize("name, value, words", [
    ("KVTIER_STORE__DISK_MODELS", "llama", r"store.disk_models \(env KVTIER_STORE__DISK_MODELS\): 'llama' is not"),
    ("KVTIER_STORE__DISK_MODELS", "llama=int3", r"store.disk_models \(env .*\['llama'\]"),
    ("KVTIER_STORE__DISK_MODELS", "=raw", r"pattern ''"),
    ("KVTIER_STORE__DISK_K_AXIS", "row", "disk_k_axis"),
    ("KVTIER_REMOTE__MODELS", "a=raw,a=int8", r"remote.models \(env .*appears twice"),
    ("KVTIER_REMOTE__K_AXIS", "row", "remote.k_axis"),
])
def test_bad_environment_values_name_the_option(name: str, value: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load_config(env={**ENV, name: value})


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
    path.write_text('[remote]\nurl = "redis+cluster://127.0.0.1:7001"\n' + MODELS_TOML)
    options = remote_args(load_config(str(path), env=ENV), "alice")["remote_options"]
    assert (options.codec, options.k_axis, options.models) == ("int8", "token", (("*-draft", "raw"),))


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

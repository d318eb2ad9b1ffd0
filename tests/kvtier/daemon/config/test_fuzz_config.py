"""Fuzzing of the daemon's configuration inputs: the TOML file, ``KVTIER_*`` variables, flag
values and sizes. ``load_config`` returns a config or raises ConfigError; nothing else."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.daemon.config import ENV_ALIASES, OPTIONS, ConfigError, env_name, load_config, parse_size, split_hostport

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
EXAMPLE = Path(__file__).resolve().parents[4] / "configs" / "kvtier.toml"
toml_values = st.recursive(st.one_of(st.booleans(), st.integers(-(1 << 64), 1 << 64), st.text(max_size=30),
                                     st.floats(allow_nan=True), st.sampled_from(["4GiB", "off", "auto", "1.5G",
                                                                                 "127.0.0.1:0", "tcp://x:1"])),
                           lambda inner: st.lists(inner, max_size=3), max_leaves=6)


def load_file(tmp_path: Path, text: bytes) -> None:
    path = tmp_path / "kvtier.toml"
    path.write_bytes(text)
    try:
        load_config(str(path), env={"HOME": str(tmp_path)})
    except ConfigError:
        pass


def toml_scalar(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else "-inf" if v == float("-inf") else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_scalar(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"').encode("ascii", "backslashreplace").decode()\
        .replace("\\x", "\\u00") + '"'


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(OPTIONS)), toml_values, max_size=5))
def test_any_value_for_any_option(tmp_path: Path, options: dict) -> None:
    sections: dict[str, list[str]] = {}
    for option, value in options.items():
        section, key = option.split(".")
        sections.setdefault(section, []).append(f"{key} = {toml_scalar(value)}")
    text = "\n".join(f"[{s}]\n" + "\n".join(lines) for s, lines in sections.items())
    try:
        tomllib.loads(text)
    except (tomllib.TOMLDecodeError, UnicodeError):
        return  # the writer above is approximate; the parser's refusals are tested below
    load_file(tmp_path, text.encode())


@FUZZ
@given(st.text(max_size=200))
def test_any_utf8_text(tmp_path: Path, text: str) -> None:
    load_file(tmp_path, text.encode("utf-8", "replace"))


@FUZZ
@given(st.data())
def test_mutated_example_config(tmp_path: Path, data: st.DataObject) -> None:
    lines = EXAMPLE.read_text().splitlines()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(lines) - 1))
        lines[i] = data.draw(st.sampled_from([lines[i][: len(lines[i]) // 2], lines[i] + "x", "[store]", "x = 1",
                                              lines[i].replace("=", "= -"), lines[i].replace('"', ""), ""]))
    load_file(tmp_path, "\n".join(lines).encode())


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted([env_name(o) for o in OPTIONS] + list(ENV_ALIASES))),
                       st.text(max_size=30).map(lambda s: s.replace("\x00", "")), max_size=5))
def test_any_environment(tmp_path: Path, env: dict) -> None:
    try:
        load_config(None, env={"HOME": str(tmp_path), **env})
    except ConfigError:
        pass


@FUZZ
@given(st.sampled_from(sorted(OPTIONS)), st.text(max_size=40).map(lambda s: s.replace("\x00", "")))
def test_any_flag_value(option: str, text: str) -> None:
    try:
        load_config(None, env={"HOME": "/nonexistent"}, overrides={option: text})
    except ConfigError:
        pass


@FUZZ
@given(st.one_of(st.text(max_size=40), st.integers(-5, 1 << 70)))
def test_sizes_and_addresses(text: str | int) -> None:
    try:
        n = parse_size(text)
        assert isinstance(n, int) and n >= 0
    except ConfigError:
        pass
    try:
        host, port = split_hostport(text)  # type: ignore[arg-type]
        assert 0 <= port <= 65535
    except ConfigError:
        pass


@pytest.mark.parametrize("text,expected", [("4GiB", 4 << 30), ("1.5GiB", 3 << 29), (" 20 g ", 20 << 30),
                                           ("500MB", 500_000_000), ("0", 0), ("7", 7)])
def test_sizes(text: str, expected: int) -> None:
    assert parse_size(text) == expected


# --- regressions of defects the fuzzer found (fixed by the patch named in each marker) ----------


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"[store]\nhost_bytes = \"\xff\xfe\"\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(str(path), env={"HOME": str(tmp_path)})


def test_deeply_nested_value_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deep.toml"
    path.write_bytes(b"[store]\nhost_bytes = " + b"[" * 5000 + b"]" * 5000 + b"\n")
    with pytest.raises(ConfigError, match="nests"):
        load_config(str(path), env={"HOME": str(tmp_path)})


def test_huge_integer_for_a_float_option_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "huge.toml"
    path.write_bytes(b"[daemon]\ndrain_timeout_s = " + b"9" * 400 + b"\n")
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        load_config(str(path), env={"HOME": str(tmp_path)})


def test_nul_in_a_path_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "nul.toml"
    path.write_bytes(b'[dataplane]\nsocket = "/tmp/a\\u0000b"\n')
    with pytest.raises(ConfigError, match="NUL"):
        load_config(str(path), env={"HOME": str(tmp_path)})

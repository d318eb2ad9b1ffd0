"""Daemon addresses: unix paths and TCP host:port in their accepted spellings."""

from __future__ import annotations

import pytest

from kvtier_protocol.address import Address, parse_address
from kvtier_protocol.errors import InvalidRequest


@pytest.mark.parametrize("text, expected", [
    ("unix:/run/kvtier/kvtier.sock", Address("unix", path="/run/kvtier/kvtier.sock")),
    ("unix:///run/kvtier/kvtier.sock", Address("unix", path="/run/kvtier/kvtier.sock")),
    ("unix:relative.sock", Address("unix", path="relative.sock")),
    ("/tmp/x/kvtier.sock", Address("unix", path="/tmp/x/kvtier.sock")),
    ("./kvtier.sock", Address("unix", path="./kvtier.sock")),
    ("kvtier.sock", Address("unix", path="kvtier.sock")),
    ("tcp://127.0.0.1:7470", Address("tcp", host="127.0.0.1", port=7470)),
    ("tcp://:7470", Address("tcp", host="127.0.0.1", port=7470)),
    ("tcp:127.0.0.1:41234", Address("tcp", host="127.0.0.1", port=41234)),  # as kvtierd logs it
    ("localhost:1", Address("tcp", host="localhost", port=1)),
    ("[::1]:65535", Address("tcp", host="::1", port=65535)),
    ("tcp://[::1]:80", Address("tcp", host="::1", port=80)),
    ("  127.0.0.1:7470 ", Address("tcp", host="127.0.0.1", port=7470)),
])
def test_accepted_spellings(text: str, expected: Address) -> None:
    assert parse_address(text) == expected
    assert parse_address(str(expected)) == expected  # str() round-trips
    assert parse_address(expected) is expected


@pytest.mark.parametrize("text", ["", "   ", "unix:", "tcp://host", "tcp://h:0", "tcp://h:70000",
                                  "tcp://h:port", "tcp:h", "http://127.0.0.1:80"])
def test_rejected(text: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_address(text)


def test_not_a_string() -> None:
    with pytest.raises(InvalidRequest):
        parse_address(7470)  # type: ignore[arg-type]


def test_kind_helpers() -> None:
    assert parse_address("/a.sock").is_unix
    assert not parse_address("h:1").is_unix
    assert str(parse_address("[::1]:9")) == "tcp://[::1]:9"


def test_default_address_is_where_the_daemon_listens_by_default(tmp_path) -> None:
    from kvtier_protocol.address import default_address, default_socket

    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    assert default_address(env) == "unix:" + default_socket(env, "/unused")
    assert parse_address(default_address(env)).path == str(tmp_path / "kvtier" / "kvtier.sock")


def test_default_address_takes_kvtier_address_then_kvtier_socket() -> None:
    from kvtier_protocol.address import default_address

    env = {"XDG_RUNTIME_DIR": "/x", "KVTIER_SOCKET": "/s/kvtier.sock"}
    assert default_address(env) == "/s/kvtier.sock"
    assert default_address({**env, "KVTIER_ADDRESS": "tcp://127.0.0.1:7470"}) == "tcp://127.0.0.1:7470"

"""The admin commands against a real daemon that is restarted: what it knows of its namespaces survives."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest
import torch

from kvtier.client import Client
from kvtier.commands.admin import register
from kvtier_protocol.namespace import Namespace
from tests.kvtier.commands.envkit import isolate_env
from tests.kvtier.conftest import KvtierDaemon

NS = Namespace(model="restart/model", revision="r7", attention="mha", num_layers=2, num_kv_heads=2, head_dim=32,
               block_tokens=16, kv_dtype="float16")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    isolate_env(monkeypatch, tmp_path, runtime_dir=False)


def kvtier(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="kvtier")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_namespaces_are_known_again_after_a_restart(tmp_path: Path, capsys) -> None:
    """A namespace registered from saved headers is saved with the disk tier: after a restart
    ``ls`` still shows its model and ``lookup --ns`` still answers (it said "not registered")."""
    port = free_port()
    daemon = KvtierDaemon(tmp_path, extra_args=("--rest", f"127.0.0.1:{port}"))
    try:
        daemon.start()
        tokens = list(range(1000, 1000 + 3 * NS.block_tokens))
        keys = NS.block_keys(tokens)
        gen = torch.Generator().manual_seed(7)
        blocks = [torch.randn(2, 2, 2, 16, 32, generator=gen).half() for _ in keys]
        with Client(daemon.address, token=daemon.token) as client:
            assert client.save_tensors(NS, keys, blocks) == ["stored"] * 3
        rest = ("--rest", f"127.0.0.1:{port}", "--token-file", str(daemon.data_dir / "token"))
        ns_hex, ids = NS.ns_id.hex(), ",".join(map(str, tokens))
        assert kvtier("lookup", *rest, "--ns", ns_hex, "--tokens", ids, "--json") == 0
        assert json.loads(capsys.readouterr().out)["hit_blocks"] == 3

        daemon.restart()  # a clean stop: the host blocks are written to disk, the namespace was saved before
        assert kvtier("ls", *rest) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
        assert [ns_hex, "restart/model", "r7", "16", "yes", "3"] in rows
        assert kvtier("lookup", *rest, "--ns", ns_hex, "--tokens", ids) == 0
        assert capsys.readouterr().out.startswith("hit 48 of 48 tokens (3 of 3 blocks of 16)")
        with Client(daemon.address, token=daemon.token) as client:
            loaded = client.load_tensors(NS, keys)
        assert len(loaded) == 3 and all(torch.equal(a, b) for a, b in zip(loaded, blocks))
    finally:
        daemon.cleanup()

"""Fixtures of the client tests: a toy data-plane peer (peer.py) in a short temporary directory, and
a real ``kvtier serve`` per test module (daemonkit.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator

import pytest

from tests.kvtier.client.daemonkit import Daemon
from tests.kvtier.client.peer import Peer


@pytest.fixture
def short_dir() -> Iterator[str]:
    """A directory with a short path: unix socket paths are limited to 107 bytes."""
    path = tempfile.mkdtemp(prefix="kvc-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_peer(short_dir: str) -> Iterator[Callable[..., Peer]]:
    """Factory of started peers, stopped at teardown."""
    peers: list[Peer] = []

    def _make(**kwargs: object) -> Peer:
        peer = Peer(short_dir, **kwargs).start()  # type: ignore[arg-type]
        peers.append(peer)
        return peer

    yield _make
    for peer in peers:
        peer.stop()


@pytest.fixture
def peer(make_peer: Callable[..., Peer]) -> Peer:
    """A started peer without a token."""
    return make_peer()


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """A real daemon (its defaults, unix socket and TCP) shared by a test module's tests."""
    directory = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    d = Daemon(directory).start()
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)

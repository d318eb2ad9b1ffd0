"""Helpers of the client tests: block records of any size, built with the real header encoder."""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum
from tests.kvtier.waitkit import PATIENCE_S

NS_ID = hashlib.sha256(b"client-tests").digest()[:16]
OTHER_NS_ID = hashlib.sha256(b"client-tests-other").digest()[:16]


def key(i: int, tag: bytes = b"") -> bytes:
    """A 32-byte chain hash for block ``i``."""
    return hashlib.sha256(tag + i.to_bytes(8, "little")).digest()


def make_record(ns_id: bytes, chain_hash: bytes, size: int, *, seed: int = 0,
                parent: bytes | None = None) -> bytes:
    """A raw uint8 block record whose payload is ``size`` random bytes (``size`` % 32 == 0)."""
    assert size % 32 == 0 and size > 0, "shape (1, 2, 1, 16, size / 32)"
    payload = random.Random(seed).randbytes(size)
    header = BlockHeader(ns_id=ns_id, chain_hash=chain_hash, parent_hash=parent, num_tokens=16,
                         layout="canonical", shape=(1, 2, 1, 16, size // 32), dtype="uint8",
                         codec="raw", sections=(Section("payload", 0, size),), payload_len=size,
                         checksum=payload_checksum(payload))
    return encode_header(header) + payload


def make_blocks(n: int, size: int, *, ns_id: bytes = NS_ID, tag: bytes = b"") -> list[tuple[bytes, bytes]]:
    """``n`` consecutive ``(chain_hash, record)`` blocks of one chain."""
    keys = [key(i, tag) for i in range(n)]
    return [(k, make_record(ns_id, k, size, seed=i, parent=keys[i - 1] if i else None))
            for i, k in enumerate(keys)]


def eventually(condition: Callable[[], bool], timeout_s: float = PATIENCE_S) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passed; its last value. Releases travel
    without the client waiting for their answers, so a peer sees them shortly after a call (the
    deadline is generous: a busy machine may take long, a broken client never gets there)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


@contextmanager
def short_timeout(client: Any, timeout_s: float = 0.3) -> Iterator[None]:
    """Calls of ``client`` made inside time out after ``timeout_s``; outside, its own (generous)
    timeout applies again.

    For calls a test *means* to time out (the peer or daemon is stalled, so no answer can come):
    they cost a short wait, while the calls around them, which must succeed, keep a timeout no
    busy machine comes near.
    """
    saved = client.options
    client.options = dataclasses.replace(saved, timeout_s=timeout_s,
                                         connect_timeout_s=min(saved.connect_timeout_s, timeout_s))
    try:
        yield
    finally:
        client.options = saved

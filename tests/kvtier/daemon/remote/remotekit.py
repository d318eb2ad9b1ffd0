"""Helpers of the remote-tier tests: real block records of a real namespace, of any size."""

from __future__ import annotations

import hashlib
import random

from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.remote.backend import RemoteKey

LAYERS, TOKENS = 4, 16  # a bfloat16 canonical block [4, 2, 1, 16, D] holds 256 * D bytes


def namespace_for(size: int, *, model: str = "remote-tests") -> Namespace:
    """A namespace whose raw bfloat16 blocks are ``size`` bytes (``size`` % 256 == 0)."""
    assert size % (LAYERS * 2 * TOKENS * 2) == 0
    return Namespace(model=model, revision="r1", attention="mha", num_layers=LAYERS, num_kv_heads=1,
                     head_dim=size // (LAYERS * 2 * TOKENS * 2), block_tokens=TOKENS, hash_tokens=TOKENS)


def chain_hash(i: int, tag: bytes = b"") -> bytes:
    """A 32-byte chain hash for block ``i``."""
    return hashlib.sha256(tag + i.to_bytes(8, "little")).digest()


def make_record(ns: Namespace, chain: bytes, *, seed: int = 0, parent: bytes | None = None) -> bytes:
    """A whole raw record (header + random payload) of block ``chain`` in ``ns``."""
    size = ns.block_payload_bytes()
    payload = random.Random(seed).randbytes(size)
    shape = (ns.num_layers, 2, ns.num_kv_heads, ns.block_tokens, ns.head_dim)
    header = BlockHeader(ns_id=ns.ns_id, chain_hash=chain, parent_hash=parent, num_tokens=ns.block_tokens,
                         layout="canonical", shape=shape, dtype=ns.kv_dtype, codec="raw",
                         sections=(Section("payload", 0, size),), payload_len=size,
                         checksum=payload_checksum(payload))
    return encode_header(header) + payload


def make_blocks(ns: Namespace, n: int, *, tenant: str = "default", tag: bytes = b"") -> list[tuple[RemoteKey, bytes]]:
    """``n`` consecutive blocks of one chain in ``ns``: ``(key, record)``."""
    hashes = [chain_hash(i, tag) for i in range(n)]
    return [(RemoteKey(tenant, ns.ns_id, h), make_record(ns, h, seed=i, parent=hashes[i - 1] if i else None))
            for i, h in enumerate(hashes)]

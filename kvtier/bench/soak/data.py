"""The soak's working set: keys, records and the expected content of every block, from numbers alone.

Every process of the soak (the suite, which pre-fills the tiers, and each worker) derives the same
blocks from ``(seed, prefix, position)`` without sharing any state, so any client can check any
block it loads, whoever saved it::

    key(p, j)      = sha256(ns_id || seed || p || j)            32 bytes, the chain hash
    payload(p, j)  = key(p, j) || base[off : off + size - 32]    off = first 4 bytes of the key
    record(p, j)   = encoded header (checksum of the payload) || payload

``base`` is one buffer of deterministic random bytes; a block's payload is a window into it that
starts with its own key, so a block served in place of another (a reused slot, a stale disk
record) differs in its first bytes and in every byte after them, and one flipped byte anywhere
differs from the expectation. Sizes vary by block (64-256 KiB) so that the host allocator mixes
slab classes and the disk tier stores every record in its blob files. Torch-free.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field

import numpy as np

from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

KIB = 1 << 10
SIZES = tuple(n * KIB for n in (64, 96, 128, 192, 256))
"""Payload sizes; multiples of 64 so that a float16 ``[1, 2, 1, 16, n/64]`` shape covers them."""
SPAN = 64 * KIB  # window offsets range over this many bytes of the base buffer
NS_ID = hashlib.sha256(b"kvtier bench soak").digest()[:16]


@dataclass(slots=True)
class Workload:
    """``prefixes`` chains of ``blocks`` blocks each: the soak's working set.

    Args:
        prefixes: number of distinct prompt prefixes.
        blocks: blocks per prefix (each a chain hash whose parent is the block before it).
        seed: selects the keys and the content; every process of one soak uses the same.
        skew: popularity exponent: prefix ``p`` is drawn as ``int(prefixes * u ** skew)`` for a
            uniform ``u``, so low-numbered prefixes are hot (hits in host memory), the middle ones
            warm (hits on disk, promoted) and the tail cold (misses, new saves, evictions).
    """

    prefixes: int
    blocks: int = 4
    seed: int = 1
    skew: float = 2.0
    _base: bytes = field(init=False, repr=False)
    _base_np: np.ndarray = field(init=False, repr=False)
    _headers: dict[tuple[int, int], bytes] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.Generator(np.random.PCG64(self.seed))
        self._base = rng.bytes(max(SIZES) + SPAN)
        self._base_np = np.frombuffer(self._base, dtype=np.uint8)

    @property
    def avg_block_bytes(self) -> float:
        return sum(SIZES) / len(SIZES)

    @classmethod
    def covering(cls, nbytes: int, *, blocks: int = 4, seed: int = 1) -> Workload:
        """A workload whose blocks add up to at least ``nbytes``."""
        per_prefix = blocks * sum(SIZES) / len(SIZES)
        return cls(max(1, math.ceil(nbytes / per_prefix)), blocks, seed)

    def key(self, p: int, j: int) -> bytes:
        return hashlib.sha256(NS_ID + self.seed.to_bytes(8, "little") + p.to_bytes(8, "little")
                              + j.to_bytes(2, "little")).digest()

    def chain(self, p: int) -> list[bytes]:
        """The chain hashes of prefix ``p``, first first."""
        return [self.key(p, j) for j in range(self.blocks)]

    def size(self, p: int, j: int) -> int:
        return SIZES[(p * 7 + j) % len(SIZES)]

    def pick(self, rng: random.Random) -> int:
        """A prefix, drawn with the workload's skew."""
        return min(self.prefixes - 1, int(self.prefixes * rng.random() ** self.skew))

    def _window(self, key: bytes, size: int) -> tuple[int, int]:
        off = int.from_bytes(key[:4], "little") % SPAN
        return off, off + size - len(key)

    def header(self, p: int, j: int) -> bytes:
        """The encoded header of block ``(p, j)`` (cached: it depends on nothing else)."""
        cached = self._headers.get((p, j))
        if cached is not None:
            return cached
        key, n = self.key(p, j), self.size(p, j)
        lo, hi = self._window(key, n)
        h = BlockHeader(ns_id=NS_ID, chain_hash=key, parent_hash=self.key(p, j - 1) if j else None,
                        num_tokens=16, layout="canonical", shape=(1, 2, 1, 16, n // 64), dtype="float16",
                        codec="raw", sections=(Section("payload", 0, n),), payload_len=n,
                        checksum=payload_checksum(key + self._base[lo:hi]))
        self._headers[(p, j)] = out = encode_header(h)
        return out

    def record(self, p: int, j: int) -> bytes:
        """The whole record of block ``(p, j)``: header, then payload."""
        key = self.key(p, j)
        lo, hi = self._window(key, self.size(p, j))
        return b"".join((self.header(p, j), key, memoryview(self._base)[lo:hi]))

    def blocks_of(self, p: int) -> list[tuple[bytes, bytes]]:
        """``(chain_hash, record)`` of every block of prefix ``p``: what a save sends."""
        return [(self.key(p, j), self.record(p, j)) for j in range(self.blocks)]

    def payload_ok(self, p: int, j: int, payload: memoryview | bytes | bytearray) -> bool:
        """Whether ``payload`` is exactly block ``(p, j)``'s payload, byte for byte."""
        key = self.key(p, j)
        lo, hi = self._window(key, self.size(p, j))
        view = memoryview(payload)
        if view.nbytes != len(key) + hi - lo or bytes(view[:len(key)]) != key:
            return False
        # numpy compares at memcmp speed; a memoryview comparison goes element by element
        return bool(np.array_equal(np.frombuffer(view[len(key):], dtype=np.uint8), self._base_np[lo:hi]))

"""The blocks of `kvtier bench crash` and the raw data-plane link its writer and checker speak over.

Every block is a pure function of ``(cycle, index)``: its key, parent and payload are derived from
them, so any process can tell what a block served by the daemon must be, byte for byte, without
keeping a copy. The link is the client's own transport (:class:`BlockingConnection`) driven one
request at a time, without the client's retries, so that the writer can stop between the steps of
a save (reserve, copy into shared memory, commit) and a dead daemon shows at once.
"""

from __future__ import annotations

import hashlib
import random
import select
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier_protocol.address import parse_address
from kvtier.client.steps import Call
from kvtier.client.options import ClientOptions
from kvtier.client.transport import BlockingConnection
from kvtier_protocol.frames import EXISTS, encode_frame, parse_response, raise_for_error
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

NS_ID = hashlib.sha256(b"kvtier bench crash").digest()[:16]
BLOCK_TOKENS = 16


def block_key(cycle: int, index: int) -> bytes:
    """The chain hash of block ``index`` written in ``cycle``."""
    return hashlib.sha256(NS_ID + cycle.to_bytes(4, "little") + index.to_bytes(4, "little")).digest()


def block_parts(cycle: int, index: int, nbytes: int) -> tuple[bytes, bytes, bytes]:
    """``(key, encoded header, payload)`` of a block; the payload is ``nbytes`` pseudo-random bytes."""
    assert nbytes % 64 == 0, "payloads are [1, 2, 1, 16, nbytes / 64] float16"
    key = block_key(cycle, index)
    payload = random.Random(key).randbytes(nbytes)
    header = BlockHeader(ns_id=NS_ID, chain_hash=key, parent_hash=block_key(cycle, index - 1) if index else None,
                         num_tokens=BLOCK_TOKENS, layout="canonical", shape=(1, 2, 1, BLOCK_TOKENS, nbytes // 64),
                         dtype="float16", codec="raw", sections=(Section("payload", 0, nbytes),),
                         payload_len=nbytes, checksum=payload_checksum(payload))
    return key, encode_header(header), payload


def block_record(cycle: int, index: int, nbytes: int) -> bytes:
    """The whole record (header + payload) the daemon must serve for this block."""
    _, header, payload = block_parts(cycle, index, nbytes)
    return header + payload


@dataclass(slots=True)
class Served:
    """What an acquire of some blocks found: how many were served intact, which were served with
    other bytes than were written, which were missing."""

    intact: int = 0
    bad: list[tuple[int, int]] = field(default_factory=list)
    missing: list[tuple[int, int]] = field(default_factory=list)


class SteppedConnection(BlockingConnection):
    """The client's blocking connection, with a request that runs a callable between sending and
    receiving (it reaches into the transport's send and receive steps, which ``call`` joins)."""

    def call_between(self, call: Call, deadline: float, between: Callable[[], None]) -> Any:
        """Like :meth:`call`, running ``between()`` once the request is sent, before the answer is read."""
        session = self.session
        assert session is not None, "hello precedes every call"
        ident = next(self._ids)
        try:
            self._send(encode_frame({"op": call.op, "id": ident, **call.keys}, limits=session.limits), deadline)
            between()
            frame = self._recv_frame(session.limits, deadline)
            self._check_id(frame, ident)
        except BaseException:
            self.close()
            raise
        raise_for_error(frame.header)
        return parse_response(call.op, frame, limits=session.limits)

    def answered(self) -> bool:
        """Whether bytes of an answer wait in the socket (the daemon has replied)."""
        sock = self._sock
        return sock is not None and bool(self._pending or select.select([sock], [], [], 0)[0])


class Link:
    """One unix-socket connection to the daemon (shared memory mapped), without retries.

    Raises (every method): KVTierError subclasses of the client: ConnectionLost / TimedOut when
    the daemon died or went silent, the daemon's typed error otherwise.
    """

    def __init__(self, address: str, *, timeout_s: float = 10.0, lease_ms: int = 30_000) -> None:
        self.timeout_s = timeout_s
        options = ClientOptions(client_name="kvtier-bench-crash", timeout_s=timeout_s, lease_ms=lease_ms)
        self.conn = SteppedConnection.open(parse_address(address), options, time.monotonic() + timeout_s)
        session = self.conn.session
        assert session is not None and session.shm is not None, "a unix socket session maps the segments"
        self.shm = session.shm
        self.lease_ms = session.lease_ms
        self.max_batch = session.limits.max_batch

    def call(self, op: str, **keys: Any) -> Any:
        return self.conn.call(Call(op, keys), time.monotonic() + self.timeout_s)

    def call_between(self, op: str, between: Callable[[], None], **keys: Any) -> Any:
        return self.conn.call_between(Call(op, keys), time.monotonic() + self.timeout_s, between)

    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int], between: Callable[[], None]) -> Any:
        return self.call_between("reserve", between, ns_id=NS_ID, hashes=list(keys), sizes=list(sizes),
                                 lease_ms=self.lease_ms, priority=0)

    def commit(self, lease: int, headers: Sequence[bytes | None], between: Callable[[], None]) -> int:
        return self.call_between("commit", between, lease=lease, headers=list(headers)).committed

    def grant(self, sizes: Sequence[int]) -> Any:
        return self.call("grant", sizes=list(sizes), lease_ms=self.lease_ms, priority=0)

    def place(self, lease: int, keys: Sequence[bytes], positions: Sequence[int], headers: Sequence[bytes],
              between: Callable[[], None]) -> list[str]:
        return self.call_between("place", between, lease=lease, ns_id=NS_ID, hashes=list(keys),
                                 positions=list(positions), headers=list(headers)).results

    def lookup_tiers(self, keys: Sequence[bytes]) -> list[str]:
        """The tier of each key of the stored prefix of ``keys``."""
        tiers: list[str] = []
        for lo in range(0, len(keys), self.max_batch):
            chunk = list(keys[lo:lo + self.max_batch])
            r = self.call("lookup", ns_id=NS_ID, hashes=chunk)
            tiers.extend(r.tiers)
            if r.num_hits < len(chunk):
                break
        return tiers

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.call("delete", ns_id=NS_ID, hashes=list(keys)).deleted

    def check_served(self, blocks: Sequence[tuple[int, int]], nbytes: int, *, chunk: int = 16) -> Served:
        """Acquire ``blocks`` (``(cycle, index)`` pairs) and compare every served record, byte for
        byte, with what was written. A block after a miss is asked for again, so every block is
        classified: intact, bad (served with other bytes) or missing."""
        out = Served()
        todo = list(blocks)
        while todo:
            part, todo = todo[:chunk], todo[chunk:]
            r = self.call("acquire", ns_id=NS_ID, hashes=[block_key(c, i) for c, i in part], lease_ms=self.lease_ms)
            try:
                for n, ((c, i), slot, header) in enumerate(zip(part, r.slots, r.headers)):
                    if slot is None or slot == EXISTS or header is None:
                        out.missing.append((c, i))
                        todo = part[n + 1:] + todo  # the prefix ends here: ask for the rest again
                        break
                    if self.shm.read_record(header, slot) == block_record(c, i, nbytes):
                        out.intact += 1
                    else:
                        out.bad.append((c, i))
            finally:
                if r.lease:
                    self.call("release", lease=r.lease)
        return out

    def close(self) -> None:
        self.conn.close()

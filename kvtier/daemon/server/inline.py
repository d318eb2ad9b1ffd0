"""The byte work of the inline (TCP) path: check put records, copy payloads into host slots, send
get payloads from them.

A put's payloads are verified as they are copied into their slots, a chunk at a time, the hash
reading each chunk of the slot just written while it is still in cache: one pass over memory
fewer than checking the received record and then copying it, and what is verified is exactly the
slot, so the store marks it checked at once (no background scrub pass later, no hash by readers).
Large batches run on a worker thread (:func:`run_sized`), so one big put does not stall the event
loop that serves every other connection.

A get's records are not copied at all: the response's payload is the list of record headers and
views of the leased slots (:func:`record_views`), which the connection hands to the socket as they
are (``writev``); the lease is released once those bytes have left (kvtier.daemon.server.connection).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.header import copy_checksummed, payload_checksum, split_record

COPY_IN_THREAD_BYTES = 4 << 20  # larger copies and checksums leave the event loop


async def run_sized(nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on a worker thread when it touches more than COPY_IN_THREAD_BYTES."""
    if nbytes > COPY_IN_THREAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def check_records(ns_id: bytes, hashes: Sequence[bytes], records: Sequence[memoryview | None]
                  ) -> tuple[list[bytes], list[memoryview], list[int]]:
    """Decode every record of a put before anything is stored (payloads are verified as they are
    copied: :func:`copy_checked`).

    Returns:
        Per key, the encoded header (what commit takes), a view of the payload, and the
        header's payload checksum.

    Raises:
        InvalidRequest: a record names another block than its key. What
        :func:`~kvtier_protocol.header.split_record` raises (bad_header, checksum_mismatch for a
        payload longer than the header says, truncated, ...).
    """
    headers, payloads, checksums = [], [], []
    for i, (key, record) in enumerate(zip(hashes, records)):
        assert record is not None, "validate_request refuses nil lens in a put"
        h, payload = split_record(record)
        if h.ns_id != ns_id or h.chain_hash != key:
            raise InvalidRequest(f"put: record {i} names another block than its key")
        headers.append(bytes(record[:record.nbytes - payload.nbytes]))
        payloads.append(payload)
        checksums.append(h.checksum)
    return headers, payloads, checksums


def copy_checked(items: Sequence[tuple[memoryview | None, memoryview, int]]) -> list[int]:
    """Copy each payload into its slot view and hash what landed there (a payload without a
    slot, of a key stored already or without room, is only hashed); the indexes of the items
    whose xxh3-64 differs from their checksum (empty: every slot holds its payload)."""
    return [i for i, (dst, src, checksum) in enumerate(items)
            if (payload_checksum(src) if dst is None else copy_checksummed(src, dst)) != checksum]


def record_views(pairs: Sequence[tuple[bytes, memoryview]]) -> list[bytes | memoryview]:
    """The payload of a get response as buffers to send back to back, nothing copied: each
    record's header, then a read-only view of its slot. The views are valid only while the lease
    on those slots holds: until the bytes have left (the connection releases it then)."""
    out: list[bytes | memoryview] = []
    for header, view in pairs:
        out.append(header)
        out.append(view.toreadonly())
    return out


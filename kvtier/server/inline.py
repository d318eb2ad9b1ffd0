"""The byte work of the inline (TCP) path: check put records, copy payloads into and out of host slots.

Large batches run on a worker thread (:func:`run_sized`), so one big put or get does not stall
the event loop that serves every other connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.header import split_record, verify_payload

COPY_IN_THREAD_BYTES = 4 << 20  # larger copies and checksums leave the event loop


async def run_sized(nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on a worker thread when it touches more than COPY_IN_THREAD_BYTES."""
    if nbytes > COPY_IN_THREAD_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def check_records(ns_id: bytes, hashes: Sequence[bytes], records: Sequence[memoryview | None]
                  ) -> tuple[list[bytes], list[memoryview]]:
    """Decode and verify every record of a put before anything is stored.

    Returns:
        Per key, the encoded header (what commit takes) and a view of the payload.

    Raises:
        InvalidRequest: a record names another block than its key. What
        :func:`~kvtier_protocol.header.split_record` and ``verify_payload`` raise (bad_header,
        checksum_mismatch, truncated, ...).
    """
    headers, payloads = [], []
    for i, (key, record) in enumerate(zip(hashes, records)):
        assert record is not None, "validate_request refuses nil lens in a put"
        h, payload = split_record(record)
        if h.ns_id != ns_id or h.chain_hash != key:
            raise InvalidRequest(f"put: record {i} names another block than its key")
        verify_payload(h, payload)
        headers.append(bytes(record[:record.nbytes - payload.nbytes]))
        payloads.append(payload)
    return headers, payloads


def copy_into(pairs: Sequence[tuple[memoryview, memoryview]]) -> None:
    """Copy each source payload into its destination slot view."""
    for dst, src in pairs:
        dst[:] = src


def copy_out(dst: memoryview, pairs: Sequence[tuple[bytes, memoryview]]) -> None:
    """The records of a get response, back to back at the start of ``dst`` (header, then a copy
    of the slot's payload, made before the lease ends: the slot may be reused after)."""
    at = 0
    for header, view in pairs:
        dst[at:at + len(header)] = header
        at += len(header)
        dst[at:at + view.nbytes] = view
        at += view.nbytes

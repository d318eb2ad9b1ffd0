"""``load_into``: block payloads copied straight into buffers the caller owns, verified as they land.

``load`` returns each record as a new ``bytes`` object: the copy goes into freshly allocated
pages (page faults on every 4 KiB) and the checksum reads the record a second time. A caller that
already holds its destination (a preallocated bytearray, a pinned torch tensor's ``.numpy()``)
passes it here instead::

    slot (shared memory) or record (TCP frame)
        │ 256 KiB at a time
        ▼
    caller's buffer ──► xxh3-64 streaming update of the chunk just written (still in cache)

The digest is of the destination's bytes, so what is verified is exactly what the caller gets.
A slot the daemon reports checked (SPEC §7.4, ``acquire``'s ``verified``) is copied without the
hash unless the client was made with ``verify="always"``, with the other such slots of its
acquired sub-batch in one ``kvtier.client.memcopy.copy_many`` call (``SegmentMap.read_many``). A record
that fails any check is a miss (the prefix ends there; that buffer's contents are then
unspecified), never wrong data. Torch-free.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvtier_protocol.errors import InvalidRequest, KVTierError
from kvtier_protocol.frames import SlotRef
from kvtier_protocol.header import BlockHeader, copy_checksummed, decode_header, split_record

from kvtier.client.flows import Flow, acquire_flow, fetch_flow
from kvtier.client.session import Session

log = logging.getLogger("kvtier.client")


def check_buffers(buffers: Sequence[Any], num_keys: int) -> list[memoryview]:
    """One writable, C-contiguous byte view per key.

    Raises:
        InvalidRequest: a count other than one buffer per key, or a buffer that is read-only,
            not contiguous or does not support the buffer protocol.
    """
    if len(buffers) != num_keys:
        raise InvalidRequest(f"load_into: {len(buffers)} buffers for {num_keys} keys")
    views = []
    for i, buf in enumerate(buffers):
        try:
            view = memoryview(buf)
        except TypeError:
            raise InvalidRequest(f"load_into: buffer {i} ({type(buf).__name__}) is not a buffer") from None
        if view.readonly or not view.c_contiguous:
            raise InvalidRequest(f"load_into: buffer {i} must be writable and C-contiguous")
        views.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    return views


copy_hashed = copy_checksummed
"""Copy ``src`` into ``dst`` (same length) and return the xxh3-64 of the bytes written."""


def _header(ns_id: bytes, key: bytes, header: bytes | memoryview, payload_len: int) -> BlockHeader | None:
    """The decoded header of a leased block if it is whole and names ``ns_id``/``key`` and a
    payload of ``payload_len`` bytes; None (a miss) otherwise."""
    try:
        h, off = decode_header(header)
    except KVTierError as exc:
        log.warning("record %s failed verification (%s); treated as a miss", key.hex(), exc.code)
        return None
    if off != len(header) or h.payload_len != payload_len:
        log.warning("record %s: header and slot disagree on its length; treated as a miss", key.hex())
        return None
    if h.ns_id != ns_id or h.chain_hash != key:
        log.warning("daemon returned a record of another key for %s; treated as a miss", key.hex())
        return None
    return h


def _dest(dests: list[memoryview], i: int, h: BlockHeader) -> memoryview:
    dest = dests[i]
    if dest.nbytes < h.payload_len:
        raise InvalidRequest(f"load_into: buffer {i} holds {dest.nbytes} bytes, block "
                             f"{h.chain_hash.hex()} has {h.payload_len}")
    return dest[:h.payload_len]


def _checked(h: BlockHeader, digest: int) -> BlockHeader | None:
    if digest != h.checksum:
        log.warning("record %s failed verification (checksum); treated as a miss", h.chain_hash.hex())
        return None
    return h


def load_into_flow(s: Session, ns_id: bytes, hashes: list[bytes],
                   dests: list[memoryview]) -> Flow[list[BlockHeader]]:
    """Copy the payloads of the stored prefix of ``hashes`` into ``dests`` (one per key);
    returns the headers of the blocks copied and verified, first first."""
    if s.shm is None:
        def take_record(i: int, key: bytes, record: memoryview) -> BlockHeader | None:
            try:
                h, payload = split_record(record)
            except KVTierError as exc:
                log.warning("record %s failed verification (%s); treated as a miss", key.hex(), exc.code)
                return None
            if h.ns_id != ns_id or h.chain_hash != key:
                log.warning("daemon returned a record of another key for %s; treated as a miss", key.hex())
                return None
            return _checked(h, copy_hashed(payload, _dest(dests, i, h)))
        return (yield from fetch_flow(s, ns_id, hashes, take_record))
    shm = s.shm
    slots: list[SlotRef] = []  # checked blocks of the current sub-batch, copied by settle()
    into: list[memoryview] = []

    def take_slot(i: int, key: bytes, slot: SlotRef, header: bytes, checked: bool) -> BlockHeader | None:
        h = _header(ns_id, key, header, slot[2])
        if h is None:
            return None
        if checked:  # the daemon verified the slot: a plain copy, made with the others in settle()
            into.append(_dest(dests, i, h))  # first: it raises for a buffer too small
            slots.append(slot)
            return h
        return _checked(h, shm.read_into(slot, _dest(dests, i, h), copy_hashed))

    def settle() -> None:
        try:
            shm.read_many(slots, into)
        finally:
            slots.clear()
            into.clear()
    return (yield from acquire_flow(s, ns_id, hashes, take_slot, [d.nbytes for d in dests], settle))

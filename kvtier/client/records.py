"""Block records and keys on their way in and out of the client: argument checks, splitting a
record into the header (sent in commit) and payload (written to a slot), and verifying what the
daemon returns, so that a corrupt or misplaced block is a miss, never wrong data. Torch-free."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvtier_protocol.errors import HeaderError, InvalidKey, InvalidRequest, KVTierError, Truncated
from kvtier_protocol.frames import MAX_HASH_LEN, MIN_HASH_LEN, NS_ID_LEN
from kvtier_protocol.header import PREAMBLE_LEN, decode_header, parse_preamble, split_record, verify_payload

log = logging.getLogger("kvtier.client")

Buffer: TypeAlias = bytes | bytearray | memoryview
_BYTES = frozenset((bytes,))
Block: TypeAlias = tuple[bytes, Buffer]
"""``(chain_hash, record)``: a block to save; ``record`` is a whole block record (header + payload)."""


@dataclass(slots=True)  # not frozen: built per block of every save, and a frozen init costs ~4x
class Record:
    """A block record to save, split once: its key, its encoded header and its payload.
    Read-only by convention."""

    key: bytes
    record: memoryview
    header: bytes  # preamble + header map: what commit carries
    payload: memoryview  # what the reserved slot receives


def check_ns_id(ns_id: Buffer) -> bytes:
    """``ns_id`` as bytes. Raises InvalidKey unless it is 16 bytes."""
    ns_id = _as_bytes(ns_id, "ns_id")
    if len(ns_id) != NS_ID_LEN:
        raise InvalidKey(f"ns_id must be {NS_ID_LEN} bytes, got {len(ns_id)}")
    return ns_id


def check_hashes(hashes: Sequence[Buffer]) -> list[bytes]:
    """Chain hashes as bytes. Raises InvalidKey for one outside 8..64 bytes."""
    # Fast path (hundreds of keys per lookup): C-level passes over types and lengths.
    if not isinstance(hashes, (list, tuple)):
        hashes = list(hashes)  # iterated more than once below
    if set(map(type, hashes)) <= _BYTES:
        lens = set(map(len, hashes))
        if not lens or (min(lens) >= MIN_HASH_LEN and max(lens) <= MAX_HASH_LEN):
            return list(hashes)
    out = [_as_bytes(h, "a chain hash") for h in hashes]
    for h in out:
        if not MIN_HASH_LEN <= len(h) <= MAX_HASH_LEN:
            raise InvalidKey(f"a chain hash must be {MIN_HASH_LEN}..{MAX_HASH_LEN} bytes, got {len(h)}")
    return out


def _as_bytes(value: Any, what: str) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise InvalidKey(f"{what} must be bytes, got {type(value).__name__}")


def prepare_records(ns_id: bytes, blocks: Sequence[Block]) -> list[Record]:
    """Split each block's record into header and payload, checking it belongs to its key.

    Raises:
        InvalidKey: a malformed key.
        InvalidRequest: a record whose header names another namespace or chain hash.
        KVTierError: a record that does not decode (HeaderError, Truncated, LimitExceeded, ...).
    """
    keys = check_hashes([key for key, _ in blocks])
    out = []
    for key, (_, record) in zip(keys, blocks):
        view = memoryview(record)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        # The header bytes are needed anyway (they travel in commit/place); decoding them as
        # bytes finds the header the caller just encoded in the decode memo, one dict lookup.
        end = PREAMBLE_LEN + parse_preamble(view)
        header = bytes(view[:end])
        h, _ = decode_header(header)
        if view.nbytes != end + h.payload_len:
            raise (Truncated if view.nbytes < end + h.payload_len else HeaderError)(
                f"record of {view.nbytes} bytes; its header declares {end + h.payload_len}")
        if h.ns_id != ns_id or h.chain_hash != key:
            raise InvalidRequest(f"record for key {key.hex()} carries key "
                                 f"{h.ns_id.hex()}/{h.chain_hash.hex()}")
        out.append(Record(key, view, header, view[end:]))
    return out


def verified_record(ns_id: bytes, key: bytes, record: Buffer, *,
                    payload_checked: bool = False) -> bytes | None:
    """``record`` as bytes if it is whole, names ``ns_id``/``key`` and matches its checksums; None
    otherwise (a corrupt block is a miss, never wrong data). ``payload_checked``: the daemon
    already checked the payload; only the header's own checksum, key and length are checked."""
    try:
        h, payload = split_record(record)
        if h.ns_id != ns_id or h.chain_hash != key:
            log.warning("daemon returned a record of another key for %s; treated as a miss", key.hex())
            return None
        if not payload_checked:
            verify_payload(h, payload)
    except KVTierError as exc:
        log.warning("record %s failed verification (%s); treated as a miss", key.hex(), exc.code)
        return None
    return record if isinstance(record, bytes) else bytes(record)

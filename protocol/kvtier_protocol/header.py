"""The self-describing block record: preamble, msgpack header map, payload (SPEC.md §4). Torch-free.

::

    offset          size        field
    0               4           magic        b"KVT1"
    4               2           version      u16 LE, 1
    6               2           flags        u16 LE: bit 0 = compressed (SPEC 4.8); other bits reserved
    8               4           header_len   u32 LE, bytes of the msgpack map that follows
    12              8           header_xxh3  u64 LE, xxh3-64 (seed 0) of those header_len bytes
    20              header_len  msgpack map, keys in the order of WIRE_KEYS
    20+header_len   plen        payload: the header's sections, back to back

Anyone holding a record can decode and verify it without asking the daemon: the header names
layout, shape, dtype, codec, the payload's sections and its xxh3-64 checksum. The header checksum
makes a flipped header byte a detected error (a miss), never a silently wrong hit.
"""

from __future__ import annotations

from typing import Any

import msgpack
import xxhash

from kvtier_protocol.compression import FLAG_COMPRESSED
from kvtier_protocol.errors import ChecksumMismatch, HeaderError, LimitExceeded, Truncated
from kvtier_protocol.header_decode import _DECODED, _MAX_DECODED, decode_header, parse_preamble, split_record
from kvtier_protocol.header_types import (CHECKSUM_ALG, DEFAULT_MAX_HEADER_LEN, DEFAULT_MAX_PAYLOAD_LEN, MAGIC,
                                          MAX_HASH_LEN, MAX_NAME_LEN, MAX_SECTIONS, MIN_HASH_LEN, NS_ID_LEN,
                                          OPTIONAL_KEYS, PREAMBLE, PREAMBLE_LEN, REQUIRED_KEYS, VERSION, WIRE_KEYS,
                                          BlockHeader, Section)


def _to_map(h: BlockHeader) -> dict[str, Any]:
    m: dict[str, Any] = {
        "ns": h.ns_id, "hash": h.chain_hash, "parent": h.parent_hash, "tokens": h.num_tokens,
        "layout": h.layout, "shape": list(h.shape), "dtype": h.dtype, "codec": h.codec,
        "sections": [[s.name, s.offset, s.length] for s in h.sections], "plen": h.payload_len,
        "csum_alg": h.checksum_alg, "csum": h.checksum,
        "quant": h.quant.to_wire() if h.quant is not None else None,
    }
    if h.ns_fields is not None:
        m["ns_fields"] = dict(h.ns_fields)
    if h.created_ms is not None:
        m["created"] = h.created_ms
    if h.compression is not None:
        m["compression"] = h.compression.to_wire()
    m.update(h.extra)
    return m


def encode_header(h: BlockHeader) -> bytes:
    """The preamble and header map of ``h`` (the payload follows them in a record).

    Raises:
        HeaderError: a value in ``ns_fields`` or ``extra`` cannot be packed as msgpack.
        LimitExceeded: the map is larger than DEFAULT_MAX_HEADER_LEN (no default reader takes it).
    """
    try:
        body = msgpack.packb(_to_map(h), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise HeaderError(f"header does not pack as msgpack: {e}") from None
    if len(body) > DEFAULT_MAX_HEADER_LEN:
        raise LimitExceeded(f"header map is {len(body)} bytes > {DEFAULT_MAX_HEADER_LEN}")
    flags = 0 if h.compression is None else FLAG_COMPRESSED
    out = PREAMBLE.pack(MAGIC, VERSION, flags, len(body), xxhash.xxh3_64_intdigest(body)) + body
    # A record encoded here is usually decoded again in this process soon (a client checks each
    # record it saves: kvtier.client.records.prepare_records), and decoding ``out`` with the
    # default limits yields ``h`` (validated when it was made): remember it, as decode_header
    # would, so that check costs a dict lookup instead of a validation (~25-50 us a header).
    if (h.ns_fields is None and not h.extra and h.quant is None and h.compression is None
            and max(h.payload_len, h.decoded_len) <= DEFAULT_MAX_PAYLOAD_LEN and _plain(h)):
        if len(_DECODED) >= _MAX_DECODED:
            _DECODED.clear()
        _DECODED[(out, DEFAULT_MAX_PAYLOAD_LEN)] = h
    return out


def _plain(h: BlockHeader) -> bool:
    """Every number of ``h`` is a plain int (not a subclass), so ``h`` equals its decoded copy
    type for type, not only value for value."""
    ints = (h.num_tokens, h.payload_len, h.checksum, *h.shape,
            *(n for s in h.sections for n in (s.offset, s.length)))
    return all(type(v) is int for v in ints) and (h.created_ms is None or type(h.created_ms) is int)


def payload_checksum(buf: bytes | bytearray | memoryview) -> int:
    """xxh3-64 (seed 0) of a payload, as an unsigned integer."""
    return xxhash.xxh3_64_intdigest(buf)


COPY_CHUNK = 256 << 10
"""Bytes :func:`copy_checksummed` copies before hashing them: small enough to stay in L2, large
enough to amortise the calls."""


def copy_checksummed(src: memoryview, dst: memoryview) -> int:
    """Copy ``src`` into ``dst`` (same length) and return :func:`payload_checksum` of the bytes
    written, hashing each chunk of ``dst`` right after it is written (still in cache): one pass
    over memory, and what is verified is the destination itself."""
    assert src.nbytes == dst.nbytes, "copy_checksummed copies equal lengths"
    digest = xxhash.xxh3_64()
    for off in range(0, src.nbytes, COPY_CHUNK):
        part = dst[off:off + COPY_CHUNK]
        part[:] = src[off:off + COPY_CHUNK]
        digest.update(part)
    return digest.intdigest()


def verify_payload(h: BlockHeader, payload: bytes | bytearray | memoryview) -> None:
    """Check a payload against its header's length and checksum.

    Raises:
        Truncated: the payload is shorter than ``plen``.
        ChecksumMismatch: longer than ``plen``, or its xxh3-64 differs.
    """
    n = memoryview(payload).nbytes
    if n < h.payload_len:
        raise Truncated(f"payload is {n} bytes, header says {h.payload_len}")
    if n != h.payload_len or payload_checksum(payload) != h.checksum:
        raise ChecksumMismatch(f"payload does not match its header's {CHECKSUM_ALG} checksum")


def record_len(h: BlockHeader) -> int:
    """Bytes of the whole record: preamble + header map + payload."""
    return len(encode_header(h)) + h.payload_len


__all__ = ["CHECKSUM_ALG", "COPY_CHUNK", "DEFAULT_MAX_HEADER_LEN", "DEFAULT_MAX_PAYLOAD_LEN", "MAGIC", "MAX_HASH_LEN",
           "MAX_NAME_LEN", "MAX_SECTIONS", "MIN_HASH_LEN", "NS_ID_LEN", "OPTIONAL_KEYS", "PREAMBLE",
           "PREAMBLE_LEN", "REQUIRED_KEYS", "VERSION", "WIRE_KEYS", "BlockHeader", "Section",
           "copy_checksummed", "decode_header", "encode_header", "parse_preamble", "payload_checksum", "record_len",
           "split_record", "verify_payload"]

"""A get's lossy or compressed records, decoded for a client that asks (SPEC.md §7.4 ``get``,
request key ``decode``; issue 25).

A client without shared memory (a remote host, a tool) that wants a block in its dtype, whatever
codec the daemon stored it with, sends ``decode: true``. Each returned record whose stored copy is
lossy (codec other than raw) or compressed is then read, verified and decoded here into a raw
record of the header's dtype: same key, namespace, parent, token count, layout, shape, dtype,
namespace map and creation time; codec raw, no ``quant``, no compression, one ``payload``
section, a new ``plen`` and checksum. Records stored raw and uncompressed are sent as they are.

::

    plan (event loop): per acquired block, in key order: as stored | to decode, within the
                       response's max_payload_len (sizes of the decoded records estimated)
    decode (a worker thread, torch imported there): copy the record out of its slot, verify the
                       copy, decode it, encode it raw; stop at the first that fails
    finish (event loop): the prefix of records that decoded and fit, exactly measured

The payload is copied out of its slot before it is checked, and the check and the decode read
that copy: a process that maps the segment cannot change the bytes between them. A record that
fails its check or does not decode is a miss, and the prefix ends there (as everywhere: never
wrong data). Decoded records are built in memory, at most ``max_payload_len`` bytes per response
and :data:`CONCURRENT_DECODES` responses at once (kvtier.daemon.server.handlers).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from kvtier_protocol.dtypes import DTYPE_SIZES
from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import BlockHeader, decode_header

log = logging.getLogger(__name__)

CONCURRENT_DECODES = 2
"""Gets with ``decode: true`` served at once by one daemon (the others wait their turn before
they acquire anything): decoded records are new memory, up to max_payload_len per response, held
until sent, and their decoding is CPU on the default executor's threads."""


def needs_decoding(h: BlockHeader) -> bool:
    """Whether ``decode: true`` changes this record: its codec is lossy or its payload compressed."""
    return h.codec != "raw" or h.compression is not None


def raw_payload_len(h: BlockHeader) -> int:
    """Payload bytes of the block decoded into a raw record of its dtype (``shape`` x dtype size)."""
    return math.prod(h.shape) * DTYPE_SIZES[h.dtype]


@dataclass(frozen=True, slots=True)
class Planned:
    """One record of a get response, before the decodes: its stored header and a view of its
    slot's payload; ``codec`` is the stored codec when the record is to be decoded, else None."""

    header: bytes
    payload: memoryview
    codec: str | None


def plan(blocks: list[tuple[bytes, memoryview]], budget: int) -> list[Planned]:
    """The prefix of ``blocks`` (``(stored header, payload view)`` in key order) a decoding get
    answers: each either as stored or to decode, until the next would not fit ``budget`` bytes
    (a record to decode counted at its stored header plus its raw payload length; the decoded
    record is measured again once built, :func:`finish`). A header that does not decode ends the
    prefix (a miss)."""
    out: list[Planned] = []
    for header, payload in blocks:
        try:
            h, _ = decode_header(header)
        except KVTierError:
            log.warning("get: a stored header does not decode; answered as a miss")
            break
        lossy = needs_decoding(h)
        size = len(header) + (raw_payload_len(h) if lossy else payload.nbytes)
        if size > budget:
            break  # SPEC §7.4: records that no longer fit are answered nil, as if missing
        budget -= size
        out.append(Planned(header, payload, h.codec if lossy else None))
    return out


def decode_planned(planned: list[Planned], max_payload_len: int) -> list[bytes]:
    """The raw records of the planned records that are to be decoded, in order, stopping at the
    first that fails its checksum or does not decode (the caller ends the prefix there). Runs on a
    worker thread: it imports torch and spends CPU in proportion to the bytes."""
    import torch  # noqa: PLC0415  (a daemon that never decodes never loads it here)

    from kvtier_protocol.block import decode_block, encode_block  # noqa: PLC0415  (imports torch)

    # One intra-op thread, as the disk and remote codecs set it (kvtier.daemon.store.moves.Mover):
    # OpenMP workers spinning on a busy host make the codec's small ops milliseconds each.
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    out: list[bytes] = []
    for p in planned:
        if p.codec is None:
            continue
        record = b"".join((p.header, p.payload))  # the copy that is checked is the copy decoded
        try:
            h, tensor = decode_block(record, verify=True, max_payload_len=max_payload_len)
            out.append(encode_block(tensor, ns_id=h.ns_id, chain_hash=h.chain_hash, parent_hash=h.parent_hash,
                                    layout=h.layout, codec="raw", num_tokens=h.num_tokens,
                                    ns_fields=dict(h.ns_fields) if h.ns_fields is not None else None,
                                    created_ms=h.created_ms))
        except KVTierError as exc:  # checksum_mismatch above all: a damaged copy is a miss
            log.warning("get: a stored %s record was not decoded (%s); answered as a miss", p.codec, exc.code)
            break
    return out


def finish(planned: list[Planned], decoded: list[bytes], budget: int
           ) -> tuple[list[bytes | memoryview], list[int], list[str | None]]:
    """The response's payload buffers, ``lens`` and ``decoded`` entries of the records answered:
    the planned prefix up to the first record that failed to decode or whose decoded record no
    longer fits ``budget`` bytes. Stored records are sent from their slot views (read-only)."""
    payload: list[bytes | memoryview] = []
    lens: list[int] = []
    codecs: list[str | None] = []
    results = iter(decoded)
    for p in planned:
        if p.codec is None:
            parts: list[bytes | memoryview] = [p.header, p.payload.toreadonly()]
            size = len(p.header) + p.payload.nbytes
        else:
            record = next(results, None)
            if record is None:
                break  # this one failed to decode: the prefix ends here
            parts, size = [record], len(record)
        if size > budget:
            break
        budget -= size
        payload.extend(parts)
        lens.append(size)
        codecs.append(p.codec)
    return payload, lens, codecs

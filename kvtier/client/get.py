"""``get``: whole records fetched inline (SPEC.md §7.4 ``get``), optionally decoded by the daemon.

A client without shared memory (a remote host, a tool) that wants every block in its dtype, raw,
whatever codec the daemon stored it with (issue 25: int8 on disk, lz4 on the network tier...),
asks ``get(..., decode=True)``: the daemon decodes each lossy or compressed record into a raw
record of the header's dtype and says which it decoded. The answer says, per record, the codec
of the stored copy it came from, so that a block decoded from a lossy copy is never taken for
exact data::

    get ── verify each record (checksums, key) ── GotRecord(record, header, decoded_from)
        └─ decode=True and a record still lossy or compressed (a daemon that does not know the
           key sends records as stored): decoded here, with torch, outside the client's lock

Torch is imported only for that fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import BlockHeader, decode_header

from kvtier.client.load import fetch_flow
from kvtier.client.records import check_hashes, check_ns_id, verified_record
from kvtier.client.session import Session
from kvtier.client.steps import Flow, FlowFactory

log = logging.getLogger("kvtier.client")


@dataclass(frozen=True, slots=True)
class GotRecord:
    """One block record a ``get`` returned, verified (checksums, key).

    Attributes:
        record: the whole record (header + payload), as sent or, for ``decoded_from`` set, the raw
            record the block was decoded into.
        header: its decoded header (codec, dtype, layout, shape: what decoding it needs).
        decoded_from: None: the record is the stored copy, as stored. Else the codec of the stored
            copy it was decoded from (by the daemon, or by this client for a daemon that ignored
            ``decode``): ``"raw"`` when that copy was only compressed (the values are exact), any
            other codec when it was lossy (the raw record holds that codec's approximation).
    """

    record: bytes
    header: BlockHeader
    decoded_from: str | None = None

    @property
    def exact(self) -> bool:
        """The values are the writer's, bit for bit: neither this record nor the copy it was
        decoded from is lossy."""
        return self.header.codec == "raw" and self.decoded_from in (None, "raw")


def prepare_get(ns_id: bytes, hashes: Sequence[bytes], decode: bool = False,
                accept_lossy: bool | None = None) -> FlowFactory:
    """Check a get's arguments (nothing is sent); returns what starts its flow on a session.

    Raises:
        InvalidKey: a malformed ns_id or hash.
    """
    ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
    return lambda s: get_flow(s, ns_id, keys, decode, accept_lossy)


def get_flow(s: Session, ns_id: bytes, hashes: list[bytes], decode: bool = False,
             accept_lossy: bool | None = None) -> Flow[list[GotRecord]]:
    """The stored prefix of ``hashes`` as verified records, by ``get`` on any connection; with
    ``decode`` the daemon is asked to decode (``decode: true``)."""
    decoded: list[str | None] | None = [] if decode else None
    records = yield from fetch_flow(s, ns_id, hashes, lambda i, key, record: verified_record(ns_id, key, record),
                                    accept_lossy, decoded=decoded)
    codecs = decoded if decoded is not None else [None] * len(records)
    return [GotRecord(r, decode_header(r)[0], codec) for r, codec in zip(records, codecs)]


def decode_rest(got: list[GotRecord]) -> list[GotRecord]:
    """``got`` with every record still lossy or compressed decoded here into a raw record of its
    dtype (what the daemon does for ``decode: true``; a daemon that ignores the key sends them as
    stored). The records were verified on receipt; torch is imported only when one is left."""
    if all(g.header.codec == "raw" and g.header.compression is None for g in got):
        return got
    from kvtier_protocol.block import decode_block, encode_block  # noqa: PLC0415  (imports torch)

    out = []
    for g in got:
        h = g.header
        if h.codec == "raw" and h.compression is None:
            out.append(g)
            continue
        try:
            _, tensor = decode_block(g.record, verify=False)  # verified by get_flow
            record = encode_block(tensor, ns_id=h.ns_id, chain_hash=h.chain_hash, parent_hash=h.parent_hash,
                                  layout=h.layout, codec="raw", num_tokens=h.num_tokens,
                                  ns_fields=dict(h.ns_fields) if h.ns_fields is not None else None,
                                  created_ms=h.created_ms)
        except KVTierError as exc:  # a codec this build cannot decode: a miss, the prefix ends here
            log.warning("record %s (%s) could not be decoded (%s); treated as a miss",
                        h.chain_hash.hex(), h.codec, exc.code)
            break
        out.append(GotRecord(record, decode_header(record)[0], h.codec))
    return out

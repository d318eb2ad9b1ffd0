"""Every way a load goes, in one place: ``load`` (whole verified records) and ``load_into``
(payloads copied into the caller's buffers), each over shared memory or inline (SPEC.md §7.4)::

    load, unix socket:       acquire ── copy records out, verify* ── release   (acquire_flow)
    load, TCP:               get ── verify                                      (fetch_flow)
    load_into, unix socket:  acquire ── copy payloads into the buffers, hashing as they land ── release
    load_into, TCP:          get ── payloads received into the buffers, hashed as they land

    * payloads the daemon reports it checked are not hashed again (``ClientOptions.verify``)

A block that fails any check is a miss (the prefix ends there), never wrong data.

**Pipelines.** With ``ClientOptions.pipeline_bytes`` > 0 a load over shared memory is cut into
sub-batches of about that much payload, and the next acquire travels while the client copies the
blocks of the last::

    acquire 0 ─┐
    acquire 1 ─┴─ copy 0 ─ release 0 ─┐           (releases are never waited for:
    acquire 2 ───────────── copy 1 ─ release 1 ... a lost one expires on its own)

An acquire still in flight when a load ends early (a miss, an error) is forgotten by the driver,
which releases its lease when the answer comes (kvtier.client.steps).

**load_into**: block payloads copied straight into buffers the caller owns, verified as they land.

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
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, TypeVar

from kvtier_protocol.errors import InvalidRequest, KVTierError
from kvtier_protocol.frames import SlotRef
from kvtier_protocol.header import BlockHeader, copy_checksummed, decode_header, split_record

from kvtier.client.records import check_hashes, check_ns_id, verified_record
from kvtier.client.session import Session
from kvtier.client.steps import Await, Call, Flow, FlowFactory, Landing, Ticket, expect_len

log = logging.getLogger("kvtier.client")

T = TypeVar("T")

TakeSlot: TypeAlias = Callable[[int, bytes, SlotRef, bytes, bool], "T | None"]
"""What a load does with one leased block: ``(index, key, slot, header, checked) -> item | None``;
``checked``: the daemon checked the slot's payload and the session trusts that (no hashing needed)."""
TakeRecord: TypeAlias = Callable[[int, bytes, memoryview], "T | None"]
"""What a load does with one record received inline: ``(index, key, record) -> item | None``."""

FIRST_KEYS = 4
"""Keys of a load's first acquire when the block sizes are not known in advance (``load``; a
``load_into`` sizes it from its buffers): later acquires are sized from the slots seen."""
ACQUIRE_HEADER_BUDGET = 4096
"""Bytes of an acquire response's header map budgeted per key (one block header each), so that a
batch never exceeds the daemon's ``max_header_len``."""


def prepare_load(ns_id: bytes, hashes: Sequence[bytes], accept_lossy: bool | None = None) -> FlowFactory:
    """Check a load's arguments (nothing is sent); returns what starts its flow on a session.
    ``accept_lossy``: sent with each acquire/get when not None (:func:`lossy_keys`).

    Raises:
        InvalidKey: a malformed ns_id or hash.
    """
    ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
    return lambda s: load_flow(s, ns_id, keys, accept_lossy)


def prepare_load_into(ns_id: bytes, hashes: Sequence[bytes], buffers: Sequence[Any],
                      accept_lossy: bool | None = None) -> FlowFactory:
    """Check a load_into's arguments (nothing is sent); returns what starts its flow on a session.

    Raises:
        InvalidKey: a malformed ns_id or hash.
        InvalidRequest: not one writable contiguous buffer per key.
    """
    ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
    dests = check_buffers(buffers, len(keys))
    return lambda s: load_into_flow(s, ns_id, keys, dests, accept_lossy)


def lossy_keys(accept_lossy: bool | None) -> dict[str, bool]:
    """The optional ``accept_lossy`` request key (SPEC 7.4, issue 25): absent when None (the
    daemon's default; what daemons before the key expect), else true or false."""
    return {} if accept_lossy is None else {"accept_lossy": accept_lossy}


# -- load: whole records ------------------------------------------------------------------------


def load_flow(s: Session, ns_id: bytes, hashes: list[bytes], accept_lossy: bool | None = None) -> Flow[list[bytes]]:
    """Load the stored prefix of ``hashes`` as whole, verified records."""
    shm = s.shm
    if shm is None:
        return (yield from fetch_flow(s, ns_id, hashes,
                                      lambda i, key, record: verified_record(ns_id, key, record), accept_lossy))
    return (yield from acquire_flow(s, ns_id, hashes, lambda i, key, slot, header, checked: verified_record(
        ns_id, key, shm.read_record(header, slot), payload_checked=checked), accept_lossy=accept_lossy))


def fetch_flow(s: Session, ns_id: bytes, hashes: list[bytes], take: TakeRecord[T],
               accept_lossy: bool | None = None, landing: Landing | None = None,
               decoded: list[str | None] | None = None) -> Flow[list[T]]:
    """get (records inline) → ``take(i, key, record)`` per returned record (None: corrupt, the
    prefix ends there). TCP (or any connection: every daemon serves get). ``landing``: the
    payloads may be received into its buffers. ``decoded``: not None asks the daemon to decode
    lossy and compressed records (``decode: true``, SPEC §7.4 get) and receives, per item
    returned, the response's ``decoded`` entry (the stored codec, or None: sent as stored)."""
    out: list[T] = []
    pos = 0
    extra = {} if decoded is None else {"decode": True}
    while pos < len(hashes):
        chunk = hashes[pos:pos + s.limits.max_batch]
        into = None if landing is None else Landing(landing.dests, landing.digests, pos)
        r = yield Call("get", {"ns_id": ns_id, "hashes": chunk, **lossy_keys(accept_lossy), **extra}, into=into)
        expect_len("get", r.lens, len(chunk))
        found, corrupt = 0, False
        codecs = r.decoded if decoded is not None and r.decoded is not None else (None,) * len(chunk)
        for i, (key, record, codec) in enumerate(zip(chunk, r.records(), codecs), pos):
            if record is None:
                break
            item = take(i, key, record)
            if item is None:
                corrupt = True
                break
            out.append(item)
            if decoded is not None:
                decoded.append(codec)
            found += 1
        pos += found
        if found == len(chunk):
            continue
        # The daemon answers nil for records that no longer fit its max_payload_len: a nil right
        # after a nearly full payload may be that cap, not a miss, so ask again from there. A
        # decoded record may be larger than any record answered (int4 decodes to 4x its stored
        # size): a decoding get asks again after any nil that follows a record.
        sent = sum(n or 0 for n in r.lens)
        if corrupt or found == 0 or (decoded is None
                                     and sent + max(n or 0 for n in r.lens) <= s.limits.max_payload_len):
            break
    return out


def acquire_flow(s: Session, ns_id: bytes, hashes: list[bytes], take: TakeSlot[T],
                 sizes: Sequence[int] | None = None, settle: Callable[[], None] | None = None, *,
                 accept_lossy: bool | None = None) -> Flow[list[T]]:
    """acquire → ``take(i, key, slot, header, checked)`` per leased block (i: index in
    ``hashes``; None ends the prefix: a miss) → ``settle()`` → release (also after an error), per
    sub-batch; pipelined, the next acquire travels while this one is copied. Unix socket only.

    ``sizes``: the most bytes each block can have (sizes the first acquire), if known.
    ``settle``: finishes what the takes of a sub-batch left to do while its lease holds (copies
    they deferred, to make them in one call); it runs after the takes of every sub-batch, also
    when one of them ended the prefix or raised."""
    limit = max(1, min(s.limits.max_batch, s.limits.max_header_len // ACQUIRE_HEADER_BUDGET))
    piped = s.piped
    out: list[T] = []
    if not hashes:
        return out
    pos, count = 0, _first_count(s, limit, sizes)
    ahead: Ticket | None = yield _acquire(s, ns_id, hashes[:count], accept_lossy)
    while ahead is not None:
        chunk = hashes[pos:pos + count]
        r = yield Await(ahead)
        ahead = None
        error: KVTierError | None = None
        found: list[T] = []
        try:
            expect_len("acquire", r.slots, len(chunk))
            nxt = pos + count
            if nxt < len(hashes) and all(slot is not None for slot in r.slots):
                count = _next_count(s, limit, r)
                if piped:  # the daemon leases the next sub-batch while this one is copied
                    ahead = yield _acquire(s, ns_id, hashes[nxt:nxt + count], accept_lossy)
            checked = r.verified if s.trust_checked and r.verified is not None else (False,) * len(chunk)
            for i, (key, slot, header, ok) in enumerate(zip(chunk, r.slots, r.headers, checked), pos):
                item = None if slot is None else take(i, key, slot, header, ok)
                if item is None:
                    break
                found.append(item)
        except KVTierError as exc:
            error = exc
        if settle is not None:  # the blocks taken so far, also before a miss or an error
            try:
                settle()
            except KVTierError as exc:
                error = error or exc
        if r.lease:  # always release, also after an error; a lost release expires on its own
            yield Call("release", {"lease": r.lease}, best_effort=True, wait=False, defer=True)
        if error is not None:
            raise error  # an acquire still in flight is forgotten (released) by the driver
        out.extend(found)
        if len(found) < len(chunk):
            break  # a miss: an acquire still in flight is forgotten (released) by the driver
        pos += len(chunk)
        if ahead is None and not piped and pos < len(hashes):
            ahead = yield _acquire(s, ns_id, hashes[pos:pos + count], accept_lossy)
    return out


def _acquire(s: Session, ns_id: bytes, chunk: Sequence[bytes], accept_lossy: bool | None = None) -> Call:
    return Call("acquire", {"ns_id": ns_id, "hashes": list(chunk), "lease_ms": s.lease_ms, **lossy_keys(accept_lossy)},
                wait=False)


def _next_count(s: Session, limit: int, r: Any) -> int:
    """Keys of the next acquire: ``s.pipeline_bytes`` at the mean slot size of the last answer."""
    lengths = [slot[2] for slot in r.slots if slot is not None]
    if not lengths or not s.piped:
        return limit
    return max(1, min(limit, s.pipeline_bytes * len(lengths) // max(1, sum(lengths))))


def _first_count(s: Session, limit: int, sizes: Sequence[int] | None) -> int:
    """Keys of the first acquire: a quarter of ``s.pipeline_bytes`` (its round trip and the
    daemon's work on it are the part of a load no copy overlaps), by ``sizes`` if known."""
    if not s.piped:
        return limit
    if sizes is None:
        return min(limit, FIRST_KEYS)
    used, n = 0, 0
    for size in sizes[:limit]:
        if n and used + size > s.pipeline_bytes // 4:
            break
        used, n = used + size, n + 1
    return max(1, n)


# -- load_into: payloads into the caller's buffers ----------------------------------------------


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
                   dests: list[memoryview], accept_lossy: bool | None = None) -> Flow[list[BlockHeader]]:
    """Copy the payloads of the stored prefix of ``hashes`` into ``dests`` (one per key);
    returns the headers of the blocks copied and verified, first first."""
    if s.shm is None:
        # The transport may receive a payload straight into its buffer (its digest then set):
        # that record's payload bytes in the response are unfilled, only its header is read.
        landing = Landing(dests, [None] * len(dests))

        def take_record(i: int, key: bytes, record: memoryview) -> BlockHeader | None:
            try:
                h, payload = split_record(record)
            except KVTierError as exc:
                log.warning("record %s failed verification (%s); treated as a miss", key.hex(), exc.code)
                return None
            if h.ns_id != ns_id or h.chain_hash != key:
                log.warning("daemon returned a record of another key for %s; treated as a miss", key.hex())
                return None
            landed = landing.digests[i]
            return _checked(h, landed if landed is not None else copy_hashed(payload, _dest(dests, i, h)))
        return (yield from fetch_flow(s, ns_id, hashes, take_record, accept_lossy, landing))
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
    return (yield from acquire_flow(s, ns_id, hashes, take_slot, [d.nbytes for d in dests], settle,
                                    accept_lossy=accept_lossy))

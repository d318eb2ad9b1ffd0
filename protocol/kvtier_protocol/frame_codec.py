"""Byte layer of data-plane frames (SPEC.md §7.1): preamble, msgpack header map, optional payload.

::

    offset        size         field
    0             4            magic        b"KVTF"
    4             2            version      u16 LE, 1
    6             2            flags        u16 LE; bit 0 = payload present, bits 1..15 reserved (0)
    8             4            header_len   u32 LE, bytes of the msgpack map that follows
    12            8            payload_len  u64 LE, bytes of the payload (0 when bit 0 is clear)
    20            header_len   msgpack map: "op", "id", then the keys of the op (messages.py)
    20+header_len payload_len  payload (block records of put / get), present iff flags bit 0

Both lengths are checked against :class:`Limits` as soon as the 20 preamble bytes are in, before
any buffer for the rest is allocated, so a peer cannot make the receiver reserve memory by
declaring a huge frame. Torch-free.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import msgpack

from kvtier_protocol.errors import (BadMagic, FrameError, LimitExceeded, Truncated,
                                    UnsupportedVersion)

MAGIC = b"KVTF"
FRAME_VERSION = 1
PREAMBLE = struct.Struct("<4sHHIQ")
PREAMBLE_LEN = PREAMBLE.size  # 20
_PREAMBLE_PACK = PREAMBLE.pack
FLAG_PAYLOAD = 0x0001
U64_MAX = (1 << 64) - 1

Buffer: TypeAlias = bytes | bytearray | memoryview
Payload: TypeAlias = Buffer | Sequence[Buffer]
"""A frame payload to send: one buffer, or several sent back to back (gathered, not joined)."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Receiver limits; every declared length or count is checked against them before allocating.

    The daemon announces its limits in the hello response; a client MUST stay within them.

    Attributes:
        max_header_len: largest msgpack header map of one frame, bytes.
        max_payload_len: largest payload of one frame, bytes.
        max_batch: most keys (hashes, sizes, headers, ...) in one request or response.
        max_lease_ms: longest lease a client may ask for.
        max_inflight: requests one connection may have outstanding; above it the server answers
            ``busy``.
    """

    max_header_len: int = 4 << 20
    max_payload_len: int = 256 << 20
    max_batch: int = 4096
    max_lease_ms: int = 600_000
    max_inflight: int = 256

    def __post_init__(self) -> None:
        for name in self.__slots__:
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= U64_MAX:
                raise ValueError(f"Limits.{name} must be a positive integer, got {value!r}")
        if self.max_header_len > 0xFFFF_FFFF:
            raise ValueError("Limits.max_header_len must fit the u32 header_len field")

    def to_wire(self) -> dict[str, int]:
        """The map sent as ``limits`` in the hello response (keys in declaration order)."""
        return {name: getattr(self, name) for name in self.__slots__}


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame.

    Attributes:
        header: the decoded msgpack map; has an unsigned ``"id"`` (checked by the decoder).
        payload: a read-only view of the payload, or None when the frame carries none.
    """

    header: dict[str, Any]
    payload: memoryview | None = None

    @property
    def id(self) -> int:
        """The request id (echoed by the response)."""
        return self.header["id"]

    @property
    def op(self) -> str | None:
        """The operation name, or None when absent or not a string."""
        op = self.header.get("op")
        return op if isinstance(op, str) else None


def _as_bytes_view(buf: Buffer) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # raises TypeError for non-contiguous buffers: a caller bug
    return view


def encode_frame(header: dict[str, Any], payload: Payload | None = None, *,
                 limits: Limits = DEFAULT_LIMITS) -> list[Buffer]:
    """Encode a frame as a list of buffers for ``writelines``/``sendmsg`` (payload not copied).

    Args:
        header: the header map; must contain an unsigned ``"id"``. Key order is kept on the wire.
        payload: None (no payload), one buffer, or a sequence of buffers sent back to back.
        limits: the limits the encoded frame must respect.

    Returns:
        ``[preamble + header bytes, *payload buffers]``.

    Raises:
        FrameError: the header is not an encodable map with an unsigned ``"id"``.
        LimitExceeded: the header or payload is larger than ``limits`` allow.
    """
    if not isinstance(header, dict) or not _is_u64(header.get("id")):
        raise FrameError("a frame header is a map with an unsigned 64-bit 'id'")
    try:
        packer = _local.packer
    except AttributeError:
        packer = _packer()
    try:
        packed = packer.pack(header)  # the bytes of msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FrameError(f"header is not encodable as msgpack: {exc}") from exc
    if len(packed) > limits.max_header_len:
        raise LimitExceeded(f"header is {len(packed)} bytes, limit {limits.max_header_len}")
    if payload is None:  # most frames: one buffer, preamble and header
        return [_PREAMBLE_PACK(MAGIC, FRAME_VERSION, 0, len(packed), 0) + packed]
    parts: list[Buffer] = []
    if payload is not None:
        views = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else payload
        parts = [_as_bytes_view(p) for p in views]
    payload_len = sum(p.nbytes for p in parts)
    if payload_len > limits.max_payload_len:
        raise LimitExceeded(f"payload is {payload_len} bytes, limit {limits.max_payload_len}")
    flags = FLAG_PAYLOAD if payload is not None else 0
    head = PREAMBLE.pack(MAGIC, FRAME_VERSION, flags, len(packed), payload_len) + packed
    return [head, *parts]


_local = threading.local()


def _packer() -> msgpack.Packer:
    """This thread's reusable msgpack packer: ``msgpack.packb`` makes (and frees) a Packer and its
    buffer per call, a third of a small header's encoding. One per thread, since a Packer is not
    shared; it resets itself after every ``pack``, failed ones included."""
    try:
        return _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
        return packer


def encode_frame_bytes(header: dict[str, Any], payload: Payload | None = None, *,
                       limits: Limits = DEFAULT_LIMITS) -> bytes:
    """:func:`encode_frame` joined into one bytes object (tests, vectors, small frames)."""
    return b"".join(encode_frame(header, payload, limits=limits))


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def parse_preamble(buf: Buffer, limits: Limits = DEFAULT_LIMITS) -> tuple[int, int, bool]:
    """Check the 20-byte preamble at the start of ``buf``.

    Returns:
        ``(header_len, payload_len, has_payload)``, both lengths within ``limits``.

    Raises:
        Truncated: fewer than 20 bytes.
        BadMagic, UnsupportedVersion, FrameError, LimitExceeded: as the preamble warrants.
    """
    if len(buf) < PREAMBLE_LEN:
        raise Truncated(f"frame preamble needs {PREAMBLE_LEN} bytes, got {len(buf)}")
    magic, version, flags, header_len, payload_len = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise BadMagic(f"frame magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FRAME_VERSION:
        raise UnsupportedVersion(f"frame version {version}, this side speaks {FRAME_VERSION}")
    if flags & ~FLAG_PAYLOAD:
        # a future flag changes how the bytes must be read: a v1 reader cannot read the frame
        raise UnsupportedVersion(f"reserved frame flag bits set: {flags:#06x}")
    has_payload = bool(flags & FLAG_PAYLOAD)
    if not has_payload and payload_len:
        raise FrameError("payload_len is nonzero but the payload flag is clear")
    if header_len > limits.max_header_len:
        raise LimitExceeded(f"header_len {header_len} above limit {limits.max_header_len}")
    if payload_len > limits.max_payload_len:
        raise LimitExceeded(f"payload_len {payload_len} above limit {limits.max_payload_len}")
    return header_len, payload_len, has_payload


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not used by kvtier frames")


def unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack ``object_pairs_hook`` that refuses duplicate keys: two readers of one map must
    never see two different values for a key."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in a msgpack map")
    return out


def decode_header(buf: Buffer) -> dict[str, Any]:
    """Decode a frame's header map (already bounded by ``max_header_len``).

    Raises:
        FrameError: not exactly one msgpack map with unique string keys and an unsigned
            ``"id"``; extension types and trailing bytes are refused too.
    """
    try:
        header = msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                                 object_pairs_hook=unique_map)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise FrameError(f"frame header is not valid msgpack: {exc}") from exc
    if type(header) is not dict:  # unique_map makes every map a plain dict
        raise FrameError("frame header must be a map with string keys")
    for key in header:  # a loop, not all(<genexpr>): a generator per frame costs more than the keys
        if type(key) is not str:  # strict_map_key leaves str and bytes; raw=False makes no subclasses
            raise FrameError("frame header must be a map with string keys")
    ident = header.get("id")
    if type(ident) is not int or not 0 <= ident <= U64_MAX:
        raise FrameError("frame header needs an unsigned 64-bit 'id'")
    return header


def _frame_from(buf: Buffer, header_len: int, payload_len: int, has_payload: bool) -> Frame:
    view = memoryview(buf).toreadonly()
    header = decode_header(view[PREAMBLE_LEN:PREAMBLE_LEN + header_len])
    start = PREAMBLE_LEN + header_len
    return Frame(header, view[start:start + payload_len] if has_payload else None)


def decode_frame(buf: Buffer, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Decode exactly one complete frame held in ``buf`` (payload is a view into ``buf``).

    Raises:
        Truncated: ``buf`` ends before the declared lengths.
        FrameError: bytes after the frame, or a malformed frame; other ProtocolErrors as
            :func:`parse_preamble` says.
    """
    header_len, payload_len, has_payload = parse_preamble(buf, limits)
    total = PREAMBLE_LEN + header_len + payload_len
    if len(buf) < total:
        raise Truncated(f"frame declares {total} bytes, buffer holds {len(buf)}")
    if len(buf) > total:
        raise FrameError(f"{len(buf) - total} bytes after the end of the frame")
    return _frame_from(buf, header_len, payload_len, has_payload)


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, get complete frames back.

    A frame that fills most of the internal buffer takes it over without a copy (the few bytes
    after it move to a new buffer); smaller frames are copied out once. After an error the stream is out of
    sync and the decoder refuses further input: close the connection.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._limits = limits
        self._buf = bytearray()
        self._pending: tuple[int, int, bool] | None = None  # preamble of the frame being read
        self._failed: Exception | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as frames."""
        return len(self._buf)

    def feed(self, data: Buffer) -> list[Frame]:
        """Append ``data``; return every frame it completes, in order.

        Raises:
            ProtocolError: a subclass (BadMagic, UnsupportedVersion, FrameError, LimitExceeded)
                for malformed input; it is raised before buffering a declared oversize frame.
        """
        if self._failed is not None:
            raise FrameError("the frame stream failed earlier and is out of sync") from self._failed
        try:
            return self._feed(data)
        except Exception as exc:
            self._failed = exc
            raise

    def _feed(self, data: Buffer) -> list[Frame]:
        buf = self._buf
        buf += data
        frames: list[Frame] = []
        pos = 0
        while True:
            if self._pending is None:
                if len(buf) - pos < PREAMBLE_LEN:
                    break
                with memoryview(buf) as view:
                    self._pending = parse_preamble(view[pos:pos + PREAMBLE_LEN], self._limits)
            header_len, payload_len, has_payload = self._pending
            total = PREAMBLE_LEN + header_len + payload_len
            if len(buf) - pos < total:
                break
            self._pending = None
            if pos == 0 and 2 * total >= len(buf):
                # The frame is most of the buffer: hand the buffer over and copy the smaller
                # rest, so a large payload is never copied after it arrived.
                owned: Buffer = buf
                self._buf = buf[total:]
                del buf[total:]
                buf = self._buf
            else:
                with memoryview(buf) as view:
                    owned = bytes(view[pos:pos + total])
                pos += total
            frames.append(_frame_from(owned, header_len, payload_len, has_payload))
        if pos:
            del buf[:pos]
        return frames


async def read_frame(reader: asyncio.StreamReader, limits: Limits = DEFAULT_LIMITS,
                     read_payload: Callable[[int], Awaitable[Buffer]] | None = None) -> Frame | None:
    """Read one frame from a stream (``read_payload(n)``, if given, reads the payload's ``n``
    bytes instead of ``reader.readexactly``: e.g. into a buffer of the caller's).

    Returns:
        The frame, or None when the stream ended cleanly before the first byte of a frame.

    Raises:
        Truncated: the stream ended inside a frame.
        ProtocolError: a subclass for malformed frames; oversize lengths are refused before
            reading the rest.
    """
    try:
        preamble = await reader.readexactly(PREAMBLE_LEN)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise Truncated("stream ended inside a frame preamble") from exc
    header_len, payload_len, has_payload = parse_preamble(preamble, limits)
    try:
        head = await reader.readexactly(header_len)
        body: Buffer | None = None
        if has_payload:
            body = await (reader.readexactly(payload_len) if read_payload is None else read_payload(payload_len))
    except asyncio.IncompleteReadError as exc:
        raise Truncated("stream ended inside a frame") from exc
    header = decode_header(head)
    return Frame(header, memoryview(body).toreadonly() if body is not None else None)


async def write_frame(writer: asyncio.StreamWriter, header: dict[str, Any],
                      payload: Payload | None = None, *, limits: Limits = DEFAULT_LIMITS) -> None:
    """Encode a frame, write it without joining the payload, and wait for the buffer to drain."""
    writer.writelines(encode_frame(header, payload, limits=limits))
    await writer.drain()

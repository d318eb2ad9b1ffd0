"""Data-plane frames and operations of kvtierd (SPEC.md §7): the public face of the wire layer.

A frame is a 20-byte preamble, a msgpack header map and an optional payload::

    +--------+---------+--------+------------+-------------+------------------+-----------+
    | "KVTF" | version | flags  | header_len | payload_len | header (msgpack) | payload   |
    | 4 B    | u16 LE  | u16 LE | u32 LE     | u64 LE      | header_len B     | payload_len|
    +--------+---------+--------+------------+-------------+------------------+-----------+

Every request header has ``op`` (str) and ``id`` (u64, chosen by the client, unique among its
requests in flight on the connection); the response echoes both and adds ``ok``. Responses may
arrive in any order. A failed request is answered with ``ok: false`` and
``err: {code, msg}``, where ``code`` is a wire code of :mod:`kvtier_protocol.errors`.

The byte layer lives in :mod:`kvtier_protocol.frame_codec`, the typed messages in
:mod:`kvtier_protocol.messages` (requests) and :mod:`kvtier_protocol.responses`, the per-key
checkers in :mod:`kvtier_protocol.wire_checks`; this module re-exports what callers need and adds
request validation and error mapping. Torch-free.
"""

from __future__ import annotations

from typing import Any

from kvtier_protocol.errors import (FrameError, InvalidRequest, KVTierError, LimitExceeded,
                                    error_from_wire)
from kvtier_protocol.frame_codec import (DEFAULT_LIMITS, FLAG_PAYLOAD, FRAME_VERSION, MAGIC,
                                         PREAMBLE, PREAMBLE_LEN, U64_MAX, Buffer, Frame,
                                         FrameDecoder, Limits, Payload, decode_frame,
                                         decode_header, encode_frame, encode_frame_bytes,
                                         parse_preamble, read_frame, write_frame)
from kvtier_protocol.messages import (OPS, REQUESTS, AcquireRequest, ClearRequest, CommitRequest,
                                      DeleteRequest, GetRequest, GrantRequest, HelloRequest,
                                      LookupRequest, Message, PingRequest, PlaceRequest, PutRequest,
                                      ReleaseRequest, Request, ReserveRequest, StatsRequest,
                                      split_records)
from kvtier_protocol.responses import (PLACE_GRANT, QUIET_RELEASE, RESPONSES, AcquireResponse, ClearResponse, CommitResponse,
                                       DeleteResponse, GetResponse, GrantResponse, HelloResponse,
                                       LookupResponse, PingResponse, PlaceResponse, PutResponse,
                                       ReleaseResponse, ReserveResponse, Response, StatsResponse)
from kvtier_protocol.wire_checks import (DEFAULT_LEASE_MS, EXISTS, MAX_HASH_LEN, MAX_TEXT_LEN,
                                         MIN_HASH_LEN, NS_ID_LEN, PUT_RESULTS, TIER_NAMES,
                                         Segment, SlotRef)

CONNECTION_ERROR_ID = 0
"""Request id of an error response that answers no request (the frame could not be decoded);
the server closes the connection after sending it. Clients number their requests from 1."""

__all__ = [
    "CONNECTION_ERROR_ID", "DEFAULT_LEASE_MS", "DEFAULT_LIMITS", "EXISTS", "FLAG_PAYLOAD",
    "FRAME_VERSION", "MAGIC", "MAX_HASH_LEN", "MAX_TEXT_LEN", "MIN_HASH_LEN", "NS_ID_LEN", "OPS",
    "PLACE_GRANT", "PREAMBLE", "PREAMBLE_LEN", "PUT_RESULTS", "QUIET_RELEASE", "REQUESTS", "RESPONSES", "TIER_NAMES",
    "AcquireRequest", "AcquireResponse", "Buffer", "ClearRequest", "ClearResponse",
    "CommitRequest", "CommitResponse", "DeleteRequest", "DeleteResponse", "Frame", "FrameDecoder",
    "GetRequest", "GetResponse", "GrantRequest", "GrantResponse", "HelloRequest", "HelloResponse",
    "Limits", "LookupRequest", "LookupResponse", "Message", "Payload", "PingRequest",
    "PingResponse", "PlaceRequest", "PlaceResponse", "PutRequest", "PutResponse", "ReleaseRequest",
    "ReleaseResponse", "Request", "ReserveRequest", "ReserveResponse", "Response", "Segment",
    "SlotRef", "StatsRequest", "StatsResponse", "decode_frame", "decode_header", "encode_frame",
    "encode_frame_bytes", "encode_message", "error_response", "parse_preamble", "parse_response",
    "raise_for_error", "read_frame", "split_records", "validate_request", "write_frame",
]


def _unpack(header: dict[str, Any] | Frame,
            payload: memoryview | None) -> tuple[dict[str, Any], memoryview | None]:
    if isinstance(header, Frame):
        return header.header, header.payload
    if not isinstance(header, dict):
        raise FrameError("a frame header is a map")
    ident = header.get("id")
    if type(ident) is not int or not 0 <= ident <= U64_MAX:
        raise FrameError("a frame header needs an unsigned 64-bit 'id'")
    return header, payload


def validate_request(header: dict[str, Any] | Frame, payload: memoryview | None = None, *,
                     limits: Limits = DEFAULT_LIMITS) -> Request:
    """Check a decoded request frame and return its typed form.

    Args:
        header: a decoded header map, or a whole :class:`Frame` (then ``payload`` is ignored).
        payload: the frame payload (put requests carry one; every other request must not).
        limits: the server's limits.

    Raises:
        FrameError: not a request (e.g. a response), or a payload where none belongs.
        InvalidRequest: unknown op, missing key, wrong type or inconsistent fields.
        LimitExceeded: an array or length above ``limits``.
    """
    header, payload = _unpack(header, payload)
    if "ok" in header:
        raise FrameError("received a response where a request was expected")
    op = header.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise InvalidRequest(f"unknown op {op!r}; ops are {', '.join(OPS)}")
    return cls.from_header(header, payload, limits)  # type: ignore[return-value]


def parse_response(op: str, header: dict[str, Any] | Frame, payload: memoryview | None = None,
                   *, limits: Limits = DEFAULT_LIMITS) -> Response:
    """Check a decoded response to a request of ``op`` and return its typed form.

    Raises:
        KVTierError: the typed error the server reported (``ok: false``), via
            :func:`raise_for_error`.
        FrameError: a malformed response; a server that breaks the schema is a protocol error.
        LimitExceeded: an array or length above the client's ``limits``.
    """
    header, payload = _unpack(header, payload)
    raise_for_error(header)
    cls = RESPONSES.get(op)
    if cls is None:
        raise InvalidRequest(f"unknown op {op!r}")
    if header.get("op", op) != op:
        raise FrameError(f"response to {op!r} names op {header.get('op')!r}")
    try:
        return cls.from_header(header, payload, limits)  # type: ignore[return-value]
    except InvalidRequest as exc:
        raise FrameError(f"malformed {op} response: {exc.message}") from exc


def encode_message(message: Message, *, limits: Limits = DEFAULT_LIMITS) -> list[Buffer]:
    """Encode a typed request or response as frame buffers (payload not copied)."""
    return encode_frame(message.to_header(), message.frame_payload(), limits=limits)


def error_response(id: int, exc: BaseException, op: str | None = None) -> dict[str, Any]:
    """The header of an error response to request ``id``.

    A :class:`KVTierError` keeps its wire code and message; anything else becomes ``internal``
    with a fixed message, so that internals (paths, reprs) never leak to a peer.
    """
    if isinstance(exc, KVTierError):
        code, msg = exc.code, exc.message[:MAX_TEXT_LEN]
    else:
        code, msg = KVTierError.code, "internal error"
    header: dict[str, Any] = {} if op is None else {"op": op}
    header.update({"id": id, "ok": False, "err": {"code": code, "msg": msg}})
    return header


def raise_for_error(header: dict[str, Any]) -> None:
    """Return if ``header`` is a successful response; raise the error it carries otherwise.

    Raises:
        KVTierError: the subclass named by ``err.code`` (a plain KVTierError for unknown codes).
        FrameError: not a response, or a malformed ``err``.
    """
    if not isinstance(header, dict):
        raise FrameError("a response header is a map")
    ok = header.get("ok")
    if ok is True:
        return
    if ok is not False:
        raise FrameError("a response needs a boolean 'ok'")
    err = header.get("err")
    if not isinstance(err, dict):
        raise FrameError("an error response needs an 'err' map")
    code, msg = err.get("code"), err.get("msg")
    if not isinstance(code, str) or not isinstance(msg, str):
        raise FrameError("'err' needs string 'code' and 'msg'")
    if len(code) > MAX_TEXT_LEN or len(msg) > MAX_TEXT_LEN:
        raise LimitExceeded(f"'err' strings are limited to {MAX_TEXT_LEN} characters")
    raise error_from_wire(code, msg)

"""Tests of kvtier_protocol.frames: frame codec, incremental and async decoding, limits,
request/response validation, error mapping, fuzzing and the golden frame vectors."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier_protocol import frames as fr
from kvtier_protocol.errors import (ERRORS_BY_CODE, BadMagic, FrameError, InvalidRequest,
                                    KVTierError, LimitExceeded, NotFound, Truncated,
                                    UnsupportedVersion)

VECTORS = Path(__file__).resolve().parents[2] / "protocol" / "vectors"
_spec = importlib.util.spec_from_file_location("gen_wire", VECTORS / "gen_wire.py")
gen_wire = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_wire)

NS = bytes(range(16))
H = [bytes([i]) * 32 for i in range(8)]
HYPO = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def one_frame(data: bytes, limits: fr.Limits = fr.DEFAULT_LIMITS) -> fr.Frame:
    frames = fr.FrameDecoder(limits).feed(data)
    assert len(frames) == 1
    return frames[0]


def wire(message: fr.Message) -> bytes:
    return b"".join(bytes(b) for b in fr.encode_message(message))


def random_chunks(data: bytes, rng: random.Random) -> list[bytes]:
    chunks, pos = [], 0
    while pos < len(data):
        n = rng.randint(1, 17)
        chunks.append(data[pos:pos + n])
        pos += n
    return chunks


# --- strategies ----------------------------------------------------------------------------

ids = st.integers(1, 2**64 - 1)
u64 = st.integers(0, 2**64 - 1)
ns_ids = st.binary(min_size=16, max_size=16)
hashes = st.lists(st.binary(min_size=8, max_size=64), max_size=6).map(tuple)
texts = st.text(max_size=24)
lease_ms = st.integers(1, 600_000)
priorities = st.integers(-128, 127)
rec_lens = st.integers(1, 256 << 20)
slot = st.tuples(u64, u64, rec_lens)
records = st.lists(st.binary(min_size=1, max_size=40), max_size=5)


@st.composite
def reserve_requests(draw: Any) -> fr.ReserveRequest:
    keys = draw(hashes)
    sizes = tuple(draw(rec_lens) for _ in keys)
    return fr.ReserveRequest(draw(ids), draw(ns_ids), keys, sizes, draw(lease_ms), draw(priorities))


@st.composite
def grant_requests(draw: Any) -> fr.GrantRequest:
    sizes = tuple(draw(st.lists(rec_lens, max_size=5)))
    return fr.GrantRequest(draw(ids), sizes, draw(lease_ms), draw(priorities))


@st.composite
def place_requests(draw: Any) -> fr.PlaceRequest:
    keys = draw(hashes)
    positions = tuple(draw(st.integers(0, 4095)) for _ in keys)
    headers = tuple(draw(st.binary(min_size=1, max_size=30)) for _ in keys)
    if not draw(st.booleans()):
        return fr.PlaceRequest(draw(ids), draw(u64), draw(ns_ids), keys, positions, headers)
    refill = tuple(draw(st.lists(rec_lens, max_size=5)))  # the next save's slots (SPEC 7.4)
    return fr.PlaceRequest(draw(ids), draw(u64), draw(ns_ids), keys, positions, headers,
                           grant_sizes=refill, grant_lease_ms=draw(st.none() | lease_ms),
                           grant_priority=draw(st.none() | priorities))


@st.composite
def place_responses(draw: Any) -> fr.PlaceResponse:
    results = tuple(draw(st.lists(st.sampled_from(fr.PUT_RESULTS), max_size=5)))
    if not draw(st.booleans()):
        return fr.PlaceResponse(draw(ids), results)
    lease = draw(u64)
    slots = tuple(draw(st.lists(slot | st.none(), max_size=5))) if lease else None
    return fr.PlaceResponse(draw(ids), results, lease, slots)


@st.composite
def put_requests(draw: Any) -> fr.PutRequest:
    recs = draw(records)
    keys = tuple(draw(st.binary(min_size=8, max_size=64)) for _ in recs)
    return fr.PutRequest(draw(ids), draw(ns_ids), keys, tuple(len(r) for r in recs),
                         draw(priorities), payload=b"".join(recs))


@st.composite
def get_responses(draw: Any) -> fr.GetResponse:
    recs = draw(st.lists(st.none() | st.binary(min_size=1, max_size=40), max_size=5))
    return fr.GetResponse(draw(ids), tuple(None if r is None else len(r) for r in recs),
                          payload=b"".join(r for r in recs if r is not None))


@st.composite
def acquire_responses(draw: Any) -> fr.AcquireResponse:
    found = draw(st.lists(st.booleans(), max_size=6))
    slots = tuple(draw(slot) if f else None for f in found)
    headers = tuple(draw(st.binary(min_size=1, max_size=30)) if f else None for f in found)
    return fr.AcquireResponse(draw(ids), draw(u64), slots, headers)


@st.composite
def hello_responses(draw: Any) -> fr.HelloResponse:
    limits = fr.Limits(*(draw(st.integers(1, 2**32 - 1)) for _ in range(5)))
    segs = tuple(draw(st.lists(st.builds(fr.Segment, texts, st.integers(1, 2**40)), max_size=3)))
    fds = draw(st.sampled_from([0, len(segs)]))
    features = draw(st.none() | st.lists(texts, max_size=3).map(tuple))
    return fr.HelloResponse(draw(ids), draw(st.integers(1, 0xFFFF)), draw(texts), limits, segs,
                            fds, features)


requests = st.one_of(
    st.builds(fr.HelloRequest, ids, st.integers(1, 0xFFFF), texts, st.none() | texts,
              st.none() | texts),
    st.builds(fr.LookupRequest, ids, ns_ids, hashes),
    reserve_requests(),
    st.builds(fr.CommitRequest, ids, u64,
              st.lists(st.none() | st.binary(min_size=1, max_size=30), max_size=5).map(tuple)),
    st.builds(fr.AcquireRequest, ids, ns_ids, hashes, lease_ms),
    st.builds(fr.ReleaseRequest, ids, u64, st.none() | st.booleans()),
    put_requests(),
    st.builds(fr.GetRequest, ids, ns_ids, hashes),
    st.builds(fr.DeleteRequest, ids, ns_ids, hashes),
    st.builds(fr.ClearRequest, ids, ns_ids),
    st.builds(fr.StatsRequest, ids),
    st.builds(fr.PingRequest, ids),
    grant_requests(),
    place_requests(),
)

scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | texts | st.floats(
    allow_nan=False)
responses = st.one_of(
    hello_responses(),
    st.lists(st.sampled_from(fr.TIER_NAMES), max_size=6).map(
        lambda t: fr.LookupResponse(1, len(t), tuple(t))),
    st.builds(fr.ReserveResponse, ids, u64,
              st.lists(slot | st.just("exists") | st.none(), max_size=5).map(tuple)),
    st.builds(fr.CommitResponse, ids, u64),
    acquire_responses(),
    st.builds(fr.ReleaseResponse, ids),
    st.builds(fr.PutResponse, ids,
              st.lists(st.sampled_from(fr.PUT_RESULTS), max_size=5).map(tuple)),
    get_responses(),
    st.builds(fr.DeleteResponse, ids, u64),
    st.builds(fr.ClearResponse, ids, u64),
    st.builds(fr.StatsResponse, ids, st.dictionaries(
        texts, scalars | st.dictionaries(texts, scalars, max_size=3), max_size=5)),
    st.builds(fr.PingResponse, ids),
    st.builds(fr.GrantResponse, ids, u64, st.lists(slot | st.none(), max_size=5).map(tuple)),
    place_responses(),
)


# --- round trips ---------------------------------------------------------------------------


@HYPO
@given(requests, st.randoms(use_true_random=False))
def test_request_round_trip_in_random_chunks(message: fr.Message, rng: random.Random) -> None:
    data = wire(message)
    decoder = fr.FrameDecoder()
    frames = [f for chunk in random_chunks(data, rng) for f in decoder.feed(chunk)]
    assert len(frames) == 1 and decoder.buffered == 0
    assert fr.validate_request(frames[0]) == message
    assert b"".join(bytes(b) for b in fr.encode_frame(frames[0].header, frames[0].payload)) == data


@HYPO
@given(responses)
def test_response_round_trip(message: fr.Message) -> None:
    frame = one_frame(wire(message))
    assert fr.parse_response(message.OP, frame) == message


@HYPO
@given(st.lists(requests, min_size=1, max_size=5))
def test_byte_by_byte_feed_yields_every_frame_in_order(messages: list[fr.Message]) -> None:
    data = b"".join(wire(m) for m in messages)
    decoder = fr.FrameDecoder()
    out = [f for i in range(len(data)) for f in decoder.feed(data[i:i + 1])]
    assert [fr.validate_request(f) for f in out] == messages
    assert fr.FrameDecoder().feed(data) and decoder.buffered == 0


def test_large_frame_followed_by_more_data() -> None:
    big = fr.PutRequest(1, NS, (H[0],), (300_000,), payload=bytes(300_000))
    small = fr.PingRequest(2)
    data = wire(big) + wire(small) + wire(small)[:7]
    decoder = fr.FrameDecoder()
    out = decoder.feed(data[:1000]) + decoder.feed(data[1000:])
    assert [fr.validate_request(f) for f in out] == [big, small]
    assert decoder.buffered == 7
    assert fr.validate_request(decoder.feed(wire(small)[7:])[0]) == small


def test_payload_sent_as_buffer_list_is_not_joined() -> None:
    recs = [b"a" * 10, bytearray(b"b" * 5), memoryview(b"c" * 7)]
    put = fr.PutRequest(1, NS, tuple(H[:3]), (10, 5, 7), payload=recs)
    parts = fr.encode_message(put)
    assert len(parts) == 4 and parts[1].obj is recs[0]
    decoded = fr.validate_request(one_frame(b"".join(bytes(p) for p in parts)))
    assert [bytes(r) for r in decoded.records()] == [b"a" * 10, b"b" * 5, b"c" * 7]
    assert [bytes(r) for r in put.records()] == [bytes(r) for r in decoded.records()]


def test_get_response_records_mark_missing_keys() -> None:
    got = fr.GetResponse(4, (3, None, 2), payload=b"abcde")
    decoded = fr.parse_response("get", one_frame(wire(got)))
    assert [None if r is None else bytes(r) for r in decoded.records()] == [b"abc", None, b"de"]


def test_empty_payload_is_distinct_from_no_payload() -> None:
    with_empty = one_frame(fr.encode_frame_bytes({"id": 1}, b""))
    without = one_frame(fr.encode_frame_bytes({"id": 1}))
    assert with_empty.payload is not None and len(with_empty.payload) == 0
    assert without.payload is None


# --- preamble and limits -------------------------------------------------------------------


def preamble(magic: bytes = b"KVTF", version: int = 1, flags: int = 0, header_len: int = 0,
             payload_len: int = 0) -> bytes:
    return struct.pack("<4sHHIQ", magic, version, flags, header_len, payload_len)


@pytest.mark.parametrize("data, error", [
    (preamble(magic=b"KVT1"), BadMagic),
    (preamble(version=2), UnsupportedVersion),
    (preamble(flags=2), UnsupportedVersion),
    (preamble(payload_len=5), FrameError),
    (preamble(header_len=fr.Limits().max_header_len + 1), LimitExceeded),
    (preamble(flags=1, payload_len=1 << 60), LimitExceeded),
])
def test_bad_preamble_is_refused_as_soon_as_it_arrives(data: bytes, error: type) -> None:
    decoder = fr.FrameDecoder()
    with pytest.raises(error):
        decoder.feed(data)
    with pytest.raises(FrameError):  # the stream is out of sync: no more input
        decoder.feed(b"")


def test_huge_declared_payload_allocates_nothing() -> None:
    generous = fr.Limits(max_payload_len=1 << 62)
    decoder = fr.FrameDecoder(generous)
    head = fr.encode_frame_bytes({"id": 1})
    head = head[:6] + b"\x01\x00" + head[8:12] + struct.pack("<Q", 1 << 60) + head[20:]
    assert decoder.feed(head) == [] and decoder.buffered == len(head)
    with pytest.raises(LimitExceeded):
        fr.FrameDecoder().feed(head[:20])


def test_encoder_enforces_limits() -> None:
    small = fr.Limits(max_header_len=64, max_payload_len=8)
    with pytest.raises(LimitExceeded):
        fr.encode_frame({"id": 1, "pad": "x" * 100}, limits=small)
    with pytest.raises(LimitExceeded):
        fr.encode_frame({"id": 1}, b"123456789", limits=small)
    with pytest.raises(FrameError):
        fr.encode_frame({"op": "ping"})
    with pytest.raises(FrameError):
        fr.encode_frame({"id": 1, "x": object()})


def test_batch_limit() -> None:
    header = fr.LookupRequest(1, NS, tuple(H[:1]) * 5).to_header()
    with pytest.raises(LimitExceeded):
        fr.validate_request(header, limits=fr.Limits(max_batch=4))
    assert len(fr.validate_request(header, limits=fr.Limits(max_batch=5)).hashes) == 5


def test_decode_frame_refuses_truncated_and_trailing_bytes() -> None:
    data = wire(fr.PingRequest(1))
    with pytest.raises(Truncated):
        fr.decode_frame(data[:-1])
    with pytest.raises(Truncated):
        fr.decode_frame(data[:10])
    with pytest.raises(FrameError):
        fr.decode_frame(data + b"\0")


@pytest.mark.parametrize("header", [
    msgpack.packb([1, 2]), msgpack.packb({"op": "ping"}), msgpack.packb({"id": -1}),
    msgpack.packb({"id": True}), msgpack.packb({1: 2, "id": 1}), b"\xc1", b"",
    msgpack.packb({"id": 1}) + b"\x00", msgpack.packb(msgpack.ExtType(5, b"x")),
    b"\x82\xa2id\x01\xa2id\x02",  # duplicate key
])
def test_bad_header_bytes_are_frame_errors(header: bytes) -> None:
    data = preamble(header_len=len(header)) + header
    with pytest.raises(FrameError):
        fr.decode_frame(data)


# --- request validation --------------------------------------------------------------------


def header_of(message: fr.Message, **changes: Any) -> dict[str, Any]:
    header = message.to_header()
    for key, value in changes.items():
        if value is ...:
            del header[key]
        else:
            header[key] = value
    return header


LOOKUP = fr.LookupRequest(1, NS, (H[0], H[1]))
RESERVE = fr.ReserveRequest(2, NS, (H[0], H[1]), (100, 200))
GRANT = fr.GrantRequest(3, (100, 200))
PLACE = fr.PlaceRequest(4, 7, NS, (H[0], H[1]), (0, 1), (b"h0", b"h1"))


@pytest.mark.parametrize("header, error", [
    (header_of(LOOKUP, op="fly"), InvalidRequest),
    (header_of(LOOKUP, op=...), InvalidRequest),
    (header_of(LOOKUP, ns_id=...), InvalidRequest),
    (header_of(LOOKUP, ns_id=None), InvalidRequest),
    (header_of(LOOKUP, ns_id=b"short"), InvalidRequest),
    (header_of(LOOKUP, ns_id="x" * 16), InvalidRequest),
    (header_of(LOOKUP, hashes=[b"tiny"]), InvalidRequest),
    (header_of(LOOKUP, hashes=[b"x" * 65]), InvalidRequest),
    (header_of(LOOKUP, hashes=b"x" * 32), InvalidRequest),
    (header_of(LOOKUP, ok=True), FrameError),
    (header_of(RESERVE, sizes=[100]), InvalidRequest),
    (header_of(RESERVE, sizes=[100, 0]), InvalidRequest),
    (header_of(RESERVE, sizes=[100, True]), InvalidRequest),
    (header_of(RESERVE, sizes=[100, (256 << 20) + 1]), LimitExceeded),
    (header_of(RESERVE, lease_ms=0), InvalidRequest),
    (header_of(RESERVE, lease_ms=600_001), LimitExceeded),
    (header_of(RESERVE, priority=128), InvalidRequest),
    (header_of(fr.HelloRequest(1, 1, "c"), version=0), InvalidRequest),
    (header_of(fr.HelloRequest(1, 1, "c"), client="x" * 2000), LimitExceeded),
    (header_of(fr.ReleaseRequest(1, 5), lease=-5), InvalidRequest),
    (header_of(fr.ReleaseRequest(1, 5), quiet=1), InvalidRequest),  # a bool, never an integer
    (header_of(PLACE, grant_sizes=[100, 0]), InvalidRequest),
    (header_of(PLACE, grant_lease_ms=1000), InvalidRequest),  # a refill's lease without its sizes
    (header_of(PLACE, grant_sizes=[100], grant_priority=128), InvalidRequest),
    (header_of(fr.CommitRequest(1, 5, (b"h",)), headers=[1]), InvalidRequest),
    (header_of(GRANT, sizes=[100, 0]), InvalidRequest),
    (header_of(GRANT, sizes=[(256 << 20) + 1]), LimitExceeded),
    (header_of(GRANT, sizes=[1] * 4097), LimitExceeded),
    (header_of(GRANT, sizes=...), InvalidRequest),
    (header_of(PLACE, positions=[0]), InvalidRequest),
    (header_of(PLACE, positions=[0, -1]), InvalidRequest),
    (header_of(PLACE, positions=[0, 4096]), InvalidRequest),
    (header_of(PLACE, positions=[0, True]), InvalidRequest),
    (header_of(PLACE, headers=[b"h0", None]), InvalidRequest),
    (header_of(PLACE, headers=[b"h0"]), InvalidRequest),
    (header_of(PLACE, lease=...), InvalidRequest),
    (header_of(PLACE, tokens=[[1, 2]]), InvalidRequest),
])
def test_invalid_requests_are_refused(header: dict[str, Any], error: type) -> None:
    with pytest.raises(error):
        fr.validate_request(header)


def test_token_stays_out_of_repr() -> None:
    hello = fr.validate_request(fr.HelloRequest(1, 1, "c", token="s3cret").to_header())
    assert hello.token == "s3cret" and "s3cret" not in repr(hello)


def test_optional_keys_default_and_nil_means_absent() -> None:
    header = header_of(RESERVE, lease_ms=..., priority=None)
    request = fr.validate_request(header)
    assert request.lease_ms == fr.DEFAULT_LEASE_MS and request.priority == 0


def test_unknown_keys_are_ignored() -> None:
    assert fr.validate_request(header_of(LOOKUP, future_key=[1, {"a": 2}])) == LOOKUP


def test_payload_rules() -> None:
    put = fr.PutRequest(3, NS, (H[0],), (4,), payload=b"abcd")
    with pytest.raises(FrameError):
        fr.validate_request(put.to_header())  # put without payload
    with pytest.raises(FrameError):
        fr.validate_request(put.to_header(), memoryview(b"abc"))  # lens disagree
    with pytest.raises(InvalidRequest):
        fr.validate_request(header_of(put, lens=[None]), memoryview(b""))
    with pytest.raises(FrameError):
        fr.validate_request(LOOKUP.to_header(), memoryview(b"x"))  # lookup takes none
    assert fr.validate_request(put.to_header(), memoryview(b"abcd")) == put


def test_malformed_response_is_a_frame_error() -> None:
    lookup = fr.LookupResponse(1, 2, ("host", "disk")).to_header()
    for bad in ({**lookup, "num_hits": 3}, {**lookup, "tiers": ["host", "moon"]},
                {**lookup, "op": "get"}, {k: v for k, v in lookup.items() if k != "ok"}):
        with pytest.raises(FrameError):
            fr.parse_response("lookup", bad)
    acquire = fr.AcquireResponse(1, 3, ((0, 0, 10),), (b"h",)).to_header()
    with pytest.raises(FrameError):
        fr.parse_response("acquire", {**acquire, "headers": [None]})
    with pytest.raises(FrameError):
        fr.parse_response("acquire", {**acquire, "slots": ["exists"]})
    place = fr.PlaceResponse(1, ("stored",), 9, ((0, 0, 10),)).to_header()
    for bad in ({**place, "grant_slots": ["exists"]}, {**place, "grant_lease": 0}):
        with pytest.raises(FrameError):
            fr.parse_response("place", bad)


# --- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", sorted(ERRORS_BY_CODE.values(), key=lambda c: c.status))
def test_every_error_class_crosses_the_wire(cls: type[KVTierError]) -> None:
    frame = one_frame(fr.encode_frame_bytes(fr.error_response(9, cls("why"), op="get")))
    assert frame.header["ok"] is False and frame.header["err"]["code"] == cls.code
    with pytest.raises(cls) as info:
        fr.parse_response("get", frame)
    assert type(info.value) is cls and info.value.message == "why"


def test_foreign_exceptions_do_not_leak() -> None:
    header = fr.error_response(3, ValueError("/secret/path"))
    assert header == {"id": 3, "ok": False, "err": {"code": "internal", "msg": "internal error"}}
    with pytest.raises(KVTierError) as info:
        fr.raise_for_error(header)
    assert info.value.code == "internal"


def test_unknown_error_code_keeps_its_code() -> None:
    with pytest.raises(KVTierError) as info:
        fr.raise_for_error({"id": 1, "ok": False, "err": {"code": "from_the_future", "msg": "m"}})
    assert type(info.value) is KVTierError and info.value.code == "from_the_future"


@pytest.mark.parametrize("header", [
    {"id": 1}, {"id": 1, "ok": 1}, {"id": 1, "ok": False}, {"id": 1, "ok": False, "err": "x"},
    {"id": 1, "ok": False, "err": {"code": 5, "msg": "m"}}, [1],
])
def test_raise_for_error_refuses_malformed_responses(header: Any) -> None:
    with pytest.raises(FrameError):
        fr.raise_for_error(header)


# --- async streams -------------------------------------------------------------------------


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A toy server: answers ping and put, and echoes errors, in reverse arrival order."""
    pending = []
    while (frame := await fr.read_frame(reader)) is not None:
        try:
            request = fr.validate_request(frame)
            if isinstance(request, fr.PutRequest):
                lens = tuple(len(r) for r in request.records())
                response: fr.Message = fr.GetResponse(request.id, lens, payload=request.records())
            else:
                response = fr.PingResponse(request.id)
            pending.append((response.to_header(), response.frame_payload()))
        except KVTierError as exc:
            pending.append((fr.error_response(frame.id, exc, frame.op), None))
        if len(pending) == 3:
            for header, payload in reversed(pending):  # out of order, as the daemon may
                await fr.write_frame(writer, header, payload)
            pending.clear()
    writer.close()


async def test_read_and_write_frames_over_a_unix_socket(tmp_path: Path) -> None:
    server = await asyncio.start_unix_server(serve, path=str(tmp_path / "kv.sock"))
    try:
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "kv.sock"))
        payload = bytes(range(256)) * 1000
        sent = [fr.PingRequest(1), fr.PutRequest(2, NS, (H[0], H[1]), (1000, len(payload) - 1000),
                                                 payload=payload),
                {"op": "lookup", "id": 3, "ns_id": b"bad"}]
        for message in sent:
            header = message if isinstance(message, dict) else message.to_header()
            payload_ = None if isinstance(message, dict) else message.frame_payload()
            await fr.write_frame(writer, header, payload_)
        got = {}
        for _ in range(3):
            frame = await asyncio.wait_for(fr.read_frame(reader), timeout=60)
            got[frame.id] = frame
        assert [f.id for f in got.values()] == [3, 2, 1]
        assert fr.parse_response("ping", got[1]) == fr.PingResponse(1)
        echoed = fr.parse_response("get", got[2])
        assert b"".join(bytes(r) for r in echoed.records()) == payload
        with pytest.raises(InvalidRequest):
            fr.parse_response("lookup", got[3])
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


def stream_of(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_read_frame_end_of_stream() -> None:
    data = wire(fr.PingRequest(5))
    reader = stream_of(data * 2)
    assert (await fr.read_frame(reader)).id == 5
    assert (await fr.read_frame(reader)).id == 5
    assert await fr.read_frame(reader) is None
    for cut in (3, 25, len(data) - 1):
        with pytest.raises(Truncated):
            await fr.read_frame(stream_of(data[:cut]))


async def test_read_frame_refuses_oversize_without_waiting_for_it() -> None:
    reader = stream_of(preamble(flags=1, payload_len=1 << 60), eof=False)
    with pytest.raises(LimitExceeded):  # a reader that waited for the payload would never return:
        await asyncio.wait_for(fr.read_frame(reader), timeout=60)  # the timeout only ends that wait


# --- fuzzing -------------------------------------------------------------------------------


SAMPLE_FRAMES = [(VECTORS / p).read_bytes() for p in sorted(
    str(p.relative_to(VECTORS)) for p in (VECTORS / "frames").glob("*.bin"))]
FUZZ_VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 255, 2**32, 2**64 - 1, -2**63, 1.5, float("nan"), "", "x",
    "exists", "host", "ping", b"", b"\0" * 8, b"\1" * 16, b"h" * 32, b"h" * 65, [], [None],
    [b"h" * 32], [[0, 0, 1]], [[0, 0, 0]], [[1, 2]], ["exists"], [1, 2, 3], [True], {},
    {"name": "s", "size": 1}, [{"name": "s", "size": 0}], {"a": {"b": {"c": {"d": {"e": 1}}}}},
    [[[[[1]]]]], [b"h" * 8] * 5000, ["gpu"] * 3, {"code": "x", "msg": "y"}, [None, b"x"],
]


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if choice < 0.5 and buf:
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif choice < 0.7:
            del buf[rng.randrange(len(buf) + 1):]
        elif choice < 0.85:
            pos = rng.randrange(len(buf) + 1)
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        else:  # rewrite a length field of the preamble
            offset, size = rng.choice([(8, 4), (12, 8)])
            buf[offset:offset + size] = rng.randrange(1 << (8 * size)).to_bytes(size, "little")
    return bytes(buf)


def mutate_header(header: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    header = dict(header)
    for _ in range(rng.randint(1, 3)):
        keys = list(header) + ["op", "id", "ok", "hashes", "sizes", "lens", "slots", "limits"]
        key = rng.choice(keys)
        if rng.random() < 0.25:
            header.pop(key, None)
        else:
            header[key] = rng.choice(FUZZ_VALUES)
    return header


def test_fuzz_frame_decoder() -> None:
    # Typed errors only, whatever the input; how fast is `kvtier bench fuzz`'s (its hangs and
    # slowest rows), not a test's: the machine running the suite may be busy.
    rng = random.Random(20261130)
    outcomes = {"frames": 0, "errors": 0}
    for i in range(12_000):
        if i % 3 == 0:
            data = rng.randbytes(rng.randint(0, 60))
        elif i % 3 == 1:
            body = rng.randbytes(rng.randint(0, 40))
            data = preamble(header_len=len(body)) + body
        else:
            data = mutate_bytes(rng.choice(SAMPLE_FRAMES), rng)
        decoder = fr.FrameDecoder(fr.Limits(max_payload_len=1 << 16))
        try:
            for chunk in random_chunks(data, rng):
                for frame in decoder.feed(chunk):
                    outcomes["frames"] += 1
                    try:
                        fr.validate_request(frame)
                    except KVTierError:
                        pass
        except KVTierError:
            outcomes["errors"] += 1
    assert outcomes["frames"] > 100 and outcomes["errors"] > 1000


def test_fuzz_validate_request_and_parse_response() -> None:
    rng = random.Random(7)
    samples = [fr.decode_frame(d).header for d in SAMPLE_FRAMES]
    accepted = 0
    for i in range(12_000):
        header = mutate_header(rng.choice(samples), rng)
        payload = rng.choice([None, memoryview(b""), memoryview(b"x" * 64)])
        try:
            fr.validate_request(header, payload)
            accepted += 1
        except KVTierError:
            pass
        try:
            fr.parse_response(rng.choice(fr.OPS), header, payload)
            accepted += 1
        except KVTierError:
            pass
    assert accepted > 100


# --- golden vectors ------------------------------------------------------------------------


FRAME_VECTORS = sorted(p.stem for p in (VECTORS / "frames").glob("*.bin"))


def test_vectors_exist_for_every_named_case() -> None:
    # SPEC §10: a request and a response of every operation of §7.4, and an error response.
    want = {f"{op}_{side}" for op in fr.OPS for side in ("request", "response")} | {"error_response"}
    assert want == set(FRAME_VECTORS)


@pytest.mark.parametrize("name", FRAME_VECTORS)
def test_frame_vector(name: str) -> None:
    data = (VECTORS / "frames" / f"{name}.bin").read_bytes()
    spec = json.loads((VECTORS / "frames" / f"{name}.json").read_text(encoding="utf-8"))
    frame = fr.decode_frame(data)
    pre = spec["preamble"]
    assert fr.PREAMBLE.unpack_from(data) == (pre["magic"].encode(), pre["version"],
                                             pre["flags"], pre["header_len"], pre["payload_len"])
    assert frame.header == gen_wire.from_json(spec["header"])
    expected_payload = None if spec["payload"] is None else gen_wire.from_json(spec["payload"])
    assert (None if frame.payload is None else bytes(frame.payload)) == expected_payload
    assert fr.encode_frame_bytes(frame.header, frame.payload) == data
    if spec["typed"] is not None:
        op = frame.header["op"]
        typed = (fr.parse_response(op, frame) if "ok" in frame.header
                 else fr.validate_request(frame))
        assert type(typed).__name__ == spec["typed"]
        assert wire(typed) == data
    else:
        with pytest.raises(NotFound):
            fr.raise_for_error(frame.header)


def test_generator_reproduces_the_files_on_disk() -> None:
    for stem, (data, description) in gen_wire.all_vectors().items():
        assert (VECTORS / f"{stem}.bin").read_bytes() == data, stem
        assert (VECTORS / f"{stem}.json").read_text(encoding="utf-8") == gen_wire.json_text(
            description), stem


def test_encoded_headers_are_msgpack_packb_bytes_after_a_failed_encode_and_on_other_threads():
    # encode_frame reuses one msgpack Packer per thread (frame_codec._packer): its bytes are
    # those of msgpack.packb, also right after a header that could not be encoded.
    import threading

    from kvtier_protocol.frame_codec import PREAMBLE_LEN

    header = {"op": "place", "id": 7, "lease": 3, "ns_id": b"n" * 16, "hashes": [b"h" * 32] * 2,
              "positions": (0, 1), "headers": [b"x" * 200, b"y" * 300]}
    want = msgpack.packb(header, use_bin_type=True)
    assert fr.encode_frame_bytes(header)[PREAMBLE_LEN:] == want
    with pytest.raises(fr.FrameError):
        fr.encode_frame({"id": 1, "bad": object()})
    with pytest.raises(fr.FrameError):
        fr.encode_frame({"id": 1, "big": [1, 1 << 70]})
    assert fr.encode_frame_bytes(header)[PREAMBLE_LEN:] == want
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(fr.encode_frame_bytes(header)))
    thread.start()
    thread.join()
    assert got == [fr.encode_frame_bytes(header)]


def test_token_ids_decode_as_arrays_and_encode_back_to_the_same_bytes() -> None:
    from array import array

    tokens = ([5, 0, 1, 128000], None, [2**40, 7])  # a 0 and a 1 (a BOS) among them; one id above 32 bits
    sent = fr.CommitRequest(3, 9, (b"h0", None, b"h2"), tokens=tokens)
    data = wire(sent)
    got = fr.validate_request(one_frame(data))
    assert got.tokens == (array("I", tokens[0]), None, array("Q", tokens[2]))
    assert b"".join(bytes(b) for b in fr.encode_message(got)) == data  # arrays go back out as msgpack ints
    for bad in ([True], [0, False], [7, 1, True], [-1], [2**63], [1.5], ["1"]):
        frame = one_frame(wire(fr.CommitRequest(3, 9, (b"h0",), tokens=([4],))))
        frame.header["tokens"] = [bad]
        with pytest.raises(InvalidRequest):
            fr.validate_request(frame)

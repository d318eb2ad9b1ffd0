"""Fuzzing of the frame layer: any bytes, any header map, through every frame decoder and the
request / response validators. Only typed errors (KVTierError) may come out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier_protocol import frames as fr
from kvtier_protocol.errors import KVTierError

from tests.protocol.fuzzkit import FUZZ, msgpack_values

VECTORS = sorted((Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "frames").glob("*.bin"))
SEEDS = [p.read_bytes() for p in VECTORS]
LOOP = asyncio.new_event_loop()  # one loop for every example: a loop per example costs more than the test


def check(frame: fr.Frame) -> None:
    if "ok" in frame.header:
        fr.parse_response(frame.op if frame.op in fr.OPS else "get", frame)
    else:
        fr.validate_request(frame)


def decode_all(data: bytes) -> None:
    """decode_frame, then the validators; typed errors are the accepted failure."""
    try:
        check(fr.decode_frame(data))
    except KVTierError:
        pass


def feed_all(data: bytes, step: int) -> None:
    dec = fr.FrameDecoder()
    try:
        for pos in range(0, len(data), step):
            for frame in dec.feed(data[pos:pos + step]):
                check(frame)
    except KVTierError:
        pass


async def read_all(data: bytes) -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    try:
        while (frame := await fr.read_frame(reader)) is not None:
            check(frame)
    except KVTierError:
        pass


def framed(header: object, payload: bytes, flags: int | None = None) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    flags = (fr.FLAG_PAYLOAD if payload else 0) if flags is None else flags
    return fr.PREAMBLE.pack(fr.MAGIC, 1, flags, len(body), len(payload)) + body + payload


def test_golden_frames_are_seeds() -> None:
    assert len(SEEDS) >= 10, "the frame vectors seed the fuzzers"


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(data: bytes) -> None:
    decode_all(data)
    decode_all(fr.MAGIC + b"\x01\x00" + data)
    feed_all(data, 7)


@FUZZ
@given(st.sampled_from(SEEDS), st.data())
def test_mutated_golden_frames(seed: bytes, data: st.DataObject) -> None:
    buf = bytearray(seed)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(buf)))
    decode_all(bytes(buf))
    decode_all(bytes(buf[:cut]))
    feed_all(bytes(buf) + seed, data.draw(st.integers(1, 64)))


@FUZZ
@given(st.sampled_from(fr.OPS), st.integers(0, (1 << 64) - 1), st.dictionaries(
    st.sampled_from(["ns_id", "hashes", "sizes", "lens", "headers", "lease", "lease_ms", "priority", "tokens",
                     "unit_hashes", "version", "client", "tenant", "token", "slots", "tiers", "num_hits",
                     "results", "limits", "segments", "fds", "stats", "err", "committed", "deleted"]),
    msgpack_values, max_size=6), st.booleans(), st.binary(max_size=64))
def test_structured_headers(op: str, ident: int, keys: dict, response: bool, payload: bytes) -> None:
    """A well-framed header of any op with random values for its keys: validated, never crashing."""
    header = {"op": op, "id": ident, **keys}
    if response:
        header["ok"] = keys.get("err") is None
    data = framed(header, payload)
    decode_all(data)
    feed_all(data, 5)
    LOOP.run_until_complete(read_all(data))


@FUZZ
@given(msgpack_values, st.integers(0, 0xFFFF), st.binary(max_size=32))
def test_any_msgpack_header(header: object, flags: int, payload: bytes) -> None:
    decode_all(framed(header, payload, flags))
    decode_all(framed(header, payload))


def test_declared_lengths_are_refused_before_allocating() -> None:
    huge = fr.PREAMBLE.pack(fr.MAGIC, 1, fr.FLAG_PAYLOAD, 16, (1 << 64) - 1)
    with pytest.raises(KVTierError) as info:
        fr.FrameDecoder().feed(huge)
    assert info.value.code == "limit_exceeded"
    dec = fr.FrameDecoder(fr.Limits(max_header_len=64))
    with pytest.raises(KVTierError):
        dec.feed(fr.PREAMBLE.pack(fr.MAGIC, 1, 0, 65, 0))
    assert dec.buffered == 20, "nothing beyond the preamble is buffered for a refused frame"


def test_deep_nesting_is_a_typed_error() -> None:
    deep: object = 1
    for _ in range(500):  # msgpack's packer stops at 512 levels; the raw frame below goes deeper
        deep = [deep]
    # an unknown key is ignored however deep it nests; a known key must hold the right type
    assert fr.validate_request(fr.decode_frame(framed({"op": "stats", "id": 1, "x": deep}, b""))).id == 1
    with pytest.raises(KVTierError):
        check(fr.decode_frame(framed({"op": "lookup", "id": 1, "ns_id": b"n" * 16, "hashes": deep}, b"")))
    raw = fr.PREAMBLE.pack(fr.MAGIC, 1, 0, 100_001, 0) + b"\x91" * 100_000 + b"\x01"
    with pytest.raises(KVTierError):
        fr.decode_frame(raw)

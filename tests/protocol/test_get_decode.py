"""The optional ``decode`` key of a get request and ``decoded`` key of its response (SPEC 7.4
get, issue 25): absent unless set (the frames older peers read are unchanged), typed when present."""

from __future__ import annotations

import msgpack
import pytest

from kvtier_protocol import frames as fr
from kvtier_protocol.errors import InvalidRequest

NS = bytes(range(16))
H = (b"\x01" * 32, b"\x02" * 32)


def test_decode_is_absent_by_default_and_round_trips_as_a_bool() -> None:
    request = fr.GetRequest(3, NS, H)
    assert "decode" not in request.to_header() and request.decode is None
    for value in (False, True):
        header = {**request.to_header(), "decode": value}
        assert fr.validate_request(header).decode is value
        assert fr.validate_request(msgpack.unpackb(msgpack.packb(header))).to_header() == header
    assert list(fr.GetRequest(3, NS, H, accept_lossy=False, decode=True).to_header())[-2:] == ["accept_lossy", "decode"]


@pytest.mark.parametrize("value", [0, 1, "true", [True]])
def test_a_decode_other_than_a_bool_is_refused(value: object) -> None:
    with pytest.raises(InvalidRequest, match="decode"):
        fr.validate_request({**fr.GetRequest(3, NS, H).to_header(), "decode": value})


def response(header: dict, payload: bytes = b"abcde") -> fr.GetResponse:
    r = fr.parse_response("get", {"op": "get", "id": 3, "ok": True, **header}, memoryview(payload))
    assert isinstance(r, fr.GetResponse)
    return r


def test_decoded_names_the_stored_codec_per_key_or_is_absent() -> None:
    assert response({"lens": [2, 3]}).decoded is None
    r = response({"lens": [2, 3, None], "decoded": [None, "int8", None]})
    assert r.decoded == (None, "int8", None)
    header = fr.GetResponse(3, (2, 3, None), decoded=(None, "int8", None), payload=b"abcde").to_header()
    assert header["decoded"] == (None, "int8", None) and "decoded" not in fr.GetResponse(3, (5,), payload=b"abcde").to_header()
    assert response({"lens": [5], "decoded": ["fp9_future"]}).decoded == ("fp9_future",)  # newer codecs are names


@pytest.mark.parametrize("header", [
    {"lens": [2, 3], "decoded": ["int8"]},  # not one entry per key
    {"lens": [5, None], "decoded": [None, "int8"]},  # a decoded entry for a missing key
    {"lens": [5], "decoded": [True]},  # not a codec name
    {"lens": [5], "decoded": "int8"},  # not an array
])
def test_a_malformed_decoded_is_refused(header: dict) -> None:
    with pytest.raises((InvalidRequest, fr.FrameError)):
        response(header)

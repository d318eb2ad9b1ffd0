"""The optional ``accept_lossy`` request key of lookup, acquire and get (SPEC 7.4.2, issue 25):
absent unless set (what older daemons see is unchanged), a msgpack bool when present."""

from __future__ import annotations

import msgpack
import pytest

from kvtier_protocol import frames as fr
from kvtier_protocol.errors import InvalidRequest

NS = bytes(range(16))
H = (b"\x01" * 32, b"\x02" * 32)
REQUESTS = [fr.LookupRequest(1, NS, H), fr.AcquireRequest(2, NS, H), fr.GetRequest(3, NS, H)]


@pytest.mark.parametrize("request_", REQUESTS, ids=lambda r: r.OP)
def test_absent_by_default_and_round_trips_as_a_bool(request_: fr.Message) -> None:
    assert "accept_lossy" not in request_.to_header()  # the frame an old daemon already reads
    decoded = fr.validate_request(request_.to_header())
    assert decoded == request_ and decoded.accept_lossy is None
    for value in (False, True):
        header = {**request_.to_header(), "accept_lossy": value}
        assert fr.validate_request(header).accept_lossy is value
        assert fr.validate_request(msgpack.unpackb(msgpack.packb(header))).to_header() == header


@pytest.mark.parametrize("value", [0, 1, "false", b"\x00", [False]])
def test_anything_but_a_bool_is_refused(value: object) -> None:
    with pytest.raises(InvalidRequest, match="accept_lossy"):
        fr.validate_request({**REQUESTS[0].to_header(), "accept_lossy": value})

"""wire_checks: the fast paths of the per-key checkers accept and refuse exactly what the
per-item checks do (lookup requests and responses carry hundreds of entries)."""

from __future__ import annotations

import pytest

from kvtier_protocol.errors import InvalidRequest, LimitExceeded
from kvtier_protocol.frame_codec import Limits
from kvtier_protocol.wire_checks import (EXISTS, MAX_HASH_LEN, MIN_HASH_LEN, TIER_NAMES, U64_MAX, _slot, array, binary,
                                         hashes, headers, slots, text, tiers)

LIMITS = Limits(max_batch=8, max_payload_len=1 << 20, max_header_len=4096)


class Bin(bytes):
    """A bytes subclass: not what msgpack yields, but the per-item check accepts it."""


@pytest.mark.parametrize("value", [
    [], [b"a" * 32] * 8, [b"a" * MIN_HASH_LEN, b"b" * MAX_HASH_LEN], (b"c" * 16,), [Bin(b"d" * 32)],
    [b"a" * 32] * 9, [b"a" * (MIN_HASH_LEN - 1)], [b"a" * 32, b"b" * (MAX_HASH_LEN + 1)], [b"a" * 32, "x" * 32],
    [None], [bytearray(32)], "abc", {b"a" * 32: 1}, [[b"a" * 32]],
])
def test_hashes_fast_path_agrees_with_per_item_checks(value) -> None:
    def reference():
        if not isinstance(value, (list, tuple)):
            raise InvalidRequest("not an array")
        if len(value) > LIMITS.max_batch:
            raise LimitExceeded("too many")
        return tuple(binary("hashes", h, MIN_HASH_LEN, MAX_HASH_LEN) for h in value)
    try:
        want = reference()
    except (InvalidRequest, LimitExceeded) as exc:
        with pytest.raises(type(exc)):
            hashes("hashes", value, LIMITS)
    else:
        assert hashes("hashes", value, LIMITS) == want


@pytest.mark.parametrize("value", [
    [], list(TIER_NAMES), ["host"] * 8, ["host"] * 9, ["HOST"], ["host", None], ["host", ["gpu"]],
    ["x" * 2000], [b"host"], "host",
])
def test_tiers_fast_path_agrees_with_per_item_checks(value) -> None:
    def reference():
        if not isinstance(value, (list, tuple)):
            raise InvalidRequest("not an array")
        if len(value) > LIMITS.max_batch:
            raise LimitExceeded("too many")
        out = tuple(text("tiers", v, LIMITS) for v in value)
        if any(t not in TIER_NAMES for t in out):
            raise InvalidRequest("unknown tier")
        return out
    try:
        want = reference()
    except (InvalidRequest, LimitExceeded) as exc:
        with pytest.raises(type(exc)):
            tiers("tiers", value, LIMITS)
    else:
        assert tiers("tiers", value, LIMITS) == want


def _agrees(check, reference, value) -> None:
    try:
        want = reference()
    except (InvalidRequest, LimitExceeded) as exc:
        with pytest.raises(type(exc)):
            check(value)
    else:
        got = check(value)
        assert got == want and type(got) is tuple


@pytest.mark.parametrize("value", [
    [], [[0, 0, 1]] * 8, [[0, 0, 1]] * 9, [[U64_MAX, U64_MAX, 1 << 20]], [[1, 4096, (1 << 20) + 1]],
    [[0, 0, 0]], [[-1, 0, 8]], [[0, -1, 8]], [[0, U64_MAX + 1, 8]], [[True, 0, 8]], [[0, 0, 8.0]],
    [[0, 0]], [[0, 0, 8, 0]], [(0, 0, 8)], [None, EXISTS, [2, 64, 8]], ["other"], [b"\x00"], "slots",
])
def test_slots_fast_path_agrees_with_per_item_checks(value) -> None:
    # Every reserve and acquire answer carries a slot per block: three ints take a fast path.
    def reference():
        return tuple(_slot("slots", v, LIMITS) for v in array("slots", value, LIMITS))
    _agrees(lambda v: slots("slots", v, LIMITS), reference, value)


@pytest.mark.parametrize("value", [
    [], [b"h" * 100] * 8, [b"h" * 100] * 9, [b"h", b"h" * 4096], [b""], [b"h" * 4097], [None, b"h"],
    [Bin(b"h")], [bytearray(b"h")], ["h"], "headers",
])
def test_headers_fast_path_agrees_with_per_item_checks(value) -> None:
    def reference():
        return tuple(None if h is None else binary("headers", h, 1, LIMITS.max_header_len)
                     for h in array("headers", value, LIMITS))
    _agrees(lambda v: headers("headers", v, LIMITS), reference, value)

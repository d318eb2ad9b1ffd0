"""wire_checks: the fast paths of the per-key checkers accept and refuse exactly what the
per-item checks do (lookup requests and responses carry hundreds of entries)."""

from __future__ import annotations

import pytest

from kvtier_protocol.errors import InvalidRequest, LimitExceeded
from kvtier_protocol.frame_codec import Limits
from kvtier_protocol.wire_checks import MAX_HASH_LEN, MIN_HASH_LEN, TIER_NAMES, binary, hashes, text, tiers

LIMITS = Limits(max_batch=8)


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

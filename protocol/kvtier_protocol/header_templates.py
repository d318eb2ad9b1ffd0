"""Byte templates of block header maps: a new header decoded by comparing bytes, not by validating.

The blocks of one stream (a namespace and block geometry) have header maps that differ only in
a few keys: their chain hash, parent, payload checksum and creation time (:data:`VARYING`). A
daemon committing thousands of blocks a second, or an engine loading them, would otherwise
validate every field of every header (~50 us each, a seventh of a 2 MiB block's copy here).

A template is the canonical msgpack bytes of a header map validated before, cut around the
values of its varying keys::

    body:      | 8e a2 ns c4 10 <ns> a4 hash | c4 20 <hash> | a6 parent | c0 | ... a4 csum | cf <u64> | ... |
    template:  |<-------- fixed[0] -------->| hash value  |<-fixed[1]->|parent|<- ... ->| csum     |<tail>|

A body matches when every fixed part is byte-identical and every varying value is a msgpack
scalar of the one type the full decode accepts for it, whose value passes that key's own check:
a bin8 hash of the learnt length, nil or a bin8 parent of that length, a uint checksum, nil or a
uint creation time. Each template is compiled to one regular expression over the whole body
(fixed parts literal, one group per varying value), so matching is one C-level pass; the bytes
after the last varying value (often the namespace map) are compared first, as one ``endswith``,
and the first bytes are the template's lookup key, so the pattern covers only what lies between. The fixed
bytes being identical means every other key decodes to the identical value, types included, in
the map the template was validated from; no rule of the full validation ties a varying key to
another key. So a match is exactly as valid as a full decode, without building one. Anything
else (another encoder's key order, a non-minimal integer, a duplicate key, a hash of another
length) simply does not match, and the caller decodes in full (and learns that stream too).

Torch-free and independent of the header modules, which own the headers themselves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack

T = TypeVar("T")

VARYING = ("hash", "parent", "csum", "created")
"""The header keys a template leaves open, in no particular order."""
ABSENT = object()
"""The value :meth:`TemplateCache.match` gives a varying key the template does not have."""

PREFIX_LEN = 24
"""Bytes of a body that name its templates: for kvtier's encoder, the map header, ``ns`` and its
16 bytes (keys are written in ``WIRE_KEYS`` order), so the namespace picks the candidates."""
MAX_PER_PREFIX = 8
"""Templates kept per prefix, the newest first (a namespace has a few block geometries)."""
MAX_PREFIXES = 1024


@dataclass(frozen=True, slots=True)
class _Template(Generic[T]):
    # The body is ``prefix + middle + tail``: the prefix is the lookup key (equal by the lookup),
    # the tail (the fixed bytes after the last varying value, often the namespace map) is compared
    # as one memcmp, and only the middle runs through the pattern: literal bytes cost the regular
    # expression engine an opcode each.
    pattern: re.Pattern[bytes]  # the middle: fixed parts literally, one named group per varying value
    tail: bytes
    standard: bool  # its groups are _STANDARD_GROUPS (kvtier's writers): match() unrolls those
    value: T  # what the template stands for (a validated header)


class TemplateCache(Generic[T]):
    """Templates learnt from validated header bodies, matched against new ones."""

    def __init__(self, min_hash: int, max_hash: int) -> None:
        self._min_hash = min_hash
        self._max_hash = max_hash
        self._by_prefix: dict[tuple[bytes, int], list[_Template[T]]] = {}

    def clear(self) -> None:
        self._by_prefix.clear()

    def __len__(self) -> int:
        return sum(map(len, self._by_prefix.values()))

    def match(self, body: bytes, limit: int) -> tuple[T, list[Any]] | None:
        """The template ``body`` matches under payload limit ``limit``, and its varying values in
        the order of :data:`VARYING` (:data:`ABSENT` for a key the template lacks); None when no
        template matches."""
        # Read-only (decoders run on several threads: the daemon's I/O pool, a client's callers);
        # a list that learn() changes meanwhile is at worst walked with one template more or less.
        for t in self._by_prefix.get((body[:PREFIX_LEN], limit), ()):
            end = len(body) - len(t.tail)
            if end < PREFIX_LEN or not body.endswith(t.tail):
                continue
            m = t.pattern.fullmatch(body, PREFIX_LEN, end)
            if m is None:
                continue
            if t.standard:  # kvtier's writers: unrolled, as this runs for every block committed
                chain, parent, c8, cx = m.groups()
                return t.value, [chain, parent, int.from_bytes(c8, "big") if c8 is not None else _uint_value(cx),
                                 ABSENT]
            return t.value, self._values(t, m)
        return None

    def learn(self, body: bytes, limit: int, value: T) -> bool:
        """Remember ``body`` (a header map the caller validated in full, with ``limit``) as the
        template of ``value``. False when it cannot be one: not canonical msgpack of a map
        (packing its decoded map gives other bytes), a varying key among its first bytes, a hash
        or parent outside the hash lengths, or a varying value its own template would refuse."""
        try:
            m = msgpack.unpackb(body, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            return False
        if type(m) is not dict or msgpack.packb(m, use_bin_type=True) != body:
            return False
        n = len(m)
        pos = 1 if n < 16 else 3 if n < 1 << 16 else 5  # fixmap / map16 / map32 header
        fixed: list[bytes] = []
        keys: list[str] = []
        start = 0
        for k, v in m.items():
            pos += len(msgpack.packb(k, use_bin_type=True))
            end = pos + len(msgpack.packb(v, use_bin_type=True))
            if k in VARYING:
                fixed.append(body[start:pos])
                keys.append(k)
                start = end
            pos = end
        assert pos == len(body), "a canonical map's items cover its body"
        if not fixed or len(fixed[0]) < PREFIX_LEN:
            return False
        tail = body[start:]
        chain, parent = m.get("hash"), m.get("parent")
        hash_len = len(chain) if isinstance(chain, bytes) else 0
        parent_len = len(parent) if isinstance(parent, bytes) else hash_len
        if not (self._min_hash <= hash_len <= self._max_hash and self._min_hash <= parent_len <= self._max_hash):
            return False
        # One regular expression per template: the body is then matched by one C-level pass.
        # A hash or parent of another length than the learnt one does not match (a full decode
        # then learns that length too): a scheme's chain hashes all have one length.
        parts = [re.escape(fixed[0][PREFIX_LEN:])]
        for i, k in enumerate(keys):
            if i:
                parts.append(re.escape(fixed[i]))
            parts.append(_value_pattern(k, hash_len, parent_len))
        pattern = re.compile(b"".join(parts), re.DOTALL)
        t = _Template(pattern, tail, pattern.groupindex == _STANDARD_GROUPS, value)
        if self._match(t, body) != [m.get(k, ABSENT) for k in VARYING]:
            return False  # a varying value in an encoding or of a type templates do not take
        key = (body[:PREFIX_LEN], limit)
        candidates = self._by_prefix.get(key)
        if candidates is None:
            if len(self._by_prefix) >= MAX_PREFIXES:
                self._by_prefix.clear()
            candidates = self._by_prefix[key] = []
        candidates.insert(0, t)
        del candidates[MAX_PER_PREFIX:]
        return True

    @classmethod
    def _match(cls, t: _Template[T], body: bytes) -> list[Any] | None:
        """``body``'s varying values (VARYING order) if it matches ``t``, whose prefix it has."""
        end = len(body) - len(t.tail)
        if end < PREFIX_LEN or not body.endswith(t.tail):
            return None
        m = t.pattern.fullmatch(body, PREFIX_LEN, end)
        return None if m is None else cls._values(t, m)

    @staticmethod
    def _values(t: _Template[T], m: re.Match[bytes]) -> list[Any]:
        """The varying values (VARYING order) of a match of ``t``."""
        got = m.groupdict()
        values = [got.get("hash", ABSENT), got.get("parent", ABSENT), ABSENT, ABSENT]
        if "c8" in got:
            values[2] = int.from_bytes(got["c8"], "big") if got["c8"] is not None else _uint_value(got["cx"])
        if "created" in got:
            values[3] = None if got["created"] is None else _uint_value(got["created"])
        return values


def _value_pattern(key: str, hash_len: int, parent_len: int) -> bytes:
    """The named group(s) that match every encoding of ``key``'s value that a template takes: only
    those whose decoded value has the type the full decode requires and passes that key's check
    there. A group holds the value's bytes (a nil parent or creation time leaves its group unset;
    a checksum is in ``c8`` when a uint 64, its usual encoding, else whole in ``cx``)."""
    if key == "hash":
        return re.escape(bytes((0xC4, hash_len))) + b"(?P<hash>.{%d})" % hash_len
    if key == "parent":
        return b"(?:\\xc0|" + re.escape(bytes((0xC4, parent_len))) + b"(?P<parent>.{%d}))" % parent_len
    if key == "csum":
        return b"(?:\\xcf(?P<c8>.{8})|(?P<cx>" + _SHORT_UINT_PATTERN + b"))"
    assert key == "created", "VARYING has four keys"
    return b"(?:\\xc0|(?P<created>" + _UINT_PATTERN + b"))"


_STANDARD_GROUPS = {"hash": 1, "parent": 2, "c8": 3, "cx": 4}
"""The groups of a template of ``WIRE_KEYS``-ordered headers without ``created``, by number."""
_SHORT_UINT_PATTERN = b"[\\x00-\\x7f]|\\xcc.|\\xcd.{2}|\\xce.{4}"
"""The msgpack encodings of an unsigned integer below 2**32: positive fixint, uint 8 / 16 / 32."""
_UINT_PATTERN = _SHORT_UINT_PATTERN + b"|\\xcf.{8}"
"""Every msgpack encoding of an unsigned integer: those and uint 64."""


def _uint_value(raw: bytes) -> int:
    return raw[0] if len(raw) == 1 else int.from_bytes(raw[1:], "big")

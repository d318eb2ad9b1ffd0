"""Decoding block headers (SPEC.md §4): the preamble, the msgpack map, and the two memos that keep
a daemon and an engine from validating the same header over and over. Torch-free.

Every decode checks, in this order and before allocating anything the bytes ask for: the
preamble (magic, version, flags, ``header_len`` against the limit), the map's xxh3-64, then the map
itself. A map is judged by one of three paths, all with the same outcome:

* **exact memo** (``_DECODED``): these exact header bytes were decoded before (a hot prefix's
  blocks are loaded again and again; a client checks the record it just encoded);
* **template** (:mod:`kvtier_protocol.header_templates`): another header of the same stream was
  decoded in full, and these bytes differ from it only in hash, parent, checksum and creation
  time, each checked on its own (for bytes that are exactly an uncompressed header, the case
  of every block a daemon commits, :func:`_templated` runs this path's checks in one line);
* **full decode**: msgpack with a duplicate-key check, every key's type, then
  :class:`~kvtier_protocol.header_types.BlockHeader`'s validation.

Callers import these from :mod:`kvtier_protocol.header`.
"""

from __future__ import annotations

import struct
from types import MappingProxyType
from typing import Any

import msgpack
import xxhash

from kvtier_protocol.compression import FLAG_COMPRESSED, Compression
from kvtier_protocol.errors import (BadMagic, ChecksumMismatch, HeaderError, LimitExceeded, ProtocolError,
                                    Truncated, UnsupportedVersion)
from kvtier_protocol.header_types import (DEFAULT_MAX_HEADER_LEN, DEFAULT_MAX_PAYLOAD_LEN, MAGIC, MAX_HASH_LEN,
                                    MIN_HASH_LEN, PREAMBLE, PREAMBLE_LEN, REQUIRED_KEYS, VERSION,
                                    WIRE_KEYS, BlockHeader, Section)
from kvtier_protocol.header_templates import ABSENT, TemplateCache
from kvtier_protocol.quant import QuantParams

_NONE = type(None)
_STR = frozenset((str,))
_U64 = (1 << 64) - 1


def parse_preamble(buf: bytes | bytearray | memoryview, *,
                   max_header_len: int = DEFAULT_MAX_HEADER_LEN) -> int:
    """Check the 20-byte preamble at the start of ``buf`` and return ``header_len``.

    A streaming reader reads 20 bytes, calls this, then reads ``header_len`` more.

    Raises:
        Truncated, BadMagic, UnsupportedVersion (version != 1, or a flag other than
        FLAG_COMPRESSED), LimitExceeded.
    """
    return _preamble(buf, max_header_len)[0]


def _preamble(buf: bytes | bytearray | memoryview, max_header_len: int) -> tuple[int, int, int]:
    """:func:`parse_preamble`, also returning the preamble's xxh3 of the header map and its flags."""
    if len(buf) < PREAMBLE_LEN:
        raise Truncated(f"record needs a {PREAMBLE_LEN}-byte preamble, got {len(buf)} bytes")
    magic, version, flags, header_len, map_xxh3 = PREAMBLE.unpack_from(buf)
    if magic != MAGIC:
        raise BadMagic(f"expected magic {MAGIC!r}, got {bytes(magic)!r}")
    if version != VERSION:
        raise UnsupportedVersion(f"block record version {version}; this reader speaks {VERSION}")
    if flags & ~FLAG_COMPRESSED:
        # A flag is only ever set for a feature that changes how the bytes are read (SPEC 4.1).
        raise UnsupportedVersion(f"block record flags 0x{flags:04x}; this reader knows only "
                                 f"0x{FLAG_COMPRESSED:04x} (compressed)")
    if header_len > max_header_len:
        raise LimitExceeded(f"header_len {header_len} > limit {max_header_len}")
    return header_len, map_xxh3, flags


def _no_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    # Two readers must never see two different values for one key (parser differentials).
    out = dict(pairs)
    if len(out) != len(pairs):
        raise HeaderError("duplicate key in a header map")
    return out


def _unpack(body: memoryview) -> Any:
    n = len(body)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, object_pairs_hook=_no_duplicates,
                               max_str_len=n, max_bin_len=n, max_array_len=n, max_map_len=n,
                               max_ext_len=n)
    except HeaderError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise HeaderError(f"header map is not valid msgpack: {type(e).__name__}: {e}") from None


def _get(m: dict[str, Any], key: str, types: type | tuple[type, ...]) -> Any:
    if key not in m:
        raise HeaderError(f"required header key {key!r} is missing")
    v = m[key]
    if not isinstance(v, types) or isinstance(v, bool):
        raise HeaderError(f"header key {key!r} has the wrong msgpack type ({type(v).__name__})")
    return v


_REQUIRED_SET = frozenset(REQUIRED_KEYS)
_WIRE_SET = frozenset(WIRE_KEYS)
_REQUIRED_TYPES = (("ns", bytes), ("hash", bytes), ("parent", (bytes, _NONE)), ("tokens", int),
                   ("layout", str), ("shape", list), ("dtype", str), ("codec", str), ("sections", list),
                   ("plen", int), ("csum_alg", str), ("csum", int), ("quant", (dict, _NONE)))
assert tuple(k for k, _ in _REQUIRED_TYPES) == REQUIRED_KEYS
_FAST_TYPES = frozenset((bytes, bytes, parent, int, str, list, str, str, list, int, str, int, quant)
                        for parent in (bytes, _NONE) for quant in (_NONE, dict))
"""Every combination of exact types of REQUIRED_KEYS, in order, that :func:`_get` accepts
(msgpack yields no subclasses): one C-level tuple compare checks a whole map."""


def _from_map(m: Any, max_payload_len: int) -> BlockHeader:
    if not isinstance(m, dict) or not (set(map(type, m)) <= _STR or all(isinstance(k, str) for k in m)):
        raise HeaderError("header must be a msgpack map with string keys")
    if not (m.keys() >= _REQUIRED_SET and tuple(map(type, map(m.__getitem__, REQUIRED_KEYS))) in _FAST_TYPES):
        for key, types in _REQUIRED_TYPES:
            _get(m, key, types)  # raises the error naming the first missing or mistyped key
    plen = m["plen"]
    if plen > max_payload_len:
        raise LimitExceeded(f"plen {plen} > limit {max_payload_len}")
    sections = []
    for s in m["sections"]:
        if not (isinstance(s, list) and len(s) == 3):
            raise HeaderError("each section must be an array [name, offset, length]")
        sections.append(Section(*s))
    quant = m["quant"]
    compression = m.get("compression")
    ns_fields = m.get("ns_fields")
    if ns_fields is not None and not isinstance(ns_fields, dict):
        raise HeaderError("ns_fields must be a map")
    return BlockHeader(
        ns_id=m["ns"], chain_hash=m["hash"], parent_hash=m["parent"], num_tokens=m["tokens"],
        layout=m["layout"], shape=tuple(m["shape"]), dtype=m["dtype"], codec=m["codec"],
        sections=tuple(sections), payload_len=plen, checksum=m["csum"], checksum_alg=m["csum_alg"],
        quant=QuantParams.from_wire(quant) if quant is not None else None,
        ns_fields=None if ns_fields is None else MappingProxyType(ns_fields), created_ms=m.get("created"),
        extra=() if m.keys() <= _WIRE_SET else tuple((k, v) for k, v in m.items() if k not in WIRE_KEYS),
        compression=None if compression is None else Compression.from_wire(compression))


def _byte_view(buf: bytes | bytearray | memoryview) -> memoryview:
    view = memoryview(buf)
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as e:
            raise ProtocolError(f"record buffer is not a contiguous byte buffer: {e}") from None
    return view


def decode_header(buf: bytes | bytearray | memoryview, *,
                  max_header_len: int = DEFAULT_MAX_HEADER_LEN,
                  max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN) -> tuple[BlockHeader, int]:
    """Decode and validate the header at the start of ``buf`` (which may hold more bytes).

    Lengths are checked against the limits before anything is allocated; ``max_payload_len`` also
    bounds the decoded tensor (``prod(shape) * dtype size``) so a tiny quantized payload cannot
    declare a huge tensor.

    Returns:
        The header and the offset of the payload in ``buf``.

    Raises:
        Truncated, BadMagic, UnsupportedVersion, LimitExceeded, ChecksumMismatch (header bytes),
        HeaderError. Nothing else.
    """
    if type(buf) is bytes and len(buf) - PREAMBLE_LEN <= max_header_len:
        # Exactly a header seen before (an acquire answer's headers, a client's own records'):
        # the memo's key, so its preamble and map were checked when the entry was made.
        known = _DECODED.get((buf, max_payload_len))
        if known is not None:
            return known, len(buf)
        if buf.startswith(_PLAIN_HEAD):
            h = _templated(buf, max_payload_len)
            if h is not None:
                return h, len(buf)
    view = buf if type(buf) is bytes else _byte_view(buf)  # bytes slice and unpack as they are
    header_len, expected, flags = _preamble(view, max_header_len)
    end = PREAMBLE_LEN + header_len
    if len(view) < end:
        raise Truncated(f"header needs {end} bytes, got {len(view)}")
    if type(buf) is bytes and len(buf) == end:
        key = (buf, max_payload_len)  # exactly a header, looked up above: no copy, no second lookup
    else:
        key = (bytes(view[:end]), max_payload_len)
        known = _DECODED.get(key)
        if known is not None:
            return known, end
    raw = key[0][PREAMBLE_LEN:]
    if xxhash.xxh3_64_intdigest(raw) != expected:
        raise ChecksumMismatch("header map bytes do not match the preamble's xxh3-64")
    hit = _TEMPLATES.match(raw, max_payload_len)
    if hit is not None:
        h = _specialize(*hit)
        memoisable = True  # templates are learnt from memoisable headers only, and h shares their values
    else:
        h = _from_map(_unpack(raw), max_payload_len)
        if h.decoded_len > max_payload_len:
            raise LimitExceeded(f"decoded tensor of {h.decoded_len} bytes > limit {max_payload_len}")
        if h.compression is not None and h.compression.raw_len > max_payload_len:
            raise LimitExceeded(f"decompressed payload of {h.compression.raw_len} bytes > limit {max_payload_len}")
        memoisable = _memoisable(h)
        if memoisable:
            _TEMPLATES.learn(raw, max_payload_len, _template(h))
    if bool(flags & FLAG_COMPRESSED) != (h.compression is not None):
        # Either way round a reader could take compressed bytes for the tensor's (SPEC 4.8).
        raise HeaderError("preamble flag 'compressed' and the header's compression key disagree")
    if memoisable:
        if len(_DECODED) >= _MAX_DECODED:
            _DECODED.clear()
        _DECODED[key] = h
    return h, end


def _templated(buf: bytes, max_payload_len: int) -> BlockHeader | None:
    """:func:`decode_header` of ``buf`` when it is exactly an uncompressed header (a commit's, an
    acquire answer's) of a learnt template, else None (the general path then decides, errors
    included). The general path's checks in one straight line, for the one case that runs per
    block committed: the preamble's magic, version and zero flags are ``_PLAIN_HEAD`` (checked by
    the caller, with ``header_len`` against the limit), ``header_len`` is the rest of ``buf``, the
    map's xxh3 matches, a template matches and, flags being zero, its header is uncompressed."""
    if len(buf) < PREAMBLE_LEN:
        return None
    header_len, expected = _LEN_XXH3.unpack_from(buf, _PLAIN_HEAD_LEN)
    if header_len != len(buf) - PREAMBLE_LEN:
        return None
    raw = buf[PREAMBLE_LEN:]
    if xxhash.xxh3_64_intdigest(raw) != expected:
        return None
    hit = _TEMPLATES.match(raw, max_payload_len)
    if hit is None or hit[0][0].compression is not None:
        return None
    h = _specialize(*hit)
    if len(_DECODED) >= _MAX_DECODED:
        _DECODED.clear()
    _DECODED[(buf, max_payload_len)] = h
    return h


_PLAIN_HEAD = PREAMBLE.pack(MAGIC, VERSION, 0, 0, 0)[:8]
"""A preamble's magic, version and flags when no flag is set: a record the general path reads."""
_PLAIN_HEAD_LEN = len(_PLAIN_HEAD)
_LEN_XXH3 = struct.Struct("<IQ")
"""The preamble's ``header_len`` and xxh3 of the map, after ``_PLAIN_HEAD``."""
assert PREAMBLE.format == "<4sHHIQ" and PREAMBLE.size == _PLAIN_HEAD_LEN + _LEN_XXH3.size


def _memoisable(h: BlockHeader) -> bool:
    """Wholly immutable, so safe to hand to every caller: ns_fields is a read-only view, kept only
    when its values are scalars (what Namespace.to_wire() writes; the connectors' headers all
    carry it, and they are the blocks loaded again and again)."""
    return not h.extra and (h.ns_fields is None or all(type(v) in _SCALARS for v in h.ns_fields.values()))


def _specialize(template: tuple[BlockHeader, tuple[Any, ...]], values: list[Any]) -> BlockHeader:
    """A header like ``template`` with the varying values (``VARYING`` order: hash, parent, csum,
    created) of a header that matched it (:mod:`kvtier_protocol.header_templates`), without
    ``BlockHeader()``'s validation: the template vouches for every other field and the matcher
    checked these.

    Built as a :class:`_Unfrozen` (plain slot stores, which the interpreter specialises) and then
    made a BlockHeader by ``__class__`` assignment, which Python allows between classes of the
    same slots: a third of the cost of storing through the frozen class's slot descriptors
    (~0.5 against ~1.5 us), and this runs for every block a daemon commits.
    """
    (ns_id, num_tokens, layout, shape, dtype, codec, sections, payload_len, checksum_alg, quant, ns_fields,
     extra, compression) = template[1]
    chain, parent, csum, created = values
    h = _new(_Unfrozen)
    h.ns_id = ns_id
    h.chain_hash = chain
    h.parent_hash = parent
    h.num_tokens = num_tokens
    h.layout = layout
    h.shape = shape
    h.dtype = dtype
    h.codec = codec
    h.sections = sections
    h.payload_len = payload_len
    h.checksum = csum
    h.checksum_alg = checksum_alg
    h.quant = quant
    h.ns_fields = ns_fields
    h.created_ms = None if created is ABSENT else created
    h.extra = extra
    h.compression = compression
    h.__class__ = BlockHeader
    return h


class _Unfrozen:
    """BlockHeader's slots, with plain attribute stores: what :func:`_specialize` fills."""

    __slots__ = BlockHeader.__slots__


def _template(h: BlockHeader) -> tuple[BlockHeader, tuple[Any, ...]]:
    """What a template of ``h`` keeps: ``h``, and the values of the slots it fixes (the order
    :func:`_specialize` unpacks)."""
    return h, tuple(getattr(h, name) for name in _TEMPLATE_SLOTS)


_TEMPLATE_SLOTS = ("ns_id", "num_tokens", "layout", "shape", "dtype", "codec", "sections", "payload_len",
                   "checksum_alg", "quant", "ns_fields", "extra", "compression")
"""The fields a template fixes, in the order :func:`_specialize` unpacks them; the others vary."""
assert set(BlockHeader.__slots__) == set(BlockHeader.__dataclass_fields__) == {
    *_TEMPLATE_SLOTS, "chain_hash", "parent_hash", "checksum", "created_ms"}, \
    "BlockHeader is a slots dataclass, and _specialize sets each of its slots"
_new = object.__new__
_DECODED: dict[tuple[bytes, int], BlockHeader] = {}
"""Headers decoded and validated before, by their exact bytes (preamble included, so its xxh3 too)
and payload limit: the result is a function of those alone, and a hot prefix's blocks are loaded
again and again (each decode costs tens of µs of validation, ~10 % of a 2 MiB block's copy)."""
_MAX_DECODED = 8192
_TEMPLATES: TemplateCache[tuple[BlockHeader, tuple[Any, ...]]] = TemplateCache(MIN_HASH_LEN, MAX_HASH_LEN)
"""Validated headers as byte templates of the headers of the same stream (header_templates)."""
_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


def split_record(buf: bytes | bytearray | memoryview, *,
                 max_header_len: int = DEFAULT_MAX_HEADER_LEN,
                 max_payload_len: int = DEFAULT_MAX_PAYLOAD_LEN) -> tuple[BlockHeader, memoryview]:
    """Split one whole record into its header and a zero-copy view of its payload (unverified).

    Raises:
        What :func:`decode_header` raises; Truncated if the payload is short; HeaderError if bytes
        follow the payload.
    """
    h, off = decode_header(buf, max_header_len=max_header_len, max_payload_len=max_payload_len)
    view = _byte_view(buf)
    end = off + h.payload_len
    if len(view) < end:
        raise Truncated(f"record needs {end} bytes, got {len(view)}")
    if len(view) > end:
        raise HeaderError(f"{len(view) - end} bytes follow the payload the header declares")
    return h, view[off:end]

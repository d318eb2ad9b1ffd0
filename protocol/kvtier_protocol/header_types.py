"""The block header's types and rules (SPEC.md §4): the record's constants, :class:`Section` and
:class:`BlockHeader`, whose construction validates every field. Torch-free.

The base of the header modules: :mod:`kvtier_protocol.header_decode` decodes into these types,
:mod:`kvtier_protocol.header` encodes them and is where callers import all of it from.
"""

from __future__ import annotations

import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier_protocol.compression import Compression, check_against_sections
from kvtier_protocol.dtypes import check_dtype, dtype_size
from kvtier_protocol.errors import HeaderError, LayoutError
from kvtier_protocol.layouts import get_layout
from kvtier_protocol.quant import QuantParams

MAGIC = b"KVT1"
VERSION = 1
PREAMBLE = struct.Struct("<4sHHIQ")
PREAMBLE_LEN = PREAMBLE.size  # 20
CHECKSUM_ALG = "xxh3-64"
NS_ID_LEN = 16
MIN_HASH_LEN, MAX_HASH_LEN = 8, 64
MAX_SECTIONS = 16
MAX_NAME_LEN = 32
DEFAULT_MAX_HEADER_LEN = 64 * 1024
DEFAULT_MAX_PAYLOAD_LEN = 1 << 30
_U64 = (1 << 64) - 1
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]*\Z")
_INT = frozenset((int,))

REQUIRED_KEYS = ("ns", "hash", "parent", "tokens", "layout", "shape", "dtype", "codec",
                 "sections", "plen", "csum_alg", "csum", "quant")
OPTIONAL_KEYS = ("ns_fields", "created", "compression")
WIRE_KEYS = REQUIRED_KEYS + OPTIONAL_KEYS
"""Every key v1 defines, in the order writers emit them; future keys go after these."""


@dataclass(frozen=True, slots=True)
class Section:
    """A named byte range of the payload (offset relative to the payload start)."""

    name: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlockHeader:
    """The decoded header map of one block record. Constructing one validates it (HeaderError).

    Attributes:
        ns_id: the namespace id, 16 bytes.
        chain_hash: the block's chain hash, 8..64 bytes (the key is ``ns_id || chain_hash``).
        parent_hash: the previous block's chain hash, or None for the first block of a prefix.
        num_tokens: tokens in the block; equals ``shape[layout.token_axis]``.
        layout: the layout name of the decoded tensor (``kvtier_protocol.layouts.LAYOUTS``).
        shape: the decoded tensor's shape in ``layout``.
        dtype: the decoded tensor's dtype name (``kvtier_protocol.dtypes.DTYPE_SIZES``).
        codec: how the payload encodes the tensor: ``"raw"`` or a quantizing codec.
        sections: the payload's sections, contiguous from offset 0, covering the payload.
        payload_len: payload bytes (``plen``).
        checksum: xxh3-64 (seed 0) of the payload.
        checksum_alg: always ``"xxh3-64"`` in v1.
        quant: the quantization parameters; None for ``raw``.
        ns_fields: optionally, the full namespace map (``Namespace.to_wire()``), for inspection.
        created_ms: optionally, when the block was encoded, Unix time in milliseconds.
        extra: keys this implementation does not know, in their original order, kept so that a
            decoded header re-encodes byte-identically.
        compression: the lossless stage the payload's sections went through after the codec
            (``kvtier_protocol.compression``, SPEC.md §4.8), or None. When set, ``sections``,
            ``payload_len`` and ``checksum`` describe the stored (compressed) bytes, and the
            record's preamble carries flag bit 0.
    """

    ns_id: bytes
    chain_hash: bytes
    parent_hash: bytes | None
    num_tokens: int
    layout: str
    shape: tuple[int, ...]
    dtype: str
    codec: str
    sections: tuple[Section, ...]
    payload_len: int
    checksum: int
    checksum_alg: str = CHECKSUM_ALG
    quant: QuantParams | None = None
    ns_fields: Mapping[str, Any] | None = None
    created_ms: int | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    compression: Compression | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def decoded_len(self) -> int:
        """Bytes of the decoded tensor: ``prod(shape) * dtype size``."""
        return math.prod(self.shape) * dtype_size(self.dtype)

    def section(self, name: str) -> Section:
        """The section called ``name``.

        Raises:
            HeaderError: no such section.
        """
        for s in self.sections:
            if s.name == name:
                return s
        raise HeaderError(f"header has no section {name!r}")


def _is_int(v: object, lo: int = 0, hi: int = _U64) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


def _check_name(what: str, v: object) -> None:
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_NAME_LEN or not _NAME.match(v):
        raise HeaderError(f"{what} must match [a-z0-9][a-z0-9_.-]* (<= {MAX_NAME_LEN} chars), got {v!r}")


def _check_hash(what: str, v: object) -> None:
    if not isinstance(v, bytes) or not MIN_HASH_LEN <= len(v) <= MAX_HASH_LEN:
        raise HeaderError(f"{what} must be {MIN_HASH_LEN}..{MAX_HASH_LEN} bytes, got {v!r:.80}")


_TOKEN_AXES: dict[tuple[str, tuple[int, ...]], int] = {}
_MAX_CACHED_SHAPES = 1024


def _token_axis(layout_name: str, shape: tuple[Any, ...]) -> int:
    """Check ``shape`` against the layout; its token axis. Valid (layout, shape) pairs are
    memoised: a process sees a handful of block shapes, and the check runs on every header."""
    cache_key = (layout_name, shape)
    if set(map(type, shape)) <= _INT:  # hashable, and bools never alias ints in the cache
        axis = _TOKEN_AXES.get(cache_key)
        if axis is not None:
            return axis
    try:
        layout = get_layout(layout_name)
        layout.geometry_of(shape)
    except LayoutError as e:
        raise HeaderError(f"bad layout or shape: {e.message}") from None
    if set(map(type, shape)) <= _INT:
        if len(_TOKEN_AXES) >= _MAX_CACHED_SHAPES:
            _TOKEN_AXES.clear()
        _TOKEN_AXES[cache_key] = layout.token_axis
    return layout.token_axis


def _validate(h: BlockHeader) -> None:
    """Check every field of a header and the rules that tie them together."""
    if not isinstance(h.ns_id, bytes) or len(h.ns_id) != NS_ID_LEN:
        raise HeaderError(f"ns must be {NS_ID_LEN} bytes, got {h.ns_id!r:.80}")
    _check_hash("hash", h.chain_hash)
    if h.parent_hash is not None:
        _check_hash("parent", h.parent_hash)
    if not isinstance(h.layout, str):
        raise HeaderError(f"layout must be a string, got {h.layout!r:.80}")
    if not isinstance(h.shape, tuple):
        raise HeaderError("shape must be a tuple")
    token_axis = _token_axis(h.layout, h.shape)
    if not _is_int(h.num_tokens) or h.num_tokens != h.shape[token_axis]:
        raise HeaderError(f"tokens {h.num_tokens!r} != token axis of shape {h.shape} ({h.layout})")
    check_dtype(h.dtype)
    _check_name("codec", h.codec)
    if h.quant is not None and not isinstance(h.quant, QuantParams):
        raise HeaderError("quant must be QuantParams or None")
    if h.codec == "raw" and h.quant is not None:
        raise HeaderError("codec raw takes no quant parameters")
    if not _is_int(h.payload_len, 0, (1 << 63) - 1):
        raise HeaderError(f"plen must be an integer in [0, 2^63), got {h.payload_len!r}")
    _validate_sections(h)
    if h.checksum_alg != CHECKSUM_ALG:
        raise HeaderError(f"csum_alg must be {CHECKSUM_ALG!r}, got {h.checksum_alg!r:.80}")
    if not _is_int(h.checksum):
        raise HeaderError(f"csum must be a u64, got {h.checksum!r}")
    if h.ns_fields is not None and (not isinstance(h.ns_fields, Mapping)
                                    or not all(isinstance(k, str) for k in h.ns_fields)):
        raise HeaderError("ns_fields must be a map with string keys")
    if h.created_ms is not None and not _is_int(h.created_ms):
        raise HeaderError(f"created must be a u64 (ms since the Unix epoch), got {h.created_ms!r}")
    if not isinstance(h.extra, tuple):
        raise HeaderError("extra must be a tuple of (key, value) pairs")
    for item in h.extra:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)) or item[0] in WIRE_KEYS:
            raise HeaderError(f"extra entries must be (unknown string key, value), got {item!r:.80}")


def _validate_sections(h: BlockHeader) -> None:
    if not isinstance(h.sections, tuple) or not 1 <= len(h.sections) <= MAX_SECTIONS:
        raise HeaderError(f"sections must be a tuple of 1..{MAX_SECTIONS} Section")
    end, names = 0, set()
    for s in h.sections:
        if not isinstance(s, Section):
            raise HeaderError("sections must hold Section values")
        _check_name("section name", s.name)
        if s.name in names:
            raise HeaderError(f"duplicate section {s.name!r}")
        names.add(s.name)
        if not _is_int(s.offset) or not _is_int(s.length) or s.offset != end:
            raise HeaderError(f"section {s.name!r} must start at {end} (sections are contiguous)")
        end += s.length
    if end != h.payload_len:
        raise HeaderError(f"sections cover {end} bytes, plen is {h.payload_len}")
    raw_len = h.payload_len
    if h.compression is not None:
        if not isinstance(h.compression, Compression):
            raise HeaderError("compression must be Compression or None")
        check_against_sections(h.compression, [s.length for s in h.sections])
        raw_len = h.compression.raw_len  # the codec's rules apply to the sections before compression
    if h.codec == "raw" and (h.sections[0].name != "payload" or len(h.sections) != 1
                             or raw_len != h.decoded_len):
        raise HeaderError(f"codec raw needs one section 'payload' of prod(shape)*dtype size = "
                          f"{h.decoded_len} bytes")

"""The lossless compression stage of a block record: byte shuffle + LZ4, per section (SPEC.md §4.8).

Torch-free. A record is compressed after its codec ran (any codec, raw included): each payload
section is stored either verbatim or as one LZ4 block (the block format, no frame, no size prefix)
of the section's bytes **byte-shuffled** with a stride (the size of the section's elements: byte
0 of every element, then byte 1, ...; the exponent bytes of bfloat16 KV or of float16 scales then
sit together, which is what LZ4 finds). The header says so twice: preamble flag bit 0
(:data:`FLAG_COMPRESSED`), which every reader that predates the stage refuses
(``unsupported_version``), so none of them can take compressed bytes for the tensor's; and the
optional key ``compression`` with, per section, the stride (0 = stored verbatim) and the length
before compression. ``plen``, ``sections`` and ``csum`` describe the stored bytes, so a record is
verified and moved between tiers without decompressing it.

Opt-in: ``kvtier bench codecs`` measures ratio and speed per codec; on KV it rarely pays for the
quantized codecs (their codes are near-random bytes), and it is for the tiers where bytes cost
more than CPU (network) to turn on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import lz4.block

from kvtier_protocol.errors import CodecError, HeaderError

try:
    from kvtier_protocol import _codecs
except ImportError:  # not built: numpy's transpose does the shuffle
    _codecs = None

ALGORITHMS = ("lz4",)
"""Compression algorithms of format version 1 (``compression.alg``)."""
FLAG_COMPRESSED = 0x0001
"""Preamble flag bit set exactly when the header carries ``compression``."""
MAX_STRIDE = 64
"""Largest shuffle stride a reader accepts (element sizes are 1..8)."""
MIN_SAVING = 1 / 32
"""A writer stores a section verbatim unless LZ4 saves at least this fraction of it: below that,
the decode time is not worth the bytes."""
_U63 = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Compression:
    """The header's ``compression`` map.

    Attributes:
        alg: the algorithm, ``"lz4"``.
        sections: per entry of the header's ``sections``, in the same order: ``(stride, raw_len)``:
            stride 0 means stored verbatim (``raw_len`` equals the stored length); stride >= 1 means
            one LZ4 block that decompresses to exactly ``raw_len`` bytes, the section shuffled with
            that stride (1: not shuffled), ``raw_len`` a multiple of it.
    """

    alg: str
    sections: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.alg, str) or not 1 <= len(self.alg) <= 32:
            raise HeaderError(f"compression.alg must be a short string, got {self.alg!r:.80}")
        if not isinstance(self.sections, tuple):
            raise HeaderError("compression.sections must be a tuple")
        for entry in self.sections:
            if not (isinstance(entry, tuple) and len(entry) == 2 and all(_is_int(v) for v in entry)):
                raise HeaderError(f"compression.sections entries must be [stride, raw_len], got {entry!r:.80}")
            stride, raw_len = entry
            if stride > MAX_STRIDE or raw_len > _U63 or (stride and raw_len % stride):
                raise HeaderError(f"compression section [stride {stride}, raw_len {raw_len}]: stride must be "
                                  f"0..{MAX_STRIDE} and divide raw_len")

    @property
    def raw_len(self) -> int:
        """Bytes of the payload once decompressed."""
        return sum(n for _, n in self.sections)

    def to_wire(self) -> dict[str, Any]:
        """The header's ``compression`` map, keys in a fixed order (SPEC.md §4.8)."""
        return {"alg": self.alg, "sections": [[s, n] for s, n in self.sections]}

    @classmethod
    def from_wire(cls, m: Any) -> "Compression":
        """Parse an untrusted ``compression`` map (unknown keys ignored; wrong types: HeaderError)."""
        if not isinstance(m, Mapping) or "alg" not in m or "sections" not in m:
            raise HeaderError("compression must be a map with alg and sections")
        secs = m["sections"]
        if not isinstance(secs, list):
            raise HeaderError("compression.sections must be an array")
        out = []
        for e in secs:
            if not (isinstance(e, list) and len(e) == 2):
                raise HeaderError("compression.sections entries must be [stride, raw_len]")
            out.append(tuple(e))
        return cls(m["alg"], tuple(out))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_against_sections(c: Compression, lengths: Sequence[int]) -> None:
    """The rules that tie ``compression`` to the header's stored section lengths.

    Raises:
        HeaderError: not one entry per section, or a verbatim section whose raw_len differs.
    """
    if len(c.sections) != len(lengths):
        raise HeaderError(f"compression lists {len(c.sections)} sections, the header {len(lengths)}")
    for (stride, raw_len), stored in zip(c.sections, lengths):
        if stride == 0 and raw_len != stored:
            raise HeaderError(f"a verbatim section's raw_len {raw_len} != its stored length {stored}")


def shuffle(buf: Any, stride: int) -> bytes | memoryview:
    """Byte shuffle: ``n/stride`` elements of ``stride`` bytes, transposed (all bytes 0, then all 1, ...)."""
    view = memoryview(buf).cast("B")
    if stride == 1:
        return view
    out = bytearray(view.nbytes)
    if _codecs is not None:
        _codecs.shuffle(view, out, stride, False)
    else:
        import numpy as np  # only where the C loop is not built: the header path stays numpy-free

        np.frombuffer(out, np.uint8).reshape(stride, -1)[:] = np.frombuffer(view, np.uint8).reshape(-1, stride).T
    return memoryview(out)


def unshuffle(buf: Any, stride: int, out: Any) -> None:
    """Inverse of :func:`shuffle`, into ``out`` (writable, same length)."""
    if stride == 1:
        memoryview(out).cast("B")[:] = memoryview(buf).cast("B")
    elif _codecs is not None:
        _codecs.shuffle(buf, out, stride, True)
    else:
        import numpy as np  # as in shuffle

        np.frombuffer(out, np.uint8).reshape(-1, stride)[:] = np.frombuffer(buf, np.uint8).reshape(stride, -1).T


def compress_sections(parts: Sequence[Any], strides: Sequence[int], *,
                      min_saving: float = MIN_SAVING) -> tuple[list[Any], Compression]:
    """Compress each section (a bytes-like) with its stride; store it verbatim where LZ4 saves less
    than ``min_saving`` of it. Returns the stored sections and the header's ``compression``."""
    stored, entries = [], []
    for part, stride in zip(parts, strides):
        view = memoryview(part).cast("B")
        n = view.nbytes
        packed = lz4.block.compress(shuffle(view, stride), store_size=False) if n and n % stride == 0 else None
        if packed is not None and len(packed) <= n * (1 - min_saving):
            stored.append(packed)
            entries.append((stride, n))
        else:
            stored.append(view)
            entries.append((0, n))
    return stored, Compression("lz4", tuple(entries))


def decompress_sections(c: Compression, stored: Sequence[Any]) -> list[memoryview]:
    """The sections as they were before compression, each a fresh writable buffer or the stored view.

    Raises:
        CodecError: an unknown algorithm, or a section that is not a valid LZ4 block of exactly
            its ``raw_len`` bytes.
    """
    if c.alg not in ALGORITHMS:
        raise CodecError(f"unknown compression {c.alg!r}; expected one of {ALGORITHMS}")
    out = []
    for (stride, raw_len), part in zip(c.sections, stored):
        if stride == 0:
            out.append(memoryview(part).cast("B"))
            continue
        try:
            plain = lz4.block.decompress(part, uncompressed_size=raw_len) if raw_len else b""
        except (lz4.block.LZ4BlockError, ValueError) as e:
            raise CodecError(f"a compressed section does not decompress: {e}") from None
        if len(plain) != raw_len:
            raise CodecError(f"a compressed section decompresses to {len(plain)} bytes, expected {raw_len}")
        if stride == 1:
            out.append(memoryview(plain))
        else:
            buf = bytearray(raw_len)
            unshuffle(plain, stride, buf)
            out.append(memoryview(buf))
    return out


__all__ = ["ALGORITHMS", "FLAG_COMPRESSED", "MAX_STRIDE", "MIN_SAVING", "Compression", "check_against_sections",
           "compress_sections", "decompress_sections", "shuffle", "unshuffle"]

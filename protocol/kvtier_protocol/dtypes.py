"""Element type names of the wire format (SPEC.md §6.1). Torch-free.

A block header names the element type of the decoded tensor with one of the strings of
:data:`DTYPE_SIZES`. The names are torch's attribute names (``torch.bfloat16``, ...), so the torch
side maps them with ``getattr(torch, name)``; other languages map them by this table.
"""

from __future__ import annotations

from kvtier_protocol.errors import KVTierError, HeaderError

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Every dtype name a v1 header may carry, with its element size in bytes. Fixed for version 1."""

FLOAT_DTYPES = frozenset({"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
"""The names whose elements are floating point (the quantizing codecs accept only these)."""


def check_dtype(name: object, error: type[KVTierError] = HeaderError) -> str:
    """Return ``name`` if it is a known dtype name, else raise ``error``.

    Args:
        name: the value to check (untrusted: may be any msgpack value).
        error: the exception class to raise; HeaderError for headers, CodecError for codecs.

    Raises:
        KVTierError: ``error`` when ``name`` is not a string of :data:`DTYPE_SIZES`.
    """
    if not isinstance(name, str) or name not in DTYPE_SIZES:
        raise error(f"unknown dtype {name!r}; expected one of {sorted(DTYPE_SIZES)}")
    return name


def dtype_size(name: object, error: type[KVTierError] = HeaderError) -> int:
    """Element size in bytes of a dtype name.

    Raises:
        KVTierError: ``error`` (HeaderError by default) for an unknown name.
    """
    return DTYPE_SIZES[check_dtype(name, error)]

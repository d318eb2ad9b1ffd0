"""Input generation of `kvtier bench fuzz`: random bytes, byte-level mutations of golden vectors,
and structure-aware mutations that decode a vector's msgpack / JSON / TOML, change the decoded
value and encode it again with valid lengths and checksums, so that a mutation reaches the
validators behind the framing instead of dying at the first length or checksum check.

Everything draws from one :class:`random.Random`, so a run is reproducible from its seed.
"""

from __future__ import annotations

import json
import math
import random
import struct
from collections.abc import Callable
from typing import Any

import msgpack

INTERESTING_INTS = (0, 1, -1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096, 0x7FFF,
                    0x8000, 0xFFFF, 0x10000, (1 << 20) + 1, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
                    1 << 53, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -(1 << 31), -(1 << 63))
HUGE_INT = 10**400  # beyond float and msgpack: JSON and TOML carry it (pack() clamps it)
INTERESTING_FLOATS = (0.0, -0.0, 0.5, 1e-300, 1e300, math.inf, -math.inf, math.nan)
INTERESTING_TEXT = ("", "a", "raw", "canonical", "mla-latent", "vllm-nhc", "bfloat16", "float8_e4m3fn", "int4",
                    "fp8_e4m3", "payload", "scales", "mins", "rope", "channel", "token", "float16", "float32",
                    "xxh3-64", "exists", "stored", "host", "disk", "BlockStored", "BlockRemoved",
                    "AllBlocksCleared", "mha", "mla", "\x00", "\ud800", "é" * 40, "x" * 2000, "..", "/", "@")
WIDTHS = (1, 2, 4, 8)
Mutation = Callable[[random.Random, Any], Any]


def random_bytes(rng: random.Random, max_len: int = 512) -> bytes:
    """Random bytes of a length skewed towards short inputs (most parsers fail early on them)."""
    n = min(max_len, int(rng.expovariate(1 / 48)))
    return rng.randbytes(n)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value: scalars of every type, boundary values, nested containers."""
    r = rng.random()
    if depth > 3 or r < 0.30:
        return rng.choice(INTERESTING_INTS)
    if r < 0.40:
        return rng.choice(INTERESTING_FLOATS)
    if r < 0.55:
        return rng.choice(INTERESTING_TEXT)
    if r < 0.65:
        return rng.randbytes(rng.choice((0, 1, 7, 8, 15, 16, 17, 31, 32, 33, 64, 65, 300)))
    if r < 0.72:
        return rng.choice((None, True, False))
    if r < 0.86:
        return [random_value(rng, depth + 1) for _ in range(rng.choice((0, 1, 2, 3, 5, 17)))]
    return {rng.choice(INTERESTING_TEXT[:30]): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def nested(rng: random.Random) -> Any:
    """A deeply nested array or map: parser recursion limits are a classic crash."""
    value: Any = rng.choice(INTERESTING_INTS)
    for _ in range(rng.choice((8, 64, 200, 600, 3000))):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def mutate_value(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """One structural change somewhere inside ``value`` (a decoded msgpack/JSON document)."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        out = dict(value)
        key = rng.choice(list(out))
        r = rng.random()
        if r < 0.15:
            del out[key]
        elif r < 0.25:
            out[rng.choice(INTERESTING_TEXT[:30])] = random_value(rng)
        elif r < 0.55 and depth < 6:
            out[key] = mutate_value(rng, out[key], depth + 1)
        elif r < 0.60:
            out[key] = nested(rng)
        else:
            out[key] = random_value(rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.8:
        out_list = list(value)
        i = rng.randrange(len(out_list))
        r = rng.random()
        if r < 0.15:
            del out_list[i]
        elif r < 0.25:
            out_list.insert(i, random_value(rng))
        elif r < 0.32:
            out_list.extend(out_list[i:i + 1] * rng.choice((1, 2, 100)))
        elif r < 0.65 and depth < 6:
            out_list[i] = mutate_value(rng, out_list[i], depth + 1)
        else:
            out_list[i] = random_value(rng)
        return out_list
    if isinstance(value, bool) or value is None:
        return random_value(rng)
    if isinstance(value, int) and rng.random() < 0.6:
        return rng.choice((value + 1, value - 1, -value, value * 2, value // 2, HUGE_INT, *INTERESTING_INTS[-8:]))
    if isinstance(value, (bytes, str)) and value and rng.random() < 0.5:
        cut = rng.randrange(len(value) + 1)
        return value[:cut] if rng.random() < 0.5 else value + value[:cut]
    return random_value(rng)


# --- byte-level mutations ------------------------------------------------------------------------


def _flip(rng: random.Random, b: bytearray) -> None:
    if b:
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)


def _set_byte(rng: random.Random, b: bytearray) -> None:
    if b:
        b[rng.randrange(len(b))] = rng.choice((0, 1, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF,
                                                0xC4, 0xC6, 0xD9, 0xDB, 0xD4, 0xC7, rng.randrange(256)))


def _set_int(rng: random.Random, b: bytearray) -> None:
    width = rng.choice(WIDTHS)
    if len(b) < width:
        return
    value = rng.choice(INTERESTING_INTS) % (1 << (8 * width))
    order = "<" if rng.random() < 0.7 else ">"
    fmt = order + {1: "B", 2: "H", 4: "I", 8: "Q"}[width]
    struct.pack_into(fmt, b, rng.randrange(len(b) - width + 1), value)


def _insert(rng: random.Random, b: bytearray) -> None:
    at = rng.randrange(len(b) + 1)
    b[at:at] = rng.randbytes(rng.choice((1, 2, 4, 8, 33)))


def _delete(rng: random.Random, b: bytearray) -> None:
    if b:
        at = rng.randrange(len(b))
        del b[at:at + rng.choice((1, 2, 4, 16, 1 << 20))]


def _duplicate(rng: random.Random, b: bytearray) -> None:
    if b:
        at = rng.randrange(len(b))
        chunk = b[at:at + rng.choice((1, 4, 32, 256))]
        b[at:at] = chunk * rng.choice((1, 2, 16))


def _truncate(rng: random.Random, b: bytearray) -> None:
    del b[rng.randrange(len(b) + 1):]


BYTE_MUTATIONS = (_flip, _flip, _set_byte, _set_int, _set_int, _insert, _delete, _duplicate, _truncate)


def mutate_bytes(rng: random.Random, data: bytes, other: bytes = b"") -> bytes:
    """One to four byte-level mutations of ``data``; sometimes spliced with ``other``."""
    b = bytearray(data)
    if other and rng.random() < 0.1:
        b = b[:rng.randrange(len(b) + 1)] + other[rng.randrange(len(other) + 1):]
    for _ in range(rng.choice((1, 1, 1, 2, 3, 4))):
        rng.choice(BYTE_MUTATIONS)(rng, b)
    return bytes(b)


# --- structured containers ------------------------------------------------------------------------


def _clamp(value: Any, depth: int = 0) -> Any:
    if isinstance(value, bool) or depth > 3000:
        return value
    if isinstance(value, int):
        return max(-(1 << 63), min(value, (1 << 64) - 1))
    if isinstance(value, list):
        return [_clamp(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {k: _clamp(v, depth + 1) for k, v in value.items()}
    return value


def pack(value: Any) -> bytes:
    """msgpack with bin types; integers msgpack cannot hold are clamped to its range."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        return msgpack.packb(_clamp(value), use_bin_type=True)
    except (TypeError, ValueError, OverflowError, RecursionError):
        return msgpack.packb(None)


def unpack_trusted(data: bytes) -> Any:
    """Decode a golden vector's own msgpack (trusted bytes: a failure is a bug of the harness)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def dump_json(rng: random.Random, value: Any) -> bytes:
    """JSON text of ``value``; bytes become hex, and sometimes the text is broken on purpose."""
    def default(o: Any) -> Any:
        return o.hex() if isinstance(o, bytes) else str(o)
    try:
        text = json.dumps(value, default=default, allow_nan=True)
    except (ValueError, RecursionError):
        text = "[]"
    if rng.random() < 0.1:
        text = text[:rng.randrange(len(text) + 1)]
    return text.encode("utf-8", "surrogatepass")


def _toml_scalar(value: Any, depth: int = 0) -> str:
    if depth > 50:
        return "0"  # deep nesting comes from deep_toml, written as text
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return repr(value)
    if isinstance(value, (bytes, bytearray)):
        value = value.hex()
    if isinstance(value, list):
        return "[" + ", ".join(_toml_scalar(v, depth + 1) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_scalar(v, depth + 1)}" for k, v in value.items()) + "}"
    if value is None:
        return '"off"'
    return json.dumps(str(value), ensure_ascii=False)


def dump_toml(doc: dict[str, Any]) -> bytes:
    """A TOML document of ``{section: {key: value}}`` (values of any kind, written as TOML would
    hold them; a top-level non-table value is written as a bare key)."""
    lines: list[str] = []
    for section, table in doc.items():
        if isinstance(table, dict):
            lines.append(f"[{section}]")
            lines.extend(f"{k} = {_toml_scalar(v)}" for k, v in table.items())
        else:
            lines.insert(0, f"{section} = {_toml_scalar(table)}")
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")


def deep_toml(rng: random.Random) -> bytes:
    """A TOML value nested thousands of levels deep (arrays or inline tables)."""
    n = rng.choice((100, 1000, 5000))
    if rng.random() < 0.5:
        return b"[store]\nhost_bytes = " + b"[" * n + b"1" + b"]" * n + b"\n"
    return b"[store]\nhost_bytes = " + b"{a = " * n + b"1" + b"}" * n + b"\n"

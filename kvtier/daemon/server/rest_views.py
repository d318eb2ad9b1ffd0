"""JSON views and input parsing of the REST API: store types in, plain dicts out. No aiohttp.

Binary values become lowercase hex; 64-bit checksums become 16-digit hex strings (JSON numbers
lose precision above 2**53). A tenant salt never leaves this module: namespace views drop it and
say only whether one is set.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from kvtier_protocol.errors import InvalidKey, InvalidRequest, KVTierError, LimitExceeded
from kvtier_protocol.header import decode_header
from kvtier_protocol.namespace import NS_ID_LEN, Namespace

from kvtier.daemon.server.metrics import STORE_TIERS, tier_label
from kvtier.daemon.store.results import BlockInfo, CheckReport
from kvtier.daemon.store.stats import StoreCounters, StoreGauges
from kvtier.daemon.store.types import BlockKey, Tier, split_key

MAX_LOOKUP_TOKENS = 1 << 18  # 256 Ki: hashing them costs ~0.2 s of a worker thread, never more
"""Token ids one lookup may carry (a 1M-token context); the body size limit applies as well."""
MAX_PAGE = 1000  # blocks per /v1/blocks page
DEFAULT_PAGE = 100
MAX_REPORT_KEYS = 1000  # keys listed per category of a check report (the counts are exact)
TOKEN_MAX = (1 << 32) - 1

_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")
_CURSOR_VERSION = b"\x01"
TIERS_BY_LABEL = {tier_label(t): t for t in STORE_TIERS}


# --- parsing -----------------------------------------------------------------------------------


def parse_hex(value: Any, what: str, nbytes: int) -> bytes:
    """Decode ``nbytes`` bytes written as hex (either case).

    Raises:
        InvalidKey: not a string of exactly ``2 * nbytes`` hex digits.
    """
    if not isinstance(value, str) or len(value) != 2 * nbytes or not _HEX.fullmatch(value):
        raise InvalidKey(f"{what} must be {2 * nbytes} hex digits")
    return bytes.fromhex(value)


MIN_HASH_PREFIX = 4  # hex digits of the shortest chain-hash prefix GET /v1/blocks/{ns}/{hash} resolves (as git)
MAX_LISTED_MATCHES = 5  # blocks an ambiguous prefix's error names
_HEX_DIGITS = re.compile(r"[0-9a-fA-F]+")


def parse_hash_prefix(value: Any, nbytes: int) -> str:
    """A chain hash, or a prefix of one, as lowercase hex digits (any count from
    :data:`MIN_HASH_PREFIX` to ``2 * nbytes``).

    Raises:
        InvalidKey: not hex, too short or too long.
    """
    if (not isinstance(value, str) or not MIN_HASH_PREFIX <= len(value) <= 2 * nbytes
            or not _HEX_DIGITS.fullmatch(value)):
        raise InvalidKey(f"hash must be {2 * nbytes} hex digits, or a unique prefix of at least "
                         f"{MIN_HASH_PREFIX}")
    return value.lower()


def match_hash_prefix(keys: Iterable[BlockKey], prefix: str) -> list[bytes]:
    """The chain hashes of ``keys`` (``ns_id || chain_hash``) that start with the hex ``prefix``
    (an odd count of digits too), in key order. Compares bytes, not hex strings: one pass over
    a namespace's blocks stays cheap."""
    whole = bytes.fromhex(prefix[:len(prefix) // 2 * 2])
    nibble = int(prefix[-1], 16) if len(prefix) % 2 else None
    at = NS_ID_LEN + len(whole)
    return sorted(k[NS_ID_LEN:] for k in keys
                  if k.startswith(whole, NS_ID_LEN) and (nibble is None or (len(k) > at and k[at] >> 4 == nibble)))


def ambiguous_prefix_message(prefix: str, matches: list[bytes]) -> str:
    """The error text for a prefix that names several blocks: a few of them, and how many more."""
    shown = ", ".join(m.hex() for m in matches[:MAX_LISTED_MATCHES])
    more = len(matches) - MAX_LISTED_MATCHES
    return (f"hash prefix {prefix} is ambiguous: {len(matches)} blocks match ({shown}"
            + (f", and {more} more" if more > 0 else "") + "); give more digits")


def parse_ns(value: Any) -> bytes:
    """A namespace id (16 bytes) from hex."""
    return parse_hex(value, "ns", NS_ID_LEN)


def parse_tier(value: str | None) -> Tier | None:
    """``gpu``, ``host`` or ``disk`` (None: any tier)."""
    if value is None:
        return None
    tier = TIERS_BY_LABEL.get(value)
    if tier is None:
        raise InvalidRequest(f"tier must be one of {sorted(TIERS_BY_LABEL)}, got {value[:20]!r}")
    return tier


def parse_limit(value: str | None) -> int:
    """The page size of ``/v1/blocks``: 1..MAX_PAGE, default DEFAULT_PAGE."""
    if value is None:
        return DEFAULT_PAGE
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= MAX_PAGE:
        raise InvalidRequest(f"limit must be an integer in [1, {MAX_PAGE}]")
    return int(value)


def encode_cursor(key: BlockKey) -> str:
    """An opaque cursor: the page continues after ``key`` in key order."""
    return base64.urlsafe_b64encode(_CURSOR_VERSION + key).rstrip(b"=").decode("ascii")


def decode_cursor(value: str | None, key_len: int) -> bytes:
    """Inverse of :func:`encode_cursor`; ``b""`` (before every key) for None."""
    if value is None:
        return b""
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except ValueError:
        raw = b""
    if len(raw) != 1 + key_len or raw[:1] != _CURSOR_VERSION:
        raise InvalidRequest("cursor is not one this daemon handed out")
    return raw[1:]


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body that must be one JSON object.

    Raises:
        InvalidRequest: malformed JSON, NaN/Infinity, or not an object.
    """
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidRequest(f"malformed JSON body: {str(exc)[:120]}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the JSON body must be an object")
    return body


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def parse_token_ids(value: Any) -> list[int]:
    """Token ids: a list of at most MAX_LOOKUP_TOKENS integers in [0, 2**32)."""
    if not isinstance(value, list):
        raise InvalidRequest("token_ids must be an array of integers")
    if len(value) > MAX_LOOKUP_TOKENS:
        raise LimitExceeded(f"{len(value)} token ids > limit {MAX_LOOKUP_TOKENS}")
    if not all(type(t) is int for t in value) or (value and not 0 <= min(value) <= max(value) <= TOKEN_MAX):
        raise InvalidRequest(f"token_ids must be integers in [0, {TOKEN_MAX}]")
    return value


# --- views -------------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """Msgpack-decoded values (bytes, tuples, maps with any keys) as JSON values."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def redact_ns_fields(ns_fields: Mapping[str, Any]) -> dict[str, Any]:
    """A namespace map without its tenant salt, plus ``salted`` (whether one is set)."""
    out = {str(k): jsonable(v) for k, v in ns_fields.items() if k != "tenant_salt"}
    out["salted"] = bool(ns_fields.get("tenant_salt"))
    return out


def namespace_view(ns: Namespace | None, ns_id: bytes, blocks: int) -> dict[str, Any]:
    """One entry of ``/v1/namespaces``; ``ns`` is None for blocks of an unregistered namespace."""
    out: dict[str, Any] = {"ns_id": ns_id.hex(), "registered": ns is not None, "blocks": blocks}
    if ns is not None:
        out["fields"] = redact_ns_fields(ns.to_wire())
    return out


def counters_view(c: StoreCounters) -> dict[str, Any]:
    out: dict[str, Any] = {f.name: getattr(c, f.name) for f in fields(c) if f.name != "tiers"}
    out["tiers"] = {tier_label(t): {f.name: getattr(tc, f.name) for f in fields(tc)} for t, tc in c.tiers.items()}
    return out


def gauges_view(g: StoreGauges) -> dict[str, Any]:
    out: dict[str, Any] = {f.name: getattr(g, f.name) for f in fields(g) if f.name != "tiers"}
    out["tiers"] = {tier_label(t): {f.name: getattr(tg, f.name) for f in fields(tg)} for t, tg in g.tiers.items()}
    return out


def tiers_view(c: StoreCounters, g: StoreGauges) -> list[dict[str, Any]]:
    """``/v1/tiers``: occupancy and traffic of each tier, fastest first."""
    out = []
    for tier in STORE_TIERS:
        tg = g.tiers.get(tier)
        if tg is None:
            continue
        row: dict[str, Any] = {"tier": tier_label(tier), "medium": tier.medium, "enabled": tg.capacity_bytes > 0,
                               "capacity_bytes": tg.capacity_bytes, "used_bytes": tg.used_bytes,
                               "free_bytes": max(0, tg.capacity_bytes - tg.used_bytes), "blocks": tg.blocks,
                               # only the host allocator carves slots; the other tiers have no figure
                               "fragmentation": g.fragmentation if tier is Tier.HOST else None}
        tc = c.tiers[tier]
        row.update({f.name: getattr(tc, f.name) for f in fields(tc)})
        out.append(row)
    return out


def tier_precision(codec: str, k_axis: str, compression: str, models: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """The ``precision`` of a ``/v1/tiers`` row (issue 25): the codec blocks take on their way into
    that tier, K's axis, the lossless stage, and the per-model exceptions in the order they match."""
    return {"codec": codec, "k_axis": k_axis, "compression": compression,
            "models": [{"pattern": pattern, "codec": c} for pattern, c in models]}


def tenant_view(name: str, g: StoreGauges) -> dict[str, Any]:
    """One entry of ``/v1/tenants``: the tenant's name, blocks, and each tier's use."""
    return {"name": name, "blocks": g.blocks,
            "tiers": {tier_label(t): {"capacity_bytes": tg.capacity_bytes, "used_bytes": tg.used_bytes,
                                      "blocks": tg.blocks} for t, tg in g.tiers.items()}}


def block_view(info: BlockInfo, now: float) -> dict[str, Any]:
    """One entry of ``/v1/blocks``. ``idle_s``: seconds since the last commit, acquire or touch."""
    return {"ns": info.ns_id.hex(), "hash": info.chain_hash.hex(),
            "parent": info.parent_hash.hex() if info.parent_hash is not None else None,
            "num_tokens": info.num_tokens, "size": info.size, "tiers": [tier_label(t) for t in info.tiers],
            "priority": info.priority, "hits": info.hits, "leases": info.leases,
            "idle_s": round(max(0.0, now - info.last_access), 3)}


def block_detail(info: BlockInfo, now: float, wall_now: float) -> dict[str, Any]:
    """``/v1/blocks/{ns}/{hash}``: the entry plus the decoded header and the block's age.

    ``age_s`` needs the header's optional ``created`` time; it is null without one.
    """
    out = block_view(info, now)
    try:
        h, _ = decode_header(info.header)
    except KVTierError as exc:
        out.update(header=None, header_error=exc.message, age_s=None)
        return out
    out["header"] = {
        "ns_id": h.ns_id.hex(), "chain_hash": h.chain_hash.hex(),
        "parent_hash": h.parent_hash.hex() if h.parent_hash is not None else None,
        "num_tokens": h.num_tokens, "layout": h.layout, "shape": list(h.shape), "dtype": h.dtype,
        "codec": h.codec, "lossy": h.codec != "raw",
        "compression": None if h.compression is None else {
            "alg": h.compression.alg,
            "sections": [{"stride": stride, "raw_len": raw} for stride, raw in h.compression.sections]},
        "sections": [{"name": s.name, "offset": s.offset, "length": s.length} for s in h.sections],
        "payload_len": h.payload_len, "checksum_alg": h.checksum_alg, "checksum": f"{h.checksum:016x}",
        "quant": h.quant.to_wire() if h.quant is not None else None,
        "ns_fields": redact_ns_fields(h.ns_fields) if h.ns_fields is not None else None,
        "created_ms": h.created_ms, "extra": {k: jsonable(v) for k, v in h.extra},
    }
    out["age_s"] = round(max(0.0, wall_now - h.created_ms / 1000), 3) if h.created_ms is not None else None
    return out


def _key_view(key: BlockKey) -> dict[str, str]:
    ns_id, chain_hash = split_key(key)
    return {"ns": ns_id.hex(), "hash": chain_hash.hex()}


def check_view(report: CheckReport) -> dict[str, Any]:
    """``/v1/check``: counts of each finding, and at most MAX_REPORT_KEYS keys of each."""
    n = MAX_REPORT_KEYS
    return {
        "ok": report.ok, "fixed": report.fixed,
        "counts": {"missing": len(report.missing), "orphans": len(report.orphans), "corrupt": len(report.corrupt),
                   "accounting": len(report.accounting), "adopted": len(report.adopted)},
        "missing": [_key_view(k) for k in report.missing[:n]],
        "orphans": [_key_view(k) for k in report.orphans[:n]],
        "corrupt": [{**_key_view(k), "tier": tier_label(t)} for k, t in report.corrupt[:n]],
        "accounting": report.accounting[:n],
        "adopted": [_key_view(k) for k in report.adopted[:n]],
        "notes": report.notes[:n],
    }

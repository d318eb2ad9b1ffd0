"""Checks of caller input: keys, sizes, lease lengths, committed headers. Torch-free, no I/O.

Every check runs before the store changes anything, so a bad request raises a typed error and
leaves everything already stored as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvtier_protocol.errors import (CapacityError, HeaderError, InvalidKey, InvalidRequest,
                                    NamespaceError)
from kvtier_protocol.header import BlockHeader, decode_header
from kvtier_protocol.layouts import get_layout
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.index import BlockMeta
from kvtier.daemon.store.types import GRANT_NS, NS_ID_LEN, BlockKey

_BYTES = frozenset((bytes,))
_INTS = frozenset((int,))


def check_keys(cfg: StoreConfig, ns_id: bytes, hashes: Sequence[bytes]) -> list[BlockKey]:
    """Build the keys of a request.

    Raises:
        InvalidKey: ``ns_id`` is not 16 bytes (or is :data:`~kvtier.daemon.store.types.GRANT_NS`) or a
            hash is not ``cfg.hash_bytes`` bytes.
        InvalidRequest: more than ``cfg.max_batch`` keys.
    """
    if not isinstance(ns_id, bytes) or len(ns_id) != NS_ID_LEN:
        raise InvalidKey(f"ns_id must be {NS_ID_LEN} bytes, got {ns_id!r:.60}")
    if ns_id == GRANT_NS:
        raise InvalidKey("that ns_id is reserved for the daemon's granted slots")
    if len(hashes) > cfg.max_batch:
        raise InvalidRequest(f"{len(hashes)} keys in one call > max_batch {cfg.max_batch}")
    n = cfg.hash_bytes
    # C-level passes over types and lengths (lookup carries hundreds of keys per call); a bytes
    # subclass or a wrong length falls through to the per-item check that names it.
    if not (set(map(type, hashes)) <= _BYTES and set(map(len, hashes)) <= {n}):
        for h in hashes:
            if not isinstance(h, bytes) or len(h) != n:
                raise InvalidKey(f"chain hash must be {n} bytes, got {h!r:.60}")
    # BlockKey is a NewType (identity at run time): calling it per key would only cost a call.
    keys: list[BlockKey] = [ns_id + h for h in hashes]  # type: ignore[misc]
    return keys


def check_unique(keys: Sequence[BlockKey]) -> None:
    """Raises InvalidRequest when a key appears twice in one put."""
    if len(set(keys)) != len(keys):
        raise InvalidRequest("a key appears twice in one request")


def check_lease_seconds(cfg: StoreConfig, lease_s: float | None) -> float:
    """The lease length to use: the default, or the caller's, capped at ``max_lease_seconds``.

    Raises:
        InvalidRequest: not a positive finite number.
    """
    if lease_s is None:
        return cfg.lease_seconds
    if isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not math.isfinite(lease_s) or lease_s <= 0:
        raise InvalidRequest(f"lease_s must be a positive number of seconds, got {lease_s!r}")
    return min(float(lease_s), cfg.max_lease_seconds)


def check_sizes(cfg: StoreConfig, sizes: Sequence[int], num_keys: int, host_fits: Callable[[int], bool],
                gpu_fits: Callable[[int], bool] | None = None) -> None:
    """Check the payload sizes of a reservation.

    Args:
        host_fits: whether the host tier could hold a block of this size when empty.
        gpu_fits: the same for the GPU tier, for a reservation of GPU slots (such a block must
            fit the host tier too: GPU evictions go down through host memory).

    Raises:
        InvalidRequest: not one positive integer per key.
        CapacityError: a block can never fit the host tier (or, with write-through, the disk;
            or, for GPU slots, the GPU tier).
    """
    if len(sizes) != num_keys:
        raise InvalidRequest(f"{num_keys} keys but {len(sizes)} sizes")
    # Each distinct size once (a batch's blocks share one or two); bools are not sizes, and a
    # set would fold True into 1, so a batch with any non-int falls back to every entry.
    for size in set(sizes) if set(map(type, sizes)) <= _INTS else sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise InvalidRequest(f"block sizes must be positive integers, got {size!r}")
        if size > cfg.host_bytes or not host_fits(size):
            raise CapacityError(f"a block of {size} B can never fit the host tier "
                                f"({cfg.host_bytes} B in segments of {cfg.segment_bytes} B)")
        if gpu_fits is not None and (size > cfg.gpu_bytes or not gpu_fits(size)):
            raise CapacityError(f"a block of {size} B can never fit the GPU tier "
                                f"({cfg.gpu_bytes} B in pools of {cfg.gpu_segment} B)")
        if cfg.write_through and size > cfg.disk_bytes:
            raise CapacityError(f"a block of {size} B can never fit the disk tier ({cfg.disk_bytes} B)")


def check_priority(cfg: StoreConfig, priority: int) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority < cfg.priority_classes:
        raise InvalidRequest(f"priority must be an integer in [0, {cfg.priority_classes}), got {priority!r}")
    return priority


def check_commit(blocks: Sequence[BlockMeta | None], headers: Sequence[bytes | None],
                 namespaces: Mapping[bytes, Namespace]) -> list[BlockHeader | None]:
    """Check the headers of a commit against its reservation (one per key; None skips the key).

    Raises:
        InvalidRequest: not one header per key. What :func:`check_header` raises.
    """
    if len(headers) != len(blocks):
        raise InvalidRequest(f"{len(headers)} headers for a reservation of {len(blocks)} keys")
    get = namespaces.get
    return [None if meta is None or buf is None
            else check_header(buf, meta.key, meta.size, get(meta.key[:NS_ID_LEN]))
            for meta, buf in zip(blocks, headers)]


def check_positions(granted: Sequence[BlockMeta | None], positions: Sequence[int]) -> list[BlockMeta]:
    """The granted slots ``positions`` name (indices into a grant, each still unplaced, once).

    Raises:
        InvalidRequest: a position that is not an int, out of range, already placed, or twice.
    """
    if not set(map(type, positions)) <= _INTS:
        raise InvalidRequest("place: positions are integers")
    if len(set(positions)) != len(positions):
        raise InvalidRequest("place: a position appears twice")
    out: list[BlockMeta] = []
    for pos in positions:
        meta = granted[pos] if 0 <= pos < len(granted) else None
        if meta is None:
            raise InvalidRequest(f"place: position {pos} is not a granted slot still unplaced")
        out.append(meta)
    return out


def check_header(buf: bytes, key: BlockKey, size: int, namespace: Namespace | None) -> BlockHeader:
    """Decode a committed header and check it against the reserved key, size and namespace.

    Args:
        buf: the encoded header (preamble + map), without payload.
        key: the reserved key; the header must name the same ns_id and chain hash.
        size: the reserved payload size; the header's ``plen`` must equal it.
        namespace: the registered namespace of ``key``, if any: the geometry must agree.

    Raises:
        HeaderError (or another ProtocolError subclass): the header does not decode or names
            another key, size, or trailing bytes; NamespaceError: it contradicts the namespace.
    """
    if not isinstance(buf, (bytes, bytearray)):
        raise HeaderError(f"a header must be bytes, got {type(buf).__name__}")
    h, end = decode_header(buf)
    if end != len(buf):
        raise HeaderError(f"{len(buf) - end} bytes follow the header map (commit takes the header only)")
    if h.ns_id + h.chain_hash != key:  # make_key, inline: this runs per block committed
        raise HeaderError("the header names another block than the one reserved")
    if h.payload_len != size:
        raise HeaderError(f"header plen {h.payload_len} != reserved size {size}")
    if namespace is not None:
        check_geometry(h, namespace)
    return h


_GEOMETRY_OK: dict[tuple[Any, ...], Namespace] = {}
"""Header geometries found to fit a namespace, by ``(id(ns), layout, shape, tokens, dtype,
codec)``: every block of a stream has the same, and the full check costs ~10 us (a layout's
geometry from the shape), against one probe here. The value keeps the namespace alive, so its
id is never another's while the entry exists."""
_GEOMETRY_MEMO_MAX = 4096


def check_geometry(h: BlockHeader, ns: Namespace) -> None:
    """Raises NamespaceError when a header's block cannot belong to ``ns``.

    Tokens, dtype, codec and the layout's geometry must match; the layout itself may be any that
    describes the namespace's attention kind (engines keep different layouts of the same KV).
    A geometry that passed is remembered (:data:`_GEOMETRY_OK`): it depends on nothing else.
    """
    memo = (id(ns), h.layout, h.shape, h.num_tokens, h.dtype, h.codec)
    if memo in _GEOMETRY_OK:
        return
    _check_geometry(h, ns)
    if len(_GEOMETRY_OK) >= _GEOMETRY_MEMO_MAX:
        _GEOMETRY_OK.clear()
    _GEOMETRY_OK[memo] = ns


def _check_geometry(h: BlockHeader, ns: Namespace) -> None:
    layout = get_layout(h.layout)
    g = layout.geometry_of(h.shape)
    problems = []
    if h.num_tokens != ns.block_tokens:
        problems.append(f"{h.num_tokens} tokens, namespace blocks hold {ns.block_tokens}")
    if h.dtype != ns.kv_dtype:
        problems.append(f"dtype {h.dtype}, namespace kv_dtype {ns.kv_dtype}")
    if h.codec != ns.kv_codec:
        problems.append(f"codec {h.codec}, namespace kv_codec {ns.kv_codec}")
    if layout.is_mla != (ns.attention == "mla"):
        problems.append(f"layout {h.layout} does not fit attention {ns.attention}")
    elif g.num_layers != ns.num_layers:
        problems.append(f"{g.num_layers} layers, namespace has {ns.num_layers}")
    elif layout.is_mla and g.latent_dim != ns.head_dim + ns.mla_rope_dim:
        problems.append(f"latent {g.latent_dim}, namespace has {ns.head_dim}+{ns.mla_rope_dim}")
    elif not layout.is_mla and (g.num_heads, g.head_dim, g.head_dim) != (ns.num_kv_heads, ns.head_dim, ns.head_dim_v):
        problems.append(f"{g.num_heads} heads x {g.head_dim} dims, namespace has "
                        f"{ns.num_kv_heads} x {ns.head_dim}/{ns.head_dim_v}")
    if problems:
        raise NamespaceError("header contradicts its namespace: " + "; ".join(problems))

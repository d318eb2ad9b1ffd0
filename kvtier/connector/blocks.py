"""Block tensors <-> block records for the connector core, and the token info of a save.

Records are encoded in the core's namespace (its codec, its ``ns_fields`` in every header) and
decoded into the layout the caller wants; a decoded block whose geometry or dtype is not the
namespace's is refused, so a hit can only ever write the KV the engine expects.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier_protocol.block import decode_block, encode_block, torch_dtype
from kvtier_protocol.dtypes import DTYPE_SIZES
from kvtier_protocol.errors import InvalidRequest, KVTierError, LayoutError
from kvtier_protocol.header import split_record
from kvtier_protocol.keys import block_keys, chain_hashes
from kvtier_protocol.layouts import Geometry, get_layout
from kvtier_protocol.namespace import Namespace


def expected_shape(ns: Namespace, layout: str) -> tuple[int, ...]:
    """Shape of one block of namespace ``ns`` in ``layout``.

    Raises:
        LayoutError: unknown layout, or one of the other attention kind (MHA vs MLA).
    """
    lay = get_layout(layout)
    if lay.is_mla != (ns.attention == "mla"):
        raise LayoutError(f"layout {lay.name} does not hold {ns.attention} KV")
    if lay.is_mla:
        geometry = Geometry(ns.num_layers, ns.block_tokens, latent_dim=ns.head_dim + ns.mla_rope_dim)
    else:
        geometry = Geometry(ns.num_layers, ns.block_tokens, ns.num_kv_heads, ns.head_dim)
    return lay.shape_for(geometry)


def encode_records(ns: Namespace, hashes: Sequence[bytes], blocks: Sequence[torch.Tensor] | torch.Tensor, *,
                   layout: str, parent: bytes | None, ns_fields: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """``(chain_hash, record)`` per block, with the namespace's codec; block ``i``'s parent is
    ``hashes[i - 1]`` (``parent`` for the first).

    Raises:
        LayoutError, CodecError: a block that does not fit ``layout`` or that the codec refuses.
    """
    parents = [parent, *hashes[:-1]]
    return [(key, encode_block(block, ns_id=ns.ns_id, chain_hash=key, parent_hash=up, layout=layout,
                               codec=ns.kv_codec, ns_fields=ns_fields, mla_rope_dim=ns.mla_rope_dim))
            for key, block, up in zip(hashes, blocks, parents)]


def raw_payload(record: bytes, *, layout: str, shape: tuple[int, ...], dtype: str) -> memoryview | None:
    """The payload of ``record`` if it is raw KV of exactly ``layout``, ``shape`` and ``dtype`` (so
    its bytes can be copied into pages as they are); None for anything else (decode it)."""
    try:
        h, payload = split_record(record)
    except KVTierError:
        return None  # the decoding path reports why
    if (h.codec != "raw" or h.compression is not None or h.layout != layout or tuple(h.shape) != shape
            or h.dtype != dtype):
        return None
    if payload.nbytes != math.prod(shape) * DTYPE_SIZES[dtype]:
        return None
    return payload


Decoded = dict[str, tuple[list[int], torch.Tensor]]
"""Blocks by the layout they were stored in: their positions and the blocks stacked ``[n, *block]``."""


def decode_stacked(ns: Namespace, records: Sequence[tuple[int, bytes]], dtype: torch.dtype,
                   device: Any) -> tuple[Decoded, int | None, str]:
    """Decode verified ``(position, record)`` pairs, stacked by the layout they were stored in.

    Raw payloads are copied once, straight into their row of the stack (numpy, one thread), and
    every block of a layout then converts in one batched permute (``convert_many``): per-block
    torch calls (a stack, a permute per block) cost milliseconds each on a busy host, where
    torch's thread pool waits for cores.

    Returns:
        ``(groups, bad, why)``: the blocks by stored layout; the position of the first record
        that does not decode to the namespace's geometry (in its layout) and dtype (None: all
        did), and why. Records after ``bad`` are not decoded.
    """
    found: dict[str, list[tuple[int, memoryview | torch.Tensor]]] = {}
    bad, why = None, ""
    for at, record in records:
        try:
            h, payload = split_record(record)
            want = expected_shape(ns, h.layout)
            # load() verified the checksum on exactly these bytes: do not hash them twice. Raw and
            # uncompressed: the payload is the block's bytes; anything else is decoded (codec, lz4).
            plain = h.codec == "raw" and h.compression is None
            item = payload if plain else decode_block(record, device=device, verify=False)[1]
            got = (tuple(h.shape), torch_dtype(h.dtype)) if plain else (tuple(item.shape), item.dtype)
        except KVTierError as exc:
            bad, why = at, f"does not decode ({exc.code}: {exc.message})"
            break
        size = math.prod(want) * DTYPE_SIZES[h.dtype]
        if got != (want, dtype) or (plain and payload.nbytes != size):
            bad, why = at, f"is {h.dtype} {got[0]} in {h.layout}, expected {dtype} {want}"
            break
        found.setdefault(h.layout, []).append((at, item))
    groups: Decoded = {}
    for layout, items in found.items():
        raw = isinstance(items[0][1], memoryview)
        out = torch.empty((len(items), *expected_shape(ns, layout)), dtype=dtype, device="cpu" if raw else device)
        if raw:
            rows = out.view(torch.uint8).view(len(items), -1).numpy()
            for row, (_, payload) in zip(rows, items):
                row[:] = np.frombuffer(payload, dtype=np.uint8)
        else:
            for row, (_, block) in zip(out, items):
                row.copy_(block)
        groups[layout] = ([at for at, _ in items], out.to(device))
    return groups, bad, why


def decode_record(record: bytes, *, layout: str, shape: tuple[int, ...], dtype: torch.dtype,
                  device: Any) -> tuple[torch.Tensor | None, str | None]:
    """Decode one verified record into ``layout`` on ``device``.

    Returns:
        ``(block, None)``, or ``(None, why)`` for a record that does not decode or whose block is
        not of ``shape`` and ``dtype`` (the namespace's geometry).
    """
    try:
        # load() verified the checksum on exactly these bytes: do not hash them twice
        header, block = decode_block(record, layout=layout, device=device, verify=False)
    except KVTierError as exc:
        return None, f"does not decode ({exc.code}: {exc.message})"
    if tuple(block.shape) != shape or block.dtype != dtype:
        return None, f"is {header.dtype} {tuple(block.shape)} in {layout}, expected {dtype} {shape}"
    return block, None


def token_info(ns: Namespace, hashes: Sequence[bytes], token_ids: Sequence[int] | None,
               parent: bytes | None) -> tuple[list[list[int]] | None, list[list[bytes]] | None]:
    """Per block, its token ids and (with several hash units per block) its unit digests, for the
    daemon's KV events; ``(None, None)`` without ``token_ids``.

    ``token_ids`` start at the first block of ``hashes``. Unit digests are recomputed from the
    tokens and sent only when they reproduce ``hashes`` (the engine may hash with extra keys this
    core does not know) and the chain starts at the request's first block.

    Raises:
        InvalidRequest: fewer token ids than the blocks span.
    """
    if token_ids is None:
        return None, None
    t = ns.block_tokens
    if len(token_ids) < len(hashes) * t:
        raise InvalidRequest(f"{len(token_ids)} token ids for {len(hashes)} blocks of {t} tokens")
    try:
        flat = [operator.index(x) for x in token_ids[:len(hashes) * t]]  # numpy/torch ints too, never floats
    except TypeError:
        raise InvalidRequest("token ids must be integers") from None
    tokens = [flat[i * t:(i + 1) * t] for i in range(len(hashes))]
    per = ns.units_per_block
    if per == 1 or parent is not None:
        return tokens, None
    try:
        units = chain_hashes(flat, ns.hash_tokens, scheme=ns.hash_scheme, extras=ns.extra_keys())
    except KVTierError:  # ids the scheme cannot hash: the events go without unit digests
        return tokens, None
    if block_keys(units, per) != list(hashes):
        return tokens, None
    return tokens, [units[i * per:(i + 1) * per] for i in range(len(hashes))]


def kv_dtype(ns: Namespace) -> torch.dtype:
    """The torch dtype of the namespace's KV."""
    return torch_dtype(ns.kv_dtype)

"""Block tensors <-> block records for the clients' ``save_tensors`` / ``load_tensors``.

torch is imported here only inside the functions, so that ``import kvtier.client`` stays free of
it: a client that moves bytes (a connector in another language's process, a CLI) never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvtier_protocol.errors import InvalidRequest

from kvtier.client.records import check_hashes

if TYPE_CHECKING:
    import torch

    from kvtier_protocol.namespace import Namespace


def encode_blocks(ns: Namespace, hashes: Sequence[bytes], tensors: Sequence[torch.Tensor], *,
                  layout: str = "canonical", codec: str = "raw",
                  parents: Sequence[bytes | None] | None = None) -> list[tuple[bytes, bytes]]:
    """Encode one record per block tensor, ready for ``save``.

    Headers carry ``ns_fields`` (the namespace map), so the daemon learns the namespace from the
    first block it stores.

    Args:
        ns: the namespace of every block.
        hashes: the chain hash of each block.
        tensors: the blocks, in ``layout``, on any device.
        layout: the layout of ``tensors``.
        codec: ``"raw"`` or a quantizing codec (e.g. ``"int8"``).
        parents: each block's parent chain hash; None: the blocks form one chain from the root
            (the first has no parent, each next one's parent is the previous hash).

    Raises:
        InvalidRequest: the argument lengths differ.
        LayoutError, CodecError, HeaderError, InvalidKey: as encoding warrants.
    """
    from kvtier_protocol.block import encode_block

    keys = check_hashes(hashes)
    if len(tensors) != len(keys):
        raise InvalidRequest(f"{len(tensors)} tensors for {len(keys)} hashes")
    if parents is None:
        parents = [None, *keys[:-1]]
    elif len(parents) != len(keys):
        raise InvalidRequest(f"{len(parents)} parents for {len(keys)} hashes")
    ns_fields = ns.to_wire()
    return [(key, encode_block(t, ns_id=ns.ns_id, chain_hash=key, parent_hash=parent, layout=layout,
                               codec=codec, ns_fields=ns_fields, mla_rope_dim=ns.mla_rope_dim))
            for key, t, parent in zip(keys, tensors, parents)]


def decode_blocks(records: Sequence[bytes], *, layout: str | None = None,
                  device: Any = "cpu") -> list[torch.Tensor]:
    """Decode verified records (from ``load``) into tensors, in ``layout`` (None: as stored)."""
    from kvtier_protocol.block import decode_block

    # load() verified every checksum on the bytes it returned: do not hash them twice
    return [decode_block(r, layout=layout, device=device, verify=False)[1] for r in records]

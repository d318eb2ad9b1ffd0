"""Exact or lossy: which stored copies serve a request that asks for exact ones (issue 25).

A block's stored copy is lossy when its header names a codec other than ``raw``: its writer chose
one (a namespace with ``kv_codec = "int8"``) or the disk tier re-encoded it on demotion
(``StoreConfig.disk_codec``), and a promotion back into host memory keeps it. A request with
``accept_lossy`` false (SPEC.md §7.4: lookup, acquire, get) sees such a copy as a miss, which ends
its prefix. Torch-free, I/O-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import decode_header

from kvtier.daemon.store.index import BlockMeta

_LOSSY: dict[bytes, bool] = {}
_MAX_KNOWN = 8192  # headers remembered (a hot prefix is looked up again and again); then forgotten at once


def lossy(header: bytes) -> bool:
    """Whether the record of ``header`` (a committed block's) is not an exact copy: its codec is
    not ``raw``. A header that does not decode, never expected of a committed block, counts as
    lossy: an exact-only request never gets what it cannot vouch for."""
    known = _LOSSY.get(header)
    if known is None:
        try:
            known = decode_header(header)[0].codec != "raw"
        except KVTierError:
            known = True
        if len(_LOSSY) >= _MAX_KNOWN:
            _LOSSY.clear()
        _LOSSY[header] = known
    return known


def exact_run(metas: Sequence[BlockMeta]) -> int:
    """How many of ``metas``, from the first, are exact copies (the prefix an exact-only request gets)."""
    for i, meta in enumerate(metas):
        if lossy(meta.header):
            return i
    return len(metas)

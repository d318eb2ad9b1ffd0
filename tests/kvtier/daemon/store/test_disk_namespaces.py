"""Namespaces saved with the disk tier (``ns:<ns_id>`` in its metadata): read back at open, and
recovered from block headers carrying ``ns_fields`` when the metadata lacks them (rebuilt from the
block files, or written before namespaces were saved)."""

from __future__ import annotations

import random
from pathlib import Path

from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.disk_meta import MetaDB
from kvtier.daemon.store.types import make_key
from kvtier_protocol.header import encode_header, payload_checksum
from kvtier_protocol.header_types import BlockHeader, Section
from kvtier_protocol.namespace import Namespace
from tests.kvtier.daemon.store.test_disk_repair import damage

A = Namespace(model="ns/a", revision="r1", attention="mha", num_layers=1, num_kv_heads=1, head_dim=64,
              block_tokens=16, kv_dtype="float16")
B = Namespace(model="ns/b", revision="r2", attention="mha", num_layers=1, num_kv_heads=1, head_dim=64,
              block_tokens=16, kv_dtype="float16")


def record(ns: Namespace, i: int, *, fields: bool) -> tuple[bytes, bytes, bytes]:
    """``(key, header, payload)`` of block ``i`` of ``ns``; its header carries ns_fields if ``fields``."""
    size = ns.block_payload_bytes()
    payload = random.Random(i).randbytes(size)
    chain = i.to_bytes(32, "little")
    h = BlockHeader(ns_id=ns.ns_id, chain_hash=chain, parent_hash=None, num_tokens=16, layout="canonical",
                    shape=(1, 2, 1, 16, 64), dtype="float16", codec="raw", sections=(Section("payload", 0, size),),
                    payload_len=size, checksum=payload_checksum(payload),
                    ns_fields=ns.to_wire() if fields else None)
    return make_key(ns.ns_id, chain), encode_header(h), payload


def test_a_saved_namespace_is_read_back_at_open(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 24) as d:
        assert d.namespaces() == []
        assert d.save_namespace(A) is True and d.save_namespace(A) is False
    with DiskTier(tmp_path, 1 << 24) as d:
        assert d.namespaces() == [A] and d.repair is None


def test_namespaces_are_recovered_from_headers_when_the_metadata_is_rebuilt(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 24) as d:
        d.put_many([record(A, 0, fields=False), record(A, 1, fields=True), record(B, 2, fields=False)])
        d.save_namespace(A)
        d.save_namespace(B)
        d.flush()
    damage(tmp_path, "delete-current")
    with DiskTier(tmp_path, 1 << 24) as d:
        assert d.repair is not None and d.num_records == 3
        # A's block 1 names it in its header; no header of B does: B is not known again.
        assert d.namespaces() == [A]
    with DiskTier(tmp_path, 1 << 24) as d:  # and the recovered one was saved
        assert d.repair is None and d.namespaces() == [A]


def test_blocks_stored_before_namespaces_were_saved_name_theirs_at_open(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 24) as d:
        d.put_many([record(B, 5, fields=True)])
    with DiskTier(tmp_path, 1 << 24) as d:
        assert d.repair is None and d.namespaces() == [B]


def test_an_unreadable_saved_namespace_is_dropped(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 1 << 24) as d:
        d.save_namespace(A)
    db = MetaDB(str(tmp_path), sync=False, max_background_jobs=1, write_buffer_bytes=1 << 20)
    try:
        db.put_namespaces([(B.ns_id, b"\xa1\x00"), (b"\x01" * 16, A.canonical_bytes())])  # garbage; A under a wrong id
    finally:
        db.close()
    with DiskTier(tmp_path, 1 << 24) as d:
        assert d.namespaces() == [A]


async def test_the_store_saves_what_it_registers_and_knows_it_after_a_reopen(open_store) -> None:
    store = await open_store()
    store.register_namespace(A)
    assert store.disk.namespaces() == [A]
    await store.close()
    again = await open_store()
    assert again.namespaces() == [A]
    await again.close()
    memory_only = await open_store(disk_path=None, disk_bytes=0)
    memory_only.register_namespace(B)  # nothing to save it with: known until the close
    assert memory_only.namespaces() == [B]

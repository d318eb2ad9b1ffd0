"""``accept_lossy`` end to end (issue 25): the clients' keyword, the wire key (SPEC 7.4.2) and the
real daemon (``kvtier serve`` as a subprocess), over its unix socket (lookup, acquire) and TCP
(lookup, get). A block stored lossily (here: written int8 by its writer; the daemon's own disk
re-encoding is tested in tests/kvtier/daemon/store/test_store_precision.py) is a miss for a request
that asks for exact copies only, and a hit for every other."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

import pytest
import torch

from kvtier.client import AsyncClient, Client
from kvtier_protocol.block import encode_block
from kvtier_protocol.header import decode_header, split_record
from tests.kvtier.client.clientkit import NS_ID, key
from tests.kvtier.client.daemonkit import Daemon, demoting_blocks



def chain(tag: bytes, codecs: list[str]) -> list[tuple[bytes, bytes]]:
    """One chain of bfloat16 blocks, block ``i`` encoded with ``codecs[i]``."""
    keys = [key(i, tag) for i in range(len(codecs))]
    g = torch.Generator().manual_seed(len(tag))
    return [(k, encode_block(torch.randn(2, 2, 2, 16, 64, generator=g).to(torch.bfloat16), ns_id=NS_ID, chain_hash=k,
                             parent_hash=keys[i - 1] if i else None, layout="canonical", codec=codec))
            for i, (k, codec) in enumerate(zip(keys, codecs))]


@pytest.mark.parametrize("path", ["unix", "tcp"])
def test_a_lossy_copy_is_a_miss_only_for_exact_requests(daemon: Daemon, path: str) -> None:
    blocks = chain(path.encode(), ["raw", "raw", "int8", "raw"])
    hashes = [k for k, _ in blocks]
    records = [r for _, r in blocks]
    address = daemon.socket if path == "unix" else daemon.tcp
    with Client.connect(address, token=daemon.token) as kv:
        assert (kv.session.shm is not None) == (path == "unix")
        assert kv.save(NS_ID, blocks) == ["stored"] * 4
        assert kv.lookup(NS_ID, hashes).num_hits == 4  # the daemon's default: any copy
        assert kv.lookup(NS_ID, hashes, accept_lossy=True).num_hits == 4
        assert kv.lookup(NS_ID, hashes, accept_lossy=False).num_hits == 2
        assert kv.load(NS_ID, hashes) == records
        assert kv.load(NS_ID, hashes, accept_lossy=False) == records[:2]
        assert kv.load(NS_ID, hashes[3:], accept_lossy=False) == records[3:]  # exact after the lossy one
        buffers = [bytearray(len(r)) for r in records]
        headers = kv.load_into(NS_ID, hashes, buffers, accept_lossy=False)
        assert [h.chain_hash for h in headers] == hashes[:2] and all(h.codec == "raw" for h in headers)
        for h, buf, record in zip(headers, buffers, records):
            assert bytes(buf[:h.payload_len]) == bytes(split_record(record)[1])
        assert [h.codec for h in kv.load_into(NS_ID, hashes, buffers)] == ["raw", "raw", "int8", "raw"]

    async def exact() -> tuple[int, list[bytes]]:
        async with AsyncClient(address, token=daemon.token) as akv:
            hits = (await akv.lookup(NS_ID, hashes, accept_lossy=False)).num_hits
            return hits, await akv.load(NS_ID, hashes, accept_lossy=False)

    assert asyncio.run(exact()) == (2, records[:2])


def test_a_writers_int8_block_keeps_its_codec_in_every_answer(daemon: Daemon) -> None:
    blocks = chain(b"w", ["int8"])
    with Client.connect(daemon.socket) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"]
        (record,) = kv.load(NS_ID, [blocks[0][0]])
        assert decode_header(record)[0].codec == "int8"  # never presented as raw
        assert kv.load(NS_ID, [blocks[0][0]], accept_lossy=False) == []


def test_a_daemon_with_an_int8_disk_tier_serves_exact_copies_only_to_whoever_asks() -> None:
    """``kvtier serve`` with ``KVTIER_STORE__DISK_CODEC=int8``: blocks the host tier (64 MiB here)
    evicts go to disk as int8, a load brings them back int8, and an exact-only request misses them."""
    directory = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    d = Daemon(directory, env={"KVTIER_STORE__DISK_CODEC": "int8"}).start()
    try:
        keys, blocks = demoting_blocks(1, b"evicted")  # 80 blocks of 1 MiB: the first ones are demoted
        with Client.connect(d.socket) as kv:
            for i in range(0, 80, 8):
                assert kv.save(NS_ID, blocks[i:i + 8]) == ["stored"] * 8
            assert kv.lookup(NS_ID, keys).tiers[0] == "disk"
            assert kv.lookup(NS_ID, keys, accept_lossy=False).num_hits == 0  # block 0 is int8 on disk
            (record,) = kv.load(NS_ID, keys[:1])
            h = decode_header(record)[0]
            assert (h.codec, h.chain_hash, h.ns_id) == ("int8", keys[0], NS_ID)
            assert len(record) < len(blocks[0][1]) * 6 // 10  # about half the bytes of the raw record
            assert kv.load(NS_ID, keys[:1], accept_lossy=False) == []
            assert kv.load(NS_ID, keys[-1:], accept_lossy=False) == [blocks[-1][1]]  # still in host: exact
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)

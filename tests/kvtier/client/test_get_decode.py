"""The clients' ``get`` with ``decode`` (issue 25) against the real daemon (``kvtier serve`` as a
subprocess), over TCP and its unix socket: a block stored int8 (or lz4-compressed) comes back as a
raw record of its dtype whose tensor is ``decode_block`` of the stored record, marked as decoded
from that codec (not exact when it was lossy); without ``decode`` the stored record, byte for
byte; ``accept_lossy=False`` still misses lossy copies. Against a daemon that ignores the request
key (the toy peer), the client decodes what came back as stored."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable

import pytest
import torch

from kvtier.client import AsyncClient, Client, GotRecord
from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.header import split_record, verify_payload
from tests.kvtier.client.clientkit import NS_ID, key
from tests.kvtier.client.daemonkit import Daemon, demoting_blocks
from tests.kvtier.client.peer import Peer


def chain(tag: bytes, specs: list[tuple[str, str | None]]) -> list[tuple[bytes, bytes]]:
    """One chain of bfloat16 blocks, block ``i`` encoded with ``specs[i]`` (codec, compression)."""
    keys = [key(i, tag) for i in range(len(specs))]
    g = torch.Generator().manual_seed(len(tag))
    return [(k, encode_block(torch.randn(2, 2, 2, 16, 64, generator=g).to(torch.bfloat16), ns_id=NS_ID, chain_hash=k,
                             parent_hash=keys[i - 1] if i else None, layout="canonical", codec=codec,
                             compression=compression))
            for i, (k, (codec, compression)) in enumerate(zip(keys, specs))]


SPECS = [("raw", None), ("int8", None), ("raw", "lz4"), ("int4", "lz4")]


def check_decoded(got: list[GotRecord], blocks: list[tuple[bytes, bytes]]) -> None:
    """``got`` holds a raw, verified record of each block, its tensor the stored record's."""
    assert [g.header.chain_hash for g in got] == [k for k, _ in blocks]
    assert [g.decoded_from for g in got] == [None, "int8", "raw", "int4"]
    assert [g.exact for g in got] == [True, False, True, False]  # lz4 over raw stays exact
    for g, (_, stored) in zip(got, blocks):
        h, payload = split_record(g.record)
        verify_payload(h, payload)
        assert h == g.header and (h.codec, h.quant, h.compression) == ("raw", None, None)
        assert torch.equal(decode_block(g.record)[1], decode_block(stored)[1])
    assert got[0].record == blocks[0][1]  # a raw record is sent as stored


@pytest.mark.parametrize("path", ["tcp", "unix"])
def test_get_decodes_on_the_daemon_when_asked(daemon: Daemon, path: str) -> None:
    blocks = chain(b"dec-" + path.encode(), SPECS)
    hashes = [k for k, _ in blocks]
    address = daemon.tcp if path == "tcp" else daemon.socket
    with Client.connect(address, token=daemon.token) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * len(blocks)
        check_decoded(kv.get(NS_ID, hashes, decode=True), blocks)
        stored = kv.get(NS_ID, hashes)
        assert [g.record for g in stored] == [r for _, r in blocks]  # byte for byte
        assert [g.decoded_from for g in stored] == [None] * 4
        assert [g.exact for g in stored] == [True, False, True, False]
        # Exact copies only: the int8 block is a miss, the prefix ends there, decode or not.
        exact = kv.get(NS_ID, hashes, decode=True, accept_lossy=False)
        assert [g.decoded_from for g in exact] == [None]
        assert kv.get(NS_ID, hashes[1:2], decode=True, accept_lossy=False) == []

    async def run() -> list[GotRecord]:
        async with AsyncClient(address, token=daemon.token) as akv:
            return await akv.get(NS_ID, hashes, decode=True)

    check_decoded(asyncio.run(run()), blocks)


def test_a_daemon_that_ignores_decode_gets_its_records_decoded_by_the_client(
        make_peer: Callable[..., Peer]) -> None:
    blocks = chain(b"old", SPECS)
    hashes = [k for k, _ in blocks]
    peer = make_peer()  # the toy peer: a daemon that does not know the decode key
    with Client.connect(f"tcp://127.0.0.1:{peer.tcp_port}") as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * len(blocks)
        check_decoded(kv.get(NS_ID, hashes, decode=True), blocks)
        assert [g.record for g in kv.get(NS_ID, hashes)] == [r for _, r in blocks]


def test_a_block_the_daemon_re_encoded_int8_for_disk_comes_back_decoded() -> None:
    """``kvtier serve`` with ``KVTIER_STORE__DISK_CODEC=int8``: a block the host tier (64 MiB)
    evicted to disk is stored int8 by the daemon; a TCP get with ``decode`` returns it raw, decoded
    from int8, its tensor that of the stored int8 record."""
    directory = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    d = Daemon(directory, env={"KVTIER_STORE__DISK_CODEC": "int8"}).start()
    try:
        keys, blocks = demoting_blocks(2, b"demoted")  # 80 blocks of 1 MiB: the first ones are demoted
        with Client.connect(d.tcp, token=d.token) as kv:
            for i in range(0, 80, 8):
                assert kv.save(NS_ID, blocks[i:i + 8]) == ["stored"] * 8
            assert kv.lookup(NS_ID, keys[:1]).tiers == ("disk",)
            (stored,) = kv.get(NS_ID, keys[:1])
            assert stored.header.codec == "int8" and not stored.exact
            (got,) = kv.get(NS_ID, keys[:1], decode=True)
            assert (got.decoded_from, got.exact, got.header.codec, got.header.dtype) == ("int8", False, "raw", "bfloat16")
            assert len(got.record) == len(blocks[0][1])  # the raw record's size again
            decoded = decode_block(got.record)[1]
            assert torch.equal(decoded, decode_block(stored.record)[1])
            original = decode_block(blocks[0][1])[1].float()
            assert (decoded.float() - original).abs().max() <= original.abs().max() / 64  # int8's error, not garbage
            assert kv.get(NS_ID, keys[:1], decode=True, accept_lossy=False) == []
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)


def test_a_decoded_record_that_did_not_fit_is_asked_for_again() -> None:
    """A daemon whose responses hold 20000 bytes: a small raw block and a larger int8 one (a
    different geometry: the store does not care) fit as stored, but decoded the second no longer
    fits beside the first. The client asks again from there instead of taking the nil for a miss,
    though the record it misses is larger than any it received."""
    directory = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    d = Daemon(directory, env={"KVTIER_DATAPLANE__MAX_PAYLOAD_BYTES": "20000"}).start()
    try:
        g = torch.Generator().manual_seed(3)
        keys = [key(i, b"refit") for i in range(2)]
        small = encode_block(torch.randn(2, 2, 2, 4, 64, generator=g).to(torch.bfloat16), ns_id=NS_ID,
                             chain_hash=keys[0], parent_hash=None, layout="canonical")
        large = encode_block(torch.randn(2, 2, 2, 16, 64, generator=g).to(torch.bfloat16), ns_id=NS_ID,
                             chain_hash=keys[1], parent_hash=keys[0], layout="canonical", codec="int8")
        assert len(small) + len(large) < 20000 < len(small) + 2 * len(large)
        with Client.connect(d.tcp, token=d.token) as kv:
            assert kv.session.limits.max_payload_len == 20000
            assert kv.save(NS_ID, [(keys[0], small), (keys[1], large)]) == ["stored"] * 2
            got = kv.get(NS_ID, keys, decode=True)
            assert [g.decoded_from for g in got] == [None, "int8"]
            assert got[0].record == small and got[1].header.codec == "raw"
            assert torch.equal(decode_block(got[1].record)[1], decode_block(large)[1])
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)

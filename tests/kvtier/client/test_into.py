"""load_into (kvtier/client/load.py): payloads copied into the caller's buffers and verified as
they are copied, over both paths, against the toy peer (peer.py)."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from kvtier.client import AsyncClient, Client
from kvtier.client.load import check_buffers, copy_hashed
from kvtier_protocol.header import COPY_CHUNK as CHUNK
from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.header import split_record
from tests.kvtier.client.clientkit import NS_ID, OTHER_NS_ID, eventually, key, make_blocks
from tests.kvtier.client.peer import Peer

MiB = 1 << 20


def _address(peer: Peer, path: str) -> str:
    return f"unix:{peer.unix_path}" if path == "unix" else f"127.0.0.1:{peer.tcp_port}"


@pytest.mark.parametrize("size", [0, 1, 4095, CHUNK, CHUNK + 1, 3 * CHUNK - 5])
def test_copy_hashed_equals_one_shot_xxh3(size: int) -> None:
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    dst = bytearray(size)
    assert copy_hashed(memoryview(src), memoryview(dst)) == xxhash.xxh3_64_intdigest(src.tobytes())
    assert dst == src.tobytes()


@pytest.mark.parametrize("path", ["unix", "unix-checked", "tcp"])
def test_load_into_copies_the_prefix_and_returns_its_headers(peer: Peer, path: str) -> None:
    # unix-checked: the daemon reports every slot checked, so the client makes the copies of a
    # sub-batch in one call once its blocks are taken (SegmentMap.read_many)
    peer.report_checked = path == "unix-checked"
    path = path.removesuffix("-checked")
    blocks = make_blocks(3, 2 * MiB) + make_blocks(1, 4096, tag=b"small")
    keys = [k for k, _ in blocks] + [key(99)]
    # mixed buffer kinds, each larger than its payload: the tail must stay untouched
    bufs = [bytearray(b"\xee" * (2 * MiB + 7)), np.full(2 * MiB + 64, 0xEE, np.uint8),
            memoryview(bytearray(b"\xee" * (2 * MiB))), bytearray(b"\xee" * 8192), bytearray(b"\xee" * 16)]
    with Client(_address(peer, path)) as kv:
        kv.save(NS_ID, blocks[:3] + blocks[3:])
        headers = kv.load_into(NS_ID, keys, bufs)
    assert len(headers) == 4  # key(99) is a miss; its buffer is untouched
    assert bufs[4] == b"\xee" * 16
    for (k, record), h, buf in zip(blocks, headers, bufs):
        want_h, payload = split_record(record)
        assert h == want_h and h.chain_hash == k
        got = memoryview(buf).cast("B")
        assert got[:h.payload_len] == payload
        assert set(bytes(got[h.payload_len:])) <= {0xEE}
    assert eventually(lambda: not peer.leases), (peer.ops, peer.leases)


@pytest.mark.parametrize("path", ["unix", "tcp"])
def test_corrupt_or_foreign_block_is_a_miss(peer: Peer, path: str) -> None:
    blocks = make_blocks(3, 4096)
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path) as kv:
        kv.save(NS_ID, blocks)
    _, slot = peer.blocks[(NS_ID, keys[1])]
    peer.mm[slot[1] + 4000] ^= 0xFF  # flip one payload byte in shared memory
    with Client(_address(peer, path)) as kv:
        bufs = [bytearray(4096) for _ in keys]
        assert [h.chain_hash for h in kv.load_into(NS_ID, keys, bufs)] == keys[:1]
        assert bufs[0] == split_record(blocks[0][1])[1]
        assert kv.load_into(OTHER_NS_ID, keys, bufs) == []
    assert eventually(lambda: not peer.leases), (peer.ops, peer.leases)


@pytest.mark.parametrize("verify", ["auto", "always"])
def test_a_payload_the_daemon_checked_is_hashed_again_only_when_asked(peer: Peer, verify: str) -> None:
    """The daemon's "checked" mark is trusted by default (that is what makes a load a plain copy);
    ``verify="always"`` hashes anyway and so catches a slot changed after the daemon's check."""
    blocks = make_blocks(2, 4096)
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path) as kv:
        kv.save(NS_ID, blocks)
    _, slot = peer.blocks[(NS_ID, keys[1])]
    peer.mm[slot[1] + 10] ^= 0xFF  # changed after the (simulated) check
    peer.report_checked = True
    with Client(peer.unix_path, verify=verify) as kv:
        bufs = [bytearray(4096) for _ in keys]
        got = kv.load_into(NS_ID, keys, bufs)
        records = kv.load(NS_ID, keys)
    assert len(got) == len(records) == (2 if verify == "auto" else 1)
    assert bufs[0] == split_record(blocks[0][1])[1]
    assert eventually(lambda: not peer.leases), (peer.ops, peer.leases)


@pytest.mark.parametrize("checked", [False, True])
def test_bad_buffers_are_refused(peer: Peer, checked: bool) -> None:
    peer.report_checked = checked  # True: the copies wait for the sub-batch; made after the error too
    blocks = make_blocks(2, 4096)
    keys = [k for k, _ in blocks]
    with pytest.raises(InvalidRequest, match="2 keys"):
        check_buffers([bytearray(4096)], 2)
    with pytest.raises(InvalidRequest, match="writable"):
        check_buffers([bytes(4096)], 1)
    with pytest.raises(InvalidRequest, match="contiguous"):
        check_buffers([np.zeros((64, 128), np.uint8)[:, ::2]], 1)
    with pytest.raises(InvalidRequest, match="not a buffer"):
        check_buffers([[0] * 4096], 1)
    assert check_buffers([np.zeros((2, 4), np.float32)], 1)[0].nbytes == 32  # cast to bytes
    for path in ("unix", "tcp"):
        with Client(_address(peer, path)) as kv:
            kv.save(NS_ID, blocks)
            first, small = bytearray(4096), bytearray(100)
            with pytest.raises(InvalidRequest, match="buffer 1 holds 100 bytes"):
                kv.load_into(NS_ID, keys, [first, small])
            assert first == split_record(blocks[0][1])[1]  # the block before it was copied
            assert small == bytes(100)
        assert eventually(lambda: not peer.leases), "the pin is released after the error"


async def test_async_load_into(peer: Peer) -> None:
    blocks = make_blocks(2, 2 * MiB)
    keys = [k for k, _ in blocks]
    bufs = [np.empty(2 * MiB, np.uint8) for _ in keys]
    async with await AsyncClient.connect(peer.unix_path) as kv:
        await kv.save(NS_ID, blocks)
        headers = await kv.load_into(NS_ID, keys, bufs)
    assert [h.chain_hash for h in headers] == keys
    assert all(b.tobytes() == split_record(r)[1] for b, (_, r) in zip(bufs, blocks))
    assert eventually(lambda: not peer.leases), (peer.ops, peer.leases)

"""``get`` with ``decode: true`` (SPEC §7.4 get, issue 25) on a real in-process data plane over TCP:
lossy and compressed records come back as raw records of their dtype, decoded by the daemon and
named in the response's ``decoded``; raw ones as stored; a damaged copy is a miss, never a decode;
``accept_lossy: false`` still misses lossy copies; the response stays within max_payload_len."""

from __future__ import annotations

import pytest
import torch
from kvtier_protocol import frames as fr
from kvtier_protocol.block import decode_block, encode_block
from kvtier_protocol.header import decode_header, split_record, verify_payload

from kvtier.daemon.server import get_decode
from tests.kvtier.daemon.server.planekit import TOKEN, Peer, open_plane

NS_ID = b"\x5a" * 16
HOST_BYTES = 16 << 20  # room for blocks of several sizes (the host tier keeps slots by size class)


def chain(tag: int, specs: list[tuple[str, str | None]]) -> list[tuple[bytes, bytes]]:
    """``(key, record)`` of one chain of bfloat16 blocks, block ``i`` encoded ``specs[i]``
    (codec, compression)."""
    g = torch.Generator().manual_seed(tag)
    keys = [bytes([tag, i]) * 16 for i in range(len(specs))]
    return [(k, encode_block(torch.randn(2, 2, 2, 16, 64, generator=g).to(torch.bfloat16), ns_id=NS_ID, chain_hash=k,
                             parent_hash=keys[i - 1] if i else None, layout="canonical", codec=codec,
                             compression=compression, created_ms=1_700_000_000_000 + i))
            for i, (k, (codec, compression)) in enumerate(zip(keys, specs))]


async def put(peer: Peer, blocks: list[tuple[bytes, bytes]]) -> None:
    frame = await peer.call("put", b"".join(r for _, r in blocks), ns_id=NS_ID, hashes=[k for k, _ in blocks],
                            lens=[len(r) for _, r in blocks])
    assert frame.header["ok"] and frame.header["results"] == ["stored"] * len(blocks), frame.header


async def get(peer: Peer, keys: list[bytes], **keys_: object) -> fr.GetResponse:
    frame = await peer.call("get", ns_id=NS_ID, hashes=keys, **keys_)
    response = fr.parse_response("get", frame, limits=fr.Limits(max_payload_len=1 << 30))
    assert isinstance(response, fr.GetResponse)
    return response


def assert_decoded_from(record: memoryview, stored: bytes) -> None:
    """``record`` is the raw record of ``stored``'s block: same identity, codec raw, a payload
    that passes its new checksum, and the tensor ``decode_block`` makes of the stored record."""
    h, payload = split_record(record)
    verify_payload(h, payload)
    s = decode_header(stored)[0]
    assert (h.codec, h.quant, h.compression) == ("raw", None, None)
    assert [x.name for x in h.sections] == ["payload"]
    assert (h.ns_id, h.chain_hash, h.parent_hash, h.num_tokens, h.layout, h.shape, h.dtype, h.created_ms) == (
        s.ns_id, s.chain_hash, s.parent_hash, s.num_tokens, s.layout, s.shape, s.dtype, s.created_ms)
    _, tensor = decode_block(bytes(record))
    assert torch.equal(tensor, decode_block(stored)[1])


async def test_lossy_and_compressed_records_come_back_raw_and_named_in_decoded(tmp_path):
    blocks = chain(1, [("raw", None), ("int8", None), ("raw", "lz4"), ("int8", "lz4"), ("fp8_e4m3", None)])
    keys = [k for k, _ in blocks]
    async with open_plane(tmp_path, host_bytes=HOST_BYTES) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        await put(peer, blocks)
        r = await get(peer, keys, decode=True)
        assert r.decoded == (None, "int8", "raw", "int8", "fp8_e4m3")
        records = r.records()
        assert bytes(records[0]) == blocks[0][1]  # raw and uncompressed: sent as stored
        for record, (_, stored) in zip(records[1:], blocks[1:]):
            assert_decoded_from(record, stored)
        # Without the key (or with false): every record as stored, byte for byte, no decoded key.
        for extra in ({}, {"decode": False}):
            plain = await get(peer, keys, **extra)
            assert plain.decoded is None and [bytes(x) for x in plain.records()] == [r for _, r in blocks]
        # Nothing to decode: the key is absent from the response.
        assert (await get(peer, keys[:1], decode=True)).decoded is None


async def test_exact_only_still_misses_lossy_copies_when_decoding(tmp_path):
    blocks = chain(2, [("raw", "lz4"), ("int8", None), ("raw", None)])
    keys = [k for k, _ in blocks]
    async with open_plane(tmp_path, host_bytes=HOST_BYTES) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        await put(peer, blocks)
        r = await get(peer, keys, decode=True, accept_lossy=False)
        assert r.lens[1:] == (None, None) and r.decoded == ("raw", None, None)  # lz4 over raw is exact
        assert_decoded_from(r.records()[0], blocks[0][1])
        assert (await get(peer, keys[1:2], decode=True, accept_lossy=False)).lens == (None,)


async def test_a_damaged_stored_copy_is_a_miss_not_a_decode(tmp_path):
    blocks = chain(3, [("int8", None), ("int8", None), ("raw", None)])
    keys = [k for k, _ in blocks]
    async with open_plane(tmp_path, host_bytes=HOST_BYTES) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        await put(peer, blocks)
        got = await p.store.acquire(NS_ID, keys[1:2])
        view = p.store.host.view(got.blocks[0].slot)
        view[100] ^= 0x40  # the host copy of block 1 rots after its checks
        p.store.release(got.lease_id)
        r = await get(peer, keys, decode=True)
        assert r.lens[1:] == (None, None) and r.decoded == ("int8", None, None)  # the prefix ends there
        assert_decoded_from(r.records()[0], blocks[0][1])


async def test_decoded_records_stay_within_max_payload_len(tmp_path):
    blocks = chain(4, [("int8", None), ("int8", None)])
    keys = [k for k, _ in blocks]
    stored = sum(len(r) for _, r in blocks)
    raw_lens = [len(encode_block(decode_block(r)[1], ns_id=NS_ID, chain_hash=k, parent_hash=keys[i - 1] if i else None,
                                 layout="canonical", created_ms=1_700_000_000_000 + i))
                for i, (k, r) in enumerate(blocks)]
    assert stored < 30_000 < sum(raw_lens)  # both fit as stored; decoded, only the first
    async with open_plane(tmp_path, host_bytes=HOST_BYTES, max_payload_bytes=30_000) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        await put(peer, blocks)
        assert (await get(peer, keys)).lens == tuple(len(r) for _, r in blocks)
        r = await get(peer, keys, decode=True)
        assert r.lens == (raw_lens[0], None) and r.decoded == ("int8", None)
        assert_decoded_from(r.records()[0], blocks[0][1])
        r = await get(peer, keys[1:], decode=True)  # asked again from there, as the client does
        assert r.lens == (raw_lens[1],) and r.decoded == ("int8",)
        assert_decoded_from(r.records()[0], blocks[1][1])


@pytest.mark.parametrize("value", [1, "true"])
async def test_decode_must_be_a_bool(tmp_path, value):
    async with open_plane(tmp_path, host_bytes=HOST_BYTES) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        frame = await peer.call("get", ns_id=NS_ID, hashes=[b"\x01" * 32], decode=value)
        assert frame.header["ok"] is False and frame.header["err"]["code"] == "invalid_request"


async def test_decoding_gets_take_turns_and_give_them_back(tmp_path):
    """More decoding gets in flight than the daemon decodes at once: each waits its turn and every
    one is answered; a turn comes back after each response (also after a miss), so later ones run."""
    blocks = chain(5, [("int8", None), ("int4", "lz4")])
    keys = [k for k, _ in blocks]
    in_flight = 3 * get_decode.CONCURRENT_DECODES
    async with open_plane(tmp_path, host_bytes=HOST_BYTES) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        await put(peer, blocks)
        ids = [await peer.send({"op": "get", "ns_id": NS_ID, "hashes": keys, "decode": True}) for _ in range(in_flight)]
        frames = [await peer.recv() for _ in ids]
        assert sorted(f.id for f in frames) == sorted(ids)
        for frame in frames:
            r = fr.parse_response("get", frame, limits=fr.Limits(max_payload_len=1 << 30))
            assert r.decoded == ("int8", "int4")
            for record, (_, stored) in zip(r.records(), blocks):
                assert_decoded_from(record, stored)
        for _ in range(in_flight):
            assert (await get(peer, [b"\x77" * 32], decode=True)).lens == (None,)
        assert (await get(peer, keys, decode=True)).decoded == ("int8", "int4")

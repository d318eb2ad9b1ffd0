"""A get's records go to the socket straight from the host slots: the lease holds until they left.

The daemon no longer copies a get's payload out of the slots (kvtier.daemon.server.inline.record_views):
the transport sends the slots themselves. So the get's lease must hold until the last byte is in
the kernel, and a response that cannot leave must never be sent once its slots may be reused.
"""

from __future__ import annotations

from kvtier_protocol import frames as fr

from tests.kvtier.daemon.server.planekit import BIG_NS_ID, TOKEN, big_record, eventually, open_plane

MiB = 1 << 20
GETS = 4  # 4 x 8 MiB of answers, far beyond what loopback socket buffers take unread


def _ok(frame: fr.Frame | None) -> dict:
    assert frame is not None and frame.header.get("ok") is True, frame
    return frame.header


async def test_a_get_holds_its_lease_until_its_bytes_have_left(tmp_path):
    async with open_plane(tmp_path, host_bytes=32 * MiB) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        key, record = big_record(8 * MiB)
        _ok(await peer.call("put", record, ns_id=BIG_NS_ID, hashes=[key], lens=[len(record)]))
        ids = [await peer.send({"op": "get", "ns_id": BIG_NS_ID, "hashes": [key]}) for _ in range(GETS)]
        # Nothing read: the first answer cannot leave, the others wait behind it, and every
        # one of them still holds the lease on the slot its bytes are sent from.
        await eventually(lambda: p.store.gauges().leases == GETS)
        for ident in ids:
            frame = await peer.recv()
            assert frame is not None and frame.id == ident
            assert _ok(frame)["lens"] == [len(record)]
            assert frame.payload is not None and bytes(frame.payload) == record
        await eventually(lambda: p.store.gauges().leases == 0)
        _ok(await peer.call("ping"))  # the stream is intact after answers sent from the slots


async def test_a_get_that_cannot_leave_drops_the_connection_before_its_lease_ends(tmp_path):
    async with open_plane(tmp_path, host_bytes=32 * MiB, idle_timeout_s=0.5) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        key, record = big_record(8 * MiB)
        _ok(await peer.call("put", record, ns_id=BIG_NS_ID, hashes=[key], lens=[len(record)]))
        for _ in range(GETS):
            await peer.send({"op": "get", "ns_id": BIG_NS_ID, "hashes": [key]})
        await eventually(lambda: p.plane.num_connections == 0)
        assert p.store.gauges().leases == 0
        other = await p.connect(p.tcp, token=TOKEN)
        frame = await other.call("get", ns_id=BIG_NS_ID, hashes=[key])  # the block is intact
        assert frame.payload is not None and bytes(frame.payload) == record


async def test_records_of_many_blocks_go_out_back_to_back(tmp_path):
    async with open_plane(tmp_path, host_bytes=32 * MiB) as p:
        peer = await p.connect(p.tcp, token=TOKEN)
        blocks = [big_record(n, seed=n) for n in (128, 64 << 10, 1 * MiB, 3 * MiB)]
        _ok(await peer.call("put", [r for _, r in blocks], ns_id=BIG_NS_ID, hashes=[k for k, _ in blocks],
                            lens=[len(r) for _, r in blocks]))
        missing = b"\x01" * 32
        frame = await peer.call("get", ns_id=BIG_NS_ID, hashes=[k for k, _ in blocks] + [missing])
        assert _ok(frame)["lens"] == [len(r) for _, r in blocks] + [None]
        assert frame.payload is not None and bytes(frame.payload) == b"".join(r for _, r in blocks)
        await eventually(lambda: p.store.gauges().leases == 0)
